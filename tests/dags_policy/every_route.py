"""Policy test DAG: every route's operator, none declaring what the tags ask for (key, gap, lease)"""
from datetime import datetime

from airflow.sdk import DAG, task

from cedana_airflow.operators import CedanaKubernetesPodOperator, CedanaSlurmOperator, CheckpointedCommandOperator

with DAG("every_route", schedule=None, start_date=datetime(2026, 1, 1),
         tags=["cedana:opt-in", "cedana:effects=external", "cedana:realtime", "cedana:license=matlab"]):
    CheckpointedCommandOperator(task_id="on_a_worker", command="python train.py")
    CedanaKubernetesPodOperator(task_id="in_a_pod", name="train", image="ml/train:1", cmds=["python", "train.py"])
    CedanaSlurmOperator(task_id="as_a_slurm_job", command="python train.py", partition="cedana")

    @task.checkpointed
    def as_a_function() -> None:
        pass

    as_a_function()
