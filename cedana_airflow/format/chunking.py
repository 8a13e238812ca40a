"""Chunks: content-defined cuts, BLAKE3 digests, and the stored encoding.

Cuts are content-defined (FastCDC 2020), not fixed offsets: when a page is added early in a CRIU
image (a new heap arena, say) fixed offsets would shift every chunk after it and a heartbeat would
store the whole image again; content-defined cuts re-synchronise right after the change.

A stored chunk object is one codec byte followed by the payload:
``0x00`` raw bytes, ``0x01`` a zstd frame. The chunk's name is the BLAKE3 hex digest of the *raw*
bytes, checked on every read.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import blake3
import zstandard
from pyfastcdc.cy import FastCDC

from ..errors import CorruptCheckpoint

__all__ = ["Cut", "CutFile", "Piece", "SegmentMemo", "cut_file", "digest", "encode", "decode", "CHUNKER_NAME",
           "MAX_CHUNK_FACTOR", "SEGMENT_BYTES"]

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
#: Files are cut in segments of this many bytes, several at once: FastCDC and BLAKE3 release the GIL,
#: so a heartbeat uses every core. A segment's end is always a cut, so the same bytes give the same
#: chunks whichever heartbeat cuts them, and a file no larger than one segment is cut exactly as by
#: one pass (stores written before keep deduplicating; larger files differ at segment ends only).
SEGMENT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Cut:
    offset: int
    data: memoryview


def _cdc(avg_size: int) -> FastCDC:
    return FastCDC(avg_size=avg_size, min_size=max(avg_size // 4, 64), max_size=avg_size * MAX_CHUNK_FACTOR)


def cut_file(path: Path, avg_size: int) -> Iterator[Cut]:
    """Yield the file's chunks in order, in one pass; ``data`` is a view valid until the next item."""
    if path.stat().st_size == 0:
        return
    for c in _cdc(avg_size).cut_file(str(path)):
        yield Cut(c.offset, c.data)


@dataclass(frozen=True, slots=True)
class Piece:
    """A chunk of a file: where it is, and its digest."""

    offset: int
    size: int
    digest: str


class SegmentMemo:
    """Which chunks a segment's bytes were cut into, keyed by the BLAKE3 digest of those bytes.

    A segment's cuts are a function of its bytes alone (see SEGMENT_BYTES), so a segment whose
    digest was seen at the previous heartbeat is not cut and its chunks not hashed again: hashing
    the segment once is about a third of cutting and hashing it. Sound without any help from the
    kernel (this one has no soft-dirty tracking): equal digests mean equal bytes. Only chunking is
    skipped; whether a chunk is in the store is still the writer's question.

    ``roll()`` after each checkpoint keeps only what that checkpoint saw, so the memo stays the size
    of one image's segment list. Safe from several cutting threads (dict reads and writes are atomic).
    """

    def __init__(self) -> None:
        self._prev: dict[tuple[int, str], tuple[tuple[int, int, str], ...]] = {}
        self._now: dict[tuple[int, str], tuple[tuple[int, int, str], ...]] = {}

    def get(self, key: tuple[int, str]) -> tuple[tuple[int, int, str], ...] | None:
        found = self._now.get(key) or self._prev.get(key)
        if found is not None:
            self._now[key] = found
        return found

    def put(self, key: tuple[int, str], cuts: tuple[tuple[int, int, str], ...]) -> None:
        self._now[key] = cuts

    def roll(self) -> None:
        self._prev, self._now = self._now, {}


class CutFile:
    """A file's chunks, cut and digested segment by segment (several segments at once in ``pool``).

    The file is mapped, not read: ``data(piece)`` is a view of the mapping, so only the chunks a
    caller needs (those the store lacks) are ever copied. The mapping lives as long as its views.
    With a ``memo``, a segment cut at an earlier heartbeat is looked up instead of cut again.
    """

    def __init__(self, path: Path, avg_size: int, pool: Executor | None = None, memo: SegmentMemo | None = None) -> None:
        self.avg_size, self.pool, self.memo = avg_size, pool, memo
        self.segments = self.recalled = 0  # segments cut, and how many of them the memo answered
        self.size = path.stat().st_size
        if self.size == 0:
            self._view = memoryview(b"")
        else:
            with open(path, "rb") as f:
                self._view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    def _segment(self, start: int) -> tuple[list[Piece], bool]:
        seg = self._view[start : start + SEGMENT_BYTES]
        key = None
        if self.memo is not None:
            # One thread per segment already: the digest must not take the other cores as well.
            key = (self.avg_size, blake3.blake3(seg, max_threads=1).hexdigest())
            cuts = self.memo.get(key)
            if cuts is not None:
                return [Piece(start + off, n, d) for off, n, d in cuts], True
        pieces = [Piece(start + c.offset, len(c.data), digest(c.data)) for c in _cdc(self.avg_size).cut_buf(seg)]
        if key is not None and self.memo is not None:
            self.memo.put(key, tuple((p.offset - start, p.size, p.digest) for p in pieces))
        return pieces, False

    def pieces(self) -> Iterator[Piece]:
        starts = range(0, self.size, SEGMENT_BYTES)
        cut = self.pool.map(self._segment, starts) if self.pool is not None and len(starts) > 1 else map(self._segment, starts)
        for segment, recalled in cut:
            self.segments += 1
            self.recalled += recalled
            yield from segment

    def data(self, piece: Piece) -> memoryview:
        return self._view[piece.offset : piece.offset + piece.size]


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


#: The most a stored chunk may decompress to when it is judged on its own (intact): 64x the largest
#: average a store is made with, bounding what a forged frame header can make a reader allocate.
_INTACT_MAX = 256 << 20


def intact(blob: bytes, expected_digest: str) -> bool:
    """Whether a stored chunk is good on its own: its content hashes to its name, whatever size a
    manifest claims for it. A manifest can be wrong (forged, or naming the chunk with another size); the
    chunk cannot, and other checkpoints may need it."""
    try:
        return digest(_unpack(blob, expected_digest, _INTACT_MAX)) == expected_digest
    except CorruptCheckpoint:
        return False


def _unpack(blob: bytes, name: str, limit: int) -> bytes | memoryview:
    """A stored chunk's content, decompressed to at most ``limit`` bytes; CorruptCheckpoint when it cannot be."""
    codec, payload = blob[:1], memoryview(blob)[1:]
    if codec == _RAW:
        return payload
    if codec != _ZSTD:
        raise CorruptCheckpoint(f"chunk {name}: unknown codec byte {codec!r}")
    try:
        # python-zstandard allocates what a frame header states, whatever max_output_size says: judge it
        # first (a stored chunk is unsigned; a store writer chooses its header). Ours always state it.
        declared = zstandard.frame_content_size(payload)
        if declared < 0 or declared > limit:
            raise CorruptCheckpoint(f"chunk {name}: its frame declares {declared} bytes, more than the {limit} "
                                    "it may hold" if declared > limit else f"chunk {name}: its frame states no size")
        return zstandard.ZstdDecompressor().decompress(payload, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"chunk {name}: does not decompress ({e})") from None


def decode(blob: bytes, expected_digest: str, expected_size: int) -> bytes | memoryview:
    """Return the raw bytes of a stored chunk, or raise CorruptCheckpoint if they are not what was named.

    A raw chunk comes back as a view into ``blob`` (no copy: restores move gigabytes of them).
    """
    raw = _unpack(blob, expected_digest, expected_size)
    if len(raw) != expected_size or digest(raw) != expected_digest:
        raise CorruptCheckpoint(f"chunk {expected_digest}: content does not match its digest")
    return raw
