"""Fleet drills on a schedule: prove that restore works, measure it, and keep the reports.

`verify` reads the latest checkpoint of a sample of IDs completely (every chunk, the signature, the
image set as CRIU reads it); a `canary` on each queue the opt-in list names stages a node loss of a
small deterministic workload and restores it (the default queue when the list names none). Each
task fails when its drill fails, so retries, alerting and `[cedana] drill_notifier` see it; reports
go to the store (`cedana-airflow drills`, Browse > Checkpoints > fleet drills).

Schedule: `[cedana] drill_schedule` (default daily). Paused when it first appears: unpause it.
"""

from datetime import datetime

from airflow.sdk import DAG, task

from cedana_airflow.airflow.drills import canary_queues, drill_notifier, drill_schedule, run_drill

notifier = drill_notifier()

with DAG(
    "cedana_fleet_drill",
    schedule=drill_schedule(),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
    max_active_runs=1,
    tags=["cedana", "drill"],
    default_args={"retries": 0, **({"on_failure_callback": notifier} if notifier else {})},
    doc_md=__doc__,
):

    @task(task_id="verify")
    def verify_sample() -> dict:
        return run_drill("verify", sample=20)

    verify_sample()

    for queue in canary_queues() or [None]:

        @task(task_id=f"canary_{queue}" if queue else "canary", **({"queue": queue} if queue else {}))
        def canary() -> dict:
            return run_drill("canary", mb=64, steps=60, step_seconds=0.1, heartbeat=1.0, heartbeats=2)

        canary()
