"""A managed run from start to exit: start or restore, heartbeat, forward signals, return the exit code.

This is what ``cedana-airflow run`` and ``restore`` do, and what the Airflow operator calls.

====================  ====================================================================
outcome               meaning
====================  ====================================================================
``fresh``             no checkpoint to resume (or resume not asked): the command started
``restored``          the newest verifiable checkpoint was restored and ran to its end
====================  ====================================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from ..config import Settings
from ..engine.criu import CriuEngine, find_criu
from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint
from ..format.manifest import AirflowTask, Manifest
from ..ids import validate_checkpoint_id
from ..store import Store, index, open_store
from ..store.gc import delete_checkpoint_id
from ..store.restores import RestoreRecord, record_restore
from ..store.writer_lease import WriterLease
from .checkpointer import Checkpointer
from .environment import workload_env
from .estimate import estimate_checkpoint
from .gpu_state import GpuGate
from .triggers import Heartbeat, MemoryWatch
from .workload import Sink, Workload

__all__ = ["RunResult", "ensure_work_dir", "make_engine", "run_workload"]

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    exit_code: int
    outcome: Literal["fresh", "restored"]
    restored_from: Manifest | None = None
    skipped: tuple[str, ...] = ()
    checkpoints: list[Manifest] = field(default_factory=list)
    restore_seconds: float = 0.0
    restore_gap_seconds: float = 0.0  # from the restored checkpoint's creation to the restore's start
    stopped_by_signal: int | None = None
    skipped_heartbeats: int = 0  # too large to take (max_checkpoint_bytes, or no room in the work dir)


#: Signals that stop a managed run (final checkpoint first) and those passed straight to the workload.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_FORWARDED_SIGNALS = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def make_engine(settings: Settings) -> CriuEngine:
    binary = find_criu(settings.criu, settings.criu_prefix)
    log.debug("engine criu=%s source=%s version=%s", binary.path, binary.source, binary.version)
    return CriuEngine(binary)


def run_workload(
    settings: Settings,
    checkpoint_id: str,
    command: Sequence[str] | None,
    *,
    resume: bool,
    try_number: int = 0,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdout: Sink | None = None,
    stderr: Sink | None = None,
    handle_signals: bool = True,
    stop: threading.Event | None = None,
    store: Store | None = None,
    airflow: AirflowTask | None = None,
) -> RunResult:
    """Run ``command`` managed (or, with ``command=None``, only restore) and return how it ended.

    ``resume``: restore the newest complete checkpoint of ``checkpoint_id`` when there is one.
    With ``command=None`` a missing checkpoint is an error (CheckpointNotFound), and so is one that
    cannot be restored (CorruptCheckpoint); with a command, the command then starts fresh.
    ``store``: an opened-elsewhere backend (Airflow passes one whose S3 client comes from a
    connection); default: the one ``settings`` names.
    ``env``: the workload's whole environment; default: ours less the store's credentials
    (run/environment.py; ``settings.keep_env`` keeps named ones).
    ``stop``: setting it does what SIGTERM does (final checkpoint, then stop), for callers that own
    the signal handlers (Airflow's task runner calls ``on_kill`` from its own SIGTERM handler).
    ``airflow``: the task instance this run is (written into every manifest and restore record).
    """
    validate_checkpoint_id(checkpoint_id)
    if try_number < 0:
        raise ConfigError(f"try number {try_number} is negative. Pass --try-number 0 or more.")
    engine = make_engine(settings)
    gpu = GpuGate(settings)
    gpu.require()  # gpu = require: a node that cannot checkpoint GPU state fails here, before anything starts
    store = store or open_store(settings.resolved_store(), settings)
    store_cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    lease = (WriterLease(store, checkpoint_id, node=settings.resolved_node(), try_number=try_number,
                         ttl_seconds=settings.writer_lease_seconds) if settings.writer_lease_seconds > 0 else None)
    # The lease comes first: a second supervisor of this ID must neither restore nor start anything.
    with lease.held() if lease is not None else contextlib.nullcontext(), _work_dir(settings) as work_dir:
        cp = Checkpointer(engine, store, store_cfg, checkpoint_id, settings, work_dir=work_dir, try_number=try_number,
                          lease=lease, gpu=gpu, airflow=airflow)
        result = RunResult(exit_code=0, outcome="fresh")
        try:
            restore = resume or command is None
            while True:
                workload = _resume(cp, result, must_restore=command is None, cwd=cwd, stdout=stdout, stderr=stderr) \
                    if restore else None
                if workload is None:
                    assert command is not None
                    if env is None:  # ours, less the store's credentials: they would be in every image
                        env = workload_env(os.environ, settings.keep_env)
                    workload = Workload.start(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
                    log.info("workload started checkpoint_id=%s pid=%d node=%s", checkpoint_id, workload.pid, cp.node)
                result = _supervise(settings, cp, workload, result, handle_signals, stop)
                why = cp.lazy_failure()
                if why is None or result.stopped_by_signal:
                    break
                # Its tree was killed before it could run on a missing page: restore again, in full.
                log.warning("lazy restore failed checkpoint_id=%s: %s; restoring again in full", checkpoint_id, why)
                result = RunResult(exit_code=0, outcome="fresh", skipped=(why,))
        finally:
            cp.close()
        if result.exit_code == 0 and settings.delete_on_success:
            delete_checkpoint_id(store, checkpoint_id)  # done: nothing left to resume
        return result


def ensure_work_dir(settings: Settings) -> Path | None:
    """The configured work directory, created if needed (None: none configured, use a temp one)."""
    if settings.work_dir is not None:
        try:
            settings.work_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"work dir {settings.work_dir} cannot be used: {e.strerror}. Point --work-dir / "
                              "CEDANA_WORK_DIR at a writable local directory.") from None
    return settings.work_dir


@contextlib.contextmanager
def _work_dir(settings: Settings) -> Iterator[Path]:
    """The configured work directory, or a temp one that is removed afterwards (unless keep_local)."""
    if (configured := ensure_work_dir(settings)) is not None:
        yield configured
        return
    work_dir = Path(tempfile.mkdtemp(prefix="cedana-work-"))
    try:
        yield work_dir
    finally:
        if not settings.keep_local:
            shutil.rmtree(work_dir, ignore_errors=True)


def _resume(cp: Checkpointer, result: RunResult, *, must_restore: bool, cwd: str | None, stdout: Sink | None,
            stderr: Sink | None) -> Workload | None:
    """Restore the newest usable checkpoint into ``result``; None (start fresh) when there is none,
    unless ``must_restore`` (restore without a command), where that is the caller's error."""
    t0, started_at = time.monotonic(), datetime.now(timezone.utc)

    def history(**fields: Any) -> None:  # best effort: what the CLI and the UI show of each resume
        record_restore(cp.store, RestoreRecord(checkpoint_id=cp.checkpoint_id, try_number=cp.try_number, node=cp.node,
                                               at=started_at, airflow=cp.airflow, **fields))
        index.count_restore(cp.store, cp.checkpoint_id, started_at)

    try:
        restored = cp.restore(stdout, stderr, cwd=cwd)
    except CheckpointNotFound:
        if must_restore:
            raise
        log.info("no checkpoint to resume checkpoint_id=%s; starting fresh", cp.checkpoint_id)
        if cp.try_number > 1:  # a retry that found nothing (its node died before the first checkpoint): say so
            history(outcome="fresh", reason="no checkpoint to resume: none was complete before the previous try ended")
        return None
    except CorruptCheckpoint as e:
        if must_restore:
            raise
        result.skipped = (str(e),)
        log.warning("no checkpoint could be restored checkpoint_id=%s; starting fresh", cp.checkpoint_id)
        history(outcome="fresh", reason="every checkpoint was refused", refused=(str(e),))
        return None
    m = restored.manifest
    result.outcome, result.restored_from, result.skipped = "restored", m, restored.skipped
    result.restore_seconds = time.monotonic() - t0
    result.restore_gap_seconds = max(0.0, (started_at - m.created_at).total_seconds())
    history(outcome="restored", seq=m.seq, from_node=m.node, gap_seconds=round(result.restore_gap_seconds, 3),
            restore_seconds=round(result.restore_seconds, 3), refused=restored.skipped)
    log.info("restored checkpoint_id=%s seq=%d from_node=%s node=%s gap_seconds=%.1f restore_seconds=%.2f mode=%s",
             cp.checkpoint_id, m.seq, m.node, cp.node, result.restore_gap_seconds, result.restore_seconds, restored.mode)
    return restored.workload


def _supervise(settings: Settings, cp: Checkpointer, workload: Workload, result: RunResult,
               handle_signals: bool, stop: threading.Event | None) -> RunResult:
    """Run the triggers while the workload runs; on a stop request take the final checkpoint and stop it."""
    stop_requested = stop or threading.Event()
    got: list[int] = []

    def take() -> None:
        m = cp.checkpoint(workload)
        if m is not None:
            result.checkpoints.append(m)

    def beat() -> None:
        if workload.poll() is None:
            take()

    triggers = _Triggers(settings, workload, beat)
    with _signals(handle_signals, workload, got, stop_requested):
        triggers.start()
        try:
            while workload.poll() is None:
                if stop_requested.wait(0.1):
                    sig = signal.Signals(got[0] if got else signal.SIGTERM)
                    log.info("stop requested signal=%s checkpoint_on_term=%s", sig.name, settings.checkpoint_on_term)
                    triggers.stop()
                    if workload.poll() is None:
                        _final_checkpoint(settings, take)
                        result.stopped_by_signal = sig
                        workload.stop(settings.stop_grace_seconds, sig)
                    break
        finally:
            triggers.stop()
        rc = workload.wait()
    # Stopped by us: 128 + the signal we were sent, as a shell reports it. Otherwise its own code.
    result.exit_code = 128 + result.stopped_by_signal if result.stopped_by_signal else (rc if rc is not None else 1)
    result.skipped_heartbeats = cp.skipped
    log.info("workload exited checkpoint_id=%s exit_code=%d checkpoints=%d skipped_heartbeats=%d",
             cp.checkpoint_id, result.exit_code, len(result.checkpoints), cp.skipped)
    return result


def _final_checkpoint(settings: Settings, take: Callable[[], None]) -> None:
    if not settings.checkpoint_on_term:
        return
    try:
        take()
    except Exception as e:  # stopping matters more than the final checkpoint
        log.warning("final checkpoint failed: %s", e)


class _Triggers:
    """The heartbeat and the memory watch that ``settings`` ask for, started and stopped together."""

    def __init__(self, settings: Settings, workload: Workload, beat: Callable[[], None]) -> None:
        self.heartbeat = Heartbeat(settings.heartbeat_seconds, beat) if settings.heartbeat_seconds > 0 else None
        self.watch = (MemoryWatch(settings.checkpoint_above_bytes, lambda: estimate_checkpoint(workload.pids()).total,
                                  beat) if settings.checkpoint_above_bytes > 0 else None)

    def start(self) -> None:
        for t in (self.heartbeat, self.watch):
            if t is not None:
                t.start()

    def stop(self) -> None:
        for t in (self.heartbeat, self.watch):
            if t is not None and t.is_alive():
                t.stop()


@contextlib.contextmanager
def _signals(handle: bool, workload: Workload, got: list[int], stop_requested: threading.Event) -> Iterator[None]:
    """While supervising: SIGTERM/SIGINT request a stop (final checkpoint first), HUP/QUIT/USR1/USR2 go
    to the workload. Only in the main thread (Python's rule), and only when the caller lets us."""
    previous: dict[signal.Signals, Any] = {}
    if handle and threading.current_thread() is threading.main_thread():
        def on_stop(signum: int, frame: FrameType | None) -> None:
            got.append(signum)
            stop_requested.set()

        def on_forward(signum: int, frame: FrameType | None) -> None:
            workload.send_signal(signum)

        for s in _STOP_SIGNALS:
            previous[s] = signal.signal(s, on_stop)
        for s in _FORWARDED_SIGNALS:
            previous[s] = signal.signal(s, on_forward)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
