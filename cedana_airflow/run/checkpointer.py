"""Checkpoint and restore one workload under one checkpoint ID: the engine and the store together.

A checkpoint: freeze and dump into the local work directory (capturing open-for-writing files while
frozen), let the workload run on, then store the images; the upload is off the freeze path.
A restore: newest complete checkpoint first, each chunk verified; a corrupt one is refused and the
next older one is tried, saying so. Once every page of a restored tree is in, the huge pages a
restore cannot give it are given back in the background (engine/thp.py): without them each later
heartbeat's freeze is longer (bench/lazy_freeze.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Protocol

from .. import __version__
from ..config import Settings
from ..engine import thp
from ..engine.criu import CriuEngine
from ..engine.images import read_creds, read_restore_stats
from ..engine.inet_image import InetSk, read_inet_sockets
from ..engine.page_file import sweep
from ..engine.uffd import kernel_lazy_pages
from ..errors import ConfigError, CorruptCheckpoint, NodeInTheWay, NotRestorableHere, RestoreFailed, StoreUnavailable, WriterFenced
from ..failpoints import failpoint
from ..format.chunking import MAX_CHUNK_FACTOR, SegmentMemo
from ..format.manifest import CAPTURED_DIR, AirflowTask, Manifest, ProcessInfo
from ..format.selection import AgeLimit, limits_exceeded
from ..format.limits import restore_refusal
from ..format.trust import Trust
from ..ids import validate_checkpoint_id
from ..keys import NodeKey, node_key, node_trust
from ..store import index
from ..store.base import Store, StoreConfig
from ..store.gc import prune_checkpoints
from ..store.transfer import (CapturedSource, CheckpointMeta, fetch_checkpoint, load_manifests, require_latest,
                              save_checkpoint)
from ..store.writer_lease import WriterLease
from ..units import binary_size
from .captured import NOBODY, CapturedFilesBack, DenyList, ensure_cwd, node_denied, refusal, restore_roots
from .cooperative import Cooperation
from .estimate import captured_too_large, copies_too_large, dump_too_large, estimate_checkpoint, too_large
from .gpu_state import GpuGate
from .lazy_restore import LazyFeed, lazy_files
from .preflight import preflight
from .job import RESTORE_WAIT_SECONDS, Job, Round, joined
from .sockets import prepare_sockets, to_job
from .streamed_restore import PageStream, can_stream, streamed_files
from .timeline import Timeline
from .workload import Sink, Workload, become_subreaper

__all__ = ["Checkpointer", "PhaseHook", "Restored", "StartCooperative"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    workload: Workload
    manifest: Manifest
    skipped: tuple[str, ...]  # why newer checkpoints were refused, newest first
    mode: str = "full"  # how its memory came back: "lazy" (streaming in) or "full"
    timeline: Timeline | None = None  # where the restore's time went (timeline.py)


#: Called with a phase's name and its seconds, after each phase that completes: ``dump`` (frozen,
#: into the work dir), ``save`` (chunks and manifest into the store), ``fetch`` (chunks out of the
#: store, each verified), ``criu_restore`` (the engine's restore). An explicit hook for whoever
#: measures (bench/), so nobody has to wrap this module's functions to time them.
PhaseHook = Callable[[str, float], None]

#: Starts the command of a cooperative checkpoint's run, its state put back in the given directory
#: (CEDANA_RESTORE_DIR), with the restore's stdout and stderr (the runner's: it knows the command).
StartCooperative = Callable[[Manifest, Path, "Sink | None", "Sink | None"], Workload]
class RestoreTree(Protocol):
    """What turns a checked image dir into a running tree (full restores only): the node agent's runs
    ``criu restore`` under the workload's shim, with its caller's pipes (agent/workloads.py). Default:
    CRIU as our child, adopted here."""

    def vet(self, image_dir: Path, m: Manifest) -> bool:
        """Raise CorruptCheckpoint where it will not restore these images (a tree with more than its
        caller has): called first, before any of the checkpoint's files is put back or any folder made.
        Whether the tree is in namespaces of its own whose root is this node's ``/`` (agent/shim.py)."""

    def __call__(self, engine: CriuEngine, image_dir: Path, m: Manifest, pidfile: Path) -> Workload:
        """The running tree, from the engine, the images, the manifest and the pidfile CRIU writes."""


def _what(e: BaseException) -> str:
    """An error in one line: its type, unless our own errors (whose message says it all)."""
    return str(e) if isinstance(e, (CorruptCheckpoint, RestoreFailed)) else f"{type(e).__name__}: {e}"


def _drop_all_but_logs(folder: Path) -> None:
    """Remove a dump or restore folder's images and copies (large: process memory), keeping CRIU's
    logs, which an error message may name; the folder goes when nothing else is left."""
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif not entry.name.endswith(".log"):
            entry.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # empty: nothing failed, no log was written


def check_owner(store: Store, checkpoint_id: str, trust: Trust) -> None:
    """Before a supervisor writes under its ID: the newest checkpoint there that this node's key vouches
    for must be its task's (and, for the node agent's caller other than root, its uid's), or its retention
    would prune another task's checkpoints and its retry would find them. Unverifiable manifests never
    block a task's own process (a store writer cannot lock it out); an agent's caller other than root is
    refused an ID that holds only such manifests (its delete_on_success would delete them all)."""
    if trust.owner is None and not trust.uid:
        return
    unvouched = 0
    for m in load_manifests(store, checkpoint_id):
        if trust.signed_by(m) is None:
            unvouched += 1
            continue
        if (why := trust.owner_refusal(m)) is not None:
            raise ConfigError(f"checkpoint ID {checkpoint_id} (seq {m.seq}) may be neither written nor restored "
                              f"by this task: {why}")
        return
    if unvouched and trust.uid:  # the node agent's caller other than root: an ID nobody can show is its own
        raise ConfigError(f"checkpoint ID {checkpoint_id} holds checkpoints this node's key does not vouch for, so "
                          f"none shows it is uid {trust.uid}'s: it may be neither written nor restored through the node "
                          "agent. Give this task its own checkpoint_id, or have the store's owner remove that ID")


#: Free space a fetch leaves on the work dir's file system at least (CRIU's logs, a pidfile, the page cache).
ROOM_MARGIN_BYTES = 64 << 20


