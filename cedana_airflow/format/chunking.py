"""Chunks: content-defined cuts, BLAKE3 digests, and the stored encoding.

Cuts are content-defined (FastCDC 2020), not fixed offsets: when a page is added early in a CRIU
image (a new heap arena, say) fixed offsets would shift every chunk after it and a heartbeat would
store the whole image again; content-defined cuts re-synchronise right after the change.

A stored chunk object is one codec byte followed by the payload:
``0x00`` raw bytes, ``0x01`` a zstd frame. The chunk's name is the BLAKE3 hex digest of the *raw*
bytes, checked on every read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import zstandard
from pyfastcdc.cy import FastCDC

from ..errors import CorruptCheckpoint

__all__ = ["Cut", "cut_file", "digest", "encode", "decode", "CHUNKER_NAME", "MAX_CHUNK_FACTOR"]

CHUNKER_NAME = "fastcdc-2020"
#: FastCDC cuts no chunk longer than this many times the store's average: a manifest that declares a
#: longer one is refused before any byte of it is read (its size would be allocated to decompress it).
MAX_CHUNK_FACTOR = 4
_RAW = b"\x00"
_ZSTD = b"\x01"
# Memory images are often incompressible (float weights): a trial on a sample avoids paying full
# zstd time for a 3% saving. Below this ratio on the sample the whole chunk is compressed.
_SAMPLE = 64 << 10
_WORTH_IT = 0.9


@dataclass(frozen=True, slots=True)
class Cut:
    offset: int
    data: memoryview


def cut_file(path: Path, avg_size: int) -> Iterator[Cut]:
    """Yield the file's chunks in order; ``data`` is a view valid until the next item."""
    if path.stat().st_size == 0:
        return
    cdc = FastCDC(avg_size=avg_size, min_size=max(avg_size // 4, 64), max_size=avg_size * MAX_CHUNK_FACTOR)
    for c in cdc.cut_file(str(path)):
        yield Cut(c.offset, c.data)


def digest(data: bytes | memoryview) -> str:
    return blake3.blake3(data, max_threads=1 if len(data) < (4 << 20) else blake3.blake3.AUTO).hexdigest()


def encode(data: bytes | memoryview, compression: str) -> bytes:
    if compression == "zstd" and len(data) >= 512:
        cctx = zstandard.ZstdCompressor(level=1)
        sample = data[:_SAMPLE]
        if len(cctx.compress(sample)) < _WORTH_IT * len(sample):
            packed = cctx.compress(data)
            if len(packed) < len(data):
                return _ZSTD + packed
    return _RAW + bytes(data)


def decode(blob: bytes, expected_digest: str, expected_size: int) -> bytes | memoryview:
    """Return the raw bytes of a stored chunk, or raise CorruptCheckpoint if they are not what was named.

    A raw chunk comes back as a view into ``blob`` (no copy: restores move gigabytes of them).
    """
    codec, payload = blob[:1], memoryview(blob)[1:]
    try:
        raw: bytes | memoryview
        if codec == _RAW:
            raw = payload
        elif codec == _ZSTD:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected_size)
        else:
            raise CorruptCheckpoint(f"chunk {expected_digest}: unknown codec byte {codec!r}")
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"chunk {expected_digest}: does not decompress ({e})") from None
    if len(raw) != expected_size or digest(raw) != expected_digest:
        raise CorruptCheckpoint(f"chunk {expected_digest}: content does not match its digest")
    return raw
