"""End to end with the real Airflow 3.3 (`airflow dags test`, SQLite home in a temp dir; a Clear and a stop
through the test run's shared stack), real CRIU and a real store: try 1's workload is killed after a heartbeat,
try 2 resumes from the checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import AIRFLOW, TRAIN_ARGS, WORKER_ENV, airflow_env, start_agent, uninterrupted_digest, wait_gone
from shared_stack import SharedStack

pytestmark = pytest.mark.integration

def first_manifest(list_manifest, deadline_s: float, proc: subprocess.Popen[bytes], log: Path) -> dict:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        m = list_manifest()
        if m:
            return m
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared:\n" + log.read_text()[-3000:])


def file_manifest(store: Path, prefix: str):
    def look() -> dict | None:
        for p in sorted(store.glob(f"{prefix}*/*/manifest.json")):
            return json.loads(p.read_text())
        return None
    return look


@contextmanager
def node_agent(tmp_path: Path) -> Iterator[Path]:
    """A node agent (root) for the test's store, ``tmp_path/store``: its socket; its log ``tmp_path/agent.log``."""
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW"))}
    env.update(CEDANA_STORE=f"file://{tmp_path / 'store'}", CEDANA_WORK_DIR=str(tmp_path / "agent-work"))
    agent = start_agent(folder / "agent.sock", env, tmp_path / "agent.log")
    try:
        yield folder / "agent.sock"
    finally:
        agent.terminate()
        agent.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


def kill_workload(pid: int) -> None:
    """The workload dies under a running task (an OOM kill, a GPU Xid): its PID namespace's init goes."""
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid, 10)


