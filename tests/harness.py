"""What the processes of one test run share. `make test` runs the suite in several pytest-xdist workers
(most end-to-end tests wait on heartbeats and Airflow's loops, so their waits overlap); this module is
how they keep out of each other's way:

- the run's directory (``CEDANA_TEST_RUN``), made by the controller before the workers start;
- the machine lock: every test holds it shared, a test marked ``serial`` (machine-wide checks,
  benchmark-like restores) holds it alone; fair, so a serial test is not starved by the others;
- services started once per run (an Airflow stack, the pod image, a migrated Airflow database) when a
  test first needs one, described in a JSON record every worker reads, and stopped when the run ends.
  Under xdist the controller starts them (a worker asks with a file): their processes are then never in a
  worker's process tree, where a test that counts its own processes would see them come and go.

Without xdist (``pytest tests/x.py``) the one process is controller and worker: the same code runs, and
a service starts in the process that asks for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from local_parts import reap  # noqa: E402

RUN_ENV = "CEDANA_TEST_RUN"


def worker_id() -> str:
    """``gw0``, ``gw1``... under xdist; ``main`` in a run without workers."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def is_controller(config: Any) -> bool:
    """The process that runs no tests under xdist, or the only one without it."""
    return not hasattr(config, "workerinput")


def start_run() -> Path:
    """The controller's first step: the run's directory, in the environment the workers inherit."""
    path = Path(tempfile.mkdtemp(prefix="cedana-test-run-"))
    os.environ[RUN_ENV] = str(path)
    return path


def run_dir() -> Path:
    path = os.environ.get(RUN_ENV)
    if not path:  # imported outside a pytest run (a script): a private one
        path = str(start_run())
    return Path(path)


@contextlib.contextmanager
def _flock(path: Path, how: int) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, how)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def machine(exclusive: bool) -> Iterator[None]:
    """Hold the machine shared (any test) or alone (a ``serial`` one). Whoever wants it passes the gate
    first; a serial test keeps the gate while it waits for the tests already running to end, so no new
    one starts meanwhile (flock alone lets shared holders starve an exclusive one)."""
    root = run_dir()
    with _flock(root / "machine.gate", fcntl.LOCK_EX):
        main = open(root / "machine.lock", "a")
        fcntl.flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(main, fcntl.LOCK_UN)
        main.close()


