"""The manifest: the JSON document that describes one checkpoint and makes it exist.

A checkpoint is complete once its manifest is written (last, atomically). The manifest names every
chunk by digest, so a restore can verify each byte it uses. See docs/store-format.md for the fields.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..errors import CheckpointIdError, CorruptCheckpoint, UnknownRequiredBlock
from ..ids import validate_checkpoint_id
from . import limits

__all__ = [
    "MANIFEST_FORMAT_VERSION",
    "ChunkRef",
    "FileEntry",
    "CapturedFile",
    "ProcessInfo",
    "AirflowTask",
    "CallerInfo",
    "GpuProcess",
    "GpuState",
    "StateFile",
    "CooperativeState",
    "COOPERATIVE_ENGINE",
    "JOB_ENGINE",
    "JobMember",
    "JobPart",
    "JobState",
    "MAX_JOB_PARTS",
    "Manifest",
    "MARKED_BLOCKS_VERSION",
    "parse_manifest",
]

MANIFEST_FORMAT_VERSION: Literal[1] = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: The folder of a fetched image set where captured files land: no image file may take its name.
CAPTURED_DIR = "captured"


class ChunkRef(_Frozen):
    """One chunk of a file: its digest (hex BLAKE3 of the raw bytes) and raw length."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


def _chunks_add_up(size: int, chunks: tuple[ChunkRef, ...], what: str) -> None:
    # A file shorter than its size would be zero-filled by the restore: never restore a gap.
    if sum(c.size for c in chunks) != size:
        raise ValueError(f"{what}: chunks add up to {sum(c.size for c in chunks)} bytes, not its size {size}")


class FileEntry(_Frozen):
    """One file of the CRIU image set, relative to the image directory."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    size: int = Field(ge=0)
    chunks: tuple[ChunkRef, ...]

    @model_validator(mode="after")
    def _complete(self) -> FileEntry:
        if self.name == CAPTURED_DIR:
            raise ValueError(f"image file name {CAPTURED_DIR!r} is reserved: captured files are fetched there")
        _chunks_add_up(self.size, self.chunks, f"image file {self.name}")
        return self


class CapturedFile(_Frozen):
    """A regular file the workload held open for writing, copied while the tree was frozen.

    CRIU records each open file's size and refuses a restore when it differs ("bad size"), so the
    restore writes this content back at ``path`` before calling ``criu restore``.
    """

    path: str = Field(description="Absolute path on the node that took the checkpoint.")
    size: int = Field(ge=0)
    mode: int = Field(ge=0, le=0o777, description="Permission bits only: no setuid/setgid/sticky.")
    chunks: tuple[ChunkRef, ...]

    @model_validator(mode="after")
    def _safe(self) -> CapturedFile:
        if not self.path.startswith("/") or os.path.normpath(self.path) != self.path or "\0" in self.path:
            raise ValueError(f"captured path {self.path!r} must be absolute and normalised")
        _chunks_add_up(self.size, self.chunks, f"captured file {self.path}")
        return self


#: The manifest's ``engine`` for a checkpoint the workload wrote itself.
COOPERATIVE_ENGINE = "cooperative"


class StateFile(_Frozen):
    """One file of a cooperative checkpoint: written by the workload into CEDANA_CHECKPOINT_DIR."""

    path: str = Field(min_length=1, max_length=4096, description="Relative to the state directory, '/'-separated.")
    size: int = Field(ge=0)
    mode: int = Field(ge=0, le=0o777, description="Permission bits only.")
    chunks: tuple[ChunkRef, ...]

    @model_validator(mode="after")
    def _complete(self) -> StateFile:
        # Relative and normalised, every part a plain name: a restore writes only below the folder it made.
        parts = self.path.split("/")
        if any(p in ("", ".", "..") or len(p) > 255 or any(ord(c) < 32 for c in p) for p in parts):
            raise ValueError(f"state file {self.path!r} is not a plain relative path")
        _chunks_add_up(self.size, self.chunks, f"state file {self.path}")
        return self


class CooperativeState(_Frozen):
    """Version 4+, required: the workload wrote this checkpoint itself (run/cooperative.py). A restore
    puts ``files`` back under a fresh directory named in CEDANA_RESTORE_DIR and starts the command;
    there is no CRIU image (``files`` of the manifest is empty)."""

    files: tuple[StateFile, ...]
    request: int = Field(ge=1, description="Which request of its supervisor it answered (1, 2, ...).")
    ranks: int = Field(ge=1, default=1, description="Processes that wrote a part (their DONE markers).")
    write_seconds: float = Field(ge=0, default=0.0, description="From the request to COMPLETE.")
    verify_command: tuple[str, ...] = Field(default=(), description="What the verify drill runs on the files "
                                            "(cooperative_verify_command), if anything.")

    @model_validator(mode="after")
    def _distinct(self) -> CooperativeState:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("cooperative state lists a file twice")
        prefixes = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
        if prefixes & set(paths):
            raise ValueError("cooperative state lists a path both as a file and as a directory")
        return self


class ProcessInfo(_Frozen):
    """What was running: enough to explain a checkpoint and to wire a restore."""

    pid: int = Field(description="Host PID of the workload's root (the init of its PID namespace).")
    command: tuple[str, ...]
    cwd: str
    rss_bytes: int = Field(ge=0, default=0)
    stdout_pipe: str = Field(description="CRIU's name of the stdout pipe, e.g. 'pipe:[1234]', for --inherit-fd.")
    stderr_pipe: str


class Signature(_Frozen):
    """Who wrote a manifest: an HMAC-SHA256 over its canonical bytes (format/signing.py) and the ID of
    the key, so a node with another key can say so instead of calling the manifest forged."""

    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    hmac: str = Field(pattern=r"^[0-9a-f]{64}$")


class GpuProcess(_Frozen):
    ns_pid: int = Field(ge=1, description="Its pid inside the workload's PID namespace (what a restore brings back).")
    memory_bytes: int = Field(ge=0, default=0, description="GPU memory it held, moved into its host memory (NVML).")


class GpuState(_Frozen):
    """CUDA state moved into host memory by the driver before the dump (engine/cuda.py, docs/gpu.md).
    A restore needs the driver's checkpoint API and the same GPU models, in the same order."""

    driver_version: str = Field(description="The kernel module's version, e.g. '580.65.06'.")
    cuda_api_version: int = Field(ge=0, description="cuDriverGetVersion, e.g. 13000.")
    gpus: tuple[str, ...] = Field(description="The node's GPU models, in index order.")
    processes: tuple[GpuProcess, ...] = Field(min_length=1)
    checkpoint_seconds: float = Field(ge=0, description="Lock and copy-out, before CRIU froze the tree.")
    resume_seconds: float = Field(ge=0, default=0.0, description="Copy-back and unlock, after the dump.")


