"""Policy test DAG: opted in without cedana:effects"""
from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("no_effects", schedule=None, start_date=datetime(2026, 1, 1), tags=["cedana:opt-in"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py")
