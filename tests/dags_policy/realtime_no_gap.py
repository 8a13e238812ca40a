"""Policy test DAG: realtime without max_restore_gap"""
from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("realtime_no_gap", schedule=None, start_date=datetime(2026, 1, 1), tags=["cedana:opt-in", "cedana:effects=none", "cedana:realtime"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py")
