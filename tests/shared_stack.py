"""The test run's one Airflow stack: `airflow api-server`, `scheduler`, `dag-processor` and `triggerer`
(LocalExecutor, PostgreSQL), started by the first test that needs it and stopped when the run ends
(tests/harness.py). A stack's start-up costs about 16 s of CPU; one per test was most of some tests.
Its metadata DB is PostgreSQL, not SQLite: with four workers' tests writing through the API while the
scheduler and the dag processor write, SQLite's one writer lock timed out under load and the API
answered 500 (a CI run's unpause of a new DAG).

Each test puts its own DAG on it (``add_dag``): a file in the stack's DAGs folder that calls a factory of
tests/stack_dags/ with the test's own DAG ID, store, work dir, opt-in list and queue, so that no test sees
another's runs, checkpoints or failure history. The stack's own [cedana] settings are the defaults a test
does not set (a store of the run's, an opt-in list that admits everything).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from airflow_stack import AirflowStack  # noqa: E402
from local_parts import AIRFLOW, Postgres  # noqa: E402

#: The factories the tests' DAG files call (on the stack's PYTHONPATH).
FACTORIES = REPO / "tests" / "stack_dags"
OPTIN_ALL = '[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
READY_DAG = "shared_stack_ready"


def start(d: Path) -> dict[str, Any]:
    """Bring the stack up in ``d``: its home, its DAGs folder (empty but for the DAG that says it is
    ready), and its defaults. Returns the record every worker reads."""
    home, dags = d / "airflow", d / "dags"
    home.mkdir()
    dags.mkdir()
    (d / "optin.toml").write_text(OPTIN_ALL)
    (dags / f"{READY_DAG}.py").write_text(
        "from datetime import datetime\nfrom airflow.sdk import DAG\n\n"
        f"dag = DAG({READY_DAG!r}, schedule=None, start_date=datetime(2026, 1, 1))  # the stack is ready once served\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_", "PYTEST_"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(dags), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CEDANA__STORE=f"file://{d / 'store'}", AIRFLOW__CEDANA__WORK_DIR=str(d / "work"),
               AIRFLOW__CEDANA__OPTIN_FILE=str(d / "optin.toml"),
               # a new test's file is listed within 2 s (files already parsed are not parsed again for it)
               AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="2",
               PYTHONPATH=os.pathsep.join(p for p in (str(FACTORIES), env.get("PYTHONPATH", "")) if p),
               PYTHONUNBUFFERED="1")
    pg = Postgres()
    try:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = pg.start()
        subprocess.run([*AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
        stack = AirflowStack(env, home, wait_dag=READY_DAG)
        stack.__enter__()
    except BaseException:
        pg.stop()
        raise
    # each part leads its own session, PostgreSQL's too; its data dir goes once they have stopped
    return {"base": stack.base, "home": str(home), "dags": str(dags), "env": stack.env,
            "pgids": [*(p.pid for p in stack.procs.values()), pg.pid], "dirs": [str(pg.dir)]}


class SharedStack(AirflowStack):
    """A worker's client of the run's stack, and the one way a test puts a DAG on it."""

    _n = itertools.count(1)
    dags: Path

    @classmethod
    def of_this_run(cls) -> SharedStack:
        record = harness.service("airflow")  # conftest.py registers start()
        stack = cls.running(record["base"], Path(record["home"]), record["env"])
        stack.dags = Path(record["dags"])
        return stack  # type: ignore[return-value]

    def add_dag(self, stem: str, factory: str, **params: Any) -> str:
        """A DAG of this test: ``factory`` ("module:function" of tests/stack_dags) called with its own
        DAG ID (``stem`` and this worker's counter) and ``params`` (literals only). Returns the DAG ID,
        once the stack serves it."""
        dag_id = f"{stem}_{harness.worker_id()}_{next(self._n)}"
        module, function = factory.split(":")
        path = self.dags / f"{dag_id}.py"
        body = (f'"""DAG {dag_id} of {os.environ.get("PYTEST_CURRENT_TEST", "a test").split(" ")[0]}, on the test run\'s '
                f'shared Airflow stack (tests/shared_stack.py)."""\n\n'
                f"from {module} import {function}\n\n{function}({dag_id!r}, **{params!r})\n")
        assert re.fullmatch(r"[A-Za-z0-9_]+", dag_id), dag_id
        tmp = path.with_suffix(".tmp")  # the dag processor lists *.py: never a half-written one
        tmp.write_text(body)
        tmp.rename(path)
        self.serve(dag_id, path)
        return dag_id

    def task_log_files(self, dag_id: str, try_number: int) -> str:
        """Every task's log of ``dag_id`` at ``try_number`` as the worker writes it (read while it runs)."""
        return "".join(p.read_text() for p in (self.home / "logs" / f"dag_id={dag_id}").rglob(f"attempt={try_number}.log"))
