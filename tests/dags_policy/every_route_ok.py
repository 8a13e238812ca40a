"""Policy test DAG: every route's operator, each declaring the key, the gap and the lease the tags ask for"""
from datetime import datetime, timedelta

from airflow.sdk import DAG, task

from cedana_airflow.operators import CedanaKubernetesPodOperator, CedanaSlurmOperator, CheckpointedCommandOperator

DECLARED = {"idempotency_key": "{{ run_id }}", "max_restore_gap": timedelta(minutes=5), "lease": timedelta(hours=1)}

with DAG("every_route_ok", schedule=None, start_date=datetime(2026, 1, 1),
         tags=["cedana:opt-in", "cedana:effects=external", "cedana:realtime", "cedana:license=matlab"]):
    CheckpointedCommandOperator(task_id="on_a_worker", command="python train.py", **DECLARED)
    CedanaKubernetesPodOperator(task_id="in_a_pod", name="train", image="ml/train:1", cmds=["python", "train.py"],
                                **DECLARED)
    CedanaSlurmOperator(task_id="as_a_slurm_job", command="python train.py", partition="cedana", **DECLARED)

    @task.checkpointed(**DECLARED)
    def as_a_function() -> None:
        pass

    as_a_function()