def _room_for(m: Manifest, sparse: frozenset[str], restore_dir: Path, max_chunk_bytes: int) -> None:
    """A node whose work dir cannot hold what the fetch writes fails the try before the first get, naming
    both (a disk filling mid-fetch failed every candidate the same way, then started fresh). Only for
    sizes a signature vouches for: an unsigned manifest's are its writer's word, refused like a corrupt
    one (the restore falls back), so that a store writer cannot end every try; a chunk larger than any
    the store holds is the fetch's to refuse."""
    if any(c.size > max_chunk_bytes for c in m.chunk_refs()):
        return
    state = m.cooperative.files if m.cooperative is not None else ()
    needed = (sum(f.size for f in m.files if f.name not in sparse) + sum(c.size for c in m.captured)
              + sum(f.size for f in state))
    st = os.statvfs(restore_dir)
    free = st.f_bavail * st.f_frsize
    if needed + ROOM_MARGIN_BYTES > free:
        why = (f"checkpoint {m.checkpoint_id} seq={m.seq} needs {needed} bytes in {restore_dir}, whose file system has "
               f"{free} free")
        if m.signature is None:
            raise CorruptCheckpoint(f"{why}, by what its unsigned manifest declares")
        raise NodeInTheWay(f"{why}: free space there (work_dir), or let the retry run on another node")


