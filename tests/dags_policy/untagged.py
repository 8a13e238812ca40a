"""Policy test DAG: no cedana tags: never touched"""
from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("untagged", schedule=None, start_date=datetime(2026, 1, 1), tags=["team:ml"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py")
