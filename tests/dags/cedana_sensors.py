"""The three ways a CheckpointSensor waits; tests/test_sensors.py starts each one's workload once it is waiting."""

from datetime import datetime

from airflow.sdk import DAG

from cedana_airflow.sensors import CheckpointSensor

with DAG("cedana_sensors", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    CheckpointSensor(task_id="wait_deferred", checkpoint_id="sensed-deferred", deferrable=True, poke_interval=0.5, timeout=120)
    CheckpointSensor(task_id="wait_poke", checkpoint_id="sensed-poke", mode="poke", poke_interval=0.5, timeout=120)
    CheckpointSensor(task_id="wait_reschedule", checkpoint_id="sensed-reschedule", mode="reschedule", poke_interval=1, timeout=120)
