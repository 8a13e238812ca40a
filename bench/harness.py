"""What every benchmark shares: the workload and its output, bare CRIU, memory prewarming, phase timing.

Imports only cedana_airflow; every other bench module imports from here (and report.py), never
the other way round.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.run.workload import Workload
from cedana_airflow.store.base import Store, StoreConfig

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TRAIN = REPO / "tests" / "workloads" / "train.py"
MB = 1 << 20


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stored_manifests(store: Path, checkpoint_id: str) -> list[dict[str, Any]]:
    """The manifests of ``checkpoint_id`` in the ``file://`` store at ``store``, oldest first, as JSON (one that
    cannot be read this instant is left out: the next look finds it)."""
    d = store / checkpoint_id
    out = []
    for p in sorted(d.glob("*/manifest.json")) if d.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> list[float]:
    """[min, max] of the runs: how far one run may fall from the median."""
    return [min(xs), max(xs)] if xs else [float("nan"), float("nan")]


def timeline_median(timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each span's seconds, each mark and each CRIU phase over runs' restore timelines
    (Timeline.as_dict()): where a restore's time goes, per row of the report."""
    out: dict[str, Any] = {"spans": {}, "marks": {}, "criu": {}}
    for key in ("spans", "marks", "criu"):
        names: dict[str, list[float]] = {}
        for t in timelines:
            items = ((s["name"], s["seconds"]) for s in t["spans"]) if key == "spans" else t[key].items()
            for name, v in items:
                names.setdefault(name, []).append(v)
        out[key] = {n: round(med(v), 4) for n, v in names.items()}
    return out


