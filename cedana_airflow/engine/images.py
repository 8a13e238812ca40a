"""Reading the few CRIU image fields we need (dump statistics) without pulling in protobuf.

A CRIU image is ``u32 magic`` (plus a second ``u32`` for common/service images), then entries of
``u32 length`` + a protobuf message. We only read varint fields, which is all ``stats-dump`` holds.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["read_dump_stats"]

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


def _fields(msg: bytes) -> dict[int, int]:
    out: dict[int, int] = {}
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
            i += n
        else:
            break
    return out


def read_dump_stats(image_dir: Path) -> dict[str, float]:
    """``freezing``, ``frozen``, ``memdump``, ``memwrite`` seconds from stats-dump; {} if unreadable."""
    try:
        buf = (image_dir / "stats-dump").read_bytes()
        (magic,) = struct.unpack_from("<I", buf, 0)
        off = 8 if magic in (_IMG_COMMON, _IMG_SERVICE) else 4
        (n,) = struct.unpack_from("<I", buf, off)
        f = _fields(buf[off + 4 : off + 4 + n])
    except (OSError, struct.error, IndexError):
        return {}
    # stats.proto, dump_stats_entry: 1 freezing_time, 2 frozen_time, 3 memdump_time, 4 memwrite_time (µs)
    names = {1: "freezing", 2: "frozen", 3: "memdump", 4: "memwrite"}
    return {name: f[num] / 1e6 for num, name in names.items() if num in f}
