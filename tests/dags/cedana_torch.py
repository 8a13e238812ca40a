"""The realistic PyTorch job (tests/integration/test_airflow_torch.py): DataLoader workers, a dataset, a log and
a checkpoint directory outside the working directory, default settings; defined only when the test names its
directory. The node name comes from a file the test rewrites between tries: each try parses this file anew."""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

ROOT = os.environ.get("CEDANA_E2E_TORCH_ROOT")
SHAPE = str(Path(__file__).resolve().parent.parent / "integration" / "shapes" / "torch_loader.py")

if ROOT:
    node = Path(ROOT, "node")
    with DAG("cedana_torch", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="train",
            command=[sys.executable, SHAPE, "--data", f"{ROOT}/data", "--log", f"{ROOT}/logs/train.log",
                     "--ckpt", f"{ROOT}/ckpts", *os.environ.get("CEDANA_E2E_TORCH_ARGS", "").split()],
            cwd=f"{ROOT}/job",
            heartbeat=timedelta(seconds=1),
            settings={"node": node.read_text().strip()} if node.exists() else None,
        )
