"""The store's key layout: the only code that spells a store key (docs/store-format.md, "Layout").

Keys are relative to the store's root, with ``/`` between parts on every backend (a ``file://``
store maps them to paths). Everything else asks here for a key or a listing prefix, so the layout,
a documented contract, changes in one place. Checkpoint IDs are validated before they reach a key::

    store.json                                   format version and chunker parameters
    chunks/<digest[:2]>/<digest>                 one chunk object per digest
    <checkpoint id>/<seq:010d>/manifest.json     one complete checkpoint
    <checkpoint id>/restores/<time>-<try>-<random>.json   restore history
    <checkpoint id>/rounds/<seq:010d>.json       a job's coordinated checkpoint under way (run/job.py)
    <checkpoint id>/rounds/<seq:010d>/<what>-<part>   its parts' marks and staged manifests
    index/<hex digit>.json                       the listing index, 16 shards
    leases/<checkpoint id>.json                  the writer lease of an ID
    locks/gc, locks/writer-<host>-<pid>-<random> the gc lock and writers' shared locks
    quarantine/<digest>.json                     a chunk set aside as bad or missing
    drills/<drill id>.json, drills/golden-<params>.txt   drill reports, the canary's golden digests
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

from ..ids import validate_checkpoint_id

__all__ = [
    "CHUNKS", "DRILLS", "GC_LOCK_KEY", "INDEX", "INDEX_SHARDS", "LEASES", "LOCKS", "MANIFEST_NAME", "PREFIXES",
    "QUARANTINE", "RESTORES", "STORE_CONFIG_KEY", "TEMP_PREFIX", "TOP_LEVEL_NAMES",
    "CAS_LOCK_PREFIX", "cas_lock_key", "checkpoint_prefix", "chunk_digest", "chunk_key", "drill_report_key", "golden_digest_key",
    "index_shard_key", "index_shard_keys", "is_cas_lock", "is_temp", "lease_key", "manifest_key", "parse_manifest_key",
    "quarantine_digest", "quarantine_key", "restore_record_key", "restores_prefix", "writer_lock_key",
    "ROUNDS", "round_key", "round_prefix", "rounds_prefix", "parse_round_key",
]

#: The store's root document.
STORE_CONFIG_KEY = "store.json"
#: Prefix of every chunk object.
CHUNKS = "chunks/"
#: Prefix of the listing index shards.
INDEX = "index/"
#: Prefix of the writer leases.
LEASES = "leases/"
#: Prefix of the gc lock and the writers' locks.
LOCKS = "locks/"
#: Prefix of the quarantine records.
QUARANTINE = "quarantine/"
#: Prefix of the drill reports and the canary's golden digests.
DRILLS = "drills/"
#: Every top-level folder the code writes (besides the checkpoint IDs' own).
PREFIXES = (CHUNKS, DRILLS, INDEX, LEASES, LOCKS, QUARANTINE)
#: Top-level names that are not checkpoint IDs: listing skips them (equal to ids.RESERVED_NAMES).
TOP_LEVEL_NAMES = frozenset({STORE_CONFIG_KEY, *(p.rstrip("/") for p in PREFIXES)})

#: A checkpoint's manifest file name, inside its seq folder.
MANIFEST_NAME = "manifest.json"
#: The restore history folder inside a checkpoint ID's folder.
RESTORES = "restores/"
#: Name prefix of a file store's temporary files (interrupted writes leave them; gc removes them).
TEMP_PREFIX = ".tmp-"
#: The exclusive garbage-collection lock.
GC_LOCK_KEY = f"{LOCKS}gc"
#: Number of listing index shards (an ID's shard is the first hex digit of its SHA-256).
INDEX_SHARDS = 16

_MANIFEST_KEY = re.compile(rf"(.+)/(\d{{10}})/{re.escape(MANIFEST_NAME)}")


def chunk_key(digest: str) -> str:
    """The chunk object of ``digest``, under a folder named by its first two hex digits."""
    return f"{CHUNKS}{digest[:2]}/{digest}"


def chunk_digest(key: str) -> str:
    """The digest a listed chunk key names (its last part)."""
    return key.rsplit("/", 1)[-1]


def is_temp(key: str) -> bool:
    """Whether ``key`` is a temporary file of an interrupted write, not an object."""
    return key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX)


def checkpoint_prefix(checkpoint_id: str) -> str:
    """Prefix of everything stored under one checkpoint ID (manifests, restore history)."""
    return f"{checkpoint_id}/"


def manifest_key(checkpoint_id: str, seq: int) -> str:
    """The manifest of checkpoint ``seq`` of ``checkpoint_id``: its commit point."""
    return f"{checkpoint_id}/{seq:010d}/{MANIFEST_NAME}"


def parse_manifest_key(key: str) -> tuple[str, int] | None:
    """(checkpoint ID, seq) of a manifest key, or None when ``key`` is not one."""
    m = _MANIFEST_KEY.fullmatch(key)
    return (m.group(1), int(m.group(2))) if m else None


def restores_prefix(checkpoint_id: str) -> str:
    """Prefix of the restore records of ``checkpoint_id``."""
    return f"{validate_checkpoint_id(checkpoint_id)}/{RESTORES}"


def restore_record_key(checkpoint_id: str, at: datetime, try_number: int, token: str) -> str:
    """One restore record: time first, so names sort by time; ``token`` keeps concurrent ones apart."""
    return f"{restores_prefix(checkpoint_id)}{at.strftime('%Y%m%dT%H%M%S.%fZ')}-{try_number}-{token}.json"


#: A job's rounds folder inside its checkpoint ID's folder: what its parts agree on while they checkpoint.
ROUNDS = "rounds/"
_ROUND_KEY = re.compile(r"(\d{10})\.json")


def rounds_prefix(checkpoint_id: str) -> str:
    """Prefix of a job's round documents (and, one level down, their parts' marks)."""
    return f"{validate_checkpoint_id(checkpoint_id)}/{ROUNDS}"


def round_key(checkpoint_id: str, seq: int) -> str:
    """The round that takes checkpoint ``seq`` of a job: opened by its coordinator, create-only."""
    return f"{rounds_prefix(checkpoint_id)}{seq:010d}.json"


def parse_round_key(checkpoint_id: str, key: str) -> int | None:
    """The seq a listed round document is for, or None when ``key`` is not one."""
    rest = key[len(rounds_prefix(checkpoint_id)):] if key.startswith(rounds_prefix(checkpoint_id)) else ""
    m = _ROUND_KEY.fullmatch(rest)
    return int(m.group(1)) if m else None


def round_prefix(checkpoint_id: str, seq: int) -> str:
    """Prefix of round ``seq``'s marks: ``frozen-<part>``, ``failed-<part>``, ``part-<part>.json`` (a part's
    staged manifest) and ``up-<attempt>-<part>`` (a part resumed from it)."""
    return f"{rounds_prefix(checkpoint_id)}{seq:010d}/"


def index_shard_key(checkpoint_id: str) -> str:
    """The listing index shard that holds ``checkpoint_id``'s entry."""
    return f"{INDEX}{hashlib.sha256(checkpoint_id.encode()).hexdigest()[0]}.json"


