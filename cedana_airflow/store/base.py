"""The store interface: what every backend (file://, s3://) provides, and the layout they share.

Backends move bytes under keys; everything about checkpoints (chunking, manifests, verification,
choosing the latest) lives above them in :mod:`cedana_airflow.store.transfer`, so a new backend is a
small class, not a rewrite. The keys they share are spelt in :mod:`cedana_airflow.format.layout`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import default
from ..errors import CorruptCheckpoint, StoreUnavailable
from ..format.chunking import CHUNKER_NAME
from ..format.layout import chunk_key, manifest_key
from ..format import limits

#: The largest stored chunk object: 4 x a 64 MiB average, plus the codec byte (format/chunking.py).
MAX_STORED_CHUNK_BYTES = (256 << 20) + 1
from ..format.limits import TooLarge
from ..ids import RESERVED_NAMES

__all__ = ["RequiredReads", "Store", "StoreConfig", "StoredObject", "STORE_FORMAT_VERSION", "RESERVED_NAMES", "chunk_key", "manifest_key", "parse_store_config"]

STORE_FORMAT_VERSION = 1


class StoreConfig(BaseModel):
    """store.json: read before anything else; an unknown format version stops every client."""

    model_config = ConfigDict(extra="allow", frozen=True)

    format_version: int = STORE_FORMAT_VERSION
    chunker: str = CHUNKER_NAME
    chunk_avg_bytes: int = default("chunk_avg_bytes")
    digest: str = "blake3"


def parse_store_config(raw: bytes, where: str) -> StoreConfig:
    try:
        cfg = StoreConfig.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as e:
        raise StoreUnavailable(f"store {where}: store.json is unreadable ({str(e).splitlines()[0]}). Restore it from a backup or point --store elsewhere.") from None
    if cfg.format_version != STORE_FORMAT_VERSION or cfg.digest != "blake3" or cfg.chunker != CHUNKER_NAME:
        raise StoreUnavailable(
            f"store {where}: format_version={cfg.format_version} chunker={cfg.chunker} digest={cfg.digest} "
            f"is not the format this cedana-airflow writes (version {STORE_FORMAT_VERSION}). Upgrade cedana-airflow."
        )
    return cfg


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    mtime: float  # seconds since the epoch


class RequiredReads:
    """``get_chunk`` and ``get_manifest`` on top of a backend's ``get()``: the same for every backend."""

    url: str

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def get_chunk(self, digest: str) -> bytes:
        # A chunk holds at most 4 x the largest average a store is made with (64 MiB), plus its codec
        # byte: an object beyond that is refused from its size, never read into memory.
        blob = self.get_bounded(chunk_key(digest), MAX_STORED_CHUNK_BYTES)
        if blob is None:
            raise CorruptCheckpoint(f"chunk {digest} is missing from {self.url}")
        return blob

    def get_bounded(self, key: str, limit: int) -> bytes | None:
        """:meth:`get`, but TooLarge for an object over ``limit`` bytes. Backends override it to refuse
        one from its size, before reading its body; this fallback reads it first."""
        data = self.get(key)
        if data is not None and len(data) > limit:
            raise TooLarge(len(data), limit)
        return data

    def get_manifest(self, checkpoint_id: str, seq: int) -> bytes:
        try:
            raw = self.get_bounded(manifest_key(checkpoint_id, seq), limits.MAX_MANIFEST_BYTES)
        except TooLarge as e:  # a restore falls back as for any bad manifest; the api-server skips it
            raise CorruptCheckpoint(f"checkpoint {checkpoint_id} seq={seq} is refused unread: its manifest is "
                                    f"{e.size} bytes, more than the {e.limit} a reader accepts") from None
        if raw is None:  # removed between listing and reading (retention, gc)
            raise CorruptCheckpoint(f"manifest {checkpoint_id}/{seq} disappeared from {self.url}")
        return raw


@runtime_checkable
class Store(Protocol):
    """Byte-level operations a backend provides. Keys are relative to the store's root."""

    url: str
    #: Transfers in flight at once: CPU-bound for a local disk, latency-bound for S3.
    parallelism: int

    def open(self, *, create: bool, chunk_avg_bytes: int) -> StoreConfig:
        """Read store.json (creating it when ``create`` and absent); check the store is usable."""
        ...

    def has_chunk(self, digest: str) -> bool: ...

    def put_chunk(self, digest: str, blob: bytes) -> None:
        """Write a chunk object atomically. Writing an existing digest again is harmless."""
        ...

    def get_chunk(self, digest: str) -> bytes:
        """Return the stored object; raise CorruptCheckpoint when it is missing."""
        ...

    def put_manifest(self, checkpoint_id: str, seq: int, data: bytes) -> bool:
        """Write a manifest atomically, only if that (id, seq) is free. False when it was taken."""
        ...

    def get_manifest(self, checkpoint_id: str, seq: int) -> bytes:
        """The stored manifest; CorruptCheckpoint when it is gone, or over format/limits.py's byte cap
        (judged before its body is read)."""
        ...

    def list_ids(self) -> list[str]: ...

    def list_seqs(self, checkpoint_id: str) -> list[int]:
        """Sequence numbers that have a manifest (that is, complete checkpoints), ascending."""
        ...

    # -- generic keys: locks, retention and garbage collection are written on these --------------
    def get(self, key: str) -> bytes | None:
        """The object at ``key``, or None when there is none."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` atomically; False (and nothing written) when it exists."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...

    # -- compare-and-swap, for the one mutable document kind (the listing index, index.py) --------
    def get_versioned(self, key: str) -> tuple[bytes | None, str]:
        """The object and an opaque version token ("" when there is no object)."""
        ...

    def put_if_version(self, key: str, data: bytes, token: str) -> bool:
        """Write ``key`` only if it is still at ``token`` ("" meaning absent); False when it moved on."""
        ...

    def get_if_changed(self, key: str, token: str) -> tuple[bytes | None, str] | None:
        """None when ``key`` is still at ``token`` (S3: a conditional GET answered 304, no body sent);
        else what :meth:`get_versioned` returns. For a reader that keeps what it parsed."""
        ...

    def list_objects(self, prefix: str, limit: int = 0) -> Iterator[StoredObject]:
        """Every object under ``prefix`` (temporary files of interrupted writes included); ``limit`` > 0 stops early."""
        ...
