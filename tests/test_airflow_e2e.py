"""End to end with the real Airflow 3.3 (`airflow dags test`, SQLite home in a temp dir), real CRIU and
a real store: try 1's workload is killed after a heartbeat, try 2 resumes from the checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, uninterrupted_digest, wait_gone

pytestmark = pytest.mark.integration

TRAIN_ARGS = ["--mb", "60", "--steps", "50", "--step-seconds", "0.1"]
AIRFLOW = [sys.executable, "-m", "airflow"]


@pytest.fixture(scope="session")
def airflow_db(tmp_path_factory) -> Path:
    """An Airflow metadata DB migrated once; each test copies it into its own home."""
    home = tmp_path_factory.mktemp("airflow-template")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    subprocess.run([*AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    return home / "airflow.db"


def airflow_env(tmp_path: Path, airflow_db: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "airflow"
    home.mkdir(exist_ok=True)
    shutil.copy(airflow_db, home / "airflow.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "tests" / "dags"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CEDANA__STORE=f"file://{tmp_path / 'store'}",
               AIRFLOW__CEDANA__WORK_DIR=str(tmp_path / "work"), CEDANA_E2E_TRAIN_ARGS=" ".join(TRAIN_ARGS),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


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


def kill_workload(pid: int) -> None:
    """The workload dies under a running task (an OOM kill, a GPU Xid): its PID namespace's init goes."""
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid, 10)


def run_dag_killing_try_1(env: dict[str, str], tmp_path: Path, list_manifest) -> str:
    log = tmp_path / "dags-test.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*AIRFLOW, "dags", "test", "cedana_e2e"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            m = first_manifest(list_manifest, 180, proc, log)
            kill_workload(m["process"]["pid"])
            assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return log.read_text()


def assert_resumed(text: str) -> None:
    assert text.count("start-up: allocating") == 1, "the retry ran the workload's start-up code again"
    assert re.search(r"cedana: restored checkpoint_id=cedana_e2e\.train\.manual__\S+ seq=\d+ \(taken by try 1 on node ", text), text[-5000:]
    assert re.search(r"cedana: the workload exited \d+; 1 checkpoint\(s\) taken this try, the latest is seq 1: a "
                     r"retry or Clear resumes from it", text)  # try 1 failed because its workload died
    assert "where try 1 ran and failed" in text  # the retry noticed it is on the same node
    digests = re.findall(r"done digest=\w+", text)
    assert digests == [uninterrupted_digest(*TRAIN_ARGS)], digests


def test_dags_test_try_2_resumes_from_try_1s_checkpoint(tmp_path, airflow_db):
    env = airflow_env(tmp_path, airflow_db)
    text = run_dag_killing_try_1(env, tmp_path, file_manifest(tmp_path / "store", "cedana_e2e.train."))
    assert_resumed(text)


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
