"""The cedana_fleet_drill DAG's live task alone (the same call), so the test does not also run a
canary and a verify drill on two cores."""

from datetime import datetime

from airflow.sdk import DAG, Param, get_current_context, task

from cedana_airflow.airflow.drills import run_drill

with DAG("live_drill", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args={"retries": 0},
         params={"live_dry_run": Param(False, type="boolean")}):

    @task(task_id="live")
    def live() -> dict:
        return run_drill("live", dry_run=bool(get_current_context()["params"]["live_dry_run"]), poll=0.5)

    live()