def run_dag_killing_try_1(env: dict[str, str], tmp_path: Path, list_manifest, dag_id: str = "cedana_e2e",
                          succeeds: bool = True, airflow: list[str] = AIRFLOW) -> str:
    """`airflow dags test DAG_ID`; SIGKILL the workload of try 1 once its first checkpoint exists."""
    log = tmp_path / "dags-test.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*airflow, "dags", "test", dag_id], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            m = first_manifest(list_manifest, 180, proc, log)
            kill_workload(m["process"]["pid"])
            assert (proc.wait(timeout=300) == 0) == succeeds, log.read_text()[-5000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return log.read_text()


def assert_resumed(text: str, tries_known: bool = True) -> None:
    """``tries_known``: Airflow keeps where earlier tries ran (its task state store, 3.3+)."""
    assert text.count("start-up: allocating") == 1, "the retry ran the workload's start-up code again"
    assert re.search(r"cedana[^:]*: restored seq \d+ of try 1 \(node \S+\) on node \S+: gap [\d.]+ s, restore [\d.]+ s, "
                     r"checkpoint_id=cedana_e2e\.train\.manual__\S+", text), text[-5000:]
    # (the kill follows the first checkpoint; a loaded machine may commit one more before it lands)
    assert re.search(r"cedana: the workload was killed by SIGKILL; \d+ checkpoint\(s\) taken this try, the latest is seq \d+: "
                     r"a retry or Clear resumes from it", text)  # try 1 failed because its workload was killed
    assert "sigprocmask" not in text  # util-linux's line about that kill stays out of the task log
    if tries_known:
        assert "where try 1 ran and failed" in text  # the retry noticed it is on the same node
    else:  # below Airflow 3.3: the retry says it cannot know
        assert "where try 1 ran and failed" not in text
        assert "cedana: this Airflow has no task state store (it came in 3.3)" in text, text[-5000:]
    digests = re.findall(r"done digest=\w+", text)
    assert digests == [uninterrupted_digest(*TRAIN_ARGS)], digests


def test_dags_test_try_2_resumes_from_try_1s_signed_checkpoint(tmp_path, airflow_db):
    from conftest import node_key_bytes

    from cedana_airflow.format.signing import key_id

    # No key configured: the node key (/etc/cedana-airflow/node.key) signs. The Variable that held the key
    # before 0.8.0 is set to a key an attacker knows: it is never read.
    attacker = "attacker-known-key-0123456789abcdef"
    env = airflow_env(tmp_path, airflow_db, AIRFLOW_VAR_CEDANA_SIGNING_SECRET=attacker)
    text = run_dag_killing_try_1(env, tmp_path, file_manifest(tmp_path / "store", "cedana_e2e.train."))
    assert_resumed(text)
    signed = [json.loads(p.read_text()) for p in (tmp_path / "store").glob("cedana_e2e.train.*/*/manifest.json")]
    # version 3: signed with the node key, and carrying the task that wrote it (signed with the rest)
    assert signed and all(m["format_version"] == 3 and m["signature"]["key_id"] == key_id(node_key_bytes())
                          for m in signed)
    assert {(m["airflow"]["dag_id"], m["airflow"]["task_id"], m["airflow"]["map_index"]) for m in signed} == {
        ("cedana_e2e", "train", -1)}
    assert attacker not in text and node_key_bytes().decode() not in text

    # A DAG author's task replaces the Variable, then writes under train's checkpoint ID: refused in one
    # line before its workload starts, and train's checkpoints are untouched.
    target = signed[0]["checkpoint_id"]
    before = sorted(p.name for p in (tmp_path / "store" / target).iterdir())
    intruder = subprocess.run([*AIRFLOW, "dags", "test", "cedana_e2e_intruder"], capture_output=True, text=True,
                              timeout=300, env={**env, "CEDANA_E2E_TARGET_ID": target})
    said = intruder.stdout + intruder.stderr
    assert intruder.returncode != 0 and "intruder ran" not in said, said[-4000:]
    assert f"checkpoint ID {target} (seq " in said and "it belongs to DAG 'cedana_e2e' task 'train' (map index -1), " \
        "not to this task (DAG 'cedana_e2e_intruder' task 'intrude'" in said, said[-4000:]
    assert sorted(p.name for p in (tmp_path / "store" / target).iterdir()) == before
    # the retry's resume is in the store's restore history, and the listing knows the ID's task
    from cedana_airflow.config import load_settings
    from cedana_airflow.store import open_store
    from cedana_airflow.store.listing import list_store
    from cedana_airflow.store.restores import list_restores

    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    [listed] = list_store(store)
    assert listed.airflow is not None and listed.airflow.dag_id == "cedana_e2e" and listed.restores == 1
    [rec] = list_restores(store, listed.checkpoint_id)
    latest = int(re.search(r"checkpoint\(s\) taken this try, the latest is seq (\d+)", text)[1])  # 1, or 2 under load
    assert (rec.outcome, rec.try_number, rec.seq, rec.airflow.task_id) == ("restored", 2, latest, "train")
    assert rec.from_node == rec.node and rec.restore_seconds > 0


def test_dags_test_try_2_resumes_through_the_node_agent(tmp_path, airflow_db):
    """agent = require: each try's workload is the node agent's to run and checkpoint (the task process
    holds neither the node's key nor the store), and try 2 resumes try 1's checkpoint through it, into the
    task log as the in-process route writes it (issue 49)."""
    with node_agent(tmp_path) as sock:
        env = airflow_env(tmp_path, airflow_db, AIRFLOW__CEDANA__AGENT="require",
                          AIRFLOW__CEDANA__AGENT_SOCKET=str(sock))
        text = run_dag_killing_try_1(env, tmp_path, file_manifest(tmp_path / "store", "cedana_e2e.train."))
    assert_resumed(text)
    assert f"store=the node agent's ({sock})" in text and "cedana (node agent): restored seq " in text
    assert "signed and verified with node key" not in text  # the task process never read the key
    said = (tmp_path / "agent.log").read_text()
    assert said.count("agent started w-") == 2 and "checkpoint_id=cedana_e2e.train." in said and "restored seq " in said, said[-3000:]




def test_a_task_process_that_is_not_root_is_checkpointed_through_the_node_agent(tmp_path, airflow_db):
    """The Airflow task process runs as uid nobody (`airflow dags test` from the worker's own environment,
    the default `agent = auto`): its workload is the node agent's to run as nobody and to checkpoint, try 1's
    is killed, and try 2 resumes it; the task process never had the key, the store or root (issue 49)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    assert (WORKER_ENV / "bin" / "airflow").exists(), "no worker environment: run `make worker`"
    # The task's own folder: its Airflow home, its opt-in list (a worker's are its user's)
    home = Path(f"/tmp/cedana-worker-{os.getpid()}-{tmp_path.name}")
    home.mkdir(mode=0o700)
    env = airflow_env(tmp_path, airflow_db)
    shutil.copy(tmp_path / "airflow" / "airflow.db", home / "airflow.db")
    shutil.copy(tmp_path / "optin.toml", home / "optin.toml")
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CEDANA__OPTIN_FILE=str(home / "optin.toml"), HOME=str(home),
               AIRFLOW__CEDANA__WORK_DIR=str(home / "work"), PATH=f"{WORKER_ENV / 'bin'}:/usr/bin:/bin")
    for path in (home, *home.rglob("*")):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    log = tmp_path / "dags-test.log"
    try:
        with node_agent(tmp_path) as sock, open(log, "wb") as out:
            env["AIRFLOW__CEDANA__AGENT_SOCKET"] = str(sock)
            proc = subprocess.Popen([str(WORKER_ENV / "bin" / "airflow"), "dags", "test", "cedana_e2e"], env=env, cwd=home,
                                    stdout=out, stderr=subprocess.STDOUT, user=nobody.pw_uid, group=nobody.pw_gid,
                                    extra_groups=[])
            try:
                m = first_manifest(file_manifest(tmp_path / "store", "cedana_e2e.train."), 180, proc, log)
                status = Path(f"/proc/{m['process']['pid']}/status").read_text()
                assert f"Uid:\t{nobody.pw_uid}\t" in status and "NoNewPrivs:\t1" in status  # the workload: nobody's
                kill_workload(m["process"]["pid"])
                assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
            finally:
                if proc.poll() is None:
                    proc.kill()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    text = log.read_text()
    assert_resumed(text)
    assert f"store=the node agent's ({sock})" in text and "cedana (node agent): restored seq " in text
    assert "signed and verified with node key" not in text and "Permission denied" not in text, text[-3000:]


def test_dags_test_resumes_through_an_airflow_connection_to_s3(tmp_path, airflow_db, bucket, s3_env):
    import boto3

    conn = {"conn_type": "aws", "login": s3_env["AWS_ACCESS_KEY_ID"], "password": s3_env["AWS_SECRET_ACCESS_KEY"],
            "extra": {"endpoint_url": s3_env["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}
    # Only the connection knows the endpoint and the keys: boto3's own chain would find nothing.
    env = airflow_env(tmp_path, airflow_db, AIRFLOW__CEDANA__STORE=f"s3://{bucket}/af", CEDANA_E2E_CONN="moto_s3",
                      AIRFLOW_CONN_MOTO_S3=json.dumps(conn))
    client = boto3.client("s3")

    def look() -> dict | None:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="af/cedana_e2e.train.").get("Contents", [])
                if o["Key"].endswith("/manifest.json")]
        return json.loads(client.get_object(Bucket=bucket, Key=sorted(keys)[0])["Body"].read()) if keys else None

    text = run_dag_killing_try_1(env, tmp_path, look)
    assert_resumed(text)
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in text.replace("AWS_SECRET_ACCESS_KEY", "")


def test_a_missing_connection_fails_the_task_with_one_clear_line(tmp_path, airflow_db):
    env = airflow_env(tmp_path, airflow_db, AIRFLOW__CEDANA__STORE="s3://some-bucket/x", CEDANA_E2E_CONN="nope")
    r = subprocess.run([*AIRFLOW, "dags", "test", "cedana_e2e"], env=env, capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    assert "Airflow connection 'nope' (aws_conn_id) is not defined. Create it" in text, text[-4000:]
    assert "start-up: allocating" not in text  # nothing ran unprotected by mistake


# -- a Clear through the REST API with a real scheduler, dag processor and api-server -----------------
class Clearing:
    """A test's own DAG (tests/stack_dags/dags_e2e.py) on the run's shared Airflow stack, with the moves of
    a Clear: trigger, fail, clear, follow."""

    def __init__(self, stack: SharedStack, tmp_path: Path, *, nobody: bool = False, **params: object) -> None:
        """``nobody``: the task runs as uid nobody, through the stack's agent of node-a (its checkpoints
        are in the agents' store)."""
        self.stack = stack
        self.store = stack.agent_store if nobody else tmp_path / "store"
        work = stack.user_dir("work") if nobody else tmp_path / "work"
        self.dag_id = stack.add_dag("e2e_clear", "dags_e2e:clear_dag", store=f"file://{tmp_path / 'store'}",
                                    work_dir=str(work), **({"agent": stack.agent("node-a")} if nobody else {}), **params)

    def start_run_until_first_checkpoint(self) -> tuple[str, dict]:
        """Trigger the DAG; return its run ID and first manifest once that exists."""
        run_id = self.stack.trigger(self.dag_id)
        look = file_manifest(self.store, f"{self.dag_id}.train.")
        deadline = time.monotonic() + 180
        while not (m := look()):
            assert time.monotonic() < deadline and self.ti(run_id)["state"] != "failed", self.stack.logs()
            time.sleep(0.2)
        return run_id, m

    def clear(self, run_id: str) -> dict:
        """What the UI's Clear button sends, once the run has settled as failed (as it has when a person clicks).

        Clearing within a fraction of a second of the run failing, while the scheduler is still
        processing try 1's executor event, once left the cleared task unscheduled for minutes.
        """
        deadline = time.monotonic() + 60
        while self.stack.dag_run(self.dag_id, run_id)["state"] != "failed":
            assert time.monotonic() < deadline, self.stack.logs()
            time.sleep(0.5)
        # the event, not a guess at its time: the scheduler has processed try 1's end
        finished = re.compile(rf"TaskInstance Finished: dag_id={self.dag_id}, task_id=train, run_id={re.escape(run_id)}, "
                              r".*try_number=1,")
        while not finished.search((self.stack.home / "scheduler.log").read_text(errors="replace")):
            assert time.monotonic() < deadline, self.stack.logs()
            time.sleep(0.5)
        return self.stack.call("POST", f"/api/v2/dags/{self.dag_id}/clearTaskInstances",
                               {"dry_run": False, "dag_run_id": run_id, "task_ids": ["train"], "only_failed": True,
                                "reset_dag_runs": True})

    def ti(self, run_id: str) -> dict:
        return self.stack.task_instance(self.dag_id, run_id, "train")

    def wait_state(self, run_id: str, states: set[str], timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ti = self.ti(run_id)
            if ti["state"] in states:
                return ti
            time.sleep(1)
        raise AssertionError(f"task never reached {states}: {self.ti(run_id)}\n{self.stack.logs()}")

    def log(self, run_id: str, try_number: int) -> str:
        return self.stack.task_log(self.dag_id, run_id, "train", try_number)


def test_a_clear_through_the_rest_api_resumes_the_failed_task_from_its_checkpoint(tmp_path, airflow_stack):
    """The task runs as uid nobody (Airflow's run_as_user) with default settings: its workload is node-a's
    agent's to run as nobody and checkpoint; the Clear's try resumes it through the agent (issue 49)."""
    import pwd

    from conftest import node_key_bytes

    from cedana_airflow.format.signing import key_id

    nobody = pwd.getpwnam("nobody").pw_uid
    dag = Clearing(airflow_stack, tmp_path, nobody=True, train_args=TRAIN_ARGS)
    stack = airflow_stack
    run_id, m = dag.start_run_until_first_checkpoint()
    status = Path(f"/proc/{m['process']['pid']}/status").read_text()
    assert f"Uid:\t{nobody}\t{nobody}\t{nobody}\t{nobody}" in status and "NoNewPrivs:\t1" in status, status
    kill_workload(m["process"]["pid"])
    failed = dag.wait_state(run_id, {"failed", "success"})
    assert failed["state"] == "failed" and failed["try_number"] == 1  # retries=0: it stays failed
    # the newest of try 1 (a loaded machine may commit one more between the first and the kill)
    latest = max(int(p.parent.name) for p in dag.store.glob(f"{dag.dag_id}.train.*/*/manifest.json"))

    cleared = dag.clear(run_id)
    assert [t["task_id"] for t in cleared["task_instances"]] == ["train"]
    done = dag.wait_state(run_id, {"success", "failed"})
    assert done["state"] == "success" and done["try_number"] == 2, stack.logs()

    log = dag.log(run_id, 2)
    assert "start-up: allocating" not in log  # try 2 did not start over
    # The task process never read the key or the store: the agent signed with the node key, and no Variable is made.
    assert "store=the node agent's (" in log and "signed and verified with node key" not in log, log[-3000:]
    assert subprocess.run([*AIRFLOW, "variables", "get", "cedana_signing_secret"], env=stack.env, capture_output=True,
                          text=True).returncode != 0
    signed = [json.loads(p.read_text()) for p in dag.store.glob(f"{dag.dag_id}.train.*/*/manifest.json")]
    assert signed and all(m["signature"]["key_id"] == key_id(node_key_bytes()) for m in signed)
    assert all(m["caller"]["uid"] == nobody for m in signed), signed[0].get("caller")
    # the agent's supervisor's own line, said once (0.11.0: the caller no longer says a second one)
    assert len(re.findall(rf"cedana \(node agent\): restored seq \d+ of try 1 .*checkpoint_id={dag.dag_id}\.train\.",
                          log)) == 1, log[-3000:]
    assert re.findall(r"done digest=\w+", log) == [uninterrupted_digest(*TRAIN_ARGS)]
    restore = stack.xcom(dag.dag_id, run_id, "train", "cedana_restore")
    assert restore["from_try"] == 1 and restore["seq"] == latest and restore["gap_seconds"] >= 0


def test_task_checkpointed_resumes_a_python_function_and_returns_its_value(tmp_path, airflow_db):
    env = airflow_env(tmp_path, airflow_db)
    text = run_dag_killing_try_1(env, tmp_path, file_manifest(tmp_path / "store", "cedana_taskflow.train."),
                                 dag_id="cedana_taskflow")
    assert text.count("start-up: 40 MB") == 1, text[-5000:]
    assert re.search(r"cedana[^:]*: restored seq \d+ of try 1 .*checkpoint_id=cedana_taskflow\.train\.\S+", text)
    # The same arithmetic, uninterrupted (numpy is deterministic here): the function's value came through.
    import numpy as np

    x = np.arange(40 * (1 << 20) // 8, dtype=np.float64)
    for i in range(40):
        x = (x * 1.0001 + i) % 1000.0
    assert f"RESULT {{'steps': 40, 'total': {round(float(x.sum()), 3)}}}" in text, text[-3000:]


def test_stopping_a_running_task_takes_a_final_checkpoint_that_the_clear_resumes(tmp_path, airflow_stack):
    # A long heartbeat, so the only checkpoint after the first is the one on_kill takes, and a long
    # run, so the task is still running when Airflow's SIGTERM reaches it.
    # 20 MB: the final checkpoint must fit Airflow's 5 s on a loaded machine too (the suite runs tests side by side)
    args = ["--mb", "20", "--steps", "300", "--step-seconds", "0.1", "--fast-after-restores", "1"]  # try 2: no sleeps
    dag = Clearing(airflow_stack, tmp_path, train_args=args, heartbeat=4.0)
    stack = airflow_stack
    run_id, first = dag.start_run_until_first_checkpoint()
    base = f"/api/v2/dags/{dag.dag_id}/dagRuns/{quote(run_id)}/taskInstances/train"
    # Mark the running task failed (the UI's "Mark as failed"): Airflow sends the task SIGTERM.
    stack.call("PATCH", base, {"new_state": "failed"})
    # The state flips at once; the task process then gets SIGTERM and, 5 s later, Airflow's SIGKILL
    # (a fixed escalation in its supervisor): the final checkpoint has to fit in between.
    deadline = time.monotonic() + 120
    # Read once the stop has said how it ended (Airflow may write "Task killed!" before the task's last lines)
    while not re.search(r"stopped by SIGTERM|workload exited", log1 := stack.task_log_files(dag.dag_id, 1)):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.5)
    # said by the supervising loop once it sees the stop (on_kill, inside Airflow's signal handler, only sets it)
    assert re.search(r"cedana[^:]*: the task is being stopped; final checkpoint", log1), log1[-3000:]
    final = re.findall(r"checkpoint seq=(\d+): froze", log1[log1.index("the task is being stopped"):])
    assert final, "no final checkpoint was taken when the task was stopped"
    assert int(final[-1]) > first["seq"]
    # A clean cut, said in one line, within Airflow's 5 s (the log has it: Airflow's SIGKILL came later, if at all)
    stop_line = re.search(rf"stopped by SIGTERM checkpoint_id=\S+: final checkpoint seq {final[-1]} in [\d.]+ s; workload "
                          r"tree ended \(SIGKILL\) ([\d.]+) s after the stop began; writer lease released", log1)
    assert stop_line and float(stop_line.group(1)) < 5.0, log1[-3000:]
    before = [int(n) for n in re.findall(r"step (\d+)/300", log1)]

    dag.clear(run_id)
    done = dag.wait_state(run_id, {"success", "failed"})
    assert done["state"] == "success", stack.logs()
    log2 = dag.log(run_id, 2)
    assert re.search(rf"cedana[^:]*: restored seq {final[-1]} of try 1 ", log2), log2[-3000:]
    assert "writer lease of checkpoint ID" not in log2  # released: try 2 did not wait for it
    # Nothing the workload printed after its final checkpoint: try 2 goes on from the step after try 1's last.
    after = [int(n) for n in re.findall(r"step (\d+)/300", log2)]
    assert after[0] == before[-1] + 1, (before[-3:], after[:3])
    assert re.findall(r"done digest=\w+", log2) == [uninterrupted_digest(*args)]


def test_stopping_a_task_through_the_node_agent_takes_a_final_checkpoint_that_the_clear_resumes(tmp_path, airflow_stack):
    """The same stop as above, Airflow's own (Mark as failed: its supervisor's SIGTERM, then its SIGKILL), of
    a task that runs as uid nobody (run_as_user: its task process is under sudo) with default settings:
    on_kill becomes the agent's stop, the agent takes the final checkpoint, and the Clear's try resumes it
    through the agent (issue 49)."""
    args = ["--mb", "20", "--steps", "300", "--step-seconds", "0.1", "--fast-after-restores", "1"]  # try 2: no sleeps
    dag = Clearing(airflow_stack, tmp_path, nobody=True, train_args=args, heartbeat=4.0)
    stack = airflow_stack
    run_id, first = dag.start_run_until_first_checkpoint()
    stack.call("PATCH", f"/api/v2/dags/{dag.dag_id}/dagRuns/{quote(run_id)}/taskInstances/train",
               {"new_state": "failed"})
    deadline = time.monotonic() + 120
    while not re.search(r"stopped through the node agent|Task killed", log1 := stack.task_log_files(dag.dag_id, 1)):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.5)
    final = re.search(r"stopped through the node agent checkpoint_id=\S+: final checkpoint seq (\d+)", log1)
    assert final and int(final[1]) > first["seq"], log1[-3000:]
    before = [int(n) for n in re.findall(r"step (\d+)/300", log1)]

    dag.clear(run_id)
    done = dag.wait_state(run_id, {"success", "failed"})
    assert done["state"] == "success", stack.logs()
    log2 = dag.log(run_id, 2)
    assert re.search(rf"cedana \(node agent\): restored seq {final[1]} of try 1 ", log2), log2[-3000:]
    after = [int(n) for n in re.findall(r"step (\d+)/300", log2)]
    assert after[0] == before[-1] + 1, (before[-3:], after[:3])  # nothing printed after the final checkpoint
    assert re.findall(r"done digest=\w+", log2) == [uninterrupted_digest(*args)]


def test_same_node_retry_fail_fails_the_retry_fast_on_the_node_that_failed(tmp_path, airflow_db):
    env = airflow_env(tmp_path, airflow_db, AIRFLOW__CEDANA__SAME_NODE_RETRY="fail")
    text = run_dag_killing_try_1(env, tmp_path, file_manifest(tmp_path / "store", "cedana_e2e.train."), succeeds=False)
    assert re.search(r"cedana: this retry runs on node \S+, where try 1 ran and failed; its fault may still be here\. "
                     r"\[cedana\] same_node_retry = fail, so this try fails fast", text), text[-3000:]
    assert text.count("start-up: allocating") == 1 and "restored seq" not in text  # nothing ran on try 2


def test_a_task_outside_the_opt_in_list_runs_unprotected_and_says_why(tmp_path, airflow_db):
    (tmp_path / "gpu-only.toml").write_text('[node]\nhostnames = ["gpu-*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n')
    env = airflow_env(tmp_path, airflow_db, AIRFLOW__CEDANA__OPTIN_FILE=str(tmp_path / "gpu-only.toml"),
                      AIRFLOW__CEDANA__NODE="cpu-worker-3")
    r = subprocess.run([*AIRFLOW, "dags", "test", "cedana_e2e"], env=env, capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert "cedana: OUT OF SCOPE: runs unprotected" in text
    assert "cedana: node: cpu-worker-3 refused: matches none of 'gpu-*'" in text
    assert re.findall(r"done digest=\w+", text) == [uninterrupted_digest(*TRAIN_ARGS)]  # it ran, all of it
    assert not (tmp_path / "store").exists()  # and nothing was checkpointed


def test_execution_timeout_cuts_the_try_at_a_final_checkpoint_and_the_retry_goes_on_from_it(tmp_path, airflow_db):
    # A fault of Airflow's own (docs/faults.md): AirflowTaskTimeout raised in the task at 8 s of a 12 s job.
    args = ["--mb", "20", "--steps", "40", "--step-seconds", "0.3"]
    env = airflow_env(tmp_path, airflow_db, CEDANA_E2E_TRAIN_ARGS=" ".join(args))
    r = subprocess.run([*AIRFLOW, "dags", "test", "cedana_e2e_timeout"], env=env, capture_output=True, text=True,
                       timeout=300)
    text = r.stdout + r.stderr
    (tmp_path / "dags-test.log").write_text(text)
    assert r.returncode == 0, text[-5000:]
    assert "AirflowTaskTimeout" in text, text[-5000:]
    cuts = re.findall(r"stopped by AirflowTaskTimeout checkpoint_id=\S+: final checkpoint seq (\d+)", text)
    assert cuts, text[-5000:]
    restored = [int(n) for n in re.findall(r"cedana[^:]*: restored seq (\d+) of try \d+ ", text)]
    assert restored[:len(cuts)] == [int(n) for n in cuts]  # each retry resumed from the cut before it
    # Nothing done twice, nothing skipped: the workload stopped at its final checkpoint each time
    steps = [int(n) for n in re.findall(r"step (\d+)/40", text)]
    assert steps == list(range(1, 41)), steps
    assert text.count("start-up: allocating") == 1
    assert re.findall(r"done digest=\w+", text) == [uninterrupted_digest(*args)]
