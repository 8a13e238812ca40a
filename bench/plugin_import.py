"""What loading the ``cedana`` plugin costs a task process (issue 50, part "plugin"): every process that
loads Airflow's plugins imports it, a task process included (the task runner's integrate_macros_plugins),
before the workload starts.

Each figure is a fresh interpreter that has imported Airflow's task runner and plugins manager (what a
task process holds by then), timed over one step, median of ``reps`` runs:

* baseline: the plugin as 0.8.4 loaded it, its module with the browser's FastAPI app built (its class
  body called ``fastapi_app()``);
* ours: the plugin module as it is now (the app is built on the browser's first request, in the
  api-server).                                                     target ours <= 0.1x of the baseline

Also reported: the modules each adds, whether Airflow's API server came with it, and (info) what
``integrate_macros_plugins()`` as a whole costs with every plugin installed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from harness import med, say, spread

TARGET = 0.1
PRE = "import airflow.sdk.execution_time.task_runner, airflow.plugins_manager"
STEPS = {
    "baseline": "import cedana_airflow.airflow.plugin\nfrom cedana_airflow.airflow.browser import fastapi_app\nfastapi_app()",
    "ours": "import cedana_airflow.airflow.plugin",
    "integrate": "from airflow.sdk.plugins_manager import integrate_macros_plugins\nintegrate_macros_plugins()",
}


def _probe(step: str) -> dict[str, Any]:
    code = (f"import sys, time, json\n{PRE}\n"
            "before = set(sys.modules); t = time.perf_counter()\n"
            f"{step}\n"
            "took = time.perf_counter() - t\n"
            "print(json.dumps({'seconds': took, 'modules': len(set(sys.modules) - before),\n"
            "                  'api_server': 'airflow.api_fastapi.app' in sys.modules}))\n")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if r.returncode:
        raise RuntimeError(f"plugin probe failed: {r.stderr[-1500:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def bench_plugin(reps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in STEPS}
    for i in range(reps):  # alternating, so that a busy moment falls on every side
        for name, step in STEPS.items():
            runs[name].append(_probe(step))
        say(f"plugin import {i + 1}/{reps}: 0.8.4 {runs['baseline'][-1]['seconds']:.3f} s, "
            f"ours {runs['ours'][-1]['seconds'] * 1000:.1f} ms")
    secs = {k: [r["seconds"] for r in v] for k, v in runs.items()}
    b, o = med(secs["baseline"]), med(secs["ours"])
    return {"plugin": {
        "reps": reps, "baseline_seconds": b, "ours_seconds": o, "integrate_seconds": med(secs["integrate"]),
        "spread": {k: spread(v) for k, v in secs.items()},
        "modules": {k: v[0]["modules"] for k, v in runs.items()},
        "api_server": {k: v[0]["api_server"] for k, v in runs.items()},
        "ratio": o / b, "target": TARGET, "pass": o / b <= TARGET and not runs["ours"][0]["api_server"],
    }}
