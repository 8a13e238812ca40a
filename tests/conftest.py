"""Shared fixtures: real CRIU, real processes, the file store in tmp_path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import harness
from cedana_airflow.run.workload import become_subreaper

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from local_parts import AIRFLOW, WORKER_ENV, copy_build_inputs, descendants, free_port as _free_port, moto_server, reap  # noqa: E402  (re-exported: tests import them from here)

TRAIN = REPO / "tests" / "workloads" / "train.py"
#: Screenshots the browser tests leave for people to look at (CI keeps them).
ARTIFACTS = REPO / ".artifacts" / "browser"


@contextlib.contextmanager
def browser_page() -> Iterator[Any]:
    """A page of Debian's Chromium driven by Playwright (no browser download is possible here)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1440, "height": 900})
        finally:
            browser.close()


# -- one run, several workers (tests/harness.py) -----------------------------------------------------------
#: What each test took in the last full run, in seconds (refresh: copy .artifacts/durations.json here after
#: a full `make test`): the longest go first, so that no worker starts a long one when the rest are done.
DURATIONS = REPO / "tests" / "durations.json"
MEASURED = REPO / ".artifacts" / "durations.json"


def pytest_configure(config: pytest.Config) -> None:
    config._cedana_started = time.time()  # type: ignore[attr-defined]
    if harness.is_controller(config):
        harness.start_run()  # before the workers start: they inherit its path
        config._cedana_disk = harness.DiskWatch()  # type: ignore[attr-defined]
        become_subreaper()  # a killed part of a service is the controller's to reap
        if config.getoption("dist", "no") != "no" and config.getoption("tx", None):
            config._cedana_services = harness.ControllerStarts()  # type: ignore[attr-defined]


