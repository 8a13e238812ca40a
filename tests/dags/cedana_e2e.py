"""DAGs for the end-to-end tests (tests/test_airflow_e2e.py); settings come from the environment."""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

TRAIN = str(Path(__file__).resolve().parent.parent / "workloads" / "train.py")
ARGS = os.environ.get("CEDANA_E2E_TRAIN_ARGS", "--mb 50 --steps 60 --step-seconds 0.1").split()

with DAG("cedana_e2e", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
    CheckpointedCommandOperator(
        task_id="train",
        command=[sys.executable, TRAIN, *ARGS],
        heartbeat=timedelta(seconds=float(os.environ.get("CEDANA_E2E_HEARTBEAT", "1"))),
        aws_conn_id=os.environ.get("CEDANA_E2E_CONN") or None,
    )

# Airflow's own fault: execution_timeout raises AirflowTaskTimeout inside the task. Each try takes a
# final checkpoint on the way out and the next one resumes from it (retries to spare: a try that
# restores late may time out again, and the one after it goes on from there).
with DAG("cedana_e2e_timeout", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 3, "retry_delay": timedelta(seconds=1)}):
    CheckpointedCommandOperator(
        task_id="train",
        command=[sys.executable, TRAIN, *ARGS],
        heartbeat=timedelta(seconds=float(os.environ.get("CEDANA_E2E_HEARTBEAT", "2"))),
        execution_timeout=timedelta(seconds=float(os.environ.get("CEDANA_E2E_TIMEOUT", "8"))),
    )

# Issue 48: a DAG author who would sign as another DAG. Its first task reads the Variable that held the
# signing key before 0.8.0 and replaces it with a key it knows; its second writes under another task's
# checkpoint ID (CEDANA_E2E_TARGET_ID). Neither reaches the node key, and the write is refused.
with DAG("cedana_e2e_intruder", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 0}):
    from airflow.sdk import Variable, task

    @task
    def replace_the_key() -> str:
        before = Variable.get("cedana_signing_secret", default=None)
        Variable.set("cedana_signing_secret", "attacker-known-key-0123456789abcdef")
        return f"the Variable held {before!r}"

    replace_the_key() >> CheckpointedCommandOperator(
        task_id="intrude",
        command=[sys.executable, "-c", "import time; print('intruder ran', flush=True); time.sleep(3)"],
        checkpoint_id=os.environ.get("CEDANA_E2E_TARGET_ID", "cedana_e2e_intruder.none"),
        heartbeat=timedelta(seconds=1),
    )
