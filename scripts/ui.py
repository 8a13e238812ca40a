"""`make ui`: serve the demo's Airflow home in Airflow's own UI until Ctrl-C.

The same four parts as the demo (airflow_stack.py: api-server, scheduler, dag-processor, triggerer),
so Airflow's health is green and a run triggered from the UI runs; the demo DAG has no schedule, so
nothing starts by itself. The simple auth manager makes everyone an admin: a local demo needs no
login. It prints the address of the demo's latest task instance (its Logs tab at the last try) and of
the checkpoint browser. Port 8080, or a free one when 8080 is taken (CEDANA_UI_PORT chooses another).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from airflow_stack import AirflowStack, StackError  # noqa: E402
from demo import DAG_ID, REPO, TASK_ID, Demo, stop_on_sigterm  # noqa: E402


def main() -> int:
    demo = Demo(home=REPO / ".cedana" / "airflow", root=REPO / ".cedana" / "demo")
    if not (demo.home / "airflow.db").exists():
        print(f"no demo to show: {demo.home} has no Airflow database yet. Run `make demo` first.", file=sys.stderr)
        return 2
    stop_on_sigterm()
    try:
        with AirflowStack(demo.env(), demo.home, DAG_ID, port=int(os.environ.get("CEDANA_UI_PORT", "8080"))) as stack:
            runs = stack.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?order_by=-start_date&limit=1")["dag_runs"]
            print(f"Airflow UI: {stack.base}/   (no login needed: a local demo)")
            if runs:
                run_id = runs[0]["dag_run_id"]
                ti = stack.task_instance(DAG_ID, run_id, TASK_ID)
                print(f"the demo's task, try {ti['try_number']}'s log: "
                      f"{stack.ti_url(DAG_ID, run_id, TASK_ID, ti['try_number'])}")
            print(f"checkpoint browser:  {stack.base}/plugin/cedana-checkpoints")
            print("Ctrl-C stops it.", flush=True)
            while all(p.poll() is None for p in stack.procs.values()):
                time.sleep(1)
            gone = next(name for name, p in stack.procs.items() if p.poll() is not None)
            print(f"airflow {gone} stopped: see {demo.home / (gone + '.log')}", file=sys.stderr)
            return 1
    except StackError as e:
        print(f"ui failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopped.")
        return 0


if __name__ == "__main__":
    sys.exit(main())