def pytest_report_header(config: pytest.Config) -> list[str]:
    disk = getattr(config, "_cedana_disk", None)
    if disk is None or disk.start >= harness.FULL_RUN_PEAK_BYTES:
        return []
    return [f"disk: {disk.start / 2**30:.1f} GiB free in {disk.path}, and a full run takes up to "
            f"{harness.FULL_RUN_PEAK_BYTES / 2**30:.0f} GiB there: free space, or point TMPDIR at a larger disk"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not harness.is_controller(config):  # a worker: the controller hands out units (tests/scheduling.py)
        from scheduling import write_units

        try:
            known: dict[str, float] = json.loads(DURATIONS.read_text())
        except (OSError, ValueError):
            known = {}
        write_units(items, known)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from scheduling import LongestFirst

    return LongestFirst(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """A ``serial`` test runs alone on the machine; every other test beside the others."""
    with harness.machine(exclusive=item.get_closest_marker("serial") is not None):
        started, before, procs = time.time(), harness.own_cpu_seconds(), own_processes()
        yield
        left = {pid: _cmdline(pid)[:100] for pid in own_processes() - procs if not _zombie(pid)}
        harness.record_test(item.nodeid, started, time.time(), harness.own_cpu_seconds() - before, left)


_durations: dict[str, float] = {}
_cpu: dict[str, float] = {}
_machine: dict[str, Any] = {"busy": harness.machine_cpu_seconds()}  # the controller's start; its end in sessionfinish


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The controller sees every worker's reports: setup + call + teardown of each test."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def _start_pod_image(d: Path) -> dict[str, Any]:
    """The pod tests' image (scripts/pod_image.py), built once per run beside the tests that run before them;
    its log is build.log in the service's directory."""
    with open(d / "build.log", "wb") as log:
        p = subprocess.Popen(["sh", "-c", f'nice -n 10 "$0" "$1"; echo $? > "{d}/done"', sys.executable,
                              str(REPO / "scripts" / "pod_image.py")],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {"pgids": [p.pid], "done": str(d / "done")}


harness.SERVICES["pod-image"] = _start_pod_image


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a clean clone the pod image takes about a minute (mmdebstrap, podman build): start it as
    soon as the pod tests are known to run, at low priority, so it is ready when they are (once per
    run: every worker collects, the first to ask has it started)."""
    if any("test_k8s_pods.py" in item.nodeid for item in session.items) and shutil.which("podman") \
            and shutil.which("mmdebstrap"):
        harness.service("pod-image")


def wait_for_pod_image(timeout: float = 900) -> None:
    """Until the image started above is built (the caller's own build then loads it from the cache;
    a failed build is left for that one to report)."""
    done = Path(harness.run_dir() / "services" / "pod-image" / "done")
    if not done.parent.exists():
        return
    deadline = time.monotonic() + timeout
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if not harness.is_controller(session.config):
        return
    # Every worker has ended: what the services left, and page files a killed supervisor left mounted
    # under /tmp (a restore in the same work dir would unmount it), go now, not while others still run.
    from cedana_airflow.engine.page_file import sweep

    timeline, _machine["unreadable"] = harness.recorded_tests()
    if (disk := getattr(session.config, "_cedana_disk", None)) is not None:
        disk.stop()
    _cpu.update((nodeid, cpu) for nodeid, _, _, _, cpu, _ in timeline)
    _machine["busy"] = harness.machine_cpu_seconds() - _machine["busy"]
    if (starts := getattr(session.config, "_cedana_services", None)) is not None:
        starts.close()
    _machine["services"] = harness.service_cpu_seconds()
    _machine["killed"] = harness.stop_services()
    sweep(Path(tempfile.gettempdir()))
    reap()
    if _durations and len(_durations) > 100:  # a full run, or most of one: the table's next refresh
        MEASURED.parent.mkdir(parents=True, exist_ok=True)
        for path, table in ((MEASURED, _durations), (MEASURED.with_name("cpu.json"), _cpu)):
            path.write_text(json.dumps({k: round(v, 1) for k, v in sorted(table.items())}, indent=0) + "\n")
        # who ran what when: where the run's tail went (python scripts/test_timeline.py draws it)
        t0 = session.config._cedana_started  # type: ignore[attr-defined]
        MEASURED.with_name("timeline.json").write_text(json.dumps(
            [[n, w, round(a - t0, 1), round(b - t0, 1), c, left] for n, w, a, b, c, left in timeline], indent=0) + "\n")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """What the budget is about (docs/testing.md): the wall time, and the CPU time that bounds it on 2 cores."""
    if not (harness.is_controller(config) and _durations):
        return
    wall = time.time() - config._cedana_started  # type: ignore[attr-defined]
    workers = config.getoption("numprocesses", None) or 0
    cores = os.cpu_count() or 1
    write = terminalreporter.write_line
    if _cpu:
        write("")
        write(f"costliest tests in CPU time (with their subprocesses; {sum(_cpu.values()):.0f} s in all):")
        for nodeid, seconds in sorted(_cpu.items(), key=lambda kv: -kv[1])[:15]:
            write(f"{seconds:8.1f}s  {nodeid}")
    if _machine.get("unreadable"):
        write(f"test records cut short (a worker killed as it wrote, or a full disk): {'; '.join(_machine['unreadable'])}")
    if (disk := getattr(config, "_cedana_disk", None)) is not None:
        low = " (nearly full: a failure above may be the disk's)" if disk.lowest < 1 << 30 else ""
        write(f"temp disk ({disk.path}): {disk.start / 2**30:.1f} GiB free at the start, {disk.lowest / 2**30:.1f} GiB "
              f"at the lowest, {(disk.start - disk.lowest) / 2**30:.1f} GiB taken at the peak{low}")
    if services := _machine.get("services"):
        write(f"shared services' CPU time ({sum(services.values()):.0f} s in all): "
              + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(services.items(), key=lambda kv: -kv[1])))
    if _machine.get("killed"):
        write(f"shared services that did not stop on SIGTERM within 30 s, killed: {', '.join(_machine['killed'])}")
    write(f"suite: {len(_durations)} tests in {wall:.0f} s of pytest ({wall / 60:.1f} min; budget 15 min), "
          f"{workers or 'no'} xdist worker(s); the machine was busy {_machine['busy']:.0f} CPU-s of "
          f"{wall * cores:.0f} ({cores} cores, {100 * _machine['busy'] / (wall * cores):.0f}%)")


@pytest.fixture(scope="session", autouse=True)
def _reap_orphans():
    """This machine's init does not reap orphans; killed supervisors leave some behind."""
    become_subreaper()
    yield
    reap()


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver (its kernel module or libcuda): tests that check what a
    node without one is told skip there, and say so."""
    from cedana_airflow.engine.cuda import libcuda_loadable

    return os.path.exists("/proc/driver/nvidia/version") or libcuda_loadable()


#: For a test that checks what a node *without* an NVIDIA driver does or says.
no_nvidia_driver = pytest.mark.skipif(has_nvidia_driver(), reason="this machine has an NVIDIA driver; this test "
                                      "checks a node without one (scripts/gpu-validate.sh covers the GPU path)")


def uid_folder(name: str, uid: int) -> Path:
    """``/run/<name>``, a folder only ``uid`` may enter (its own, 0700): the node mounts a test makes inside
    it stay out of the trees other tests start at the same time as other uids (a tree of a caller other
    than root gets every node mount its uid reaches, and cannot be restored where one is gone)."""
    d = Path("/run") / name
    d.mkdir()
    os.chown(d, uid, uid)
    d.chmod(0o700)
    return d


def start_agent(sock: Path, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    """A node agent (`cedana-airflow agent`, as root, in its own session) listening on ``sock``, its stderr
    in ``log``; returned once it serves. ``args``: more of its options (``--audit F``)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "cedana_airflow", "agent", "--socket", str(sock), *args],
                                env=env, stderr=f, start_new_session=True)
    deadline = time.monotonic() + 30
    while b"agent serving on" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, f"the agent did not start: {log.read_text()}"
        time.sleep(0.05)
    return proc


def pipe_of(uid: int) -> tuple[int, int]:
    """A pipe as the caller ``uid`` would have made it (its inode the caller's): the agent takes a
    workload's stdout and stderr only from a pipe its caller made (server.py, review 49 F1), and a test's
    root process makes the pipes its callers' children send."""
    r, w = os.pipe()
    os.fchown(w, uid, uid)  # one inode for both ends
    return r, w


def remove_agent_folder(folder: Path) -> None:
    """An agent test's socket folder removed, and first the workloads its agents left running: a tree
    outlives its agent by design (agent.md), so without this a test's counters ran on after the suite.
    Each is named by its runs file (remembered.py) and killed only while its command line is that run's."""
    for f in sorted((folder / "runs").glob("*.json")):
        try:
            r = json.loads(f.read_text())
            with open(f"/proc/{int(r['pid'])}/cmdline", "rb") as c:
                argv = [a.decode(errors="replace") for a in c.read().split(b"\0")[:-1]]
            if argv == r["command"]:
                os.kill(int(r["pid"]), signal.SIGKILL)  # a tree's init: its PID namespace goes with it
        except (OSError, ValueError, KeyError, TypeError):
            pass  # ended already, or not ours to end
    shutil.rmtree(folder, ignore_errors=True)


def cli_env(tmp_path: Path, node: str, work: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
    env.update(CEDANA_STORE=f"file://{tmp_path / 'store'}", CEDANA_NODE=node,
               CEDANA_WORK_DIR=str(tmp_path / work), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str], timeout: float = 300, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cedana_airflow", *args], env=env, text=True,
                          capture_output=True, timeout=timeout, **kw)


def start_cli(*args: str, env: dict[str, str], out: Path, **kw: Any) -> subprocess.Popen[bytes]:
    """Start the CLI in the background, stdout and stderr to files (read them after it ends)."""
    return subprocess.Popen([sys.executable, "-m", "cedana_airflow", *args], env=env,
                            stdout=open(out.with_suffix(".out"), "wb"), stderr=open(out.with_suffix(".err"), "wb"), **kw)


def manifests(store: Path, checkpoint_id: str) -> list[dict]:
    """The ID's manifests in a file store, oldest first; one that retention removes while this reads is left
    out (keep_checkpoints prunes the oldest as each new one lands: CI run 78 read one mid-removal)."""
    d = store / checkpoint_id
    if not d.is_dir():
        return []
    found = []
    for p in sorted(d.iterdir()):
        try:
            found.append(json.loads((p / "manifest.json").read_text()))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def forge_unsigned(manifest: Path, **changes: Any) -> dict:
    """Rewrite a stored manifest as a store writer without the node key could: ``changes`` applied, the
    signature dropped (version 2 becomes 1, as an unsigned writer writes it)."""
    doc = json.loads(manifest.read_text())
    doc.update(changes)
    doc.pop("signature", None)
    if doc["format_version"] == 2:
        doc["format_version"] = 1
    manifest.write_text(json.dumps(doc))
    return doc


def node_key_bytes() -> bytes:
    """The key the tests' nodes sign with: this machine's default node key (created on first use, as a
    supervisor running as root creates it)."""
    from cedana_airflow.config import Settings
    from cedana_airflow.keys import node_key

    return node_key(Settings()).key


def wait_for_checkpoints(store: Path, checkpoint_id: str, n: int, proc: subprocess.Popen[bytes],
                         timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ms = manifests(store, checkpoint_id)
        if len(ms) >= n:
            return ms
        assert proc.poll() is None, f"supervisor exited early with {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"no {n} checkpoint(s) under {checkpoint_id} within {timeout}s")


def wait_for_checkpoint_after(store: Path, checkpoint_id: str, out: Path, text: str, proc: subprocess.Popen[bytes],
                              timeout: float = 180, n: int = 1) -> list[dict]:
    """Until ``n`` checkpoints exist that froze the workload after it printed ``text`` to ``out``; the
    manifests. The one in flight when ``text`` appears may have frozen it before, so it waits for the
    ones after that: a restore from them must go on from a later point, never from the start."""
    wait_for_line(out, text, proc, timeout)
    after = max((m["seq"] for m in manifests(store, checkpoint_id)), default=0) + 2
    deadline = time.monotonic() + timeout
    while sum(m["seq"] >= after for m in manifests(store, checkpoint_id)) < n:
        assert proc.poll() is None, f"supervisor exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no checkpoint of {checkpoint_id} after {text!r} within {timeout}s"
        time.sleep(0.2)
    return manifests(store, checkpoint_id)


def wait_for_line(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    """Until the supervisor's log at ``path`` says ``text``; the log."""
    deadline = time.monotonic() + timeout
    while text not in (log := path.read_text(errors="replace") if path.exists() else ""):
        assert proc.poll() is None, f"supervisor exited early with {proc.returncode}: {log[-2000:]}"
        assert time.monotonic() < deadline, f"{path} never said {text!r}: {log[-2000:]}"
        time.sleep(0.1)
    return log


class Echo:
    """An echo service outside the workload (a database, an API) on ``host``: one thread per connection."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


class UdpEcho:
    """A UDP service outside the workload (a resolver, a collector that answers) on ``host``: each
    datagram is sent back to whoever sent it; ``senders`` are the addresses it heard from, in order."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.senders: list[str] = []
        self._open = True
        self.sock.settimeout(0.2)  # to see close() without a datagram
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._open:
            try:
                data, peer = self.sock.recvfrom(64)
            except TimeoutError:
                continue
            if not self.senders or self.senders[-1] != peer[0]:
                self.senders.append(peer[0])
            self.sock.sendto(data, peer)

    def close(self) -> None:
        self._open = False
        self._thread.join()
        self.sock.close()


def kill_node(proc: subprocess.Popen[bytes], workload_pid: int) -> None:
    """Simulate losing the node: SIGKILL the supervisor and the workload's whole PID namespace."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        os.kill(workload_pid, signal.SIGKILL)  # the namespace's init: everything in it dies too
    except ProcessLookupError:
        pass
    wait_gone(workload_pid, 10)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def own_processes() -> set[int]:
    """This process's tree (what its tests started, the orphans it adopted), less the run's shared services
    (started here in a run without workers), whose parts start processes of their own at any time."""
    return set(descendants(os.getpid())) - set(descendants(harness.service_leaders()))


def ours(pattern: str) -> list[int]:
    """This test's live processes whose command line holds ``pattern`` (a stray restored workload, a
    lazy-pages daemon): what this worker started, and the orphans it adopted as a subreaper; never what
    a test on another worker runs meanwhile."""
    return [pid for pid in own_processes() - {os.getpid()} if pattern in _cmdline(pid) and not _zombie(pid)]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def pymp_dirs_held(pids: list[int]) -> set[str]:
    """The /tmp/pymp-* dirs (multiprocessing's temp dirs, where a process that passes descriptors listens)
    in which ``pids`` hold a unix socket: a workload's own, never a neighbour test's. Read before it is killed."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:["):-1])
    rows = (ln.split() for ln in Path("/proc/net/unix").read_text().splitlines()[1:])
    return {r[7].split("/")[2] for r in rows if len(r) >= 8 and r[6] in inodes and r[7].startswith("/tmp/pymp-")}


