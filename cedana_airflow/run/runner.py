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
import secrets
import shutil
import signal
import statistics
import sys
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
from ..engine.procfs import has_cap_sys_admin
from ..errors import CedanaError, CheckpointNotFound, ConfigError, CorruptCheckpoint, EngineUnavailable
from ..format.manifest import AirflowTask, Manifest
from ..ids import validate_checkpoint_id
from ..keys import node_key, node_trust
from ..store import Store, index, open_store
from ..store.gc import delete_checkpoint_id
from ..store.restores import RestoreRecord, record_restore
from ..store.writer_lease import WriterLease
from ..units import duration_text
from .cadence import COST_WINDOW, Cadence, HeartbeatChoice, checkpoint_cost, estimated_cost
from .checkpoint_triggers import Failures, Heartbeat, MemoryWatch
from .checkpointer import Checkpointer, RestoreTree, check_owner
from .cooperative import Cooperation
from .environment import workload_env
from .estimate import estimate_checkpoint
from .gpu_state import GpuGate
from .job import Job, JobSpec
from .restore_gap import judge_settings
from .stop import StopReport, clean_cut
from .timeline import Timeline
from .workload import Sink, Starter, Workload

__all__ = ["RunResult", "engine_for", "ensure_work_dir", "make_engine", "run_workload", "usable_engine"]

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    exit_code: int
    outcome: Literal["fresh", "restored"]
    restored_from: Manifest | None = None
    skipped: tuple[str, ...] = ()
    checkpoints: list[Manifest] = field(default_factory=list)
    restore_seconds: float = 0.0
    restore_timeline: Timeline | None = None  # where that restore's time went (timeline.py)
    restore_gap_seconds: float = 0.0  # from the restored checkpoint's creation to the restore's start
    stopped_by_signal: int | None = None
    killed_by_signal: int | None = None  # the signal that ended the workload, when not one we sent to stop it
    skipped_heartbeats: int = 0  # too large to take (max_checkpoint_bytes, or no room in the work dir)
    failed_heartbeats: int = 0  # heartbeats (and threshold checkpoints) that failed; the workload kept running
    heartbeat_failures: list[dict[str, Any]] = field(default_factory=list)  # each kind: its latest line, how often
    stop: StopReport | None = None  # how a stop went (final checkpoint, the tree's end), when there was one
    heartbeat: index.HeartbeatRow | None = None  # the interval in use at the end and its figures (run/cadence.py)
    heartbeat_in_force: str = ""  # what the run was given and where from (Settings.heartbeat_text)
    unprotected: str = ""  # in scope, yet no checkpoint to resume from: why, in one line (issue 51)


#: Signals that stop a managed run (final checkpoint first) and those passed straight to the workload.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_FORWARDED_SIGNALS = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def make_engine(settings: Settings) -> CriuEngine:
    binary = find_criu(settings.criu, settings.criu_prefix)
    log.debug("engine criu=%s source=%s version=%s", binary.path, binary.source, binary.version)
    return CriuEngine(binary)


def usable_engine(settings: Settings) -> CriuEngine:
    """This node's CRIU, if it can dump here: found, new enough, and with CAP_SYS_ADMIN (root in a hardened
    container, or with its capabilities dropped, has not). Raises EngineUnavailable saying which."""
    engine = make_engine(settings)
    if not has_cap_sys_admin():
        raise EngineUnavailable(f"this process lacks CAP_SYS_ADMIN (uid {os.geteuid()}), which CRIU needs to dump "
                                "and restore; run the supervisor as root with its capabilities, or use mode = "
                                "cooperative or auto")
    return engine


