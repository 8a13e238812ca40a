"""Fleet drills on a schedule: prove that restore works, measure it, and keep the reports.

`verify` reads the latest checkpoint of a sample of IDs completely (every chunk, the signature, the
image set as CRIU reads it); a `canary` on each queue the opt-in list names stages a node loss of a
small deterministic workload and restores it (the default queue when the list names none); `live`,
only when the opt-in list says `live = true` under `[drills]`, fails one running checkpointed task
within the list's limits and follows its retry (trigger with `{"live_dry_run": true}` to see what it
would pick, touching nothing; set the Variable `cedana_drills_stop` or pause this DAG to stop it). Each
task fails when its drill fails, so retries, alerting and `[cedana] drill_notifier` see it; reports
go to the store (`cedana-airflow drills`, Browse > Checkpoints > fleet drills).

Schedule: `[cedana] drill_schedule` (default daily). Paused when it first appears: unpause it.
"""

from datetime import datetime

from airflow.sdk import DAG, Param, get_current_context, task

from cedana_airflow.airflow.drills import canary_queues, drill_notifier, drill_schedule, live_enabled, run_drill

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
    params={"live_dry_run": Param(False, type="boolean", description="live: say what it would fail, touch nothing")},
):

    @task(task_id="verify")
    def verify_sample() -> dict:
        return run_drill("verify", sample=20)

    verify_sample()

    for queue in canary_queues() or [None]:

        @task(task_id=f"canary_{queue}" if queue else "canary", **({"queue": queue} if queue else {}))
        def canary() -> dict:
            # 12 s of steps: two heartbeats fit on a node that is busy (a canary must not fail for that)
            return run_drill("canary", mb=64, steps=120, step_seconds=0.1, heartbeat=1.0, heartbeats=2)

        canary()

    if live_enabled():

        @task(task_id="live")
        def live() -> dict:
            return run_drill("live", dry_run=bool(get_current_context()["params"]["live_dry_run"]))

        live()
