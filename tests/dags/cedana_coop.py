"""Cooperative checkpoints through Airflow (tests/integration/test_airflow_torch.py): two-rank DDP training under
torchrun in mode cooperative; a cooperative workload with mode auto on a worker where CRIU cannot run; and a
transparent task on that worker, which runs unprotected and says why. Defined only when the test names its
directory; the node name comes from a file the test rewrites between tries (each try parses this file anew)."""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

ROOT = os.environ.get("CEDANA_E2E_COOP_ROOT")
WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"
NO_CRIU = "/nonexistent/criu"  # this worker "has no CRIU"

if ROOT:
    node = Path(ROOT, "node")
    here = {"node": node.read_text().strip()} if node.exists() else {}
    with DAG("cedana_coop", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="train_ddp", mode="cooperative", heartbeat=timedelta(seconds=1), settings=here,
            command=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(WORKLOADS / "ddp_coop.py"), "--steps", "80", "--step-seconds", "0.1"],
        )
        CheckpointedCommandOperator(
            task_id="auto_no_criu", mode="auto", heartbeat=timedelta(seconds=1), settings={**here, "criu": NO_CRIU},
            command=[sys.executable, str(WORKLOADS / "coop_counter.py"), "--steps", "150", "--step-seconds", "0.1"],
        )
        CheckpointedCommandOperator(
            task_id="transparent_no_criu", settings={"criu": NO_CRIU}, retries=0,
            command=[sys.executable, "-c", "print('ran to its end')"],
        )
