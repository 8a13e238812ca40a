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

Its parts run from the worker environment (`make worker`: Debian's python3 with our wheel, what an Airflow
image has), so that a task may run as another user: a DAG whose factory gets ``agent=stack.agent(...)``
(tests/stack_dags/nobody.py) runs its tasks as uid nobody through Airflow's own impersonation
(``run_as_user``: the task process re-executes itself under sudo), and their workloads go through the
stack's node agents, root, one per
node name (``node-a``, ``node-b``), on the stack's own store (issue 49). The folders such a task reads
(the stack's home, its DAGs, a test's ``user_dir``) are under one any user may enter; the agents' store
and work dirs are root's alone.
"""

from __future__ import annotations

import itertools
import os
import pwd
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from airflow_stack import AirflowStack  # noqa: E402
from local_parts import WORKER_ENV, Postgres  # noqa: E402

#: The factories the tests' DAG files call: linked into the DAGs folder, which Airflow puts on sys.path (sudo
#: drops PYTHONPATH from a task it runs as another user), and listed in its .airflowignore (no DAG files).
FACTORIES = REPO / "tests" / "stack_dags"
OPTIN_ALL = '[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
READY_DAG = "shared_stack_ready"
#: The stack's node agents: one per node name a test's nobody task may run on.
NODES = ("node-a", "node-b")
#: One more agent, with a store of its own that only the live drill's test writes (a drill chooses among every
#: running task of the stack that has a checkpoint it can see), and nobody's group among its agent_drillers.
DRILL_NODE = "node-drill"
#: Airflow's CLI in the worker environment: the interpreter a task re-executes under sudo must be one any
#: user may run (the tests' .venv lives in root's 0700 home).
WORKER_AIRFLOW = [str(WORKER_ENV / "bin" / "python"), "-P", "-m", "airflow"]


def _start_agents(d: Path) -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    """The stack's node agents (root, the worker environment's `cedana-airflow agent`), one per node name,
    on one store of the stack's (the drill's: its own): node name -> socket, and their processes."""
    socks = Path(f"/run/cedana-stack-{os.getpid()}")  # a unix socket's path has at most 107 bytes
    socks.mkdir(mode=0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_", "PYTEST_"))}
    env.update(CEDANA_STORE=f"file://{d / 'store'}", PYTHONUNBUFFERED="1")
    agents, procs = {}, []
    drill = {"CEDANA_STORE": f"file://{d / 'store-drill'}", "CEDANA_AGENT_DRILLERS": "65534"}  # nogroup
    for node in (*NODES, DRILL_NODE):
        sock, log = socks / f"{node}.sock", d / f"agent-{node}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen([str(WORKER_ENV / "bin" / "cedana-airflow"), "agent", "--socket", str(sock),
                                           "--node", node, "--audit", str(d / f"agent-{node}.audit")],
                                          env={**env, "CEDANA_WORK_DIR": str(d / f"agent-work-{node}"),
                                               **(drill if node == DRILL_NODE else {})},
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        agents[node] = str(sock)
    deadline = time.monotonic() + 60
    for node, proc in zip((*NODES, DRILL_NODE), procs):
        log = d / f"agent-{node}.log"
        while b"agent serving on" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"the stack's agent {node} did not start: {log.read_text()[-500:]}")
            time.sleep(0.1)
    return agents, procs


def start(d: Path) -> dict[str, Any]:
    """Bring the stack up: its agents, its home, its DAGs folder (empty but for the DAG that says it is
    ready), and its defaults. Returns the record every worker reads."""
    if not (WORKER_ENV / "bin" / "airflow").exists():
        raise RuntimeError(f"no worker environment in {WORKER_ENV}: run `make worker`")
    public = Path(tempfile.mkdtemp(prefix="cedana-stack-"))  # what a nobody task reads: any user may enter
    public.chmod(0o755)
    home, dags, users = public / "airflow", public / "dags", public / "users"
    for folder in (home, dags, users):
        folder.mkdir(mode=0o755)
    (public / "optin.toml").write_text(OPTIN_ALL)
    factories = sorted(FACTORIES.glob("*.py"))
    for f in factories:
        (dags / f.name).symlink_to(f)
    (dags / ".airflowignore").write_text("".join(f"{f.name}\n" for f in factories))
    (dags / f"{READY_DAG}.py").write_text(
        "from datetime import datetime\nfrom airflow.sdk import DAG\n\n"
        f"dag = DAG({READY_DAG!r}, schedule=None, start_date=datetime(2026, 1, 1))  # the stack is ready once served\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_", "PYTEST_"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(dags), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CEDANA__STORE=f"file://{d / 'store'}", AIRFLOW__CEDANA__WORK_DIR=str(d / "work"),
               AIRFLOW__CEDANA__OPTIN_FILE=str(public / "optin.toml"),
               # a new test's file is listed within 2 s (files already parsed are not parsed again for it)
               AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="2",
               # each test's file is parsed once, when it appears (and again if it changes): re-parsing
               # every file every 30 s, Airflow's default, was about 60 of the stack's 211 CPU-s a run
               AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="3600",
               PYTHONUNBUFFERED="1")
    pg = Postgres()
    agents, procs = _start_agents(d)
    try:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = pg.start()
        subprocess.run([*WORKER_AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
        stack = AirflowStack(env, home, wait_dag=READY_DAG, airflow=WORKER_AIRFLOW)
        stack.__enter__()
    except BaseException:
        pg.stop()
        for p in procs:
            p.kill()
        raise
    # each part leads its own session, PostgreSQL's and the agents' too; the folders go once they have stopped
    return {"base": stack.base, "home": str(home), "dags": str(dags), "env": stack.env, "agents": agents,
            "agent_store": str(d / "store"), "drill_store": str(d / "store-drill"), "users": str(users),
            "pgids": [*(p.pid for p in stack.procs.values()), pg.pid, *(p.pid for p in procs)],
            "dirs": [str(pg.dir), str(public), str(Path(agents[NODES[0]]).parent)]}


class SharedStack(AirflowStack):
    """A worker's client of the run's stack, and the one way a test puts a DAG on it."""

    _n = itertools.count(1)
    dags: Path
    agents: dict[str, str]
    #: The agents' store (a nobody task's checkpoints are there, not in the store its DAG names).
    agent_store: Path
    #: The DRILL_NODE agent's own store.
    drill_store: Path
    users: Path

    @classmethod
    def of_this_run(cls) -> SharedStack:
        record = harness.service("airflow")  # conftest.py registers start()
        stack = cls.running(record["base"], Path(record["home"]), record["env"])
        stack.dags = Path(record["dags"])
        stack.agents, stack.agent_store, stack.users = record["agents"], Path(record["agent_store"]), Path(record["users"])
        stack.drill_store = Path(record["drill_store"])
        return stack  # type: ignore[return-value]

    def agent(self, node: str = NODES[0]) -> dict[str, str]:
        """What a DAG factory's ``agent`` takes: its task runs as nobody through node ``node``'s agent."""
        return {"node": node, "socket": self.agents[node]}

    def user_dir(self, name: str) -> Path:
        """A test's folder that a nobody task may read and write (its workload's data, cwd and work dir):
        nobody's, 0700, where any user may enter. Its files are the test's to make before it chowns them."""
        path = self.users / f"{harness.worker_id()}-{next(self._n)}-{name}"
        path.mkdir(mode=0o700)
        give_to_nobody(path)
        return path

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


def give_to_nobody(root: Path) -> None:
    """``root`` and everything under it: uid and gid nobody's (what a nobody task's workload writes into)."""
    user = pwd.getpwnam("nobody")
    for path in (root, *root.rglob("*")):
        os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