# --------------------------------------------------------------------------------------------
# the workload: tests/workloads/train.py, managed, and what it prints
# --------------------------------------------------------------------------------------------
class StepSink:
    """A stream for a workload's stdout: remembers the last 'step N/M' line and wakes waiters."""

    _STEP = re.compile(rb"^step (\d+)/")

    def __init__(self) -> None:
        self.step = 0
        self.lines = 0
        self.first_at = 0.0  # time.monotonic() of the first step line
        self._buf = b""
        self._cond = threading.Condition()

    def write(self, data: bytes) -> int:
        with self._cond:
            self._buf += data
            *done, self._buf = self._buf.split(b"\n")
            for line in done:
                self.lines += 1
                m = self._STEP.match(line)
                if m:
                    self.step = int(m.group(1))
                    self.first_at = self.first_at or time.monotonic()
            self._cond.notify_all()
        return len(data)

    def flush(self) -> None:
        pass

    def wait_step(self, above: int, timeout: float) -> int:
        """Wait until a step greater than ``above`` was printed; return it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.step <= above:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"workload printed no step after {above} within {timeout:.0f}s")
                self._cond.wait(left)
            return self.step


class TailSink:
    """Keeps the last few KB of a stream (the workload's stderr, for error messages)."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> int:
        self.data = (self.data + data)[-4096:]
        return len(data)

    def flush(self) -> None:
        pass


def start_workload(mb: int, step_seconds: float, change_fraction: float, cwd: Path) -> tuple[Workload, StepSink, TailSink]:
    out, err = StepSink(), TailSink()
    cmd = [sys.executable, str(TRAIN), "--mb", str(mb), "--steps", "1000000",
           "--step-seconds", str(step_seconds), "--change-fraction", str(change_fraction)]
    w = Workload.start(cmd, cwd=str(cwd), stdout=out, stderr=err)
    try:
        out.wait_step(0, timeout=120 + mb / 10)  # allocation done, first step taken
    except TimeoutError:
        kill(w)
        raise SystemExit(f"workload did not start: {err.data.decode(errors='replace')[-500:]}")
    return w, out, err


def kill(w: Workload) -> None:
    try:
        os.kill(w.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    w.wait(timeout=60)


def check_alive(w: Workload, sink: StepSink, step_seconds: float, what: str) -> None:
    """The restored workload runs on: it prints its next step (untimed); killed and an error if not."""
    try:
        sink.wait_step(sink.step, timeout=step_seconds + 30)
    except TimeoutError:
        kill(w)
        raise SystemExit(f"{what}: the restored workload printed no step for {step_seconds + 30:.0f}s")


# --------------------------------------------------------------------------------------------
# bare CRIU: the baselines
# --------------------------------------------------------------------------------------------
def bare_dump(engine: CriuEngine, pid: int, d: Path) -> float:
    """``criu dump --leave-running --file-locks`` of ``pid`` into a new directory ``d`` (its log
    beside it), without our action script; return the seconds the criu call took."""
    log = d.with_name(d.name + ".dump.log")
    cmd = [engine.binary.path, "dump", "-t", str(pid), "-D", str(d), "--leave-running", "--file-locks",
           "-o", str(log)]
    d.mkdir(parents=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"bare criu dump failed (exit {p.returncode}); see {log}")
    return wall


def bare_restore(engine: CriuEngine, image_dir: Path, process: ProcessInfo, pidfile: Path) -> tuple[int, int, int]:
    """``criu restore -d`` of a plain image directory, the workload's stdout and stderr pipes
    inherited from new pipes (``--inherit-fd``, as Checkpointer.restore does it); return the
    restored root's PID and the read ends, for :func:`adopt`."""
    return engine.restore_piped(image_dir, process.stdout_pipe, process.stderr_pipe, pidfile=pidfile)


def adopt(restored: tuple[int, int, int], process: ProcessInfo, sink: StepSink) -> Workload:
    """The tree :func:`bare_restore` brought back, supervised like any restored workload."""
    pid, out_r, err_r = restored
    return Workload.adopt(pid, process.command, process.cwd, out_r, err_r, sink, TailSink())


def drop_dir(p: Path) -> None:
    """Remove a dump directory and its siblings (logs, scripts), then flush dirty pages, untimed."""
    for q in [p, *p.parent.glob(p.name + ".*")]:
        shutil.rmtree(q, ignore_errors=True) if q.is_dir() else q.unlink(missing_ok=True)
    os.sync()


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# --------------------------------------------------------------------------------------------
# our side: a Checkpointer, and the seconds of its phases
# --------------------------------------------------------------------------------------------
class PhaseTimes:
    """A Checkpointer's ``on_phase`` hook: the seconds of each phase ("dump", "save", "fetch",
    "criu_restore") since the last :meth:`reset`, summed when a phase repeats (a restore that falls
    back fetches twice), and actions to run right after a phase ends (outside its seconds)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._after: dict[str, Callable[[], None]] = {}

    def __call__(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        action = self._after.get(phase)
        if action is not None:
            action()

    def __getitem__(self, phase: str) -> float:
        return self.seconds.get(phase, 0.0)

    def reset(self) -> None:
        self.seconds.clear()

    @contextmanager
    def after(self, phase: str, action: Callable[[], None]) -> Iterator[None]:
        """Run ``action`` right after each ``phase`` while in this block (e.g. SIGSTOP after a dump)."""
        self._after[phase] = action
        try:
            yield
        finally:
            self._after.pop(phase, None)


def make_checkpointer(engine: CriuEngine, store: Store, cfg: StoreConfig, cid: str, settings: Settings,
                      work_dir: Path, phases: PhaseTimes | None = None) -> Checkpointer:
    """A Checkpointer as ``cedana-airflow run`` builds one (runner.py), from ``settings``, without the
    progress display (the benchmark's output is its log)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    return Checkpointer(engine, store, cfg, cid, settings.model_copy(update={"progress": "never"}),
                        work_dir=work_dir, try_number=0, on_phase=phases)


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint both restores of a benchmark use: in ``store`` under ``checkpoint_id``, and as
    ``plain``, the image directory of the same dump."""

    store: Store
    cfg: StoreConfig
    checkpoint_id: str
    manifest: Manifest
    plain: Path


# --------------------------------------------------------------------------------------------
# memory on a VM
# --------------------------------------------------------------------------------------------
_BLOCK = b"\1" * (64 * MB)


def prewarm(nbytes: int) -> float:
    """Touch ``nbytes`` of fresh anonymous memory and free it again; return the seconds it took.

    On a VM with free page reporting (virtio-balloon; this Firecracker guest reports free 8 MB
    blocks to the host after ~2 s), memory the guest freed a while ago costs a host fault per page
    when it is touched again: restoring 1 GB into such memory took 2-3 s instead of 1 s here. Each
    timed run starts right after this, so every run gets host-backed memory and none is charged
    for the VM's memory management.
    """
    t0 = time.monotonic()
    m = mmap.mmap(-1, nbytes)
    try:
        for off in range(0, nbytes - len(_BLOCK) + 1, len(_BLOCK)):
            m.write(_BLOCK)
    finally:
        m.close()
    return time.monotonic() - t0


class Warm:
    """prewarm(), held: touch ``nbytes`` of fresh memory on entry, free it on exit. The
    workload steps every few seconds and a run must start right after a step; memory freed while
    waiting for it could go back to the host (prewarm()), so it is freed only then."""

    release_seconds = 0.0

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seconds = 0.0
        self._m: mmap.mmap | None = None

    def __enter__(self) -> Warm:
        if self.nbytes:
            t0 = time.monotonic()
            self._m = mmap.mmap(-1, self.nbytes)
            for _ in range(self.nbytes // len(_BLOCK)):
                self._m.write(_BLOCK)
            self.seconds = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._m is not None:
            t0 = time.monotonic()
            self._m.close()
            self._m = None
            self.release_seconds = time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# the machine, for the report
# --------------------------------------------------------------------------------------------
def _first_field(path: str, prefix: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    cpu = _first_field("/proc/cpuinfo", "model name") or "unknown"
    ram = int((_first_field("/proc/meminfo", "MemTotal:") or "0 kB").split()[0]) * 1024
    return {"kernel": platform.release(), "cpu": cpu, "cores": os.cpu_count(),
            "ram_gib": round(ram / (1 << 30), 1), "hostname": socket.gethostname()}
