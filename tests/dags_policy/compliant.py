"""Policy test DAG: opted in, effects declared, external with a key"""
from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("compliant", schedule=None, start_date=datetime(2026, 1, 1), tags=["cedana:opt-in", "cedana:effects=external", "team:ml"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py", idempotency_key="{{ run_id }}")
