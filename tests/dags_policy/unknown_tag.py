"""Policy test DAG: a misspelt cedana tag"""
from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("unknown_tag", schedule=None, start_date=datetime(2026, 1, 1), tags=["cedana:optin", "cedana:effects=none"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py")