class Checkpointer:
    """Checkpoints and restores under one checkpoint ID, as ``settings`` say (node, compression,
    retention, size limit, progress display, whether local dumps are kept). With a ``lease`` (held
    by the caller), nothing is written once another supervisor took the ID over.

    ``engine`` is None where CRIU cannot run (``engine_why`` says why): then only cooperative
    checkpoints are taken and restored, through ``coop`` and ``start`` (run/cooperative.py)."""

    def __init__(self, engine: CriuEngine | None, store: Store, store_cfg: StoreConfig, checkpoint_id: str,
                 settings: Settings, *, work_dir: Path, try_number: int = 0, on_phase: PhaseHook | None = None,
                 lease: WriterLease | None = None, gpu: GpuGate | None = None,
                 airflow: AirflowTask | None = None, coop: Cooperation | None = None,
                 start: StartCooperative | None = None, engine_why: str = "", key: NodeKey | None = None,
                 restore_tree: RestoreTree | None = None, caller_uid: int | None = None,
                 job: Job | None = None) -> None:
        self.engine, self.store, self.store_cfg = engine, store, store_cfg
        self.job = job  # this supervisor runs one part of a job that spans nodes (run/job.py)
        self._staged: tuple[int, set[str]] | None = None  # a part's last staged seq and its chunks, not yet known committed
        self._restore_tree = restore_tree
        if restore_tree is not None and settings.restore_mode != "full":  # its lazy pages would need a shim's watch
            settings = settings.model_copy(update={"restore_mode": "full"})
        self.coop, self._start, self.engine_why = coop, start, engine_why
        self._route_said = ""  # the last "how heartbeats are taken" line said (auto mode), said once per change
        self.stopping: threading.Event | None = None  # set by the runner: a stop withdraws a heartbeat's request
        self.checkpoint_id = validate_checkpoint_id(checkpoint_id)
        self.settings = settings
        self.node, self.work_dir, self.try_number = settings.resolved_node(), work_dir, try_number
        # Read once (the runner's, when it read it): a heartbeat must not fail on a moved file. No key fails
        # here, before anything starts.
        self.node_key = key or node_key(settings)
        self._key = self.node_key.key
        log.debug("manifests are signed and verified with node key %s from %s", self.node_key.key_id, self.node_key.where)
        self.skipped = 0  # heartbeats skipped as too large
        self._on_phase = on_phase
        self.lease = lease
        self.gpu = gpu or GpuGate(settings)
        self.airflow = airflow  # the task instance that owns this ID, written into every manifest
        self.caller_uid = caller_uid  # the node agent's caller: in every manifest, and whose IDs it may use
        self.trust = node_trust(settings, airflow, self.node_key, uid=caller_uid)
        self._lock = threading.Lock()
        self._count = 0
        # This checkpointer's own in the work dir's folder names: a node agent runs many in one process (one
        # pid), and two restores of one seq, or two dumps of one count, must never share (or rmtree) a folder.
        self._tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._known: set[str] = set()
        self._memo = SegmentMemo()  # heartbeats cut only the segments that changed
        self.parent_seq: int | None = None
        self._feed: LazyFeed | None = None  # a lazy restore's pages, while they stream in
        self.timeline = Timeline()  # the last restore's (restore() starts a new one)
        self._lazy_off = ""  # why lazy restore is off from now on ("" while it is on)
        self._refused: dict[int, str] = {}  # seq -> why (a chunk that failed while streaming)
        self._window_said = False  # the stop-window warning, once per supervisor
        self._restorable_said = False  # the would-be-refused warning, once per supervisor
        self._stale_warning_checked = False  # an earlier supervisor's warning, cleared once it no longer holds
        self.huge_pages_back = True  # after a restore (_huge_pages_back); bench/ turns it off to measure without
        self._closing = threading.Event()

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Report a phase that completed (a failed one raises; its time is nobody's figure)."""
        t0 = time.monotonic()
        yield
        if self._on_phase is not None:
            self._on_phase(name, time.monotonic() - t0)

    def _check_stop_window(self, manifest: Manifest, took: float, freeze: float, what: str = "this checkpoint") -> None:
        """Say once when a checkpoint takes longer than a stop leaves for the final one: at start from the
        restored checkpoint's freeze (all that is known of it then), after each heartbeat from its own time."""
        window = self.settings.stop_window_seconds
        if window and took > window and not self._window_said:
            self._window_said = True
            log.warning("a stop will fall back to the last heartbeat checkpoint_id=%s: %s (seq %d, %d bytes) "
                        "took %.1f s (frozen %.2f s), more than the %.1f s a stop leaves for the final one "
                        "(stop_window_seconds); the work since the last heartbeat is redone after a stop",
                        self.checkpoint_id, what, manifest.seq, manifest.image_bytes, took, freeze, window)

    def checkpoint(self, workload: Workload, *, leave_running: bool = True, final: bool = False,
                   budget: float | None = None, rnd: Round | None = None) -> Manifest | None:
        """Take a checkpoint and store it; None when it was skipped as too large (see estimate.py), or
        because another supervisor took the checkpoint ID over (said once, by the lease). ``final``: a
        stop's, with ``budget`` seconds (None: as long as it takes) for a cooperative one. One part of a
        job checkpoints only in a round (``rnd``; part 0 opens one here): run/job.py."""
        if self.job is not None and (final or not leave_running):
            return None  # a stop's final checkpoint would be one part's alone (and must not wait on a round's lock)
        with self._lock:
            if self.job is None:
                return self._checkpoint(workload, leave_running, final, budget, None)
            if rnd is None:
                if not self.job.spec.coordinator:
                    return None
                rnd = self.job.open_round()
            known = self._known
            try:
                with joined(self.job, rnd):
                    self._job_known()
                    known = self._known
                    m = self._checkpoint(workload, leave_running, final, budget, rnd)
            except BaseException:
                self._known = known
                raise
            if m is None:
                self._known = known
                self.job.fail(rnd, f"part {self.job.spec.part} took no checkpoint (skipped: its log says why)")
            return m

    def _job_known(self) -> None:
        """A part other than 0 staged its last chunks before it knew whether they were committed: only a
        commit keeps them past gc's grace, so only then does the next round take them as stored (without a
        commit, the chunks it knew before that round, which a commit named)."""
        staged, self._staged = self._staged, None
        if staged is not None and self.job is not None and self.job.committed(staged[0], staged[1]):
            self._known = staged[1]

    def _checkpoint(self, workload: Workload, leave_running: bool, final: bool, budget: float | None,
                    rnd: Round | None) -> Manifest | None:
        if self.lease is not None and self.lease.fenced:
            return None  # no freeze either: this supervisor's checkpoints would never be used
        route = self._route(workload)
        if route == "cooperative":
            return self._cooperative(workload, final, budget, rnd)
        if self.engine is None:
            return None  # unprotected for now: _route said why
        if not self._pages_in(wait=not leave_running):
            return None
        pids = workload.pids()
        holding, why_not = self.gpu.dump_refusal(pids)
        if why_not and self.settings.mode == "auto" and self.coop is not None and self.coop.declared():
            self._say_route(f"this tree cannot be dumped ({why_not}): cooperative checkpoints, as the workload "
                            "declared it can write them")
            return self._cooperative(workload, final, budget, rnd)
        if why_not:  # the workload keeps running; said once, not every heartbeat
            self.gpu.say_once(f"heartbeat skipped checkpoint_id={self.checkpoint_id}: {why_not}; the workload "
                              "keeps running without a new checkpoint")
            return None
        estimate = estimate_checkpoint(pids, gpu=bool(holding))  # no /dev/nvidia* mapped: no GPU memory
        why = (too_large(estimate, self.settings.max_checkpoint_bytes, self.work_dir)
               or captured_too_large(pids, self.settings.max_captured_bytes))
        if why:
            self._skip(why)
            return None
        self._count += 1
        # Each dump gets its own folder: images, CRIU's log and the captured files, removed together.
        dump_dir = self.work_dir / f"dump-{self._tag}-{self._count}"
        dump_dir.mkdir(mode=0o700, parents=True)  # images and captured copies are process memory: root's eyes only
        rss = estimate.rss_bytes
        job, hold = self.job, None
        if rnd is not None and job is not None:
            job.wait_for(rnd)  # every part freezes at the round's appointed moment

            def hold() -> str | None:  # images written, tree frozen: until every part is
                assert job is not None and rnd is not None
                return job.hold(rnd)
        froze_at = time.time()
        started = time.monotonic()
        try:
            with self._phase("dump"):
                # CUDA state first moves into host memory (engine/cuda.py), then CRIU dumps it with the rest.
                with self.gpu.suspended(holding, leave_running=leave_running) as suspension:
                    failpoint("heartbeat.freeze", workload=workload.pid, work_dir=self.work_dir)
                    dump = self.engine.dump(workload.pid, dump_dir / "images", leave_running=leave_running,
                                            extra=workload.criu_dump_options(), hold=hold)
                    failpoint("heartbeat.dump", workload=workload.pid, work_dir=self.work_dir)
            grew = (dump_too_large(dump, self.settings.max_checkpoint_bytes)
                    or copies_too_large(dump, self.settings.max_captured_bytes))
            if grew and leave_running:  # the tree grew after its estimate: the limit still holds for the store
                shutil.rmtree(dump_dir, ignore_errors=True)
                self._skip(grew)
                return None
            if grew:  # a final checkpoint: the tree is gone, these images are all that is left of its work
                log.warning("final checkpoint checkpoint_id=%s: %s; stored anyway, the workload has stopped",
                            self.checkpoint_id, grew)
            gpu = self.gpu.state(suspension, estimate) if suspension is not None else None
            # The workload's CUDA work stops for the copy-out and the copy-back too: part of its freeze.
            freeze = dump.freeze_seconds + (gpu.checkpoint_seconds + gpu.resume_seconds if gpu else 0.0)
            meta = CheckpointMeta(
                checkpoint_id=self.checkpoint_id, node=self.node, engine_version=self.engine.version,
                process=ProcessInfo(pid=workload.pid, command=workload.command, cwd=workload.cwd,
                                    rss_bytes=rss, stdout_pipe=workload.stdout_pipe,
                                    stderr_pipe=workload.stderr_pipe),
                try_number=self.try_number, freeze_seconds=freeze, parent_seq=self.parent_seq, gpu=gpu,
                airflow=self.airflow, caller_uid=self.caller_uid,
                job_part=(job.part_block(rnd, _sockets(dump.image_dir), froze_at=froze_at)
                          if rnd is not None and job else None),
            )
            captured = [CapturedSource(p, c, m) for p, c, m in dump.captured]
            failpoint("heartbeat.capture", workload=workload.pid, work_dir=self.work_dir)
            saving = time.monotonic()
            with self._phase("save"):
                manifest = save_checkpoint(self.store, self.store_cfg, meta, dump.image_dir, captured,
                                           known_digests=self._known, compression=self.settings.compression,
                                           progress_mode=self.settings.progress, signing_key=self._key,
                                           before_commit=self.lease.confirm if self.lease else None,
                                           memo=self._memo, stage=self._stage(rnd))
            saved = time.monotonic() - saving  # the store's part alone: gc and the index come after
        except WriterFenced:
            shutil.rmtree(dump_dir, ignore_errors=True)
            return None  # taken over while this one was being saved: the lease has said so, once
        except BaseException:
            if not self.settings.keep_local:
                _drop_all_but_logs(dump_dir)
            raise
        else:
            if not self.settings.keep_local:
                shutil.rmtree(dump_dir, ignore_errors=True)
        more = ""
        if rnd is not None:
            if (committed := self._round_stored(rnd, manifest, f"froze {freeze:.3f} s", saved)) is None:
                return manifest
            manifest = committed
            assert manifest.job is not None
            more = (f"; job of {manifest.job.parts} parts committed, freeze skew "
                    f"{manifest.job.freeze_skew_seconds * 1000:.1f} ms, held {manifest.freeze_seconds:.3f} s at most")
        else:
            self._known = manifest.chunk_digests()
        self._check_stop_window(manifest, time.monotonic() - started, freeze)
        kept = prune_checkpoints(self.store, self.checkpoint_id, self.settings.keep_checkpoints, self.trusted)[0]
        failpoint("heartbeat.index", workload=workload.pid)
        index.record_checkpoint(self.store, manifest, kept)
        self._check_restorable(manifest)  # after the row: an index entry without checkpoints is dropped
        self._say_taken(manifest, f"froze {freeze:.3f} s", saved,
                        (f"; GPU {binary_size(estimate.gpu_bytes)} out in {gpu.checkpoint_seconds:.3f} s, back in "
                         f"{gpu.resume_seconds:.3f} s" if gpu else "") + more)
        return manifest

    def _stage(self, rnd: Round | None) -> tuple[int, Callable[[Manifest, bytes], None]] | None:
        """Where one part of a job puts its manifest instead of committing it (run/job.py)."""
        job = self.job
        if rnd is None or job is None:
            return None
        return rnd.seq, lambda m, data: job.stage(rnd, m, data)

    def _round_stored(self, rnd: Round, manifest: Manifest, held: str, saved: float) -> Manifest | None:
        """This part's checkpoint of a job's round, stored: a part other than 0 staged it (said here; None),
        part 0 commits every part's and returns the commit (raises JobRoundFailed). Only a commit makes this
        part's chunks known as stored (a part other than 0 learns of it at the next round: _job_known)."""
        assert self.job is not None
        if not self.job.spec.coordinator:
            self._staged = (rnd.seq, manifest.chunk_digests())
            self._say_taken(manifest, held, saved,
                            f"; part {self.job.spec.part} of {self.job.spec.parts}, staged for the job's commit")
            return None
        committed = self.job.commit(rnd, manifest, refusal=self.trust.refusal, key=self._key,
                                    before_commit=self.lease.confirm if self.lease else None, own_seconds=saved)
        self._known = manifest.chunk_digests()
        return committed

    def _route(self, workload: Workload) -> str:
        """How this heartbeat is taken: "transparent" or "cooperative" (mode = auto: transparent where CRIU
        runs here, else cooperative once the workload declared it answers; unprotected until then)."""
        mode = self.settings.mode
        if mode == "cooperative" or (mode == "auto" and self.engine is None and self.coop is not None
                                     and self.coop.declared()):
            if mode == "auto":
                self._say_route(f"CRIU cannot run here ({self.engine_why}): cooperative checkpoints, as the workload "
                                "declared it can write them")
            return "cooperative"
        if self.engine is None:
            self._say_route(f"no checkpoint: this task is unprotected: CRIU cannot run here ({self.engine_why}) and the "
                            "workload has not declared the cooperative contract (cedana_airflow.coop.listen(), or "
                            "create $CEDANA_CHECKPOINT_READY)", level=logging.WARNING)
        return "transparent"

    def _say_route(self, line: str, level: int = logging.INFO) -> None:
        if line != self._route_said:
            self._route_said = line
            log.log(level, "mode %s checkpoint_id=%s: %s", self.settings.mode, self.checkpoint_id, line)

    def _cooperative(self, workload: Workload, final: bool, budget: float | None,
                     rnd: Round | None = None) -> Manifest | None:
        """Ask the workload for its state, then store what it wrote as this ID's next checkpoint. A
        heartbeat's request is withdrawn when a stop comes (the stop asks again, within its window); a
        stop's leaves a third of its budget for the upload. One part of a job (``rnd``) asks at the round's
        appointed moment, with the round's seq as the request's number: its ranks agree on it with the
        ranks of the other nodes (coop.torch), and what it wrote is staged for part 0's commit."""
        assert self.coop is not None
        if rnd is not None and self.job is not None:
            self.job.wait_for(rnd)
        started = time.monotonic()
        if final:
            taken = self.coop.ask(workload, budget=None if budget is None else max(0.2, budget * 2 / 3))
        else:
            taken = self.coop.ask(workload, stop=self.stopping, n=rnd.seq if rnd is not None else None)
        if taken is None:  # the workload ended while asked: nothing left to protect
            return None
        if isinstance(taken, str):
            self.skipped += 1  # not a checkpoint: counted and shown like any skipped heartbeat
            log.warning("heartbeat skipped checkpoint_id=%s: %s; the workload keeps running without a new checkpoint "
                        "(skipped=%d)", self.checkpoint_id, taken, self.skipped)
            index.record_skip(self.store, self.checkpoint_id, taken)
            return None
        meta = CheckpointMeta(
            checkpoint_id=self.checkpoint_id, node=self.node, engine_version=__version__,
            process=ProcessInfo(pid=workload.pid, command=workload.command, cwd=workload.cwd, rss_bytes=0,
                                stdout_pipe="", stderr_pipe=""),
            try_number=self.try_number, freeze_seconds=taken.source.write_seconds, parent_seq=self.parent_seq,
            airflow=self.airflow, caller_uid=self.caller_uid,
            job_part=(self.job.part_block(rnd, froze_at=time.time() - taken.source.write_seconds)
                      if rnd is not None and self.job is not None else None))
        saving = time.monotonic()
        try:
            with self._phase("save"):
                manifest = save_checkpoint(self.store, self.store_cfg, meta, None, state=taken.source,
                                           known_digests=self._known, compression=self.settings.compression,
                                           progress_mode=self.settings.progress, signing_key=self._key,
                                           before_commit=self.lease.confirm if self.lease else None, memo=self._memo,
                                           stage=self._stage(rnd))
            saved = time.monotonic() - saving
        except WriterFenced:
            return None
        finally:
            if not self.settings.keep_local:  # (kept, it goes at the next request: run/cooperative.py)
                shutil.rmtree(taken.where, ignore_errors=True)
        wrote = (f"written by the workload in {taken.source.write_seconds:.3f} s ({taken.source.ranks} rank(s), "
                 f"{len(taken.source.files)} file(s), request {taken.source.request})")
        if rnd is not None:
            if (committed := self._round_stored(rnd, manifest, wrote, saved)) is None:
                return manifest
            manifest = committed
            assert manifest.job is not None
            wrote += f"; job of {manifest.job.parts} parts committed"
        else:
            self._known = manifest.chunk_digests()
        self._check_stop_window(manifest, time.monotonic() - started, taken.source.write_seconds)
        kept = prune_checkpoints(self.store, self.checkpoint_id, self.settings.keep_checkpoints, self.trusted)[0]
        index.record_checkpoint(self.store, manifest, kept)
        self._say_taken(manifest, wrote, saved)
        return manifest

    def _say_taken(self, m: Manifest, held: str, save_seconds: float, more: str = "") -> None:
        """A checkpoint's one line: what a reader weighs (how long the workload was held, what it cost the
        store). The ID was said when the run started: it goes with the record, for whoever must tell runs
        apart (the node agent's log, its callers' lines: agent/said.py)."""
        log.info("checkpoint seq=%d: %s; image %s, %s stored (%d of %d chunks new) in %.2f s%s", m.seq, held,
                 binary_size(m.image_bytes), binary_size(m.stored_bytes), m.new_chunks, len(m.chunk_refs()),
                 save_seconds, more, extra={"checkpoint_id": self.checkpoint_id})

    def _check_restorable(self, m: Manifest) -> None:
        """Say at the first checkpoint, not at the first restore, when a restore would refuse it: its
        captured files must lie under restore_roots when set, or the working directory, and never on the
        deny-list (captured.py). Once per supervisor, and recorded for `checkpoints`/`explain`: at the first
        checkpoint that captured files (a workload can open its files after its first heartbeat)."""
        if self._restorable_said:
            return
        roots = restore_roots(self.settings.restore_roots, m.process.cwd, signed=True)  # what we write is signed
        # The working directory is the restoring command's own on a retry (the same task), so only the
        # captured files are judged.
        # the restore's own deny-list (_restore_from), read on this node: the restoring one is alike
        denied = self._denied() if m.captured else None
        refused = {c.path: why for c in m.captured if (why := refusal(c.path, roots, denied)) is not None}
        self._restorable_said = bool(m.captured)  # nothing captured yet: a later checkpoint's files are judged
        if not refused:
            if not self._stale_warning_checked and index.read_entry(self.store, self.checkpoint_id).restore_warning:
                index.record_restore_warning(self.store, self.checkpoint_id, "")  # fixed since: say no more
            self._stale_warning_checked = True
            return
        # Only a file outside the roots is a setting away from restorable; the deny-list is not.
        dirs = sorted({os.path.dirname(path) for path, w in refused.items() if "outside the restore roots" in w})
        files = "; ".join(f"captured file {why}" for why in refused.values())
        fix = (f"set restore_roots (CEDANA_RESTORE_ROOTS={':'.join(dirs)}) on the restoring nodes" if dirs
               else "the workload must keep such files elsewhere")
        why = f"a restore would refuse this checkpoint: {files}. Fix: {fix}"
        # recorded before it is said: whoever reads the line (an operator, a test) finds it in `checkpoints` too
        index.record_restore_warning(self.store, self.checkpoint_id, why)
        log.warning("checkpoint_id=%s seq=%d: %s", self.checkpoint_id, m.seq, why)

    def _skip(self, why: str) -> None:
        """A heartbeat skipped as too large: counted, said once per checkpoint ID at WARNING (a heartbeat
        every minute must not flood the log), and recorded so that `checkpoints` can show it."""
        self.skipped += 1
        index.record_skip(self.store, self.checkpoint_id, why)  # recorded before it is said, as above
        (log.debug if self.skipped > 1 else log.warning)(
            "heartbeat skipped checkpoint_id=%s: %s; the workload keeps running without a new checkpoint "
            "(skipped=%d)", self.checkpoint_id, why, self.skipped)

    def _pages_in(self, *, wait: bool) -> bool:
        """Whether a lazily restored tree has all its memory (CRIU cannot dump one that has not). A
        heartbeat is skipped until then; a final checkpoint waits for it a while."""
        feed = self._feed
        if feed is None or not feed.streaming:
            return True
        if wait and feed.wait(60.0):
            return feed.failure is None
        log.info("heartbeat skipped checkpoint_id=%s: the restored checkpoint's memory is still streaming in",
                 self.checkpoint_id)
        return False

    def lazy_failure(self) -> str | None:
        """Why the lazy restore's pages stopped streaming in (its tree was killed), once; from then on
        restores are full ones, and a checkpoint with a bad chunk is refused."""
        feed = self._feed
        if feed is None or feed.failure is None:
            return None
        feed.wait(30.0)
        feed.close()
        self._feed = None
        self._lazy_off = f"a lazy restore failed before ({feed.failure})"
        if feed.corrupt:
            self._refused[feed.manifest.seq] = f"checkpoint {self.checkpoint_id} seq={feed.manifest.seq}: {feed.failure}"
        return feed.failure

    def pages_in_at(self, timeout: float = 600.0) -> float:
        """Wait until a lazy restore's pages are all in; when that was (time.monotonic()). For bench/."""
        feed = self._feed
        if feed is None:
            return time.monotonic()
        feed.wait(timeout)
        return feed.finished or time.monotonic()

    def close(self) -> None:
        """Let go of a lazy restore's daemon, page server and images (after its tree, never before)."""
        self._closing.set()
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    def _huge_pages_back(self, workload: Workload, feed: LazyFeed | None) -> None:
        """Give a restored tree the transparent huge pages a fresh one would hold (engine/thp.py): criu
        restore and a lazy restore's UFFDIO_COPY bring memory back in 4 KiB pages, khugepaged takes ten
        minutes a GiB, and until then each heartbeat's dump handles 512 times as many pages. In the
        background once every page is in (a lazy restore's last one: a VMA still registered with a
        userfaultfd is not touched), a step at a time under the heartbeat's lock: no dump runs
        meanwhile, and a heartbeat or a stop waits one step at most."""
        def stop() -> bool:
            return self._closing.is_set() or workload.poll() is not None

        def run() -> None:
            if feed is not None:
                feed.wait()
                if feed.failure is not None:
                    return
            if stop():
                return
            try:
                res = thp.collapse(workload.pids(), gate=lambda: self._lock, stop=stop)
            except Exception:  # noqa: BLE001 - best effort: the tree runs on as restored
                log.debug("huge pages back checkpoint_id=%s failed", self.checkpoint_id, exc_info=True)
                return
            if res.asked_bytes or res.why_not:
                notes = "".join(f"; {n}" for n in (res.refused and f"refused {res.refused}", res.why_not) if n)
                log.info("huge pages back checkpoint_id=%s: %d MiB asked in %.2f s, %d -> %d MiB in huge pages%s",
                         self.checkpoint_id, res.asked_bytes >> 20, res.seconds, res.huge_before >> 20,
                         res.huge_after >> 20, notes)

        threading.Thread(target=run, name="cedana-huge-pages", daemon=True).start()

    def restore_mode(self, m: Manifest) -> tuple[str, str]:
        """("lazy" or "full", why) for restoring ``m`` on this node."""
        if self.settings.restore_mode == "full":
            return "full", "restore_mode = full"
        if self._lazy_off:
            return "full", self._lazy_off
        if m.gpu is not None:
            return "full", "the checkpoint holds GPU state, which is restored in full"
        assert self.engine is not None
        ok, why = kernel_lazy_pages() or self.engine.lazy_pages  # the kernel asked directly: no CRIU process
        return ("lazy", why) if ok else ("full", f"this kernel cannot restore lazily ({why})")

    def restore(self, stdout: Sink | None = None, stderr: Sink | None = None, *, cwd: str | None = None) -> Restored:
        """Restore the newest usable checkpoint and supervise it.

        A checkpoint that fails verification, that would write outside this node's restore roots
        (``settings.restore_roots`` and ``cwd``, default ours: see captured.py), or that CRIU cannot
        restore here, is refused with a warning and the next older one is tried. A lazy restore that
        fails for any other reason (the lazy machinery's, not the checkpoint's) is first retried in
        full, with a warning. Raises
        CheckpointNotFound when there is none, and CorruptCheckpoint (with every reason) when none
        could be restored.
        """
        tl = self.timeline = Timeline()
        stdout, stderr = _FirstOutput.wrap(stdout, tl), _FirstOutput.wrap(stderr, tl)
        if stale := sweep(self.work_dir):
            log.warning("unmounted %d page file(s) a killed supervisor left under %s", stale, self.work_dir)
        failpoint("restore.lease", work_dir=self.work_dir)  # the runner holds the writer lease by now
        job_seq: int | None = None  # one part of a job: the seq it resumes, said down if it cannot
        try:
            with tl.span("manifests"):
                candidates = require_latest(self.store, self.checkpoint_id)
                if self.job is not None:  # this part of the newest committed seq, or nothing
                    job_seq = candidates[0].seq
                    candidates = [self.job.part_of(candidates[0], self.trust.refusal)]
            return self._restore_candidates(candidates, tl, stdout, stderr, cwd)
        except BaseException:
            if self.job is not None and job_seq is not None:
                self.job.down(job_seq)  # the other parts waiting at their gates give up now
            raise

    def _restore_candidates(self, candidates: list[Manifest], tl: Timeline, stdout: Sink | None,
                            stderr: Sink | None, cwd: str | None) -> Restored:
        """restore()'s work on its candidates, newest first."""
        skipped: list[str] = []
        for i, m in enumerate(candidates):
            failpoint("restore.manifest", work_dir=self.work_dir)
            with tl.span("checks"):  # signature, GPU, age
                why_not = self._refused.get(m.seq) or self._refusal(m)
            if why_not:  # each candidate, not just the newest: a fallback must not run forged or stale state
                skipped.append(why_not)
                log.warning("checkpoint refused checkpoint_id=%s seq=%d: %s", self.checkpoint_id, m.seq, why_not)
                continue
            # Only what a key of this node vouches for may put files back outside restore_roots and the cwd.
            roots = restore_roots(self.settings.restore_roots, cwd, signed=self._vouched(m))
            if m.is_cooperative:
                try:
                    workload = self._restore_cooperative(m, stdout, stderr)
                except CorruptCheckpoint as e:
                    skipped.append(str(e))
                    log.warning("checkpoint refused checkpoint_id=%s seq=%d: %s; %s", self.checkpoint_id, m.seq, e,
                                "falling back to the previous one" if i + 1 < len(candidates) else "no older checkpoint left")
                    continue
                self.parent_seq, self._known = m.seq, m.chunk_digests()
                self._go_on_as("cooperative", m)
                return Restored(workload, m, tuple(skipped), "cooperative", tl)
            with tl.span("mode"):  # the first time: can this kernel restore lazily (userfaultfd)?
                mode, why_mode = self.restore_mode(m)
            log.debug("restore mode checkpoint_id=%s seq=%d mode=%s: %s", self.checkpoint_id, m.seq, mode, why_mode)
            # what this checkpoint wrote anew: recently written memory, fetched ahead first when lazy
            hot = m.chunk_digests() - candidates[i + 1].chunk_digests() if i + 1 < len(candidates) else set()
            try:
                try:
                    workload, feed = self._attempt(m, mode, hot, stdout, stderr, roots)
                except (CorruptCheckpoint, RestoreFailed, OSError, ValueError, MemoryError) as e:
                    if isinstance(e, NodeInTheWay):  # the node's fault, not the checkpoint's: this try ends
                        raise
                    if mode != "lazy" or isinstance(e, (CorruptCheckpoint, NotRestorableHere)):
                        raise
                    # The lazy machinery failed (a page file, the daemon, a write), not the checkpoint,
                    # whose chunks all verified: the same checkpoint in full, before any older one.
                    log.warning("lazy restore failed checkpoint_id=%s seq=%d: %s; retried in full",
                                self.checkpoint_id, m.seq, _what(e))
                    mode = "full"
                    workload, feed = self._attempt(m, mode, hot, stdout, stderr, roots)
            except NodeInTheWay as e:
                log.warning("checkpoint not restorable on this node now checkpoint_id=%s seq=%d: %s", self.checkpoint_id,
                            m.seq, e)
                raise
            except (CorruptCheckpoint, RestoreFailed, OSError, ValueError, MemoryError) as e:
                # Whatever a fetched checkpoint makes fail here refuses it; only the store being down
                # (StoreUnavailable) is not the checkpoint's fault, and goes up.
                if not isinstance(e, (CorruptCheckpoint, RestoreFailed)):
                    e = CorruptCheckpoint(f"checkpoint {self.checkpoint_id} seq={m.seq} could not be prepared "
                                          f"({mode} restore): {_what(e)}")
                skipped.append(str(e))
                if isinstance(e, NotRestorableHere):  # older checkpoints need the same files: start fresh
                    log.warning("checkpoint not restorable on this node checkpoint_id=%s seq=%d: %s; no older "
                                "checkpoint is tried", self.checkpoint_id, m.seq, e)
                    break
                log.warning("checkpoint refused checkpoint_id=%s seq=%d: %s; %s", self.checkpoint_id, m.seq, e,
                            "falling back to the previous one" if i + 1 < len(candidates) else "no older checkpoint left")
                continue
            self._feed = feed
            if self.huge_pages_back:
                self._huge_pages_back(workload, feed)
            self._go_on_as("transparent", m)
            self.parent_seq = m.seq
            self._known = m.chunk_digests()
            self._check_stop_window(m, m.freeze_seconds, m.freeze_seconds, "the restored checkpoint, when it was taken,")
            return Restored(workload, m, tuple(skipped), mode, tl)
        raise CorruptCheckpoint(
            f"no checkpoint under checkpoint ID {self.checkpoint_id!r} could be restored "
            f"({'; '.join(skipped)}). Nothing was restored; start the workload fresh (run without --resume)."
        )

    def _attempt(self, m: Manifest, mode: str, hot: set[str], stdout: Sink | None, stderr: Sink | None,
                 roots: Sequence[PurePosixPath]) -> tuple[Workload, LazyFeed | None]:
        """Fetch ``m`` and restore it, lazily or in full: the workload, and its lazy feed if any.
        Whatever fails leaves only CRIU's logs behind (the error may name them)."""
        assert self.engine is not None  # _refusal refused a CRIU image where CRIU cannot run
        # images/ (with captured/ inside) plus CRIU's log and pidfile, removed together.
        restore_dir = self.work_dir / f"restore-{self._tag}-{m.seq}-{mode}"
        shutil.rmtree(restore_dir, ignore_errors=True)
        restore_dir.mkdir(mode=0o700, parents=True)  # the fetched images are process memory: root's eyes only
        feed = None
        stream = None
        self.timeline.facts["mode"] = mode  # before the tree can print: a lazy timeline is complete only with its pages in
        streamed = mode == "full" and self._stream_full()
        sparse = lazy_files(m) if mode == "lazy" else streamed_files(m) if streamed else frozenset()
        try:
            _room_for(m, sparse, restore_dir, MAX_CHUNK_FACTOR * self.store_cfg.chunk_avg_bytes)
            with self._phase("fetch"):
                with self.timeline.span("fetch"):  # the images fetched whole (all, in a plain full restore)
                    fetch_checkpoint(self.store, m, restore_dir / "images", self.settings.progress,
                                     max_chunk_bytes=MAX_CHUNK_FACTOR * self.store_cfg.chunk_avg_bytes,
                                     leave_sparse=sparse, reader=self.node)
                if mode == "lazy":
                    feed = LazyFeed(self.engine, self.store, m, restore_dir / "images", hot,
                                    keep_dir=self.settings.keep_local, via=self.settings.lazy_pages_via,
                                    timeline=self.timeline)
                    with self.timeline.span("fill"):
                        feed.fill()
                elif streamed:
                    stream = PageStream(self.store, m, restore_dir / "images", reader=self.node, timeline=self.timeline)
                    try:
                        with self.timeline.span("page_source_start"):
                            stream.start()
                    except OSError as e:  # no page files here after all: write the pages, as without
                        stream = None
                        log.warning("streamed restore unavailable checkpoint_id=%s seq=%d: %s; the pages are "
                                    "written to the work dir first", self.checkpoint_id, m.seq, e)
                        fetch_checkpoint(self.store, m, restore_dir / "images", self.settings.progress,
                                         max_chunk_bytes=MAX_CHUNK_FACTOR * self.store_cfg.chunk_avg_bytes,
                                         reader=self.node)
            try:
                workload = self._restore_from(restore_dir / "images", m, stdout, stderr, roots, feed)
            except RestoreFailed as e:
                err = stream.error if stream is not None else None  # the pages' fault, not CRIU's
                if isinstance(err, StoreUnavailable):  # not the checkpoint's: the try fails, no older one is tried
                    raise StoreUnavailable(str(err)) from e
                if err is not None:
                    raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id} seq={m.seq}: {err}") from e
                raise
            finally:
                if stream is not None:
                    stream.close()  # criu restore has returned: every page is in the tree, or it failed
        except BaseException:
            if feed is not None:
                feed.close(remove_dir=False)
            if not self.settings.keep_local:
                _drop_all_but_logs(restore_dir)  # its message may name CRIU's restore log: keep that
            raise
        if not self.settings.keep_local and feed is None:
            shutil.rmtree(restore_dir, ignore_errors=True)  # a lazy restore's goes when its pages are in
        return workload, feed

    def _stream_full(self) -> bool:
        """Whether a full restore streams its pages into CRIU (``full_restore_via``)."""
        if self.settings.full_restore_via == "write":
            return False
        ok, why = can_stream()
        if not ok:
            log.warning("full_restore_via = stream, but page files cannot be served here (%s): pages are written "
                        "to the work dir first", why)
        return ok

    def _refusal(self, m: Manifest) -> str | None:
        """Why a candidate is refused before any chunk is fetched: a bad signature, too old, GPU state
        this node cannot take, or a kind of checkpoint this run cannot restore."""
        if (problem := self.trust.refusal(m)) is not None:
            return f"checkpoint {self.checkpoint_id} seq={m.seq} is refused: {problem}"
        if (too_big := restore_refusal(m, self.settings)) is not None:  # before any chunk is fetched
            return too_big
        if m.is_cooperative and (self.coop is None or self._start is None):
            return (f"checkpoint {self.checkpoint_id} seq={m.seq} was written by the workload (cooperative), which "
                    "this caller cannot start")
        if not m.is_cooperative and self.engine is None:
            return (f"checkpoint {self.checkpoint_id} seq={m.seq} is a CRIU image and CRIU cannot run here "
                    f"({self.engine_why})")
        gpu = self.gpu.restore_refusal(m)
        if gpu is not None:
            return gpu
        limit = self.settings.max_restore_gap_seconds
        if limit is None:
            return None
        gap, beyond = limits_exceeded(m, datetime.now(timezone.utc), [AgeLimit("max_restore_gap", limit)])
        return f"seq {m.seq} is {gap:.0f} s old, beyond max_restore_gap = {limit:.0f} s" if beyond else None

    def _denied(self) -> DenyList:
        """This node's deny-list, with what this checkpointer holds: its work dir, store and CRIU."""
        return node_denied(self.settings, self.work_dir, getattr(self.store, "root", None),
                           self.engine and os.path.dirname(self.engine.binary.path))

    def trusted(self, m: Manifest) -> bool:
        """Whether this node would restore ``m``'s signature and owner (other checks come per restore)."""
        return self.trust.refusal(m) is None

    def _vouched(self, m: Manifest) -> bool:
        """Whether this node's own key signed ``m`` (said when it is an old key, or none under allow_unsigned).
        A legacy key verifies but does not vouch: it was 0.7.0's Variable, which others could read."""
        by = self.trust.signed_by(m)
        if by == "legacy":
            log.warning("checkpoint_id=%s seq=%d is signed with legacy key %s (legacy_key_file), which others may "
                        "have read: its captured files stay under restore_roots and the working directory. New "
                        "checkpoints are signed with node key %s; drop legacy_key_file once old runs are done",
                        self.checkpoint_id, m.seq, m.signature.key_id if m.signature else "?", self.node_key.key_id)
        elif by is None:
            log.warning("restoring unsigned checkpoint checkpoint_id=%s seq=%d (allow_unsigned = true): whoever can "
                        "write store %s chose what this node runs", self.checkpoint_id, m.seq, self.store.url)
        return by == "node"

    def check_owner(self) -> None:
        check_owner(self.store, self.checkpoint_id, self.trust)

    def _go_on_as(self, kind: str, m: Manifest) -> None:
        """After a restore, heartbeats go on the way the restored checkpoint was taken when the mode would
        not: a workload restarted from its own state answers requests (this run's, in its environment), and
        a tree CRIU restored still names the old run's request paths, so asking it would only time out."""
        mode = self.settings.mode
        if mode == kind or mode == "auto" and kind == "transparent":
            return
        self.settings = self.settings.model_copy(update={"mode": kind})
        log.info("restored checkpoint_id=%s seq=%d was taken %sly: this run's heartbeats are %s too (mode was %s)",
                 self.checkpoint_id, m.seq, kind, kind, mode)

    def _restore_cooperative(self, m: Manifest, stdout: Sink | None, stderr: Sink | None) -> Workload:
        """Put ``m``'s files back (each chunk verified) and start the command with CEDANA_RESTORE_DIR
        naming them: the workload resumes itself. A bad chunk refuses the checkpoint (CorruptCheckpoint)."""
        assert self.coop is not None and self._start is not None
        dest = self.coop.restore_dir(m.seq)
        tl = self.timeline
        tl.facts["mode"] = "cooperative"
        try:
            with self._phase("fetch"), tl.span("fetch"):
                fetch_checkpoint(self.store, m, dest, self.settings.progress,
                                 max_chunk_bytes=MAX_CHUNK_FACTOR * self.store_cfg.chunk_avg_bytes, reader=self.node)
        except OSError as e:  # a name this file system refuses, a full disk: not restorable here, try an older one
            shutil.rmtree(dest, ignore_errors=True)
            raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id} seq={m.seq}: its files could not be put back "
                                    f"here ({e})") from None
        self.coop.give(dest)  # the node agent's caller's, before its command starts
        with tl.span("start"):
            workload = self._start(m, dest, stdout, stderr)
        tl.mark("resumed", latest=True)
        return workload

    def _restore_from(self, dest: Path, m: Manifest, stdout: Sink | None, stderr: Sink | None,
                      roots: Sequence[PurePosixPath], feed: LazyFeed | None) -> Workload:
        node_rooted = self._restore_tree is not None and self._restore_tree.vet(dest, m)
        # Files go back as the tree's own user, never where the deny-list forbids (captured.py).
        try:
            creds = read_creds(dest) or NOBODY  # no pstree.img: CRIU refuses it first thing; until then, nobody
        except ValueError as e:
            raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id} seq={m.seq} is refused: {e}") from None
        denied = self._denied()
        # One part of a job: the traffic to the other parts is held back until every part is up (run/job.py).
        gate = self.job.gate(m.seq, to_job(_sockets(dest), self.job.peers)) if self.job is not None else None
        with CapturedFilesBack(m, dest / CAPTURED_DIR, roots, denied, creds) as files_back, \
                preflight(dest, m, roots, denied, creds, node_root_tree=node_rooted), \
                gate if gate is not None else contextlib.nullcontext():
            ensure_cwd(m, roots, denied, creds)
            try:
                prepare_sockets(dest, f"checkpoint {self.checkpoint_id} seq={m.seq}",
                                job_peers=self.job.peers if self.job is not None else frozenset())
            except ValueError as e:  # a files.img we cannot read: CRIU will judge it, as before
                log.debug("sockets not prepared checkpoint_id=%s seq=%d: %s", self.checkpoint_id, m.seq, e)
            become_subreaper()
            tl = self.timeline
            with self._phase("criu_restore"):
                if feed is not None:  # only now: every check of the checkpoint has passed
                    with tl.span("page_source_start"):
                        feed.start()
                failpoint("restore.criu", work_dir=self.work_dir)
                assert self.engine is not None
                pidfile = dest.with_name(dest.name + ".pid")
                with tl.span("criu_restore"):
                    if self._restore_tree is not None:  # supervised by its shim from the first instant
                        workload = self._restore_tree(self.engine, dest, m, pidfile)
                    else:
                        pid, out_r, err_r = self.engine.restore_piped(dest, m.process.stdout_pipe,
                                                                      m.process.stderr_pipe, pidfile=pidfile,
                                                                      lazy=feed is not None)
            tl.mark("resumed", latest=True)  # the tree runs (a fallback's later restore replaces it)
            tl.facts["criu"] = read_restore_stats(dest)
            adopting = time.monotonic()
            if self._restore_tree is None:
                # Supervised (watchdog on) before anything else can fail: a restored tree is never left alone.
                holds = feed.held_copies() if feed is not None else []
                try:
                    workload = Workload.adopt(pid, m.process.command, m.process.cwd, out_r, err_r, stdout, stderr,
                                              watchdog_holds=tuple(holds))
                finally:
                    for fd in holds:
                        os.close(fd)
            pid = workload.pid
            if feed is not None:
                feed.attach(pid)
            failpoint("restore.resume", workload=pid, work_dir=self.work_dir)
            seconds = self.gpu.resume(workload, m)  # a failure kills the tree and refuses the checkpoint
            if m.gpu is not None:
                log.info("gpu state restored checkpoint_id=%s seq=%d processes=%d seconds=%.3f",
                         self.checkpoint_id, m.seq, len(m.gpu.processes), seconds)
            files_back.keep()
            if gate is not None:
                with tl.span("job_parts_up"):
                    up = gate.open()
                if not up:  # its peers will not come: running on alone, it would wait on them for good
                    workload.kill()
                    raise NodeInTheWay(f"checkpoint {self.checkpoint_id} seq={m.seq}: not every part of the job resumed "
                                       f"from it within {RESTORE_WAIT_SECONDS:.0f} s, so this part gives its try up "
                                       "(a part's node down, or parts resuming different seqs?); the checkpoint "
                                       "stays the latest")
        tl.spans.append(("adopt", adopting - tl.t0, time.monotonic() - adopting))
        return workload


def _sockets(image_dir: Path) -> list[InetSk]:
    """The image's inet sockets; none where its files.img cannot be read (CRIU judges it, as before)."""
    try:
        return read_inet_sockets(image_dir)
    except ValueError:
        return []


class _FirstOutput:
    """A restored workload's stdout or stderr that marks its first write on the timeline."""

    def __init__(self, target: Sink, tl: Timeline) -> None:
        self.target, self.tl, self._seen = target, tl, False

    @classmethod
    def wrap(cls, target: Sink | None, tl: Timeline) -> Sink | None:
        return None if target is None else cls(target, tl)

    def write(self, data: bytes, /) -> int:
        if not self._seen and data:
            self._seen = True
            self.tl.mark("first_output")
        return self.target.write(data)

    def flush(self) -> None:
        self.target.flush()
