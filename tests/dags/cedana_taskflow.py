"""@task.checkpointed end to end (tests/test_airflow_e2e.py): a numpy loop whose result becomes the XCom."""

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("cedana_taskflow", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):

    @task.checkpointed(heartbeat=timedelta(seconds=1))
    def train(steps: int, mb: int) -> dict:
        import time

        import numpy as np

        print(f"start-up: {mb} MB", flush=True)
        x = np.arange(mb * (1 << 20) // 8, dtype=np.float64)
        for i in range(steps):
            x = (x * 1.0001 + i) % 1000.0
            print(f"step {i + 1}/{steps}", flush=True)
            time.sleep(0.1)
        return {"steps": steps, "total": round(float(x.sum()), 3)}

    @task
    def report(result: dict) -> None:
        print(f"RESULT {result}")

    report(train(40, 40))