class AirflowTask(_Frozen):
    """Which Airflow task instance wrote a checkpoint: what the UI filters by DAG permission. The try
    is the manifest's ``try_number``."""

    dag_id: str = Field(min_length=1, max_length=250)
    task_id: str = Field(min_length=1, max_length=250)
    run_id: str = Field(min_length=1, max_length=250)
    map_index: int = Field(ge=-1, default=-1)


class CallerInfo(_Frozen):
    """Whom the node agent ran the tree for (format 4+, written only through the agent): a caller other
    than root may write and restore only under IDs whose newest checkpoint carries its own uid."""

    uid: int = Field(ge=0, description="The caller's uid, from the kernel (SO_PEERCRED), never its word.")


#: The manifest's ``engine`` for a job's commit: each part's own manifest is inside it (``job``).
JOB_ENGINE = "job"
#: The most parts one job's checkpoint holds (a reader parses each part's manifest on its own).
MAX_JOB_PARTS = 1024


class JobPart(_Frozen):
    """Version 4+, required: this checkpoint is one part of a job's round (run/job.py), never a checkpoint on
    its own. Inside the part's own signed manifest, so that what a restore acts on (which part it is, whom
    its connections go to) is what the part's node wrote, not what a store writer put beside it."""

    part: int = Field(ge=0, lt=MAX_JOB_PARTS)
    parts: int = Field(ge=2, le=MAX_JOB_PARTS)
    token: str = Field(pattern=r"^[0-9a-f]{32}$", description="The round's: every part of one commit names it.")
    froze_after_seconds: float = Field(default=0.0, ge=-86400, le=86400, description="When its freeze (or its "
                                       "request) began, after the round's appointed moment (its node's clock).")
    endpoints: tuple[tuple[str, int], ...] = Field(default=(), max_length=65536, description="The (address, port) "
                                                   "of each of the part's TCP sockets, listeners and connections: "
                                                   "another part's connection to one of them is the job's own.")

    @field_validator("endpoints")
    @classmethod
    def _addresses(cls, v: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
        for addr, port in v:
            if str(ipaddress.ip_address(addr)) != addr:  # ValueError: not an address (it reaches firewall rules)
                raise ValueError(f"endpoint address {addr!r} is not in its plain form")
            if not 0 <= port <= 65535:
                raise ValueError(f"port {port} of {addr} is out of range")
        return v


class JobMember(_Frozen):
    """One part of a job that spans nodes, in its commit: its own manifest, signed by its own node (with
    its ``job_part`` block), and when it froze."""

    part: int = Field(ge=0, lt=MAX_JOB_PARTS)
    node: str = Field(pattern=r"^[^\s/]{1,253}$")
    froze_after_seconds: float = Field(description="When its freeze began, after the round's appointed time "
                                       "(the node's clock: the skew of clocks is in it).")
    held_seconds: float = Field(ge=0, description="How long it stayed frozen: its dump and the wait for the others.")
    manifest: dict[str, Any] = Field(description="The part's own manifest document (format/manifest.py).")


class JobState(_Frozen):
    """Version 4+, required: the commit of a job's checkpoint. The seq exists only once every part's
    images are stored and named here; a reader that predates it refuses it (upgrade) rather than
    restoring one part as if it were the whole."""

    parts: int = Field(ge=2, le=MAX_JOB_PARTS)
    members: tuple[JobMember, ...]
    freeze_skew_seconds: float = Field(ge=0, description="From the first part's freeze to the last one's.")
    _parsed: dict[int, Manifest] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _every_part_once(self) -> JobState:
        if sorted(m.part for m in self.members) != list(range(self.parts)):
            raise ValueError(f"a job of {self.parts} parts names each part once, 0 to {self.parts - 1}")
        return self

    def member(self, part: int) -> Manifest:
        """Part ``part``'s own manifest (parsed once); ValueError where it does not parse."""
        if part not in self._parsed:
            doc = next(m.manifest for m in self.members if m.part == part)
            self._parsed[part] = parse_manifest(json.dumps(doc))
        return self._parsed[part]


#: Version 4 and later mark what a reader must understand (parse_manifest; docs/store-format.md,
#: "Forward compatibility"): every later version keeps that rule.
MARKED_BLOCKS_VERSION = 4


class Manifest(_Frozen):
    # 1: unsigned. 2: the same fields plus ``signature`` (only signed manifests are written as 2, so
    # readers that predate signing still read every unsigned one). 3: holds ``gpu`` (CUDA state)
    # and/or ``airflow`` (the task that wrote it), signed or not: readers that predate it skip it.
    # 4 and later: ``writer`` and ``required``, and any blocks; one this reader does not know is
    # skipped unless ``required`` names it (parse_manifest).
    format_version: int = Field(default=MANIFEST_FORMAT_VERSION, ge=1, strict=True)
    checkpoint_id: str
    seq: int = Field(ge=1, description="1, 2, 3 ... within a checkpoint ID; the newest complete one restores.")
    try_number: int = Field(ge=0, default=0, description="Which try of the task took it (0 outside Airflow).")
    node: str
    created_at: datetime
    engine: str = "criu"
    engine_version: str
    process: ProcessInfo
    files: tuple[FileEntry, ...]
    captured: tuple[CapturedFile, ...] = ()
    image_bytes: int = Field(ge=0, description="Bytes of the CRIU image set plus captured files.")
    stored_bytes: int = Field(ge=0, description="Bytes this checkpoint added to the store (new chunks only).")
    new_chunks: int = Field(ge=0, default=0)
    freeze_seconds: float = Field(ge=0, default=0.0, description="How long the workload was frozen.")
    parent_seq: int | None = Field(default=None, description="The checkpoint this one was restored from, if any.")
    signature: Signature | None = Field(default=None, description="Present when the writer had a signing key.")
    gpu: GpuState | None = Field(default=None, description="Present when the tree held CUDA state (version 3).")
    airflow: AirflowTask | None = Field(default=None, description="Present when an Airflow task wrote it (version 3).")
    cooperative: CooperativeState | None = Field(default=None, description="Version 4+, and then required: the "
                                                 "workload wrote this checkpoint itself (engine 'cooperative').")
    writer: str | None = Field(default=None, description="Version 4+: what wrote it, e.g. 'cedana-airflow 0.6.0'.")
    caller: CallerInfo | None = Field(default=None, description="Version 4+ (0.8.2): the node agent's caller it "
                                      "was taken for; absent: a supervisor that ran as itself.")
    job: JobState | None = Field(default=None, description="Version 4+ (0.12.0), and then required: the commit of "
                                 "a job's parts on several nodes (engine 'job'), each part's manifest inside.")
    job_part: JobPart | None = Field(default=None, description="Version 4+ (0.12.0), and then required: one part "
                                     "of a job's commit, never restored on its own.")
    required: tuple[str, ...] = Field(default=(), description="Version 4+: blocks a reader must understand to "
                                      "restore it; any other block may be skipped by a reader that does not know it.")
    #: Version 4+: blocks of a later version this reader skipped (kept: a signature covers them too).
    _unknown_blocks: dict[str, object] = PrivateAttr(default_factory=dict)

    @field_validator("checkpoint_id")
    @classmethod
    def _id(cls, v: str) -> str:
        try:
            return validate_checkpoint_id(v)
        except CheckpointIdError as e:  # a validation error, so that readers skip the manifest like any bad one
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _version_says_what_is_in_it(self) -> Manifest:
        if self.format_version >= MARKED_BLOCKS_VERSION:
            if not self.writer:
                raise ValueError(f"format_version {self.format_version} names its writer")
            if (self.cooperative is not None) != (self.engine == COOPERATIVE_ENGINE):
                raise ValueError(f"a cooperative block goes with engine {COOPERATIVE_ENGINE!r}, and only there")
            if (self.job is not None) != (self.engine == JOB_ENGINE):
                raise ValueError(f"a job block goes with engine {JOB_ENGINE!r}, and only there")
            if self.job_part is not None and ("job_part" not in self.required or self.job is not None):
                raise ValueError("a job's part requires its block, and is no commit itself")
            if self.job is not None and ("job" not in self.required or self.files or self.captured
                                         or self.gpu is not None or self.cooperative is not None):
                raise ValueError("a job's commit requires its block and holds its parts only inside it")
            if self.cooperative is not None and ("cooperative" not in self.required or self.files or self.captured
                                                 or self.gpu is not None):
                raise ValueError("a cooperative checkpoint requires its block and has no image files, captured "
                                 "files or GPU state")
            return self
        if self.job is not None or self.job_part is not None:
            raise ValueError(f"a job or job_part block goes with format_version {MARKED_BLOCKS_VERSION} and later")
        if self.cooperative is not None or self.caller is not None:
            raise ValueError(f"a cooperative or caller block goes with format_version {MARKED_BLOCKS_VERSION} and later")
        if self.writer is not None or self.required:
            raise ValueError(f"writer and required go with format_version {MARKED_BLOCKS_VERSION} and later")
        if (self.format_version == 3) != self.has_blocks():
            raise ValueError("a gpu or airflow block goes with format_version 3, and only there")
        if self.format_version == 2 and self.signature is None or self.format_version == 1 and self.signature:
            raise ValueError("a signature goes with format_version 2 (3 with a gpu block), and only there")
        return self

    @staticmethod
    def version_for(*, signed: bool, blocks: bool) -> Literal[1, 2, 3]:
        """The version a manifest is written as: ``blocks`` when it has a gpu or an airflow block."""
        return 3 if blocks else 2 if signed else 1

    def has_blocks(self) -> bool:
        return self.gpu is not None or self.airflow is not None

    def to_json(self) -> bytes:
        """The stored document: absent blocks have no key at all (version 1 readers forbid unknown fields);
        blocks of a later version that this reader skipped are written back as they were."""
        if self._unknown_blocks:
            doc = {**self._unknown_blocks, **self.model_dump(mode="json", exclude=self.absent_blocks())}
            return json.dumps(doc, indent=1).encode()
        return self.model_dump_json(indent=1, exclude=self.absent_blocks()).encode()

    def absent_blocks(self) -> set[str]:
        """Keys the stored document does not have (versions before 4 have no writer or required)."""
        absent = {k for k in ("signature", "gpu", "airflow", "cooperative", "caller", "job", "job_part")
                  if getattr(self, k) is None}
        return absent | ({"writer", "required"} if self.format_version < MARKED_BLOCKS_VERSION else set())

    @property
    def unknown_blocks(self) -> dict[str, object]:
        """Blocks of a later version that this reader skipped, as written."""
        return dict(self._unknown_blocks)

    @model_validator(mode="after")
    def _distinct(self) -> Manifest:
        names = [f.name for f in self.files]
        paths = [c.path for c in self.captured]
        if len(set(names)) != len(names) or len(set(paths)) != len(paths):
            raise ValueError("manifest lists a file twice")
        return self

    @field_validator("created_at")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        return v if v.tzinfo else v.replace(tzinfo=timezone.utc)

    @property
    def is_cooperative(self) -> bool:
        return self.cooperative is not None

    @property
    def is_job(self) -> bool:
        return self.job is not None

    def chunk_refs(self) -> list[ChunkRef]:
        """Every chunk it names, in file order: image files, captured files, state files; a job's commit,
        every part's (a part whose manifest does not parse names none: it can never be restored)."""
        if self.job is not None:
            out: list[ChunkRef] = []
            for member in self.job.members:
                with contextlib.suppress(ValueError, CorruptCheckpoint):
                    out += self.job.member(member.part).chunk_refs()
            return out
        state = self.cooperative.files if self.cooperative is not None else ()
        return [c for group in (self.files, self.captured, state) for f in group for c in f.chunks]

    def chunk_digests(self) -> set[str]:
        return {c.digest for c in self.chunk_refs()}


_FIELDS = frozenset(Manifest.model_fields)


def parse_manifest(raw: bytes | str) -> Manifest:
    """A stored manifest, read by this version's rules for every format version (docs/store-format.md,
    "Forward compatibility"): from version 4 on, a top-level block this reader does not know is skipped
    unless the manifest's ``required`` names it; then the manifest is refused in one line naming the
    block and its writer. Raises ValueError (pydantic's included) for a manifest that does not parse,
    and CorruptCheckpoint for one over a count of format/limits.py."""
    try:
        doc = json.loads(raw)
    except RecursionError:  # a nesting bomb: not a ValueError, and would escape every reader's handler
        raise ValueError("a manifest nests deeper than a reader parses") from None
    if not isinstance(doc, dict):
        raise ValueError("a manifest is a JSON object")
    # Counted on the JSON: validation would build an object per entry first.
    problem = limits.count_problem(doc.get("checkpoint_id"), doc.get("seq"), limits.doc_counts(doc))
    if problem:
        raise CorruptCheckpoint(problem)
    version = doc.get("format_version")
    unknown: dict[str, object] = {}
    if isinstance(version, int) and not isinstance(version, bool) and version >= MARKED_BLOCKS_VERSION:
        required = doc.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("required is a list of block names")
        unknown = {k: v for k, v in doc.items() if k not in _FIELDS}
        # kept as objects (the signature covers them): their size is bounded, not only the manifest's
        if unknown and len(json.dumps(unknown)) > limits.MAX_UNKNOWN_BLOCK_BYTES:
            raise CorruptCheckpoint(f"checkpoint {doc.get('checkpoint_id')} seq {doc.get('seq')} is refused: blocks "
                                    f"this reader does not know take more than {limits.MAX_UNKNOWN_BLOCK_BYTES} bytes")
        needed = [k for k in required if k not in _FIELDS]
        if needed:
            raise UnknownRequiredBlock(
                f"checkpoint {doc.get('checkpoint_id')} seq {doc.get('seq')} needs block {needed[0]!r}, written by "
                f"{doc.get('writer') or 'an unnamed writer'} (manifest format {version}), which this cedana-airflow "
                f"({_own_version()}) does not know: upgrade cedana-airflow on this node to restore it")
        doc = {k: v for k, v in doc.items() if k in _FIELDS}
    m = Manifest.model_validate(doc)
    m._unknown_blocks = unknown
    return m


def _own_version() -> str:
    from .. import __version__

    return __version__
