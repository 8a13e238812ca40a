"""Policy test DAG: realtime with max_restore_gap"""
from datetime import datetime, timedelta

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

with DAG("realtime_ok", schedule=None, start_date=datetime(2026, 1, 1), tags=["cedana:opt-in", "cedana:effects=none", "cedana:realtime"]):
    CheckpointedCommandOperator(task_id="train", command="python train.py", max_restore_gap=timedelta(minutes=5))