def drop_pymp(dirs: set[str]) -> tuple[list[str], list[str]]:
    """Another node's /tmp has none of a killed workload's pymp dirs (``pymp_dirs_held`` before the kill).
    Returns (removed, those already gone with their process)."""
    removed = sorted(d for d in dirs if os.path.isdir(f"/tmp/{d}"))
    for d in removed:
        shutil.rmtree(f"/tmp/{d}", ignore_errors=True)
    return removed, sorted(set(dirs) - set(removed))


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` no longer exists, reaping the orphans we adopted meanwhile."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return not os.path.exists(f"/proc/{pid}")


def varint(n: int) -> bytes:
    """Protobuf's varint, for image files written by hand (CRIU's images are protobuf entries)."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb_message(*fields: tuple[int, int | bytes]) -> bytes:
    """A protobuf message written by hand: each (field number, a varint or bytes) in turn."""
    out = b""
    for num, v in fields:
        out += varint(num << 3) + varint(v) if isinstance(v, int) else varint(num << 3 | 2) + varint(len(v)) + v
    return out


def criu_image(*entries: bytes, magic: int = 0x1) -> bytes:
    """An image file as CRIU writes one: its two magics, then each entry after its length."""
    return struct.pack("<II", 0x54564319, magic) + b"".join(struct.pack("<I", len(e)) + e for e in entries)


def uninterrupted_digest(*train_args: str) -> str:
    out = subprocess.run([sys.executable, str(TRAIN), *train_args, "--step-seconds", "0"],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]

class _GatedStore:
    """A real store with one test hook: once ``reading()`` is true, chunk reads wait at ``gate``."""

    def __init__(self, store: Any, reading: Callable[[], bool]):
        self._store, self._reading = store, reading
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def get_chunk(self, digest: str) -> bytes:
        if not self.gate.is_set() and self._reading():
            self.waiting.set()
            self.gate.wait(60)
        return self._store.get_chunk(digest)


def restore_as_the_s3_store_goes_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *,
                                      reading: Callable[[], bool], **settings: Any) -> list[BaseException]:
    """Checkpoint a 120 MB training workload into moto's S3 server and lose its node; restore it on
    another node through the real S3 store, and once ``reading()`` says the restore reads pages, stop
    the server. Returns what the restore raised."""
    from cedana_airflow.config import Settings
    from cedana_airflow.run.runner import run_workload
    from cedana_airflow.store import open_store

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    args = ["--mb", "120", "--steps", "400", "--step-seconds", "0.05"]
    with moto_server() as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        import boto3

        boto3.client("s3").create_bucket(Bucket="gone")
        url_ = "s3://gone/ckpt"
        base = Settings(store=url_, node="node-a", work_dir=tmp_path / "work-a", heartbeat_seconds=1, **settings)
        proc = start_cli("run", "--id", "gone", "--heartbeat", "1", "--", sys.executable, str(TRAIN), *args,
                         env={**os.environ, "CEDANA_STORE": url_, "CEDANA_NODE": "node-a",
                              "CEDANA_WORK_DIR": str(tmp_path / "work-a")}, out=tmp_path / "a")
        deadline = time.monotonic() + 120
        s3 = boto3.client("s3")
        while not any(o["Key"].endswith("manifest.json")
                      for o in s3.list_objects_v2(Bucket="gone", Prefix="ckpt/gone/").get("Contents", [])):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was taken"
            time.sleep(0.2)
        workloads = [pid for pid in descendants(proc.pid)[1:] if str(TRAIN) in _cmdline(pid)]  # this test's, not a neighbour's
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for pid in workloads:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        store = _GatedStore(open_store(url_, base), reading)
        failed: list[BaseException] = []

        def restore() -> None:
            try:
                with open(tmp_path / "b.out", "wb") as sink:
                    run_workload(base.model_copy(update={"node": "node-b", "work_dir": tmp_path / "work-b"}),
                                 "gone", None, resume=True, store=store, handle_signals=False, stdout=sink)
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=restore)
        t.start()
        assert store.waiting.wait(120), "the restore never started reading pages"
    store.gate.set()  # the S3 server is gone now: let the chunk reads through
    t.join(180)
    assert not t.is_alive()
    return failed


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server over HTTP on a loopback port: a real S3 endpoint for boto3, started once."""
    with moto_server() as url:
        yield url


def _s3_env(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for boto3 (here and in CLI subprocesses) pointing at ``endpoint`` (both servers take any
    credentials), set here too."""
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """The environment for moto's endpoint."""
    return _s3_env(s3_endpoint, monkeypatch)


def _seaweed(d: Path) -> dict[str, Any]:
    from local_parts import Seaweed

    server = Seaweed()
    server.start()
    assert server.proc is not None
    return {"url": server.url, "pgids": [server.proc.pid], "dirs": [str(server.dir)]}


harness.SERVICES["seaweedfs"] = _seaweed


@pytest.fixture(scope="session")
def seaweed_endpoint():
    """A real S3 server, SeaweedFS (`weed mini`), one for the test run (tests/harness.py): the S3 end-to-end
    tests' endpoint; moto's stays where its being in one Python process is the point (issue 52)."""
    return harness.service("seaweedfs")["url"]


@pytest.fixture
def seaweed_env(seaweed_endpoint, monkeypatch):
    """The environment for SeaweedFS's endpoint."""
    return _s3_env(seaweed_endpoint, monkeypatch)


@pytest.fixture
def seaweed_bucket(seaweed_env, request):
    """A bucket of the test's own on SeaweedFS (one server for the run: each test names its own)."""
    import boto3

    name = "sw-" + re.sub(r"[^a-z0-9-]", "-", f"{harness.worker_id()}-{request.node.name}".lower())[:55].strip("-")
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def bucket(moto_bucket):
    """A bucket of the test's own on moto's server (a module may override it to run on both servers)."""
    return moto_bucket


@pytest.fixture(params=["file", "s3"])
def file_or_s3_store(request, tmp_path):
    """An opened store and its config, once on disk and once on S3 (``bucket``): the test runs on both. The
    S3 one is under a prefix named after the module (buckets are named after the test, cut short)."""
    from cedana_airflow.config import load_settings
    from cedana_airflow.store import open_store

    prefix = request.module.__name__.rsplit(".", 1)[-1]
    url = f"file://{tmp_path / 'store'}" if request.param == "file" else f"s3://{request.getfixturevalue('bucket')}/{prefix}"
    s = open_store(url, load_settings(environ={}))
    return s, s.open(create=True, chunk_avg_bytes=64 << 10)


@pytest.fixture
def moto_bucket(s3_env, request):
    import boto3

    name = "b-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    return name


# -- an Airflow home: shared by the Airflow end-to-end tests and the sensor tests -----------------------
#: The e2e DAG's workload (tests/dags/cedana_e2e.py reads CEDANA_E2E_TRAIN_ARGS): small, so that a heartbeat
#: costs little, and 8 s long, so that a loaded machine still checkpoints it before it ends.
TRAIN_ARGS = ["--mb", "20", "--steps", "80", "--step-seconds", "0.1"]


def _migrated(d: Path) -> dict[str, Any]:
    env = {**os.environ, "AIRFLOW_HOME": str(d), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    subprocess.run([*AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    return {"db": str(d / "airflow.db")}


harness.SERVICES["airflow-db"] = _migrated


# -- what users install: the wheel and the sdist, built once per run ------------------------------------
def _built(d: Path) -> dict[str, Any]:
    src, out = copy_build_inputs(d / "src"), d / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), str(src)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode:
        raise RuntimeError(f"pip wheel failed: {r.stderr[-2000:]}")
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", str(out)], cwd=src, capture_output=True, text=True,
                       timeout=300)
    if r.returncode:
        raise RuntimeError(f"building the sdist failed: {r.stderr[-2000:]}")
    [wheel] = out.glob("cedana_airflow-*.whl")
    [sdist] = out.glob("cedana_airflow-*.tar.gz")
    return {"wheel": str(wheel), "sdist": str(sdist)}


harness.SERVICES["wheel"] = _built


def link_site_packages(site: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """Another venv's packages in ``target`` by hard links: a third of a second for 540 MB, where pip from
    PyPI takes minutes. ``skip``: the name prefixes left out."""
    for entry in site.iterdir():
        if entry.name == "__pycache__" or (skip and entry.name.startswith(skip)):
            continue
        if entry.is_dir():
            shutil.copytree(entry, target / entry.name, copy_function=os.link, symlinks=True)
        else:
            os.link(entry, target / entry.name)


def send_json(handler: Any, code: int, body: object) -> None:
    """A stand-in server's JSON answer (``handler``: an http.server request handler)."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@pytest.fixture(scope="session")
def wheel() -> Path:
    """cedana-airflow's wheel, built once per run from a copy of the checkout (every worker shares it)."""
    return Path(harness.service("wheel")["wheel"])


@pytest.fixture(scope="session")
def sdist() -> Path:
    return Path(harness.service("wheel")["sdist"])


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """An Airflow metadata DB migrated once per run (for every worker); each test copies it into its own home."""
    return Path(harness.service("airflow-db")["db"])


#: An opt-in list that admits every node, queue and workload: these tests are about what happens in scope.
OPTIN_ALL = '[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'


def airflow_env(tmp_path: Path, airflow_db: Path | None, **extra: str) -> dict[str, str]:
    """An Airflow home in ``tmp_path`` with a copy of ``airflow_db`` (None: none; the caller migrates one)."""
    home = tmp_path / "airflow"
    home.mkdir(exist_ok=True)
    if airflow_db is not None:
        shutil.copy(airflow_db, home / "airflow.db")
    (tmp_path / "optin.toml").write_text(OPTIN_ALL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "tests" / "dags"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CEDANA__STORE=f"file://{tmp_path / 'store'}",
               AIRFLOW__CEDANA__WORK_DIR=str(tmp_path / "work"), CEDANA_E2E_TRAIN_ARGS=" ".join(TRAIN_ARGS),
               AIRFLOW__CEDANA__OPTIN_FILE=str(tmp_path / "optin.toml"),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _airflow_stack(d: Path) -> dict[str, Any]:
    import shared_stack

    return shared_stack.start(d)


harness.SERVICES["airflow"] = _airflow_stack


@pytest.fixture(scope="session")
def airflow_stack():
    """The test run's one Airflow stack (tests/shared_stack.py): a test puts its own DAG on it (``add_dag``)."""
    from shared_stack import SharedStack

    return SharedStack.of_this_run()
