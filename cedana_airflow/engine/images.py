"""Reading the few CRIU image fields we need (dump statistics) without pulling in protobuf.

A CRIU image is ``u32 magic`` (plus a second ``u32`` for common/service images), then entries of
``u32 length`` + a protobuf message. We read varints and nested messages: all that ``stats-dump``
and ``pagemap`` need.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["image_entries", "message_fields", "read_dump_stats", "read_image"]

_IMG_COMMON = 0x54564319
_IMG_SERVICE = 0x55105940


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def message_fields(msg: bytes) -> dict[int, int | bytes]:
    """Varint fields as ints, length-delimited fields (nested messages) as bytes."""
    out: dict[int, int | bytes] = {}
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            out[num], i = _varint(msg, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = _varint(msg, i)
            out[num] = msg[i : i + n]
            i += n
        else:
            break
    return out


def _payload_start(buf: bytes) -> int:
    (magic,) = struct.unpack_from("<I", buf, 0)
    return 8 if magic in (_IMG_COMMON, _IMG_SERVICE) else 4


def read_image(path: Path) -> tuple[list[dict[int, int | bytes]], bool]:
    """Every entry of a CRIU image file, as :func:`message_fields` reads it, and whether the entries
    end exactly at the end of the file (an image of entries only, not truncated, nothing after)."""
    buf = path.read_bytes()
    off, out = _payload_start(buf), []
    while off + 4 <= len(buf):
        (n,) = struct.unpack_from("<I", buf, off)
        out.append(message_fields(buf[off + 4 : off + 4 + n]))
        off += 4 + n
    return out, off == len(buf)


def image_entries(path: Path) -> list[dict[int, int | bytes]]:
    return read_image(path)[0]


#: stats.proto, dump_stats_entry: times in microseconds, then page counts.
_DUMP_STATS = {1: "freezing", 2: "frozen", 3: "memdump", 4: "memwrite", 5: "pages_scanned", 7: "pages_written"}


def read_dump_stats(image_dir: Path) -> dict[str, float]:
    """``freezing``, ``frozen``, ``memdump``, ``memwrite`` (seconds) and ``pages_scanned``,
    ``pages_written`` (counts) from stats-dump; {} if it is missing or unreadable.

    stats-dump holds one stats_entry whose field 1 is the nested dump_stats_entry.
    """
    try:
        entries = image_entries(image_dir / "stats-dump")
        dump = entries[0].get(1) if entries else None
        f = message_fields(dump) if isinstance(dump, bytes) else {}
    except (OSError, struct.error, IndexError):
        return {}
    return {name: (v / 1e6 if num <= 4 else float(v)) for num, name in _DUMP_STATS.items()
            if isinstance(v := f.get(num), int)}
