"""Checkpoints in and out of a store: chunking, dedup, verification, and the manifest commit point.

Write order (docs/store-format.md): every chunk first, the manifest last. A checkpoint whose
manifest is absent does not exist, so a writer killed at any point leaves the previous checkpoint
as the latest. Read order: manifests first, then chunks, each verified before its bytes are used.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .. import __version__
from ..config import default
from ..errors import CheckpointNotFound, CorruptCheckpoint, StoreError
from ..failpoints import failpoint
from ..format import chunking, layout, limits
from ..format.manifest import (CAPTURED_DIR, COOPERATIVE_ENGINE, MARKED_BLOCKS_VERSION, AirflowTask, CallerInfo,
                               CapturedFile, ChunkRef, CooperativeState, FileEntry, GpuState, JobPart, Manifest, ProcessInfo,
                               StateFile,
                               parse_manifest)
from ..format.selection import restore_order
from ..format.signing import sign
from ..ids import validate_checkpoint_id
from .base import Store, StoreConfig
from .locks import acquire_writer
from .progress import Progress
from .quarantine import heal_known, read_chunk

__all__ = ["CAPTURED_DIR", "CapturedSource", "CheckpointMeta", "StateSource", "fetch_checkpoint", "load_manifests", "read_manifest",
           "load_manifests_of", "require_latest", "save_checkpoint"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class CapturedSource:
    """A file copied while the workload was frozen: where it belongs, and where the copy is."""

    path: str
    copy: Path
    mode: int


@dataclass(frozen=True)
class StateSource:
    """A cooperative checkpoint as its workload left it (run/cooperative.py lists and checks it)."""

    files: tuple[tuple[str, Path, int], ...]  # (path relative to the state directory, the file, its mode bits)
    request: int
    ranks: int = 1
    write_seconds: float = 0.0
    verify_command: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointMeta:
    checkpoint_id: str
    node: str
    engine_version: str
    process: ProcessInfo
    try_number: int = 0
    freeze_seconds: float = 0.0
    parent_seq: int | None = None
    gpu: GpuState | None = None  # CUDA state the driver moved into the images (engine/cuda.py)
    airflow: AirflowTask | None = None  # the task instance that wrote it (the UI's permission filter)
    caller_uid: int | None = None  # the node agent's caller it was taken for (format 4's caller block)
    job_part: JobPart | None = None  # one part of a job's round (run/job.py): format 4, its block required


@dataclass
class _Writer:
    store: Store
    cfg: StoreConfig
    compression: str
    known: set[str]
    progress: Progress
    pool: ThreadPoolExecutor
    cut_pool: ThreadPoolExecutor  # cuts and digests a file's segments on every core
    check_store: bool  # ask before each upload (a first checkpoint into a store that holds chunks)
    memo: chunking.SegmentMemo | None  # segments cut at the previous heartbeat of the same writer
    stored_bytes: int = 0
    new_chunks: int = 0
    segments: int = 0
    recalled: int = 0  # segments the memo answered without cutting them again
    pending: deque[Future[int]] = field(default_factory=deque)

    def _put_if_missing(self, d: str, data: bytes) -> int:
        # The existence check runs in the pool too: on S3 it is a request, not a stat.
        if self.check_store and self.store.has_chunk(d):
            return -1
        blob = chunking.encode(data, self.compression)
        self.store.put_chunk(d, blob)
        failpoint("heartbeat.upload")
        return len(blob)

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            n = self.pending.popleft().result()
            if n >= 0:
                self.stored_bytes += n
                self.new_chunks += 1

    def add_file(self, path: Path) -> tuple[int, tuple[ChunkRef, ...]]:
        refs: list[ChunkRef] = []
        size = 0
        f = chunking.CutFile(path, self.cfg.chunk_avg_bytes, self.cut_pool, self.memo)
        for piece in f.pieces():
            d, n = piece.digest, piece.size
            refs.append(ChunkRef(digest=d, size=n))
            size += n
            if d not in self.known:  # only new chunks are copied out of the file's mapping
                self.known.add(d)
                self._drain(2 * self.store.parallelism)
                self.pending.append(self.pool.submit(self._put_if_missing, d, bytes(f.data(piece))))
            self.progress.advance(n)
        self.segments += f.segments
        self.recalled += f.recalled
        return size, tuple(refs)


def save_checkpoint(
    store: Store,
    cfg: StoreConfig,
    meta: CheckpointMeta,
    image_dir: Path | None,
    captured: Sequence[CapturedSource] = (),
    *,
    state: StateSource | None = None,
    known_digests: Iterable[str] = (),
    compression: str = default("compression"),
    progress_mode: str = "never",  # a library call is quiet unless its caller asks
    signing_key: bytes | None = None,
    before_commit: Callable[[], None] | None = None,
    memo: chunking.SegmentMemo | None = None,
    stage: tuple[int, Callable[[Manifest, bytes], None]] | None = None,
) -> Manifest:
    """Store an image directory (and captured files) as a new checkpoint; return its manifest.
    With ``state`` (and no ``image_dir``) it is a cooperative checkpoint: the files the workload wrote.

    ``known_digests`` are chunks known to be in the store already (from the previous manifest of
    this checkpoint ID), which saves an existence check per chunk. ``signing_key``: sign the
    manifest (format/signing.py). ``before_commit``: called right before the manifest is written;
    raising there abandons the checkpoint (the writer lease's last check, store/writer_lease.py).
    ``memo``: the same writer's memo at every heartbeat, so unchanged segments are not cut again.
    ``stage``: (seq, put) for one part of a job (run/job.py): the manifest gets that seq and goes to ``put``
    instead of its commit point; the job's coordinator commits every part's together.
    """
    validate_checkpoint_id(meta.checkpoint_id)
    lock = acquire_writer(store)  # garbage collection waits while any checkpoint is being written
    try:
        return _save(store, cfg, meta, image_dir, captured, state, known_digests, compression, progress_mode,
                     signing_key, before_commit, memo, stage)
    finally:
        lock.release(store)


def _save(store: Store, cfg: StoreConfig, meta: CheckpointMeta, image_dir: Path | None,
          captured: Sequence[CapturedSource], state: StateSource | None, known_digests: Iterable[str], compression: str,
          progress_mode: str, signing_key: bytes | None, before_commit: Callable[[], None] | None,
          memo: chunking.SegmentMemo | None, stage: tuple[int, Callable[[Manifest, bytes], None]] | None = None,
          ) -> Manifest:
    t0 = time.monotonic()
    image_files = sorted(p for p in image_dir.iterdir() if p.is_file()) if image_dir is not None else []
    state_files = state.files if state is not None else ()
    total = (sum(p.stat().st_size for p in image_files) + sum(c.copy.stat().st_size for c in captured)
             + sum(f.stat().st_size for _, f, _ in state_files))
    progress = Progress(f"checkpoint {meta.checkpoint_id}", total, progress_mode)
    with ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-put") as pool, \
            ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="cedana-cut") as cut_pool:
        known = set(known_digests)
        healed = heal_known(store, known) if known else set()
        if healed:  # set aside as bad by a reader: this checkpoint uploads them again from the workload's memory
            log.warning("re-uploading %d chunk(s) set aside as bad checkpoint_id=%s: %s", len(healed),
                        meta.checkpoint_id, ", ".join(sorted(healed)))
        # Only a first checkpoint asks "is it there?" per chunk (another checkpoint ID may share its
        # chunks), and into an empty store not even that: one listing answers for all. A heartbeat
        # knows the previous checkpoint's chunks; one it does not know is new bytes the workload just
        # wrote, so asking first would be a wasted request per chunk. A chunk stored twice, or by a
        # concurrent writer, is the same bytes: a missed dedup costs an upload, never correctness.
        check = not known and next(iter(store.list_objects(layout.CHUNKS, limit=1)), None) is not None
        if memo is not None:
            memo.roll()  # what the previous save saw (a failed one too: cuts depend on bytes, not on the store)
        w = _Writer(store, cfg, compression, known, progress, pool, cut_pool, check, memo)
        entries = []
        for p in image_files:
            size, refs = w.add_file(p)
            entries.append(FileEntry(name=p.name, size=size, chunks=refs))
            failpoint("heartbeat.chunk")
        caps = []
        for c in captured:
            size, refs = w.add_file(c.copy)
            caps.append(CapturedFile(path=c.path, size=size, mode=c.mode, chunks=refs))
        kept = []
        for rel, f, mode in state_files:
            size, refs = w.add_file(f)
            kept.append(StateFile(path=rel, size=size, mode=mode, chunks=refs))
        w._drain(0)
    coop = (CooperativeState(files=tuple(kept), request=state.request, ranks=state.ranks,
                             write_seconds=round(state.write_seconds, 6), verify_command=state.verify_command)
            if state is not None else None)
    progress.close()
    if stage is not None:
        seq = stage[0]
    else:
        seqs = store.list_seqs(meta.checkpoint_id)
        seq = (seqs[-1] if seqs else 0) + 1
    while True:
        # A cooperative checkpoint is format 4, its block required: a reader that predates it refuses it in
        # one line (upgrade) instead of handing an empty image set to CRIU.
        # A tree the node agent ran for a caller is format 4 too, for its caller block (not required: a reader
        # that predates it restores it as before; one that knows it keeps other uids off the ID).
        marked: dict[str, Any] = {"format_version": MARKED_BLOCKS_VERSION, "writer": f"cedana-airflow {__version__}",
                                  "required": ("cooperative",), "engine": COOPERATIVE_ENGINE, "cooperative": coop} if coop else (
            {"format_version": MARKED_BLOCKS_VERSION, "writer": f"cedana-airflow {__version__}"}
            if meta.caller_uid is not None else
            {"format_version": Manifest.version_for(signed=False, blocks=meta.gpu is not None or meta.airflow is not None)})
        if meta.caller_uid is not None:
            marked["caller"] = CallerInfo(uid=meta.caller_uid)
        if meta.job_part is not None:
            marked.update(format_version=MARKED_BLOCKS_VERSION, writer=f"cedana-airflow {__version__}",
                          required=(*marked.get("required", ()), "job_part"), job_part=meta.job_part)
        manifest = Manifest(
            **marked,
            gpu=meta.gpu,
            airflow=meta.airflow,
            checkpoint_id=meta.checkpoint_id,
            seq=seq,
            try_number=meta.try_number,
            node=meta.node,
            created_at=datetime.now(timezone.utc),
            engine_version=meta.engine_version,
            process=meta.process,
            files=tuple(entries),
            captured=tuple(caps),
            image_bytes=total,
            stored_bytes=w.stored_bytes,
            new_chunks=w.new_chunks,
            freeze_seconds=meta.freeze_seconds,
            parent_seq=meta.parent_seq,
        )
        if signing_key is not None:
            manifest = sign(manifest, signing_key)
        data = manifest.to_json()
        if problem := _over_limits(manifest, len(data)):  # what every reader would refuse is not worth writing
            raise StoreError(f"{problem}; not stored, as every reader would refuse it (docs/store-format.md, Limits)")
        if before_commit is not None:
            before_commit()
        failpoint("heartbeat.manifest")
        if stage is not None:  # one part of a job: its coordinator's commit makes the seq exist, or nothing does
            stage[1](manifest, data)
            break
        # The commit point: until this write succeeds the checkpoint does not exist.
        if store.put_manifest(meta.checkpoint_id, seq, data):
            break
        seq += 1  # another writer took this seq first; ours goes after it
    log.debug(
        "checkpoint saved checkpoint_id=%s seq=%d chunks=%d new=%d image_bytes=%d stored_bytes=%d seconds=%.2f "
        "segments=%d recalled=%d",
        meta.checkpoint_id, seq, len(manifest.chunk_refs()), w.new_chunks, total, w.stored_bytes, time.monotonic() - t0,
        w.segments, w.recalled,
    )
    return manifest


def _over_limits(m: Manifest, size: int = 0) -> str | None:
    """A reader's refusal of ``m`` by format/limits.py's node-independent caps (its JSON's ``size`` too)."""
    if size > limits.MAX_MANIFEST_BYTES:
        return (f"checkpoint {m.checkpoint_id} seq={m.seq} is refused: its manifest is {size} bytes, more than "
                f"the {limits.MAX_MANIFEST_BYTES} a reader accepts")
    return (limits.count_problem(m.checkpoint_id, m.seq, limits.manifest_counts(m))
            or limits.total_problem(m, limits.MAX_DECLARED_BYTES))


def load_manifests(store: Store, checkpoint_id: str) -> list[Manifest]:
    """Every readable complete checkpoint of an ID, newest first (see :func:`restore_order`).

    A manifest that does not parse is reported and skipped: it can never be restored. A store that
    cannot be read raises: a passing network fault must not make an older checkpoint "the latest".
    """
    return load_manifests_of(store, [checkpoint_id])[checkpoint_id]


def read_manifest(store: Store, checkpoint_id: str, seq: int) -> Manifest | None:
    """One stored manifest, or None (said in the log) where it does not parse or names another place: it
    can never be restored. A store that cannot be read raises."""
    try:
        m = parse_manifest(store.get_manifest(checkpoint_id, seq))
    except (ValidationError, ValueError, CorruptCheckpoint) as e:
        log.warning("manifest unreadable checkpoint_id=%s seq=%d: %s", checkpoint_id, seq, str(e).splitlines()[0])
        return None
    if m.checkpoint_id != checkpoint_id or m.seq != seq:
        log.warning("manifest misplaced checkpoint_id=%s seq=%d names %s/%d; skipped", checkpoint_id, seq,
                    m.checkpoint_id, m.seq)
        return None
    return m


def load_manifests_of(store: Store, checkpoint_ids: Sequence[str]) -> dict[str, list[Manifest]]:
    """:func:`load_manifests` for many IDs, reading the manifests ``store.parallelism`` at a time."""
    for cid in checkpoint_ids:
        validate_checkpoint_id(cid)
    with ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-list") as pool:
        keys = [(cid, seq) for cids in pool.map(lambda c: [(c, s) for s in store.list_seqs(c)], checkpoint_ids)
                for cid, seq in cids]
        found = list(pool.map(lambda key: read_manifest(store, *key), keys))
    out: dict[str, list[Manifest]] = {cid: [] for cid in checkpoint_ids}
    for m in found:
        if m is not None:
            out[m.checkpoint_id].append(m)
    return {cid: restore_order(ms) for cid, ms in out.items()}


def fetch_checkpoint(store: Store, manifest: Manifest, dest: Path, progress_mode: str = "never", *,
                     max_chunk_bytes: int | None = None, leave_sparse: frozenset[str] = frozenset(),
                     reader: str = "", max_total_bytes: int = limits.MAX_DECLARED_BYTES) -> None:
    """Download and verify every chunk of a checkpoint into ``dest`` (image files, then captured/).
    Image files named in ``leave_sparse`` are only created at their size, holes all through (a lazy
    restore fills what it needs of them). A bad chunk is set aside (store/quarantine.py) in the name
    of node ``reader``.

    Raises CorruptCheckpoint, leaving nothing usable in ``dest``, if any chunk is missing or wrong,
    or (with ``max_chunk_bytes``, the store's cap) declared longer than any chunk the store can hold;
    before touching ``dest``, if it is over format/limits.py's caps or declares more than ``max_total_bytes``.
    """
    # Manifests are refused over these when read; this is for one that was not (and the node's total).
    problem = _over_limits(manifest) or limits.total_problem(manifest, max_total_bytes)
    if problem:
        raise CorruptCheckpoint(problem)
    if max_chunk_bytes is not None:
        big = next((c for c in manifest.chunk_refs() if c.size > max_chunk_bytes), None)
        if big is not None:
            raise CorruptCheckpoint(
                f"checkpoint {manifest.checkpoint_id} seq={manifest.seq}: chunk {big.digest} declares {big.size} "
                f"bytes, more than any chunk of this store ({max_chunk_bytes}). Its manifest is not one we wrote")
    if dest.exists():
        shutil.rmtree(dest)
    # A cooperative checkpoint's files go straight into ``dest`` (the workload's CEDANA_RESTORE_DIR), in
    # folders made here: their paths are plain relative names (format/manifest.py), and nothing else is
    # in ``dest`` to follow.
    (dest if manifest.is_cooperative else dest / CAPTURED_DIR).mkdir(parents=True, mode=0o700)
    targets: list[tuple[Path, int, tuple[ChunkRef, ...]]] = [
        (dest / f.name, f.size, () if f.name in leave_sparse else f.chunks) for f in manifest.files]
    targets += [(dest / CAPTURED_DIR / str(i), c.size, c.chunks) for i, c in enumerate(manifest.captured)]
    state = manifest.cooperative.files if manifest.cooperative is not None else ()
    targets += [(dest / f.path, f.size, f.chunks) for f in state]
    modes = {dest / f.path: f.mode for f in state}
    total = sum(c.size for _, _, refs in targets for c in refs)
    progress = Progress(f"restore {manifest.checkpoint_id}#{manifest.seq}", total, progress_mode)
    # A file is opened per chunk written, not held open for the whole fetch: a state of thousands of
    # files must not run out of descriptors.
    try:
        for path, size, refs in targets:
            if path.parent != dest:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                if path in modes:
                    os.fchmod(fd, modes[path] | 0o600)  # the workload's bits, and always readable and writable by it
                os.ftruncate(fd, size)
            finally:
                os.close(fd)

        def jobs() -> Iterator[tuple[Path, int, ChunkRef]]:
            for path, _, refs in targets:
                off = 0
                for ref in refs:
                    yield path, off, ref
                    off += ref.size

        def get(job: tuple[Path, int, ChunkRef]) -> None:
            path, off, ref = job
            failpoint("restore.chunks")
            raw = read_chunk(store, ref.digest, ref.size, reader)
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.pwrite(fd, raw, off)
            finally:
                os.close(fd)
            progress.advance(ref.size)

        # A few jobs per worker in flight, not a future per ref (Executor.map submits them all): a
        # chunk named a million times costs a million gets, in memory only one at a time per worker.
        with ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-get") as pool:
            pending: deque[Future[None]] = deque()
            try:
                for job in jobs():
                    pending.append(pool.submit(get, job))
                    if len(pending) > 2 * store.parallelism:
                        pending.popleft().result()
                while pending:
                    pending.popleft().result()
            except BaseException:
                for f in pending:
                    f.cancel()
                raise
    except CorruptCheckpoint as e:
        shutil.rmtree(dest, ignore_errors=True)
        raise CorruptCheckpoint(f"checkpoint {manifest.checkpoint_id} seq={manifest.seq}: {e}") from None
    finally:
        progress.close()


def require_latest(store: Store, checkpoint_id: str) -> list[Manifest]:
    manifests = load_manifests(store, checkpoint_id)
    if not manifests:
        raise CheckpointNotFound(
            f"no complete checkpoint under checkpoint ID {checkpoint_id!r} in {store.url}. "
            "Check --id and --store, or start the workload with 'cedana-airflow run'."
        )
    return manifests
