"""Policy test DAG: external effects, no idempotency key"""
from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("external_no_key", schedule=None, start_date=datetime(2026, 1, 1), tags=["cedana:opt-in", "cedana:effects=external"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py")
