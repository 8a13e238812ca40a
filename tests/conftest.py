"""Shared fixtures: real CRIU, real processes, the file store in tmp_path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cedana_airflow.run.workload import become_subreaper

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from local_parts import AIRFLOW, free_port as _free_port, moto_server, processes_with, reap  # noqa: E402  (re-exported: tests import them from here)

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


#: The pod tests' image (scripts/pod_image.py), built beside the tests that run before them.
_pod_image: subprocess.Popen[bytes] | None = None
POD_IMAGE_LOG = Path(tempfile.gettempdir()) / "cedana-pod-image.log"


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a clean clone the pod image takes about a minute (mmdebstrap, podman build): start it as
    soon as the pod tests are known to run, at low priority, so it is ready when they are."""
    global _pod_image
    if any("test_k8s_pods.py" in item.nodeid for item in session.items) and shutil.which("podman") \
            and shutil.which("mmdebstrap"):
        with open(POD_IMAGE_LOG, "wb") as log:
            _pod_image = subprocess.Popen(["nice", "-n", "10", sys.executable, str(REPO / "scripts" / "pod_image.py")],
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_pod_image(timeout: float = 900) -> None:
    """Until the image started above is built (the caller's own build then loads it from the cache;
    a failed build is left for that one to report)."""
    if _pod_image is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            _pod_image.wait(timeout)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _pod_image is not None and _pod_image.poll() is None:
        os.killpg(_pod_image.pid, signal.SIGTERM)
        _pod_image.wait()


@pytest.fixture(scope="session", autouse=True)
def _reap_orphans():
    """This machine's init does not reap orphans; killed supervisors leave some behind."""
    become_subreaper()
    yield
    # A supervisor killed while a lazy restore streamed leaves its page file mounted (a restore in the
    # same work dir would unmount it); nothing of ours may stay mounted under /tmp after the tests.
    from cedana_airflow.engine.page_file import sweep

    sweep(Path(tempfile.gettempdir()))
    reap()


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver (its kernel module or libcuda): tests that check what a
    node without one is told skip there, and say so."""
    from cedana_airflow.engine.cuda import libcuda_loadable

    return os.path.exists("/proc/driver/nvidia/version") or libcuda_loadable()


#: For a test that checks what a node *without* an NVIDIA driver does or says.
no_nvidia_driver = pytest.mark.skipif(has_nvidia_driver(), reason="this machine has an NVIDIA driver; this test "
                                      "checks a node without one (scripts/gpu-validate.sh covers the GPU path)")


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
    d = store / checkpoint_id
    if not d.is_dir():
        return []
    return [json.loads((p / "manifest.json").read_text()) for p in sorted(d.iterdir()) if (p / "manifest.json").exists()]


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


def kill_node(proc: subprocess.Popen[bytes], workload_pid: int) -> None:
    """Simulate losing the node: SIGKILL the supervisor and the workload's whole PID namespace."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        os.kill(workload_pid, signal.SIGKILL)  # the namespace's init: everything in it dies too
    except ProcessLookupError:
        pass
    wait_gone(workload_pid, 10)


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
        workloads = list(processes_with(str(TRAIN)))
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


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Environment for boto3 (here and in CLI subprocesses) pointing at the moto endpoint."""
    env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def bucket(s3_env, request):
    import boto3

    name = "b-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    return name


# -- an Airflow home: shared by the Airflow end-to-end tests and the sensor tests -----------------------
#: The e2e DAG's workload (tests/dags/cedana_e2e.py reads CEDANA_E2E_TRAIN_ARGS).
TRAIN_ARGS = ["--mb", "60", "--steps", "50", "--step-seconds", "0.1"]


@pytest.fixture(scope="session")
def airflow_db(tmp_path_factory) -> Path:
    """An Airflow metadata DB migrated once; each test copies it into its own home."""
    home = tmp_path_factory.mktemp("airflow-template")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    subprocess.run([*AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    return home / "airflow.db"


#: An opt-in list that admits every node, queue and workload: these tests are about what happens in scope.
OPTIN_ALL = '[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'


def airflow_env(tmp_path: Path, airflow_db: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "airflow"
    home.mkdir(exist_ok=True)
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
