"""Would CRIU accept this image set? What can be checked without restoring it.

A restore is the only full proof; before one, an image set fetched and verified chunk by chunk can
still be one CRIU refuses: a file missing, an image whose entries run past its end, or a pages file
whose size disagrees with the pagemap that indexes it. Those are checked here, for drills (``verify``).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from .images import image_entries

__all__ = ["image_set_problems"]

#: pagemap_entry.flags: PE_PRESENT, the page's bytes are in pages-<id>.img.
_PE_PRESENT = 1 << 2
_REQUIRED = ("inventory.img", "pstree.img")
_IMAGE_VERSION = 2  # inventory_entry.img_version CRIU 3.x/4.x writes


def _entries_fit(path: Path) -> bool:
    """Every entry's declared length stays inside the file (a truncated or padded image does not)."""
    buf = path.read_bytes()
    if len(buf) < 4:
        return False
    (magic,) = struct.unpack_from("<I", buf, 0)
    off = 8 if magic in (0x54564319, 0x55105940) else 4
    while off + 4 <= len(buf):
        (n,) = struct.unpack_from("<I", buf, off)
        off += 4 + n
    return off == len(buf)


def image_set_problems(image_dir: Path) -> list[str]:
    """Why CRIU would refuse ``image_dir``, one line each; empty when nothing here says it would."""
    names = set(os.listdir(image_dir))
    problems = [f"{n} is missing" for n in _REQUIRED if n not in names]
    if problems:
        return problems
    for name in sorted(n for n in names if n.endswith(".img") and not n.startswith("pages-")):
        if not _entries_fit(image_dir / name):
            problems.append(f"{name} is not a well-formed CRIU image (an entry runs past its end)")
    try:
        inventory = image_entries(image_dir / "inventory.img")
        version = inventory[0].get(1) if inventory else None
        if version != _IMAGE_VERSION:
            problems.append(f"inventory.img says image version {version!r}, not {_IMAGE_VERSION}")
        for name in sorted(n for n in names if n.startswith("pagemap-") and n.endswith(".img")):
            head, *entries = image_entries(image_dir / name)
            pages = f"pages-{head.get(1)!s}.img"
            present = [e for e in entries if int(e.get(4, _PE_PRESENT)) & _PE_PRESENT]
            want = sum(int(e.get(2, 0)) for e in present) * os.sysconf("SC_PAGE_SIZE")
            have = (image_dir / pages).stat().st_size if pages in names else -1
            if have != want:
                problems.append(f"{pages} holds {have} bytes where {name} indexes {want}")
    except (ValueError, TypeError, IndexError, struct.error) as e:
        problems.append(f"an image does not decode ({type(e).__name__}: {e})")
    return problems
