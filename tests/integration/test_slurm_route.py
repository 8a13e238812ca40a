"""The Slurm route against a real Slurm (munge, slurmctld and two slurmd from Debian's packages, started by
scripts/slurm_cluster.py in a temp dir on loopback): CedanaSlurmOperator under `airflow dags test`,
real CRIU inside the jobs, a node loss that Slurm answers with a requeue, the jobs that must stay
unprotected, and a submission through a login node over SSH (a throwaway sshd from Debian's
openssh-server on loopback, scripts/ssh_login.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import AIRFLOW, REPO

sys.path.insert(0, str(REPO / "scripts"))

import pod_jobs  # noqa: E402
from demo_k8s import host_address  # noqa: E402
from demo_slurm import TRAIN_ARGS, airflow_env, node_loss, summary, uninterrupted  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402
from ssh_login import SshLogin  # noqa: E402

from cedana_airflow.config import load_settings  # noqa: E402
from cedana_airflow.store import open_store  # noqa: E402

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def cluster():
    """In a folder every user may enter (a node's slurm.conf and munge socket are every local user's):
    the node-loss test's jobs run as nobody."""
    root = Path(tempfile.mkdtemp(prefix="cedana-slurm-"))
    root.chmod(0o755)
    try:
        with SlurmCluster(root) as c:
            yield c
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def open_tmp(tmp_path):
    """A test folder the worker's user (nobody) may enter, unlike ``tmp_path`` (root's alone)."""
    d = Path(tempfile.mkdtemp(prefix=f"cedana-{tmp_path.name[:30]}-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _dags_test(env: dict[str, str], dag_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AIRFLOW, "dags", "test", dag_id], env=env, capture_output=True, text=True, timeout=300)


def test_a_job_whose_node_dies_is_requeued_by_slurm_and_resumes_on_the_other_node(cluster, open_tmp, airflow_db):
    """The Airflow worker and its jobs run as nobody (from the worker environment); each node's agent
    (root) checkpoints the job, and the requeued job resumes through the other node's agent."""
    expect = uninterrupted(TRAIN_ARGS)
    env = airflow_env(open_tmp, cluster, airflow_db, user="nobody")
    out = node_loss(cluster, env, open_tmp, user="nobody")
    text = summary(out, expect)
    print(text)
    log = out["log"]
    print("\n".join(line for line in log.splitlines() if "cedana" in line and " step " not in line)[-6000:])
    for node in cluster.nodes:  # the agents' own lines, for a failure's report
        print(f"--- agent of {node}:", (cluster.root / f"agent-{node}.out").read_text(errors="replace")[-3000:])
    a, b = out["node_a"], out["node_b"]
    assert out["exit_code"] == 0 and {a, b} == {"node1", "node2"}, text + log[-4000:]
    # the requeued job (same Slurm job, same Airflow try) restored what the dead node took, on the other node
    restored = re.search(rf"slurm job {out['job_id']}: cedana: (?:node agent: )?restored seq (\d+)(?: of try \d+)? \(node {a}\) on node {b}: "
                         rf".*checkpoint_id={re.escape(out['checkpoint_id'])},", log)
    assert restored and int(restored.group(1)) >= out["last_seq"] >= 3, log[-4000:]
    assert f"protected: checkpoint partition cedana, CEDANA_ENABLE=1; node {b}, Slurm restart 1" in log
    assert log.count("start-up: allocating") == 1  # the requeued run did not start over
    assert re.findall(r"done digest=\w+", log) == [expect]
    assert "(through the node agent)" in log and cluster.job(out["job_id"])["UserId"].startswith("nobody("), log[-4000:]
    # checkpoints are named by SLURMD_NODENAME: the dead node's before the kill, the other's after (the
    # retention of 3 has pruned the older ones by the end)
    assert out["taken_on"] == a and out["nodes_in_store"] == [b]
    assert "Marking task as UP_FOR_RETRY" not in log  # Slurm's requeue, not an Airflow retry, did it


def test_jobs_outside_a_checkpoint_partition_or_without_cedana_enable_run_unprotected_and_say_why(
        cluster, tmp_path, airflow_db):
    env = airflow_env(tmp_path, cluster, airflow_db)
    r = _dags_test(env, "cedana_slurm_unprotected")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    # in the list's workload scope, but partition batch is not a checkpoint partition: no CEDANA_ENABLE either
    assert "node: Slurm partition batch refused: not in partitions ['cedana']" in log
    assert re.search(r"slurm job \d+: cedana: partition batch is not a checkpoint partition \(the opt-in list's "
                     r"\[node\] partitions: cedana\): this job runs unprotected", log), log[-4000:]
    # a checkpoint partition, but the task is out of the workload scope: the job carries no CEDANA_ENABLE
    assert "workload: cedana_slurm_unprotected.no_enable refused" in log
    assert re.search(r"slurm job \d+: cedana: CEDANA_ENABLE is not set for this job: in checkpoint partition cedana "
                     r"only jobs carrying CEDANA_ENABLE=1 are checkpointed; this one runs unprotected", log), log[-4000:]
    assert len(re.findall(r"slurm job \d+: done digest=\w+", log)) == 3  # all ran, unchanged
    # each job's lines reach the task log once, in order: at the end when deferred, as they come when the
    # worker follows the job (deferrable=False)
    steps: dict[str, list[int]] = {}
    for job, n in re.findall(r"slurm job (\d+): step (\d+)/5", log):
        steps.setdefault(job, []).append(int(n))
    assert list(steps.values()) == [[1, 2, 3, 4, 5]] * 3, steps
    store = open_store(env["AIRFLOW__CEDANA__STORE"], load_settings(environ={}))
    assert [i for i in store.list_ids() if i.startswith("cedana_slurm_unprotected")] == []  # nothing written


def test_bad_input_is_one_line_each_and_fails_the_task_without_retries(cluster, tmp_path, airflow_db):
    env = airflow_env(tmp_path, cluster, airflow_db)
    r = _dags_test(env, "cedana_slurm_bad")
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert re.search(r"cedana: sbatch refused the job on this worker: sbatch: error: Batch job submission failed: "
                     r"Invalid partition name specified\. Fix the operator's arguments \(partition 'nosuch'", log), log[-4000:]
    assert "cedana: the SSH connection 'nosuch_login' does not exist" in log
    assert re.search(r"cedana: Slurm job \d+ FAILED \(exit code 3:0\) on node\d", log), log[-4000:]
    assert re.search(r"slurm job \d+: about to fail", log)  # the job's output reached the task log
    # retries=2 on the first two, but retrying cannot help: each ran once
    for task in ("unknown_partition", "no_ssh_connection"):
        assert len(re.findall(rf"running task <TaskInstance: cedana_slurm_bad\.{task} ", log)) == 1, task
    # sbatch missing on the worker: one line, and no retry either
    bare = {**env, "PATH": str(REPO / ".venv" / "bin") if (REPO / ".venv" / "bin").is_dir() else os.path.dirname(sys.executable)}
    r = subprocess.run([*AIRFLOW, "tasks", "test", "cedana_slurm_bad", "unknown_partition"], env=bare,
                       capture_output=True, text=True, timeout=300)  # `tasks test` exits 0 whatever the task did
    said = r.stdout + r.stderr
    assert "AirflowFailException: cedana: sbatch is not installed on this worker (not on PATH)" in said, said[-3000:]


def test_a_job_submitted_through_a_login_node_over_ssh_is_checkpointed_and_followed_there(cluster, tmp_path, airflow_db):
    with SshLogin(tmp_path / "login", env={"SLURM_CONF": str(cluster.conf)}) as login:
        wrong = json.loads(login.airflow_connection())
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
        wrong["extra"]["host_key"] = " ".join((tmp_path / "other.pub").read_text().split()[:2])  # not this server's
        env = airflow_env(tmp_path, cluster, airflow_db, AIRFLOW_CONN_CEDANA_LOGIN=login.airflow_connection(),
                          AIRFLOW_CONN_CEDANA_LOGIN_WRONG_KEY=json.dumps(wrong),
                          CEDANA_SLURM_JOB_DIR=str(tmp_path / "jobs"))
        del env["SLURM_CONF"]  # the worker cannot reach Slurm itself: only through the login node
        r = _dags_test(env, "cedana_slurm_ssh")
        sshd_log = (tmp_path / "login" / "sshd.log").read_text()
    log = r.stdout + r.stderr
    assert r.returncode != 0, log[-4000:]  # wrong_host_key fails the run
    job = re.search(r"cedana: submitted Slurm job (\d+) to partition cedana \(CEDANA_ENABLE=1\)", log)
    assert job, log[-4000:]
    # the job was protected, its lines came back over SSH (tail on the login node), and it ended as an
    # uninterrupted run does
    assert re.search(rf"slurm job {job.group(1)}: .*protected: checkpoint partition cedana, CEDANA_ENABLE=1", log)
    expect = uninterrupted(["--mb", "16", "--steps", "12"])
    assert re.findall(rf"slurm job {job.group(1)}: (done digest=\w+)", log) == [expect], log[-4000:]
    assert (tmp_path / "jobs").is_dir() and any((tmp_path / "jobs").iterdir())  # made by `mkdir -p` over SSH
    store = open_store(env["AIRFLOW__CEDANA__STORE"], load_settings(environ={}))
    [cid] = [i for i in store.list_ids() if i.startswith("cedana_slurm_ssh.train.")]
    assert store.list_seqs(cid), "no heartbeat checkpoint was stored"
    # one login per client: the operator's (mkdir, submit), the trigger run's (every poll), the output's
    # read at the end; before 0.9.0 every command logged in again, every poll of the trigger included
    logins = sshd_log.count("Accepted publickey for root from 127.0.0.1")
    assert logins == 3, f"{logins} logins to the login node for one job followed in the triggerer"
    # a login node that is not the one pinned: one line, and no retry
    said = [ln for ln in log.splitlines() if "cannot log in to the login node of SSH connection 'cedana_login_wrong_key'" in ln]
    assert said and "Host key for server" in said[0] and "does not match" in said[0], log[-4000:]
    assert "Fix the connection's login, key or pinned host_key" in said[0]
    assert len(re.findall(r"running task <TaskInstance: cedana_slurm_ssh\.wrong_host_key ", log)) == 1


def test_a_job_on_two_nodes_is_checkpointed_as_one_and_requeued_resumes_both_parts_from_one_seq(cluster, open_tmp):
    """``nodes=2, one_part_per_node``: the batch script runs one ``slurm-job`` per node (srun), each one part of the job
    (SLURM_NODEID of SLURM_STEP_NUM_NODES), talking over one TCP connection (job_pingpong.py), checkpointed
    as one. Slurm requeues the job; both parts resume from the same seq, their connection whole, and end with
    an uninterrupted run's digest. (A node loss is tests/integration/test_jobs.py's: here both "nodes" share
    one kernel, which closes a killed part's connection, so the other part would see it end.)"""
    from cedana_airflow.slurm.batch import JobSpec, batch_script, sbatch_argv

    # both "nodes" are this host: its address on the default route, not the first one it has (a test beside this
    # one adds its network-namespace nodes' bridge address, 10.x.y.1, and takes it away when it ends: CI run 80's
    # job stalled once the address its connection used was gone, and a restore after it cannot bind it)
    ip = host_address()
    pingpong = REPO / "tests" / "workloads" / "job_pingpong.py"
    py = sys.executable
    cmd = ("bash", "-c", f'if [ "$SLURM_NODEID" = 0 ]; then exec {py} {pingpong} --serve 0.0.0.0:7411 --steps 250; '
                         f'else exec {py} {pingpong} --connect {ip}:7411 --steps 250; fi')
    (open_tmp / "optin.toml").write_text('[node]\npartitions = ["cedana"]\n')
    spec = JobSpec(name="two-nodes", command=cmd, partition="cedana", checkpoint_id="two-nodes",
                   output=str(open_tmp / "job.%j.out"), enable=True, heartbeat_seconds=1, nodes=2, one_part_per_node=True,
                   cli=(py, "-m", "cedana_airflow"), store=f"file://{open_tmp / 'store'}",
                   optin_file=str(open_tmp / "optin.toml"), work_dir=str(open_tmp / "work"),
                   env={"PYTHONUNBUFFERED": "1"})
    job_id = subprocess.run(sbatch_argv(spec), input=batch_script(spec), env=cluster.env(), capture_output=True,
                            text=True, check=True, timeout=30).stdout.strip()
    out = open_tmp / f"job.{job_id}.out"
    store = open_store(f"file://{open_tmp / 'store'}", load_settings(environ={}))
    deadline = time.monotonic() + 120
    while len(store.list_seqs("two-nodes")) < 2:
        assert time.monotonic() < deadline, out.read_text(errors="replace")[-3000:] if out.exists() else "no output"
        time.sleep(0.1)
    # Requeued (as a preemption or an operator does): every part is stopped, and none takes a final checkpoint
    # of its own; the job runs again and resumes both from the newest whole seq.
    seq_before = max(store.list_seqs("two-nodes"))
    cluster.run("scontrol", "requeue", job_id)
    deadline = time.monotonic() + 240
    released = False

    def said() -> str:  # on a failure: what the parts said of their restores and gates, and CRIU's locks here
        text = out.read_text(errors="replace") if out.exists() else ""
        lines = [line for line in text.splitlines() if re.search(r"restor|gate|lock|give|part \d of 2 in|Error", line)]
        nft = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        return "\n".join(lines[-40:]) + f"\nnft tables: {nft.split()}"

    while (state := cluster.job(job_id).get("JobState")) not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, (state, said())
        if state == "PENDING" and not released:  # held until its BeginTime (about 2 minutes): released now
            released = cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False).returncode == 0
        time.sleep(1)
    log = out.read_text(errors="replace")
    assert cluster.job(job_id)["JobState"] == "COMPLETED", log[-4000:]
    restored = re.findall(r"restored seq (\d+)(?: of try \d+)? \(node (node\d)\) on node (node\d)", log)
    assert len(restored) == 2 and {r[0] for r in restored} == {restored[0][0]}, log[-4000:]  # one seq, both parts
    assert int(restored[0][0]) >= seq_before, (restored, seq_before)
    assert "restore closes" not in log  # the connection between the parts came back whole
    reference = pod_jobs.uninterrupted(250)
    assert re.findall(r"done digest=\w+", log) == [reference, reference], log[-3000:]