def index_shard_keys() -> list[str]:
    """Every listing index shard, in order."""
    return [f"{INDEX}{i:x}.json" for i in range(INDEX_SHARDS)]


#: Name prefix of a file store's compare-and-swap sidecar locks.
CAS_LOCK_PREFIX = ".lock-"


def cas_lock_key(key: str) -> str:
    """A file store's sidecar lock that queues the compare-and-swap writers of ``key`` (index, leases)."""
    folder, sep, name = key.rpartition("/")
    return f"{folder}{sep}{CAS_LOCK_PREFIX}{name}"


def is_cas_lock(key: str) -> bool:
    """Whether ``key`` is a file store's sidecar lock, not an object."""
    return key.rsplit("/", 1)[-1].startswith(CAS_LOCK_PREFIX)


def lease_key(checkpoint_id: str) -> str:
    """The writer lease of ``checkpoint_id``."""
    return f"{LEASES}{validate_checkpoint_id(checkpoint_id)}.json"


def writer_lock_key(host: str, pid: int, token: str) -> str:
    """One checkpoint writer's shared lock; ``token`` keeps two of one process apart."""
    return f"{LOCKS}writer-{host}-{pid}-{token}"


def quarantine_key(digest: str) -> str:
    """The quarantine record of ``digest``."""
    return f"{QUARANTINE}{digest}.json"


def quarantine_digest(key: str) -> str | None:
    """The digest a listed quarantine key records, or None when it is no record."""
    return key[len(QUARANTINE):-len(".json")] if key.endswith(".json") else None


def drill_report_key(drill_id: str) -> str:
    """The report of drill ``drill_id``."""
    return f"{DRILLS}{drill_id}.json"


def golden_digest_key(params: str) -> str:
    """The canary's uninterrupted digest for one parameter set (``params``: a hash of them)."""
    return f"{DRILLS}golden-{params}.txt"
