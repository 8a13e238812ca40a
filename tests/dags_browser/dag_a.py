"""The browser tests' DAG: one real run of it (`airflow dags test`) gives Airflow's UI a task
instance page whose Checkpoints tab the test opens. Its checkpoints are written by the test."""

from datetime import datetime

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

with DAG("dag_a", start_date=datetime(2026, 1, 1), schedule=None, catchup=False):
    BashOperator(task_id="train", bash_command="true")
