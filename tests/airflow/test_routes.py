"""One task adapter, every route: the command operator, @task.checkpointed, the Kubernetes pod operator
and the Slurm operator meet a broken opt-in list and a license lease the same way.

A broken list never fails a task: it runs unprotected and its log says why. A checkpoint older than
the lease is not restored: the core judges it where the restore happens (a worker, a pod's CLI, a
Slurm job's CLI), so the pod and job routes must carry the lease to it; only the Kubernetes ``cedana``
route, where Cedana's runtime restores, is judged by the operator itself. There is no Kubernetes API
server here (pods are spec-checked) and these build Slurm jobs without submitting them
(tests/integration/test_slurm_route.py runs the route on a real cluster).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")
from kubernetes.client import models as k8s  # noqa: E402

from cedana_airflow.config import load_settings  # noqa: E402
from cedana_airflow.format.manifest import ProcessInfo  # noqa: E402
from cedana_airflow.operators import (CedanaKubernetesPodOperator, CedanaSlurmOperator,  # noqa: E402
                                      CheckpointedCommandOperator)
from cedana_airflow.slurm.batch import batch_script  # noqa: E402
from cedana_airflow.store import open_store  # noqa: E402
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint  # noqa: E402
from conftest import cli, cli_env  # noqa: E402

IN_SCOPE = ('[node]\nlabels = { "cedana.ai/enabled" = "true" }\npartitions = ["cedana"]\n'
            '[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n')
LEASE = timedelta(seconds=1)


class _StateStore(dict):
    def set(self, key, value):
        self[key] = value


def _context(dag_id="train_llm", task_id="finetune"):
    pushed = {}
    ti = types.SimpleNamespace(dag_id=dag_id, task_id=task_id, try_number=2, map_index=-1, queue="default",
                               xcom_push=lambda key, value: pushed.__setitem__(key, value))
    return {"ti": ti, "dag": types.SimpleNamespace(dag_id=dag_id, tags=[]), "run_id": "manual__2026-12-02",
            "task_state_store": _StateStore()}


@pytest.fixture(autouse=True)
def taskflow_base(tmp_path, monkeypatch):
    """@task.checkpointed's folders go under tmp_path (walked from it: /tmp is everyone's), not /var/lib."""
    from cedana_airflow.airflow import decorators

    folder = decorators.taskflow_folder
    monkeypatch.setattr(decorators, "taskflow_dir", lambda settings: tmp_path / "taskflow")
    monkeypatch.setattr(decorators, "taskflow_folder", lambda base, cid: folder(base, cid, below=tmp_path))


@pytest.fixture
def store_url(tmp_path, monkeypatch):
    url = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv("AIRFLOW__CEDANA__STORE", url)
    monkeypatch.setenv("CEDANA_NODE_LABELS", "cedana.ai/enabled=true")
    return url


@pytest.fixture
def broken_list(tmp_path, monkeypatch, store_url):
    p = tmp_path / "optin.toml"
    p.write_text("[node\nthis is not toml")
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))
    return p


@pytest.fixture
def in_scope(tmp_path, monkeypatch, store_url):
    p = tmp_path / "optin.toml"
    p.write_text(IN_SCOPE)
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))
    return p


def _stale_checkpoint(store_url: str, checkpoint_id: str, tmp_path: Path, airflow=None, stale: bool = True) -> None:
    """A checkpoint of ``checkpoint_id``, signed with the node key, that is older than LEASE by the time the
    test goes on (``stale``)."""
    from conftest import node_key_bytes

    store = open_store(store_url, load_settings(environ={}))
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    images = tmp_path / "img"
    images.mkdir(exist_ok=True)
    (images / "pages-1.img").write_bytes(os.urandom(5000))
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    save_checkpoint(store, cfg, CheckpointMeta(checkpoint_id, "node-a", "4.1.1", proc, airflow=airflow), images,
                    signing_key=node_key_bytes())
    if stale:
        time.sleep(LEASE.total_seconds() + 0.3)


def _task(task_id: str, dag_id: str = "train_llm"):
    """The owner _context's task instance records in its manifests."""
    from cedana_airflow.format.manifest import AirflowTask

    return AirflowTask(dag_id=dag_id, task_id=task_id, run_id="manual__2026-12-02")


def _pod_op(**kw):
    kw.setdefault("heartbeat", timedelta(minutes=5))
    return CedanaKubernetesPodOperator(task_id="finetune", name="finetune", namespace="ml", image="ml/train:1",
                                       cmds=["python", "train.py"], **kw)