def machine_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy since boot (every core, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_cpu_seconds() -> float:
    """CPU time of this process and of every process it has reaped (a test's subprocesses, their
    children, and the orphans this subreaper adopted)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def record_test(nodeid: str, started: float, ended: float, cpu_seconds: float, left: dict[int, str]) -> None:
    """A test's span (wall clock) and CPU time, for the controller's summary and the run's timeline (one
    line per test, one file per worker); ``left``: the processes it left running (its module's fixtures,
    or a leak: either way its work goes on after it, and its CPU time counts for a later test).

    One ``write`` of the whole line, and a write that fails (a full disk) costs the line, never the
    worker: this is bookkeeping, and a crashed worker would fail a test that passed."""
    line = json.dumps([nodeid, worker_id(), round(started, 2), round(ended, 2), round(cpu_seconds, 2),
                       sorted(left.values())]) + "\n"
    try:
        fd = os.open(run_dir() / f"tests-{worker_id()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if (n := os.write(fd, data := line.encode())) < len(data):
                raise OSError(f"{n} of {len(data)} bytes written: the disk is full")
        finally:
            os.close(fd)
    except OSError as e:
        print(f"\n{nodeid}: its record for the run's timeline was not written ({e})", file=sys.stderr)


def recorded_tests() -> tuple[list[tuple[str, str, float, float, float, list[str]]], list[str]]:
    """(nodeid, worker, started, ended, cpu_seconds, left) of every test of the run, in the order they
    started; and the lines that could not be read (a worker killed mid-write, a disk that was full:
    the kernel leaves a short write at a page boundary), each as ``file:line: its start``."""
    out, unreadable = [], []
    for path in sorted(run_dir().glob("tests-*.jsonl")):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                out.append(tuple(json.loads(line)))
            except ValueError:
                unreadable.append(f"{path.name}:{n}: {line[:60]!r}")
    return sorted(out, key=lambda t: t[2]), unreadable  # type: ignore[arg-type,return-value]


#: What a full run of the suite takes of the temp disk at its peak, with tmp_path removed after each test
#: that passed (pyproject.toml): the run's images, venvs and services. Measured 6.1 GiB on 2026-12-05
#: (a clean clone, 4 workers); the kept tmp_paths took 11-14 GiB before. Less free than this at the
#: start is said before the first test.
FULL_RUN_PEAK_BYTES = 8 << 30


class DiskWatch:
    """The temp disk's free space through the run, sampled every two seconds by the controller: a run
    that fills the disk fails in ways that name anything but the disk (a short write, a crashed worker,
    a CRIU image cut short), so the summary says how low it went."""

    def __init__(self, path: str | None = None, every: float = 2.0) -> None:
        self.path = path or tempfile.gettempdir()
        self.start = self.lowest = shutil.disk_usage(self.path).free
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), name="disk-watch", daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            with contextlib.suppress(OSError):
                self.lowest = min(self.lowest, shutil.disk_usage(self.path).free)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ServiceFailed(RuntimeError):
    """A shared service did not come up: its one line, said to every test that needs it."""


#: name -> start(dir) -> record: what conftest.py registers. A record is JSON; its ``pgids`` are the process
#: groups stopped at the end of the run, its ``dirs`` (if any) are removed after them.
SERVICES: dict[str, Callable[[Path], dict[str, Any]]] = {}
_CONTROLLER_STARTS = "CEDANA_TEST_SERVICES_BY_CONTROLLER"


def service(name: str, timeout: float = 900) -> dict[str, Any]:
    """The record of service ``name``, started once per run. A start that failed is not tried again:
    every later caller gets its line."""
    root = run_dir() / "services" / name
    root.mkdir(parents=True, exist_ok=True)
    record, failed = root / "record.json", root / "failed.txt"
    if os.environ.get(_CONTROLLER_STARTS):
        with contextlib.suppress(FileExistsError):
            os.close(os.open(root / "request", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        deadline = time.monotonic() + timeout
        while not (record.exists() or failed.exists()):
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{name} was not started within {timeout:.0f} s by the controller (see {root})")
            time.sleep(0.2)
    else:
        with _flock(root / "start.lock", fcntl.LOCK_EX):
            if not (record.exists() or failed.exists()):
                _start(name, root)
    if failed.exists():
        raise ServiceFailed(failed.read_text())
    data: dict[str, Any] = json.loads(record.read_text())
    return data


def _start(name: str, root: Path) -> None:
    try:
        got = SERVICES[name](root)
    except BaseException as e:
        (root / "failed.txt").write_text(f"{name} did not start: {type(e).__name__}: {e}")
        return
    tmp = root / "record.json.tmp"
    tmp.write_text(json.dumps(got))
    tmp.rename(root / "record.json")


class ControllerStarts:
    """The controller's side under xdist: a thread that starts each service a worker asks for (a thread
    per service: the Airflow stack and the pod image come up side by side)."""

    def __init__(self) -> None:
        os.environ[_CONTROLLER_STARTS] = "1"  # before the workers start: they inherit it
        self._stop = threading.Event()
        self._started: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._loop = threading.Thread(target=self._run, name="test-services", daemon=True)
        self._loop.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for request in (run_dir() / "services").glob("*/request"):
                name = request.parent.name
                if name not in self._started:
                    self._started.add(name)
                    t = threading.Thread(target=_start, args=(name, request.parent), daemon=True)
                    t.start()
                    self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        self._loop.join()
        for t in self._threads:
            t.join()  # a start still under way ends before its service is stopped


def _records() -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, record) of each service started this run, by name (one being written is not there yet)."""
    for record in sorted((run_dir() / "services").glob("*/record.json")):
        with contextlib.suppress(OSError, ValueError):
            yield record.parent.name, json.loads(record.read_text())


def service_leaders() -> list[int]:
    """The first process of each running service's parts (its process group's leader)."""
    return [int(p) for _, got in _records() for p in got.get("pgids", [])]


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_cpu(stat: str) -> float:
    """utime + stime + cutime + cstime of one /proc/<pid>/stat line: the process and what it reaped."""
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def service_cpu_seconds() -> dict[str, float]:
    """CPU time of each running service's processes (those still in its process groups, with what they
    reaped): the half of the run's CPU that no test's own count holds (docs/testing.md)."""
    groups = {int(pgid): name for name, got in _records() for pgid in got.get("pgids", [])}
    spent: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (proc / "stat").read_text()
            name = groups.get(int(stat.rsplit(")", 1)[1].split()[2]))  # field 5, the process group
            if name is not None:
                spent[name] = spent.get(name, 0.0) + _process_cpu(stat)
    return spent


def stop_services(timeout: float = 30) -> list[str]:
    """The controller's last step: SIGTERM every service's process groups, SIGKILL what is left after
    ``timeout``; the run's directory goes too. Returns what had to be killed."""
    root = run_dir()
    records = list(_records())
    pgids = {int(pgid): name for name, got in records for pgid in got.get("pgids", [])}
    dirs: list[str] = [d for _, got in records for d in got.get("dirs", [])]
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pgids) and time.monotonic() < deadline:
        reap()  # the parts are this process's children: it started them, or adopted them (a subreaper)
        time.sleep(0.2)
    killed = []
    for pgid, name in pgids.items():
        if _alive(pgid):
            killed.append(f"{name} (process group {pgid})")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    reap()
    for d in [*dirs, root]:
        shutil.rmtree(d, ignore_errors=True)
    return killed
