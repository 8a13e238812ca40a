"""A local Airflow deployment with two Celery workers, for the failover test and `make demo-fleet`.

Everything runs on loopback in one temp dir and is stopped on exit: PostgreSQL (Debian's package;
CeleryExecutor needs a real database) as a throwaway cluster owned by the `postgres` user, Redis as
the broker, SeaweedFS, a real S3 server, as the store (through an Airflow connection), `airflow api-server`,
`scheduler`, `dag-processor`, and one `airflow celery worker` per node name, each with its own
hostname (what Airflow records for a try), `[cedana] node`, work dir and log-server port. A part
that does not come up is one line naming it and its log.

With ``worker_user`` (the demo and the failover test: ``nobody``), each node is what issue 49 deploys:
a node agent as root (`cedana-airflow agent`, its own socket, work dir and node name; the only part
that holds the store's credentials and the node key) and a Celery worker as that user, from the worker
environment (`make worker`), whose tasks are the agent's callers. Its environment has no store, no
connection to it and no key; its home and Airflow home are its own. The store's credentials are
then in no Airflow connection (every task may read every connection through the Execution API):
the agents have them, and the api-server's own environment (the checkpoint browser reads the store).

    with FleetStack(root, dags_folder, optin) as fleet:
        fleet.kill_worker("worker-a")     # SIGKILL the node's worker, agent and everything under them
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from local_parts import (AIRFLOW, WORKER_ENV, Deployment, Postgres, descendants, free_port, stop_parts,  # noqa: E402
                         http_answers, tail, weed_mini)  # (scripts/ is on sys.path)
HERE = Path(__file__).resolve().parent
BUCKET = "cedana-fleet"


class FleetError(RuntimeError):
    """One part of the deployment did not come up; the message names it."""


class FleetStack(Deployment):
    def __init__(self, root: Path, dags_folder: Path, optin: str, workers: tuple[str, ...] = ("worker-a", "worker-b"),
                 heartbeat_timeout: int = 10, extra_env: dict[str, str] | None = None,
                 worker_user: str | None = None) -> None:
        self.root, self.dags_folder, self.optin, self.worker_names = root, dags_folder, optin, workers
        self.heartbeat_timeout, self.extra_env, self.worker_user = heartbeat_timeout, extra_env or {}, worker_user
        self.homes: Path | None = None  # the workers' homes and the shared log folder (worker_user only)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.pg = Postgres()
        self.token = ""
        self.env: dict[str, str] = {}
        self.store_env: dict[str, str] = {}

    # -- parts ---------------------------------------------------------------------------------------
    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> None:
        """Start a part in its own session, its output appended to ``<name>.log`` (a restarted worker
        keeps its earlier log)."""
        with open(self.root / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True, **kw)

    def _wait(self, name: str, ready: Any, timeout: float) -> None:
        """Until ``ready()`` is true; else one line naming the part, why, and its log."""
        log = self.root / f"{name}.log"
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except (OSError, ValueError, KeyError):
                pass
            p = self.procs.get(name)
            if p is not None and p.poll() is not None:
                raise FleetError(f"{name} exited {p.returncode} while starting: {tail(log)} (log: {log})")
            if time.monotonic() > deadline:
                raise FleetError(f"{name} did not come up within {timeout:.0f} s: {tail(log)} (log: {log})")
            time.sleep(0.5)

    def _postgres(self) -> str:
        try:
            return self.pg.start()
        except RuntimeError as e:
            raise FleetError(str(e)) from None

    @property
    def pg_dir(self) -> Path | None:
        return self.pg.dir

    def _redis(self) -> str:
        if not shutil.which("redis-server"):
            raise FleetError("redis-server is not installed: apt-get install redis-server (make services does it)")
        port = free_port()
        (self.root / "redis").mkdir()
        self._start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.root / "redis"),
                              "--save", "", "--appendonly", "no"], env=dict(os.environ))

        def pong() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        self._wait("redis", pong, 30)
        return f"redis://127.0.0.1:{port}/0"

    def _s3(self) -> str:
        """A real S3 server, SeaweedFS, as the store (issue 52): any credentials, a bucket made here."""
        argv, url = weed_mini(self.root / "s3")
        self._start("s3", argv, env=dict(os.environ), cwd=self.root / "s3")
        self._wait("s3", lambda: http_answers(url), 60)
        import boto3

        boto3.client("s3", endpoint_url=url, aws_access_key_id="fleet", aws_secret_access_key="fleet",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        return url

    def worker_env(self, name: str) -> dict[str, str]:
        env = {**self.env, "CEDANA_FLEET_HOSTNAME": name, "AIRFLOW__CEDANA__NODE": name,
               "AIRFLOW__CEDANA__WORK_DIR": str(self.root / f"work-{name}"),
               "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port())}
        if self.worker_user is None:
            return env
        assert self.homes is not None
        home = self.homes / name
        env.pop("AIRFLOW__CEDANA__STORE")  # the agent's, not the worker's
        env.update(HOME=str(home), AIRFLOW_HOME=str(home / "airflow"), AIRFLOW__CEDANA__WORK_DIR=str(home / "work"),
                   AIRFLOW__CEDANA__AGENT_SOCKET=str(self.agent_socket(name)),
                   PATH=os.pathsep.join([str(WORKER_ENV / "bin"), "/usr/bin", "/bin"]))
        return env

    def agent_socket(self, name: str) -> Path:
        # on /run, as a node's would be (a unix socket's path has at most 107 bytes: not under the test's tmp)
        return Path(f"/run/cedana-fleet-{os.getpid()}-{id(self):x}/{name}/agent.sock")

    def _start_agent(self, name: str) -> None:
        """Node ``name``'s agent, as root: the store's credentials, its work dir and node name are its own."""
        sock = self.agent_socket(name)
        sock.parent.parent.mkdir(mode=0o755, exist_ok=True)
        env = {k: v for k, v in self.env.items() if not k.startswith(("AIRFLOW", "CEDANA_", "AWS_"))}
        env.update(self.store_env, CEDANA_WORK_DIR=str(self.root / f"agent-work-{name}"), PYTHONUNBUFFERED="1")
        log = self.root / f"agent-{name}.log"
        start = log.stat().st_size if log.exists() else 0
        self._start(f"agent-{name}", [sys.executable, "-m", "cedana_airflow", "agent", "--socket", str(sock),
                                      "--node", name, "--audit", str(self.root / f"agent-{name}.audit")], env)
        self._wait(f"agent-{name}", lambda: "agent serving on" in log.read_text(errors="replace")[start:], 60)

    def start_worker(self, name: str) -> None:
        """An `airflow celery worker` as node ``name`` (with its agent first, for ``worker_user``); returns
        once Celery says it is ready."""
        log = self.root / f"{name}.log"
        start = log.stat().st_size if log.exists() else 0
        if self.worker_user is None:
            self._start(name, [*AIRFLOW, "celery", "worker", "--celery-hostname", f"{name}@%h", "--concurrency", "2"],
                        self.worker_env(name))
        else:
            self._start_agent(name)
            user = pwd.getpwnam(self.worker_user)
            env = self.worker_env(name)
            self._start(name, [str(WORKER_ENV / "bin" / "airflow"), "celery", "worker", "--celery-hostname", f"{name}@%h",
                               "--concurrency", "2"], env, cwd=env["HOME"], user=user.pw_uid, group=user.pw_gid,
                        extra_groups=[])
        self._wait(name, lambda: " ready." in log.read_text(errors="replace")[start:], 120)

    def _homes(self) -> None:
        """The workers' folders (each its user's own, 0700) and the log folder they share with the
        api-server, which shows their task logs: under a folder any user may enter (the test's tmp is
        root's alone)."""
        if not (WORKER_ENV / "bin" / "airflow").exists():
            raise FleetError(f"no worker environment in {WORKER_ENV}: run `make worker`")
        user = pwd.getpwnam(self.worker_user or "")
        self.homes = Path(tempfile.mkdtemp(prefix="cedana-fleet-"))
        self.homes.chmod(0o755)
        for sub, mode in [("logs", 0o755), *((n, 0o700) for n in self.worker_names)]:
            (self.homes / sub).mkdir(mode=mode)
            os.chown(self.homes / sub, user.pw_uid, user.pw_gid)

    def kill_worker(self, name: str) -> float:
        """A node loss: freeze, then SIGKILL, the worker and everything below it (task supervisors, the
        workload's PID namespace, the watchdog), and its agent with everything below that (shims and the
        trees they watch). Returns the wall-clock time of the kill."""
        p = self.procs.pop(name)
        agent = self.procs.pop(f"agent-{name}", None)
        tree = descendants([p.pid] + ([agent.pid] if agent else []))
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)  # nothing below it gets to react to its parent's death
        at = time.time()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.wait()
        if agent is not None:
            agent.wait()
        return at

    # -- the API -------------------------------------------------------------------------------------
    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.env['AIRFLOW__API__PORT']}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.token}"} if self.token else {})})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}: {tail(p, 15)}" for p in sorted(self.root.glob("*.log")))

    # -- lifecycle -----------------------------------------------------------------------------------
    def _up(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.worker_user is not None:
            self._homes()
        db, broker, s3 = self._postgres(), self._redis(), self._s3()
        port = free_port()
        optin = (self.homes or self.root) / "optin.toml"  # the workers' to read, root's to write
        optin.write_text(self.optin)
        conn = json.dumps({"conn_type": "aws", "login": "fleet", "password": "fleet",
                           "extra": {"endpoint_url": s3, "region_name": "us-east-1"}})
        self.store_env = {"AWS_ENDPOINT_URL": s3, "AWS_ACCESS_KEY_ID": "fleet", "AWS_SECRET_ACCESS_KEY": "fleet",
                          "AWS_DEFAULT_REGION": "us-east-1", "CEDANA_STORE": f"s3://{BUCKET}/store"}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CEDANA_", "AWS_"))}
        self.env = {**base,
                    "AIRFLOW_HOME": str(self.root / "airflow"), "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db, "AIRFLOW__CELERY__BROKER_URL": broker,
                    "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + db,
                    "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                    "AIRFLOW__API__PORT": str(port),
                    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                    # one secret for every component: a worker's task token must be accepted by the api-server
                    "AIRFLOW__API_AUTH__JWT_SECRET": os.urandom(16).hex(),
                    # a dead worker's task is noticed by its missing heartbeat: low, for the demo
                    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(self.heartbeat_timeout),
                    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
                    "AIRFLOW__CORE__HOSTNAME_CALLABLE": "fleet_hostname.hostname",
                    "PYTHONPATH": os.pathsep.join([str(HERE), base.get("PYTHONPATH", "")]),
                    "AIRFLOW_CONN_CEDANA_FLEET_S3": conn, "AIRFLOW__CEDANA__AWS_CONN_ID": "cedana_fleet_s3",
                    "AIRFLOW__CEDANA__STORE": f"s3://{BUCKET}/store", "AIRFLOW__CEDANA__OPTIN_FILE": str(optin),
                    "PYTHONUNBUFFERED": "1", **self.extra_env}
        if self.homes is not None:
            self.env["AIRFLOW__LOGGING__BASE_LOG_FOLDER"] = str(self.homes / "logs")
            # No connection holds the store's credentials: any task may read any connection (the Execution
            # API serves them from the api-server's secrets, its environment included). The agents have
            # them, and the api-server's own environment, for the checkpoint browser.
            del self.env["AIRFLOW_CONN_CEDANA_FLEET_S3"], self.env["AIRFLOW__CEDANA__AWS_CONN_ID"]
        r = subprocess.run([*AIRFLOW, "db", "migrate"], env=self.env, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise FleetError(f"airflow db migrate failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        self._start("api-server", [*AIRFLOW, "api-server", "--port", str(port)],
                    {**self.env, **self.store_env} if self.homes is not None else None)
        self._start("scheduler", [*AIRFLOW, "scheduler"])
        self._start("dag-processor", [*AIRFLOW, "dag-processor"])

        def token() -> bool:
            self.token = self.call("GET", "/auth/token")["access_token"]
            return True

        self._wait("api-server", token, 180)
        health = lambda: self.call("GET", "/api/v2/monitor/health")  # noqa: E731
        self._wait("scheduler", lambda: health()["scheduler"]["status"] == "healthy", 180)
        self._wait("dag-processor", lambda: (health().get("dag_processor") or {}).get("status") == "healthy", 180)
        for name in self.worker_names:
            self.start_worker(name)

    def __exit__(self, *exc: object) -> None:
        for name in [n for n in self.procs if n in self.worker_names]:
            self.kill_worker(name)  # a polite Celery shutdown would wait for the running tasks
        stop_parts(self.procs.values())
        self.procs.clear()
        self.pg.stop()
        if self.homes is not None:
            shutil.rmtree(self.homes, ignore_errors=True)
            shutil.rmtree(self.agent_socket("x").parent.parent, ignore_errors=True)