def _env(pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


class _Log:
    """What the tests' processes wrote: Airflow's task loggers (structlog) write to the file descriptors,
    the core's loggers go through logging."""

    def __init__(self, capfd, caplog):
        self.capfd, self.caplog, self.seen = capfd, caplog, ""
        caplog.set_level(logging.INFO)

    def said(self, text: str) -> bool:
        out, err = self.capfd.readouterr()
        self.seen += out + err + "\n".join(r.getMessage() for r in self.caplog.records)
        return text in self.seen


@pytest.fixture
def log(capfd, caplog):
    return _Log(capfd, caplog)


# -- a broken opt-in list: every route runs the task unprotected and says why ---------------------------------
def test_command_route_a_broken_list_runs_the_task_unprotected(broken_list, log):
    op = CheckpointedCommandOperator(task_id="finetune", command=[sys.executable, "-c", "print('ran')"])
    assert op.execute(_context())["outcome"] == "unprotected"
    assert log.said("the opt-in list cannot be used")


def test_taskflow_route_a_broken_list_runs_the_function_unprotected(broken_list, log):
    from airflow.sdk import DAG, task

    with DAG("train_llm", schedule=None):
        @task.checkpointed
        def add(x: int) -> int:
            return x + 1

        out = add(41)
    assert out.operator.execute(_context(task_id=out.operator.task_id)) == 42
    assert log.said("the opt-in list cannot be used")


def test_kubernetes_route_a_broken_list_leaves_the_pod_unprotected_instead_of_failing(broken_list, log):
    pod = _pod_op(container_resources=k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"})) \
        .build_pod_request_obj(_context(), dry_run=True)
    assert pod.spec.runtime_class_name is None and "CEDANA_CHECKPOINT" not in _env(pod)
    keyed = _pod_op(idempotency_key="run-1").build_pod_request_obj(_context(), dry_run=True)
    assert _env(keyed)["CEDANA_IDEMPOTENCY_KEY"] == "run-1"  # as on the other routes, unprotected or not
    assert log.said("the opt-in list cannot be used") and log.said("asks for a GPU but is out of scope")


def test_slurm_route_a_broken_list_submits_the_job_without_cedana_enable(broken_list, log):
    spec = CedanaSlurmOperator(task_id="finetune", command="python train.py", partition="cedana")._spec(_context())
    assert spec.enable is False and spec.settings_env == {}
    assert log.said("the opt-in list cannot be used")


# -- the lease: a checkpoint older than it is not restored, on every route --------------------------------------
def test_command_route_a_checkpoint_older_than_the_lease_starts_fresh(in_scope, store_url, tmp_path, log):
    _stale_checkpoint(store_url, "lease-cmd", tmp_path, airflow=_task("finetune"))
    op = CheckpointedCommandOperator(task_id="finetune", command=["true"], checkpoint_id="lease-cmd", lease=LEASE,
                                     lease_renew_command="false")
    summary = op.execute(_context())
    assert summary["outcome"] == "fresh" and summary["restore"] is None
    assert log.said("beyond lease = 1 s: starting fresh") and log.said("lease_renew_command exited 1")


def test_taskflow_route_a_checkpoint_older_than_the_lease_starts_the_function_fresh(in_scope, store_url, tmp_path, log):
    from airflow.sdk import DAG, task

    _stale_checkpoint(store_url, "lease-tf", tmp_path, airflow=_task("add"))
    with DAG("train_llm", schedule=None):
        @task.checkpointed(checkpoint_id="lease-tf", lease=LEASE)
        def add(x: int) -> int:
            return x + 1

        out = add(1)
    assert out.operator.execute(_context(task_id=out.operator.task_id)) == 2
    assert log.said("beyond lease = 1 s: starting fresh")


def test_the_supervisor_a_pod_or_a_slurm_job_runs_applies_the_lease_it_is_given(tmp_path):
    """The wrap route's pod and a Slurm job run this CLI with the lease as CEDANA_LEASE_SECONDS."""
    env = cli_env(tmp_path, "node-b", "work", CEDANA_LEASE_SECONDS=str(LEASE.total_seconds()))
    _stale_checkpoint(env["CEDANA_STORE"], "lease-cli", tmp_path)
    r = cli("run", "--resume", "--id", "lease-cli", "--", "true", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "beyond lease = 1 s: starting fresh instead of restoring it" in r.stderr, r.stderr[-2000:]


def test_kubernetes_wrap_route_carries_the_lease_and_the_key_to_the_pods_supervisor(in_scope):
    pod = _pod_op(route="wrap", lease=timedelta(hours=1), lease_renew_command=["renew", "--seat", "a b"],
                  max_restore_gap=timedelta(minutes=5), idempotency_key="run-1") \
        .build_pod_request_obj(_context(), dry_run=True)
    env = _env(pod)
    assert env["CEDANA_LEASE_SECONDS"] == "3600.0" and env["CEDANA_LEASE_RENEW_COMMAND"] == "renew --seat 'a b'"
    assert env["CEDANA_MAX_RESTORE_GAP_SECONDS"] == "300.0" and env["CEDANA_IDEMPOTENCY_KEY"] == "run-1"
    assert "--resume" in pod.spec.containers[0].command


def test_kubernetes_cedana_route_a_checkpoint_older_than_the_lease_gives_a_pod_that_starts_fresh(
        in_scope, store_url, tmp_path, log):
    _stale_checkpoint(store_url, "lease-pod", tmp_path, airflow=_task("finetune"))
    fresh = _pod_op(checkpoint_id="lease-pod", lease=LEASE).build_pod_request_obj(_context(), dry_run=True)
    assert "CEDANA_CHECKPOINT" not in _env(fresh) and fresh.spec.runtime_class_name == "cedana"
    assert log.said("beyond lease = 1 s: starting fresh")
    kept = _pod_op(checkpoint_id="lease-pod", lease=timedelta(hours=1)).build_pod_request_obj(_context(), dry_run=True)
    assert _env(kept)["CEDANA_CHECKPOINT"] == "lease-pod"
    # another task's stale checkpoint under this ID is not this task's to judge: it does not start the pod fresh
    other = _pod_op(checkpoint_id="lease-pod", lease=LEASE).build_pod_request_obj(_context(dag_id="other"), dry_run=True)
    assert _env(other)["CEDANA_CHECKPOINT"] == "lease-pod"


def test_slurm_route_carries_the_lease_and_the_key_into_the_job(in_scope):
    op = CedanaSlurmOperator(task_id="finetune", command="python train.py", partition="cedana",
                             lease=timedelta(hours=1), lease_renew_command="renew", idempotency_key="run-1")
    spec = op._spec(_context())
    assert spec.enable is True
    assert spec.settings_env["CEDANA_LEASE_SECONDS"] == "3600.0"
    assert spec.settings_env["CEDANA_LEASE_RENEW_COMMAND"] == "renew"
    script = batch_script(spec)
    assert "export CEDANA_LEASE_SECONDS=3600.0" in script and "export CEDANA_IDEMPOTENCY_KEY=run-1" in script


def test_kubernetes_route_a_pod_without_a_heartbeat_gets_the_declared_k8s_heartbeat_seconds(in_scope, monkeypatch):
    from cedana_airflow.airflow.config import AirflowOptions
    from cedana_airflow.airflow.kube import HEARTBEAT_LABEL

    pod = _pod_op(heartbeat=None).build_pod_request_obj(_context(), dry_run=True)
    assert pod.metadata.labels[HEARTBEAT_LABEL] == f"{AirflowOptions().k8s_heartbeat_seconds:.0f}"
    monkeypatch.setenv("AIRFLOW__CEDANA__K8S_HEARTBEAT_SECONDS", "90")
    pod = _pod_op(heartbeat=None).build_pod_request_obj(_context(), dry_run=True)
    assert pod.metadata.labels[HEARTBEAT_LABEL] == "90"


def test_one_execute_of_the_command_operator_builds_the_settings_once(in_scope, monkeypatch):
    """Settings come from every layer once per try (they were built three times): the opt-in list's
    defaults, the signing key and Airflow's stop window narrow that one object afterwards."""
    import cedana_airflow.airflow.config as config

    op = CheckpointedCommandOperator(task_id="finetune", command=["true"], checkpoint_id="built-once")
    built = []
    real = config.load_settings
    monkeypatch.setattr(config, "load_settings", lambda *a, **kw: built.append(1) or real(*a, **kw))
    assert op.execute(_context())["outcome"] == "fresh"
    assert len(built) == 1


# -- the stop window each route's supervisor has for its final checkpoint (run/stop.py) ------------------------
def test_the_wrap_routes_supervisor_gets_the_pods_grace_period_as_its_stop_window(in_scope):
    default = _pod_op(route="wrap").build_pod_request_obj(_context(), dry_run=True)
    assert _env(default)["CEDANA_STOP_WINDOW_SECONDS"] == "30"  # Kubernetes' default terminationGracePeriodSeconds
    longer = _pod_op(route="wrap", termination_grace_period=120).build_pod_request_obj(_context(), dry_run=True)
    assert _env(longer)["CEDANA_STOP_WINDOW_SECONDS"] == "120"


def test_a_slurm_jobs_stop_window_is_the_smaller_of_its_signal_lead_and_killwait(in_scope):
    def window(**kw):
        op = CedanaSlurmOperator(task_id="finetune", command="python train.py", partition="cedana", **kw)
        return [ln for ln in batch_script(op._spec(_context())).splitlines() if "CEDANA_STOP_WINDOW_SECONDS" in ln]

    assert window() == ["export CEDANA_STOP_WINDOW_SECONDS=30"]  # a scancel: KillWait's 30 s, not the 120 s lead
    assert window(signal_before_end=timedelta(seconds=20)) == ["export CEDANA_STOP_WINDOW_SECONDS=20"]


# -- the node key (issue 48): every route signs with it; a DAG can neither read, choose nor bypass it -----------
def test_the_command_route_signs_with_the_node_key_and_never_touches_the_old_variable(in_scope, tmp_path, monkeypatch):
    """0.7.0 signed with the Airflow Variable cedana_signing_secret: any task could read it (Variable.get),
    and anyone who may edit Variables could replace it with a key they know. Here the Variable holds such
    a key and every Variable call is recorded: the checkpoint is signed with the node key, and no call
    was made."""
    from airflow.sdk import Variable

    from cedana_airflow.format.signing import key_id
    from conftest import manifests, node_key_bytes

    calls = []
    monkeypatch.setattr(Variable, "get", classmethod(lambda cls, *a, **k: calls.append(("get", a)) or "attacker-key-0123456789abcdef"))
    monkeypatch.setattr(Variable, "set", classmethod(lambda cls, *a, **k: calls.append(("set", a))))
    monkeypatch.setenv("AIRFLOW_VAR_CEDANA_SIGNING_SECRET", "attacker-key-0123456789abcdef")
    op = CheckpointedCommandOperator(task_id="finetune", command=[sys.executable, "-c", "import time; time.sleep(1.5)"],
                                     checkpoint_id="signed-cmd", heartbeat=timedelta(seconds=0.4))
    assert op.execute(_context())["outcome"] == "fresh"
    written = manifests(tmp_path / "store", "signed-cmd")
    assert written and {m["signature"]["key_id"] for m in written} == {key_id(node_key_bytes())}
    assert calls == []


def test_a_key_that_cannot_be_read_fails_the_try_in_one_line_before_the_workload_starts(in_scope, tmp_path, monkeypatch):
    """0.7.0 went on unsigned when its key could not be had (a Variable the API server did not serve)."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__CEDANA__SIGNING_KEY_FILE", str(tmp_path / "absent.key"))
    ran = tmp_path / "ran"
    op = CheckpointedCommandOperator(task_id="finetune", command=["touch", str(ran)], checkpoint_id="no-key")
    with pytest.raises(AirflowFailException, match=rf"node key {tmp_path / 'absent.key'} does not exist "
                       r"\(signing_key_file\)\. Copy the key of the other nodes"):
        op.execute(_context())
    assert not ran.exists()


def test_a_dag_can_neither_choose_the_key_nor_accept_unsigned_nor_hand_the_key_to_its_workload(in_scope, tmp_path,
                                                                                              monkeypatch):
    from airflow.sdk.exceptions import AirflowException

    for settings in ({"signing_key_file": str(tmp_path / "mine.key")}, {"allow_unsigned": True},
                     {"signing_key": "0123456789abcdef0123456789abcdef"}, {"legacy_key_file": "/tmp/k"}):
        with pytest.raises(AirflowException, match=f"setting {next(iter(settings))} \\(from operator argument "
                           "settings\\) is a node setting: a DAG cannot choose the key"):
            CheckpointedCommandOperator(task_id="t", command=["true"], settings=settings)
    with pytest.raises(AirflowException, match="CEDANA_SIGNING_KEY is the node key"):
        CheckpointedCommandOperator(task_id="t", command=["true"], settings={"keep_env": "CEDANA_SIGNING_KEY"})
    with pytest.raises(AirflowException, match="the pod's env sets CEDANA_ALLOW_UNSIGNED, CEDANA_CONFIG: node settings"):
        _pod_op(route="wrap", env_vars={"CEDANA_ALLOW_UNSIGNED": "true", "CEDANA_CONFIG": "/x"}).build_pod_request_obj(
            _context(), dry_run=True)
    # the opt-in list is the deployment's, but it admits DAGs by pattern: it may not name the key either
    in_scope.write_text(IN_SCOPE.replace('dags = ["*"]\n', 'dags = ["*"]\n[workload.defaults]\nallow_unsigned = true\n'))
    with pytest.raises(AirflowException, match="setting allow_unsigned \\(from the opt-in list's defaults\\) is a node"):
        CheckpointedCommandOperator(task_id="t", command=["true"]).execute(_context())
    in_scope.write_text(IN_SCOPE)
    monkeypatch.setenv("AIRFLOW__CEDANA__SIGNING_VARIABLE", "cedana_signing_secret")
    with pytest.raises(AirflowException, match=r"\[cedana\] signing_variable = 'cedana_signing_secret' is no longer "
                       r"read \(0\.8\.0\)"):
        CheckpointedCommandOperator(task_id="t", command=["true"]).execute(_context())


def test_a_task_of_one_dag_can_neither_write_nor_restore_under_another_dags_checkpoint_id(in_scope, store_url,
                                                                                        tmp_path):
    """0.7.0 never compared a manifest's task with the restoring one: a task of DAG A could write signed
    checkpoints under DAG B's (predictable) ID, and B's retry ran A's process."""
    from airflow.sdk.exceptions import AirflowFailException

    _stale_checkpoint(store_url, "train_llm.finetune.manual__2026-12-02", tmp_path, airflow=_task("finetune"), stale=False)
    ran = tmp_path / "ran"
    op = CheckpointedCommandOperator(task_id="steal", command=["touch", str(ran)],
                                     checkpoint_id="train_llm.finetune.manual__2026-12-02")
    with pytest.raises(AirflowFailException, match=r"checkpoint ID train_llm.finetune.manual__2026-12-02 \(seq 1\) may "
                       r"be neither written nor restored by this task: it belongs to DAG 'train_llm' task 'finetune' "
                       r"\(map index -1\), not to this task \(DAG 'other_dag' task 'steal' \(map index -1\)\)"):
        op.execute(_context(dag_id="other_dag", task_id="steal"))
    assert not ran.exists()


def test_a_slurm_job_s_xcom_counts_the_heartbeats_of_every_run_of_its_output():
    """A requeued job's runs append to one output: the XCom sums what each run's supervisor said (0.11.0)."""
    from cedana_airflow.operators.slurm import heartbeat_counts

    output = ("cedana: workload started checkpoint_id=j pid=7 node=node1\nstep 1\n"
              "cedana: workload exited checkpoint_id=j exit_code=-9 checkpoints=3 skipped_heartbeats=1 failed_heartbeats=0\n"
              "cedana: node agent: workload exited checkpoint_id=j exit_code=0 checkpoints=2 skipped_heartbeats=0 "
              "failed_heartbeats=4\n")
    assert heartbeat_counts(output) == {"checkpoints": 5, "skipped_heartbeats": 1, "failed_heartbeats": 4}
    assert heartbeat_counts("the output could not be read") == {}


def test_a_slurm_job_followed_in_the_worker_counts_its_heartbeats_in_its_xcom(log):
    """deferrable=False (Airflow's default_deferrable): the output is read as it comes, and its supervisors'
    last lines make the XCom's counts (a review found them missing there)."""
    from cedana_airflow.slurm.jobs import JobInfo

    class Client:
        def __init__(self) -> None:
            self.output = (b"cedana: workload started checkpoint_id=j pid=7 node=node1\nstep 1\n"
                           b"cedana: node agent: workload exited checkpoint_id=j exit_code=0 checkpoints=4 "
                           b"skipped_heartbeats=0 failed_heartbeats=2\n"
                           b"cedana: workload exited checkpoint_id=j exit_code=0 checkpoints=99 skipped_heartbeats=0 "
                           b"failed_heartbeats=0 (the workload quoting one)\n")

        def job(self, job_id: str) -> JobInfo:
            return JobInfo(job_id, "COMPLETED", exit_code="0:0", nodes="node1")

        def read_from(self, path: str, pos: int) -> bytes:
            return self.output[pos:]

    op = CedanaSlurmOperator(task_id="finetune", command="python train.py", partition="cedana", deferrable=False)
    out = op._follow(Client(), "7", "/out/7.log")  # type: ignore[arg-type]
    assert out["state"] == "COMPLETED" and (out["checkpoints"], out["failed_heartbeats"]) == (4, 2), out
    assert log.said("slurm job 7: step 1")
