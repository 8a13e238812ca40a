"""Would CRIU accept this image set? What can be checked without restoring it.

A restore is the only full proof; before one, an image set fetched and verified chunk by chunk can
still be one CRIU refuses: a file missing, an image whose entries run past its end, or a pages file
whose size disagrees with the pagemap that indexes it. Those are checked here, for drills (``verify``).
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from .images import read_image

__all__ = ["image_set_problems"]

#: pagemap_entry.flags: PE_PRESENT, the page's bytes are in pages-<id>.img.
_PE_PRESENT = 1 << 2
_REQUIRED = ("inventory.img", "pstree.img")
_IMAGE_VERSION = 2  # inventory_entry.img_version CRIU 3.x/4.x writes
#: Images made of entries only. Others carry raw bytes after their entries (pipes-data, fifo-data,
#: sk-queues, ghost files, tmpfs and IPC dumps, pages), so "entries end at the end" says nothing there.
_ENTRIES_ONLY = re.compile(r"(inventory|pstree|files|core-\d+|mm-\d+|pagemap-\d+|fdinfo-\d+|fs-\d+|ids-\d+)\.img")


def image_set_problems(image_dir: Path) -> list[str]:
    """Why CRIU would refuse ``image_dir``, one line each; empty when nothing here says it would."""
    names = set(os.listdir(image_dir))
    problems = [f"{n} is missing" for n in _REQUIRED if n not in names]
    if problems:
        return problems
    try:
        images = {n: read_image(image_dir / n) for n in sorted(names) if _ENTRIES_ONLY.fullmatch(n)}
        problems += [f"{n} is not a well-formed CRIU image (an entry runs past its end)"
                     for n, (_, fits) in images.items() if not fits]
        inventory = images["inventory.img"][0]
        version = inventory[0].get(1) if inventory else None
        if version != _IMAGE_VERSION:
            problems.append(f"inventory.img says image version {version!r}, not {_IMAGE_VERSION}")
        for name, (entries, _) in images.items():
            if not name.startswith("pagemap-") or not entries:
                continue
            head, *rest = entries
            pages = f"pages-{head.get(1)!s}.img"
            present = [e for e in rest if int(e.get(4, _PE_PRESENT)) & _PE_PRESENT]
            # nr_pages: field 5 (uint64) from CRIU 4.2, compat_nr_pages (2) before (pagemap.proto)
            want = sum(int(e.get(5, e.get(2, 0))) for e in present) * os.sysconf("SC_PAGE_SIZE")
            have = (image_dir / pages).stat().st_size if pages in names else -1
            if have != want:
                problems.append(f"{pages} holds {have} bytes where {name} indexes {want}")
    except (ValueError, TypeError, IndexError, struct.error) as e:
        problems.append(f"an image does not decode ({type(e).__name__}: {e})")
    return problems