def engine_for(settings: Settings) -> tuple[CriuEngine | None, str]:
    """The engine ``settings.mode`` wants, and why there is none: transparent needs CRIU (EngineUnavailable,
    as before); cooperative and auto go on without it (auto then checkpoints cooperatively, if at all)."""
    try:
        return usable_engine(settings), ""
    except EngineUnavailable as e:
        if settings.mode == "transparent":
            raise
        return None, str(e)


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
    on_restore: Callable[[RunResult], None] | None = None,
    on_fresh: Callable[[str], None] | None = None,
    starter: Starter = Workload.start,
    cooperative: bool = True,
    restore_tree: RestoreTree | None = None,
    caller_uid: int | None = None,
    owner_checked: bool = False,
    coop_root: Path | None = None,
    coop_owner: tuple[int, int, tuple[int, ...]] | None = None,
    job_attempt: str = "",
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
    ``on_restore``: called once a checkpoint is restored (``restored_from`` and the timings set), before
    any output of the restored workload reaches ``stdout``/``stderr``: a log can say what was restored
    ahead of what the workload prints next. ``on_fresh``: called with why, when a resume found nothing
    it could restore and the command starts fresh (the node agent tells its caller).
    ``starter``: what starts a fresh tree (the node agent's starts it as its caller); ``restore_tree``:
    what restores one (the node agent's runs CRIU under the tree's shim; restores are then full).
    ``cooperative=False``: a checkpoint the workload wrote itself is refused, never restored. Restoring
    one starts its recorded command through ``starter`` (the node agent's starts it as its caller).
    ``coop_root``: this run's cooperative folder (default: a new one in the work dir; the node agent names
    one per workload, which an agent started after it takes up); ``coop_owner``: the uid and gid the
    workload runs as where they are not ours (the node agent's caller, with its groups: run/cooperative.py).
    ``caller_uid``: the node agent's caller, written into every manifest; one other than root may use
    only an ID whose newest checkpoint is its own uid's (or a new one), checked before the writer lease.
    ``owner_checked``: that was judged when the run began (an agent taking up another agent's run, whose
    IDs an older agent may have written without its caller's uid): not judged again.
    ``job_attempt``: for one part of a job (``job_parts`` above 1), what every part of this attempt shares and
    no earlier attempt had (default: the try number; the Slurm route adds the job's restart count).
    """
    validate_checkpoint_id(checkpoint_id)
    if try_number < 0:
        raise ConfigError(f"try number {try_number} is negative. Pass --try-number 0 or more.")
    engine, engine_why = engine_for(settings)
    if settings.mode == "auto":
        log.info("mode auto checkpoint_id=%s: %s", checkpoint_id, "transparent checkpoints (CRIU)" if engine else
                 f"CRIU cannot run here ({engine_why}); cooperative checkpoints once the workload declares it can")
    gpu = GpuGate(settings)
    if engine is not None and settings.mode != "cooperative":
        gpu.require()  # gpu = require: a node that cannot checkpoint GPU state fails here, before anything starts
    store = store or open_store(settings.resolved_store(), settings)
    store_cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    # Another task's ID is refused before its lease is touched: a newer try of another task must not fence
    # the owner's running supervisor (read-only here; judged again once the lease is held, below).
    key = node_key(settings)  # read once for the run; no key fails here, before anything starts
    if not owner_checked:
        check_owner(store, checkpoint_id, node_trust(settings, airflow, key, uid=caller_uid))
    owner = f"{airflow.dag_id}/{airflow.task_id}/{airflow.map_index}" if airflow else ""
    if caller_uid:  # the node agent's caller other than root: another uid's newer try never fences this lease
        owner = f"{owner} uid={caller_uid}".strip()
    spec = JobSpec.of(settings)
    job = (Job(store, checkpoint_id, spec, node=settings.resolved_node(), try_number=try_number, key=key.key,
               attempt=job_attempt) if spec else None)
    if spec is not None:
        log.info("job checkpoint_id=%s: part %d of %d%s; a stop takes no final checkpoint (the newest committed seq "
                 "resumes every part)", checkpoint_id, spec.part, spec.parts,
                 ", the coordinator" if spec.coordinator else "")
    # The coordinator holds the ID's lease for the job: only it commits (the other parts stage, run/job.py).
    lease = (WriterLease(store, checkpoint_id, node=settings.resolved_node(), try_number=try_number,
                         ttl_seconds=settings.writer_lease_seconds, owner=owner)
             if settings.writer_lease_seconds > 0 and (spec is None or spec.coordinator) else None)
    # The lease comes first: a second supervisor of this ID must neither restore nor start anything.
    with _stop_line(checkpoint_id, lease) as stopped, \
            lease.held() if lease is not None else contextlib.nullcontext(), _work_dir(settings) as work_dir:
        # In every mode: whatever wrote the newest checkpoint restores it (a cooperative one needs this).
        # (a folder of this run's own: a node agent runs many in one process)
        coop = Cooperation(coop_root or work_dir / f"coop-{os.getpid()}-{secrets.token_hex(4)}", settings,
                           owner=coop_owner, private=work_dir)
        if env is None:  # ours, less the store's credentials: they would be in every image
            env = workload_env(os.environ, settings.keep_env)
        # Without CRIU there may be no root either: no PID namespace then, the workload's session is its tree.
        isolate = engine is not None or has_cap_sys_admin()

        def start_cooperative(m: Manifest, restore_dir: Path, out: Sink | None, err: Sink | None) -> Workload:
            assert env is not None
            argv = list(command) if command is not None else list(m.process.command)  # `restore`: the recorded one
            wd = cwd if command is not None or cwd is not None else m.process.cwd
            return starter(argv, cwd=wd, env={**env, **coop.env(restore_dir)}, stdout=out, stderr=err, isolate=isolate)

        cp = Checkpointer(engine, store, store_cfg, checkpoint_id, settings, work_dir=work_dir, try_number=try_number,
                          lease=lease, gpu=gpu, airflow=airflow, coop=coop, key=key,
                          start=start_cooperative if cooperative else None, engine_why=engine_why,
                          restore_tree=restore_tree, caller_uid=caller_uid, job=job)
        result = RunResult(exit_code=0, outcome="fresh")
        try:
            if not owner_checked:
                cp.check_owner()  # another task's ID: neither restored nor written, before anything starts
            restore = command is None or (resume and _lease_allows(settings, store, checkpoint_id, cp, on_fresh))
            while True:
                workload = _resume(cp, result, must_restore=command is None, cwd=cwd, stdout=stdout, stderr=stderr,
                                   on_restore=on_restore, on_fresh=on_fresh) if restore else None
                if workload is None:
                    assert command is not None
                    asked = settings.mode != "transparent"  # a transparent workload is never asked: no contract
                    workload = starter(command, cwd=cwd, env={**env, **coop.env()} if asked else env,
                                       stdout=stdout, stderr=stderr, isolate=isolate,
                                       deny_io_uring=engine is not None and settings.io_uring == "deny")
                    log.info("workload started checkpoint_id=%s pid=%d node=%s", checkpoint_id, workload.pid, cp.node)
                result = _supervise(settings, cp, workload, result, handle_signals, stop, stopped)
                why = cp.lazy_failure()
                if why is None or result.stopped_by_signal:
                    break
                # Its tree was killed before it could run on a missing page: restore again, in full.
                log.warning("lazy restore failed checkpoint_id=%s: %s; restoring again in full", checkpoint_id, why)
                result = RunResult(exit_code=0, outcome="fresh", skipped=(why,))
        finally:
            cp.close()
            coop.close()
        if result.exit_code == 0 and settings.delete_on_success:
            delete_checkpoint_id(store, checkpoint_id)  # done: nothing left to resume
        return result


def _lease_allows(settings: Settings, store: Store, checkpoint_id: str, cp: Checkpointer,
                  on_fresh: Callable[[str], None] | None = None) -> bool:
    """The license lease (cedana:license=NAME): a checkpoint older than ``lease_seconds`` holds a dead
    license, so the workload starts fresh unless ``lease_renew_command`` renews it. Judged here, where
    every route's restore happens (a worker, a pod, a Slurm job), so it is one rule on all of them."""
    # the gap: per candidate, below; only what this node would restore is judged
    verdict = judge_settings(store, checkpoint_id, settings, include_gap=False, trusted=cp.trusted)
    for level, note in verdict.notes:
        log.log(level, "%s", note)
    if not verdict.resume:  # its own line, not the notes: they hold a root command's output
        _said(on_fresh, f"no checkpoint could be restored: the newest is older than the lease of its license "
                        f"({settings.lease_seconds or 0:.0f} s, lease_seconds) and was not renewed")
    return verdict.resume


def _said(on_fresh: Callable[[str], None] | None, why: str) -> None:
    """``on_fresh(why)`` where there is one; a hook that fails is logged, never the run's end (as
    ``on_restore``)."""
    if on_fresh is None:
        return
    try:
        on_fresh(why)
    except Exception:
        log.warning("on_fresh failed", exc_info=True)


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
            stderr: Sink | None, on_restore: Callable[[RunResult], None] | None = None,
            on_fresh: Callable[[str], None] | None = None) -> Workload | None:
    """Restore the newest usable checkpoint into ``result``; None (start fresh) when there is none,
    unless ``must_restore`` (restore without a command), where that is the caller's error."""
    t0, started_at = time.monotonic(), datetime.now(timezone.utc)
    # The restored tree runs (and prints) as soon as CRIU has restored it; its output waits here until
    # the restore has been announced, so a log reads "restored ..." before what the workload printed next.
    held = _Held()
    try:
        return _restore_into(cp, result, must_restore=must_restore, cwd=cwd,
                             stdout=held.sink(stdout if stdout is not None else sys.stdout.buffer),
                             stderr=held.sink(stderr if stderr is not None else sys.stderr.buffer),
                             on_restore=on_restore, on_fresh=on_fresh, held=held, t0=t0, started_at=started_at)
    finally:
        held.release()  # (already released after a restore; a failed one printed nothing)


def _restore_into(cp: Checkpointer, result: RunResult, *, must_restore: bool, cwd: str | None, stdout: Sink,
                  stderr: Sink, on_restore: Callable[[RunResult], None] | None,
                  on_fresh: Callable[[str], None] | None, held: _Held, t0: float,
                  started_at: datetime) -> Workload | None:
    """_resume's work, with the restored tree's output in ``held`` until the restore is announced."""

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
        _said(on_fresh, "no checkpoint to resume")
        if cp.try_number > 1:  # a retry that found nothing (its node died before the first checkpoint): say so
            history(outcome="fresh", reason="no checkpoint to resume: none was complete before the previous try ended")
        return None
    except CorruptCheckpoint as e:
        if must_restore or cp.job is not None:  # a job's part starting over while the others resume: never
            raise
        result.skipped = (str(e),)
        log.warning("no checkpoint could be restored checkpoint_id=%s; starting fresh", cp.checkpoint_id)
        _said(on_fresh, f"no checkpoint could be restored: {e}")
        history(outcome="fresh", reason="every checkpoint was refused", refused=(str(e),))
        return None
    m = restored.manifest
    result.outcome, result.restored_from, result.skipped = "restored", m, restored.skipped
    result.restore_seconds = time.monotonic() - t0
    result.restore_timeline = restored.timeline
    result.restore_gap_seconds = max(0.0, (started_at - m.created_at).total_seconds())
    log.info("%s, mode %s", restored_line(m.seq, m.try_number, m.node, cp.node, result.restore_gap_seconds,
                                          result.restore_seconds, cp.checkpoint_id), restored.mode)
    if on_restore is not None:
        try:
            on_restore(result)
        except Exception:  # the restored tree runs: it must stay supervised whatever a caller's hook does
            log.warning("on_restore failed checkpoint_id=%s", cp.checkpoint_id, exc_info=True)
    held.release()  # before the store writes below: the log must not stall on them
    history(outcome="restored", seq=m.seq, from_node=m.node, gap_seconds=round(result.restore_gap_seconds, 3),
            restore_seconds=round(result.restore_seconds, 3), refused=restored.skipped)
    return restored.workload


class _Held:
    """The restored tree's stdout and stderr, kept in one queue until :meth:`release` (so the two
    streams keep their order), then passed straight through."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[tuple[Sink, bytes]] | None = []

    def sink(self, target: Sink) -> Sink:
        return _HeldSink(self, target)

    def hold(self, target: Sink, data: bytes) -> bool:
        """Queue ``data`` for ``target``; False once released (the caller writes it itself)."""
        with self._lock:
            if self._queue is None:
                return False
            self._queue.append((target, bytes(data)))
            return True

    def release(self) -> None:
        with self._lock:  # writes wait meanwhile, so nothing overtakes what was held
            queue, self._queue = self._queue or [], None
            targets = []
            for target, data in queue:
                try:
                    target.write(data)
                except (OSError, ValueError) as e:  # a closed log: what follows still goes where it can
                    log.debug("held output not written: %s", e)
                if target not in targets:
                    targets.append(target)
            for target in targets:
                with contextlib.suppress(OSError, ValueError):
                    target.flush()


class _HeldSink:
    def __init__(self, held: _Held, target: Sink) -> None:
        self.held, self.target = held, target

    def write(self, data: bytes, /) -> int:
        return len(data) if self.held.hold(self.target, data) else self.target.write(data)

    def flush(self) -> None:
        self.target.flush()


@contextlib.contextmanager
def _stop_line(checkpoint_id: str, lease: WriterLease | None) -> Iterator[list[StopReport]]:
    """One line for a stop, once the writer lease is released (the next try, on any node, starts at once)."""
    stopped: list[StopReport] = []
    try:
        yield stopped
    finally:
        if stopped:
            r = stopped[0]
            log.warning("%s (%.2f s in all)", r.line(checkpoint_id, lease_released=lease is not None and not lease.fenced),
                        time.monotonic() - r.started)


def _supervise(settings: Settings, cp: Checkpointer, workload: Workload, result: RunResult,
               handle_signals: bool, stop: threading.Event | None, stopped: list[StopReport]) -> RunResult:
    """Run the triggers while the workload runs; a stop is a clean cut (run/stop.py)."""
    stop_requested = stop or threading.Event()
    started = time.monotonic()
    cp.stopping = stop_requested  # a cooperative heartbeat waiting on the workload gives way to the stop
    got: list[int] = []
    cadence = _cadence(settings, cp, workload) if settings.heartbeat_on else None
    recorded: list[index.HeartbeatRow] = []  # the heartbeat row this run last wrote to the index

    def take() -> None:
        t0 = time.monotonic()
        m = cp.checkpoint(workload)
        if m is not None:
            result.checkpoints.append(m)
            if cadence is not None and (row := _chosen(cp, cadence.observe(checkpoint_cost(m), time.monotonic() - t0))):
                recorded[:] = [row]

    def beat() -> None:
        if workload.poll() is None:
            take()

    failures = Failures(lambda why: index.record_failure(cp.store, cp.checkpoint_id, why))
    job = cp.job
    if job is not None and not job.spec.coordinator:
        cadence = None  # part 0 appoints the heartbeats: this part joins its rounds

        def join() -> None:
            rnd = job.next_round(1.0)
            if rnd is not None and workload.poll() is None:
                m = cp.checkpoint(workload, rnd=rnd)
                if m is not None:
                    result.checkpoints.append(m)
    triggers = _Triggers(settings, workload, beat, cadence, failures,
                         join if job is not None and not job.spec.coordinator else None)

    def cut(cause: str) -> None:
        # The triggers are told to halt, not waited for: a heartbeat's upload must not eat the stop window
        # (the final checkpoint waits for its lock, within the window's budget: run/stop.py).
        stop_requested.set()  # (a timeout's exception too): a cooperative heartbeat's open request gives way
        triggers.stop(wait=False)
        if workload.poll() is None:
            result.stop = clean_cut(settings, cp, workload, cause)
            stopped.append(result.stop)
            if result.stop.final is not None:
                result.checkpoints.append(result.stop.final)

    with _signals(handle_signals, workload, got):
        triggers.start()
        try:
            while workload.poll() is None:
                if got:  # a stop signal, recorded by its handler: set here, where no lock of the Event is held
                    stop_requested.set()
                if stop_requested.is_set():
                    sig = signal.Signals(got[0] if got else signal.SIGTERM)
                    final = settings.checkpoint_on_term and cp.job is None  # a job's part takes none: no seq alone
                    if got:
                        log.info("stop requested signal=%s checkpoint_on_term=%s", sig.name, final)
                    else:  # the caller's stop (Airflow's on_kill, set inside its signal handler): said here
                        log.info("the task is being stopped; %s, then the workload tree ends",
                                 "final checkpoint" if final else "no final checkpoint")
                    result.stopped_by_signal = sig
                    cut(sig.name)
                    break
                time.sleep(0.1)
        except BaseException as e:  # execution_timeout's AirflowTaskTimeout, a KeyboardInterrupt: the same cut
            result.stopped_by_signal = signal.SIGTERM
            cut(type(e).__name__)
            raise
        finally:
            triggers.stop()
        rc = workload.wait()
    # Stopped by us: 128 + the signal we were sent, as a shell reports it. Otherwise its own code.
    result.exit_code = 128 + result.stopped_by_signal if result.stopped_by_signal else (rc if rc is not None else 1)
    result.killed_by_signal = None if result.stopped_by_signal else workload.signal
    result.skipped_heartbeats = cp.skipped
    result.failed_heartbeats = failures.total
    result.heartbeat_failures = failures.as_json()
    result.heartbeat = cadence.choice.as_row(settings.heartbeat_text()) if cadence is not None else None
    if result.checkpoints and result.heartbeat is not None and [result.heartbeat] != recorded:
        # the index keeps what the run ended with (its summary's figures), not the last change of 10% or more
        index.record_heartbeat(cp.store, cp.checkpoint_id, result.heartbeat)
    result.heartbeat_in_force = settings.heartbeat_text()
    log.info("workload exited checkpoint_id=%s exit_code=%d checkpoints=%d skipped_heartbeats=%d failed_heartbeats=%d",
             cp.checkpoint_id, result.exit_code, len(result.checkpoints), cp.skipped, failures.total)
    if not result.checkpoints and result.restored_from is None:
        result.unprotected = _why_no_checkpoint(settings, result, time.monotonic() - started)
        log.warning("no checkpoint was taken checkpoint_id=%s: %s", cp.checkpoint_id, result.unprotected)
    return result


def _why_no_checkpoint(settings: Settings, result: RunResult, ran: float) -> str:
    """Why a run in scope ended with nothing a retry could resume from, and what would change that."""
    lost = "a failure would have lost all of its work"
    if result.failed_heartbeats or result.skipped_heartbeats:
        most = result.heartbeat_failures[0]["cause"] if result.heartbeat_failures else "see the lines above"
        return (f"{result.failed_heartbeats} heartbeat(s) failed and {result.skipped_heartbeats} were skipped "
                f"(the most frequent cause: {most}); {lost} (docs/heartbeat.md#when-a-heartbeat-fails-or-is-skipped)")
    if not settings.heartbeat_on:
        return f"heartbeat {settings.heartbeat_text()}; {lost} before its end. Set a heartbeat to protect it"
    return (f"it ran {duration_text(ran)}, less than its first heartbeat (heartbeat {settings.heartbeat_text()}); "
            f"{lost}. A shorter heartbeat protects runs this short")


def _cadence(settings: Settings, cp: Checkpointer, workload: Workload) -> Cadence:
    """The heartbeat's interval for this run. Its first cost: this ID's latest checkpoints (a retry has
    them), else (auto only) the tree's size at the fleet's measured freeze rate."""
    costs = [r.freeze_seconds for r in _own_rows(cp)[-COST_WINDOW:]] if settings.heartbeat_auto else []
    if costs:
        first, source = statistics.median(costs), f"measured on {len(costs)} earlier checkpoint(s) of this ID"
    elif settings.heartbeat_auto:
        first, source = estimated_cost(estimate_checkpoint(workload.pids()).total, _fleet_freeze_rate(cp.store))
    else:
        first, source = 0.0, "not measured yet"
    cadence = Cadence(settings, first_cost=first, cost_source=source, earlier=costs)
    if cadence.auto:  # kept in the index with the first checkpoint (an entry without one is not kept)
        log.info("%s checkpoint_id=%s", cadence.choice.line(), cp.checkpoint_id)
    return cadence


def _own_rows(cp: Checkpointer) -> list[index.IndexRow]:
    try:
        return [r for r in index.read_entry(cp.store, cp.checkpoint_id).checkpoints if r.freeze_seconds > 0]
    except CedanaError as e:  # a listing cache: the estimate stands in
        log.debug("earlier checkpoints' costs not read: %s", e)
        return []


def restored_line(seq: int, try_number: int, from_node: str, node: str, gap_seconds: float, restore_seconds: float,
                  checkpoint_id: str) -> str:
    """The one line a restore gets (the task log's, the CLI's, an agent's caller's): what a reader looks for
    first, the long ID last; ``of try T`` only where there was one (a CLI run has none)."""
    tried = f" of try {try_number}" if try_number else ""
    return (f"restored seq {seq}{tried} (node {from_node}) on node {node}: gap {gap_seconds:.1f} s, "
            f"restore {restore_seconds:.2f} s, checkpoint_id={checkpoint_id}")

def _chosen(cp: Checkpointer, choice: HeartbeatChoice | None) -> index.HeartbeatRow | None:
    """A new interval (or the first measured figures): said once in the log (auto), kept in the index.
    Returns the row written."""
    if choice is None:
        return None
    if choice.auto:
        log.info("%s checkpoint_id=%s", choice.line(), cp.checkpoint_id)
    row = choice.as_row(cp.settings.heartbeat_text())
    index.record_heartbeat(cp.store, cp.checkpoint_id, row)
    return row


def _fleet_freeze_rate(store: Store) -> float | None:
    """Seconds per GiB CRIU froze for, the median over the store's listed checkpoints of 64 MiB or more
    (smaller ones are mostly fixed cost); None when it lists none."""
    try:
        rows = [r for e in index.read_index(store).values() for r in e.checkpoints
                if r.engine == "criu" and r.image_bytes >= 64 << 20 and r.freeze_seconds > 0]
    except CedanaError as e:
        log.debug("fleet freeze rate not read: %s", e)
        return None
    return statistics.median(r.freeze_seconds / (r.image_bytes / (1 << 30)) for r in rows) if rows else None


class _Triggers:
    """The heartbeat and the memory watch that ``settings`` ask for, started and stopped together."""

    def __init__(self, settings: Settings, workload: Workload, beat: Callable[[], None],
                 cadence: Cadence | None, failures: Failures, join: Callable[[], None] | None = None) -> None:
        alive = lambda: workload.poll() is None  # noqa: E731
        # One part of a job other than part 0 joins part 0's rounds instead (``join`` waits for the next one).
        self.heartbeat = (Heartbeat(cadence.interval, beat, alive=alive, failures=failures) if cadence is not None
                          else Heartbeat(0.0, join, alive=alive, failures=failures) if join is not None else None)
        self.watch = (MemoryWatch(settings.checkpoint_above_bytes, lambda: estimate_checkpoint(workload.pids()).total,
                                  beat, failures=failures) if settings.checkpoint_above_bytes > 0 else None)

    def start(self) -> None:
        for t in (self.heartbeat, self.watch):
            if t is not None:
                t.start()

    def stop(self, wait: bool = True) -> None:
        for t in (self.heartbeat, self.watch):
            if t is not None and t.is_alive():
                t.stop(wait)


@contextlib.contextmanager
def _signals(handle: bool, workload: Workload, got: list[int]) -> Iterator[None]:
    """While supervising: SIGTERM/SIGINT request a stop (final checkpoint first: recorded in ``got``, which the
    supervising loop reads), HUP/QUIT/USR1/USR2 go to the workload. Only in the main thread (Python's rule),
    and only when the caller lets us."""
    previous: dict[signal.Signals, Any] = {}
    if handle and threading.current_thread() is threading.main_thread():
        def on_stop(signum: int, frame: FrameType | None) -> None:
            # Only recorded: the handler runs in the main thread between two bytecodes, possibly while that
            # thread holds an Event's lock inside Event.wait(), and Event.set() here then waited for it for
            # ever (a SIGTERM left a supervisor hung, its workload run to the end: unit run of 2026-12-06).
            got.append(signum)

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
