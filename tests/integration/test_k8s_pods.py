"""The Kubernetes wrap route in real pods (`make demo-k8s`, scripts/demo_k8s.py): the pods that
CedanaKubernetesPodOperator builds are played by podman in the image built from deploy/Containerfile
and our wheel, against SeaweedFS (a real S3 server); a node loss, and the live drill deleting a running try's pod
(a drain as the drill causes it), each followed by the retry's pod; and a job of two pods
(CedanaKubernetesJobOperator) that loses a node, followed by the retry's Job (scripts/pod_jobs.py).

What stands in for the cluster, and only that: the scheduler's affinity filter (four pretend nodes),
the task context of each try, and the translations podman needs (scripts/pod_runtime.py); for the live
drill, the deletion as the API reports it and Airflow's retry (scripts/pod_fleet.py); for the job, the Job
controller's pods and a CNI that gives each completion index its address again (scripts/pod_jobs.py). The API server,
the kubelet and the runtime class handler are not exercised (docs/testing.md). `make demo-k8s` also
plays a drain without the drill."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("pods")]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    import demo_k8s
    from conftest import wait_for_pod_image

    wait_for_pod_image()  # started at collection, beside the tests before these
    return {c.name: c for c in demo_k8s.run(tmp_path_factory.mktemp("k8s"),
                                            cases=("node loss", "live drill", "version skew", "job"))}


def _restored(t):
    return [line for line in t.stderr.splitlines() if "cedana: restored seq " in line]


def test_pods_node_loss_the_retry_pod_restores_on_another_node_and_its_output_equals_an_uninterrupted_run(cases):
    case = cases["node loss"]
    first, retry = case.tries
    assert first.node == "gpu-node-a" and first.exit_code == 137  # SIGKILL: nothing ran after the loss
    assert first.checkpoints_before_end >= 3 and "final checkpoint" not in first.stderr
    assert ("kubernetes.io/hostname", "NotIn", ["gpu-node-a"]) in retry.affinity and retry.node == "gpu-node-b"
    [line] = _restored(retry)
    assert "(node gpu-node-a) on node gpu-node-b: " in line and "restored seq 0 " not in line
    assert retry.exit_code == 0
    assert not any(s.startswith("start-up") for s in retry.stdout.splitlines())  # resumed, not started over
    assert case.digest == case.expected and case.digest.startswith("done digest=")
    # each checkpoint names the try and the node that took it (the retry may finish before its first)
    assert {(m["node"], m["try_number"]) for m in case.manifests} <= {("gpu-node-a", 1), ("gpu-node-b", 2)}
    assert {(m["format_version"], m["airflow"]["dag_id"], m["airflow"]["task_id"]) for m in case.manifests} == {
        (3, "train_llm", "finetune")}


def test_pods_live_drill_deletes_the_running_pod_the_final_checkpoint_fits_the_grace_period_and_the_retry_restores_it(cases):
    case = cases["live drill"]
    first, retry = case.tries
    report = case.report
    assert report.ok and not report.problems, report.problems
    [target] = [t for t in report.targets if t.chosen]
    assert (target.dag_id, target.task_id, target.try_number) == ("train_llm", "finetune", 1)
    assert first.exit_code == 143  # the deletion's SIGTERM ended it, within the grace period, not the SIGKILL after
    [stopped] = [s for s in first.stderr.splitlines() if "stopped by SIGTERM" in s]
    final = int(stopped.split("final checkpoint seq ")[1].split()[0])
    assert final >= first.checkpoints_before_end + 1  # taken at the stop, after the heartbeat ones
    # the drill saw the failure, cleared the task, and followed the retry's pod to its end
    assert (report.restored_seq, report.from_node, report.to_node, target.retry_try_number) == (
        final, "gpu-node-a", "gpu-node-b", 2)
    assert target.retry_state == "success" and retry.exit_code == 0
    [line] = _restored(retry)
    assert re.search(rf"restored seq {final}(?: of try \d+)? \(node gpu-node-a\) on node gpu-node-b: ", line), line
    assert report.detect_seconds > 0 and report.rto_seconds > report.restore_seconds > 0
    assert report.bytes_fetched > 0 and report.lost_work_seconds is not None
    assert case.digest == case.expected


def test_pods_an_image_older_than_the_operator_refuses_in_one_line_before_anything_runs(cases):
    [t] = cases["version skew"].tries
    assert t.exit_code == 2 and not t.stdout
    [line] = t.stderr.strip().splitlines()
    assert line.startswith("ConfigError: this command was written by cedana-airflow") and "9.0 or later" in line
    assert not cases["version skew"].manifests


def test_pods_a_job_of_two_pods_loses_a_node_and_the_retrys_job_resumes_both_parts_from_one_seq(cases):
    """CedanaKubernetesJobOperator(parts=2): part 0 serves, part 1 talks to it over TCP between the pods. After
    two commits node b is lost and the Job fails; try 2's Job runs part 0 on node a and part 1 on node c (the
    anti-affinity keeps them apart; b is gone), both restore the same seq, the connection between them comes
    back whole, and both end with an uninterrupted run's digest."""
    case = cases["job"]
    a1, b1, a2, c2 = case.tries
    assert [(t.try_number, t.node) for t in case.tries] == [(1, "gpu-node-a"), (1, "gpu-node-b"), (2, "gpu-node-a"),
                                                           (2, "gpu-node-c")]
    assert a1.checkpoints_before_end >= 2 and "done digest" not in a1.stdout + b1.stdout  # lost mid-job
    assert "job of 2 parts committed" in a1.stderr, a1.stderr[-3000:]
    assert any("CEDANA_JOB_PART" in n and "resolved to '1'" in n for n in b1.notes)  # the pod's completion index
    seqs = set()
    for t, lost_on in ((a2, "gpu-node-a"), (c2, "gpu-node-b")):
        assert t.exit_code == 0, t.stderr[-3000:]
        [line] = _restored(t)
        m = re.search(rf"restored seq (\d+) of try 1 \(node {lost_on}\) on node {t.node}: ", line)
        assert m, line
        seqs.add(int(m.group(1)))
        assert t.stdout.strip().splitlines()[-1] == case.expected and case.expected.startswith("done digest=")
        assert not t.stdout.startswith("step 1/")  # resumed, not started over
    # one seq, no older than the newest commit seen just before node b was lost
    assert len(seqs) == 1 and min(seqs) >= case.newest_before_end, (seqs, case.newest_before_end)


def test_pods_the_store_credentials_reach_the_cli_as_files_and_never_a_checkpoint_image(cases):
    for case in (cases["node loss"], cases["live drill"], cases["job"]):
        assert case.images_hold_credentials is False, case.name  # the canary key is in the Secret, not the images
        assert any("Secret volume" in n for n in case.tries[0].notes)
