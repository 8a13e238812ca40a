"""The demo: a training-style job checkpointed every few seconds; its retry resumes instead of starting over.

`make demo` runs it through Airflow's scheduler and workers, kills the workload of try 1 after a few
heartbeats (as a lost spot node or a GPU Xid would), and try 2 restores from the latest checkpoint.
The store comes from [cedana] (AIRFLOW__CEDANA__*), as on a real cluster; the 5 s heartbeat is the operator's
argument (without it, [cedana] heartbeat_seconds: every 10 minutes by default).
"""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

# The test suite's workload: numpy state, deterministic steps, printed progress and a final digest.
TRAIN = Path(__file__).resolve().parent.parent / "tests" / "workloads" / "train.py"
ARGS = os.environ.get("CEDANA_DEMO_TRAIN_ARGS", "--mb 300 --steps 90 --step-seconds 0.5 --change-fraction 0.004").split()

with DAG(
    "cedana_demo_training",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["cedana", "demo"],
    default_args={"retries": 2, "retry_delay": timedelta(seconds=2)},
    doc_md=__doc__,
):
    CheckpointedCommandOperator(
        task_id="train",
        command=[sys.executable, str(TRAIN), *ARGS],
        heartbeat=timedelta(seconds=5),
    )
