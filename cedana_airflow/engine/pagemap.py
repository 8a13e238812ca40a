"""Where each page of a dumped process lies in its ``pages-N.img``: CRIU's pagemap images, read.

``pagemap-<vpid>.img`` holds a head (``pages_id``: which ``pages-<id>.img``) and then one entry
per run of pages: its address, its length and flags. Runs whose pages are in the pages image
(PE_PRESENT) follow one another there in pagemap order; runs in a parent image or holes take no
room. PE_LAZY marks pages a lazy restore may fill on demand (anonymous private memory, not the
stack); the rest a restore reads from the pages image itself, so they must be there beforehand.
"""

from __future__ import annotations

import bisect
import functools
import re
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from .images import read_image

__all__ = ["PAGE_SIZE", "PageRun", "Pagemap", "read_pagemaps"]

#: CRIU's images count pages of the machine that dumped them (criu/include/page.h: PAGE_SIZE is the
#: host's); restores go to the same architecture, whose arm64 and ppc64le kernels may use 16 or 64 KiB.
PAGE_SIZE = mmap.PAGESIZE
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
_NAME = re.compile(r"pagemap-(\d+)\.img$")


@dataclass(frozen=True)
class PageRun:
    vaddr: int
    nr_pages: int
    flags: int
    offset: int  # in the pages image; -1 when the run takes no room there

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT) and not self.flags & PE_PARENT

    @property
    def lazy(self) -> bool:
        """Filled on demand by a lazy restore (present in the image, and lazy-able)."""
        return self.present and bool(self.flags & PE_LAZY)

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE


@dataclass(frozen=True)
class Pagemap:  # not slotted: locate() caches its run starts
    vpid: int
    pages_id: int
    runs: tuple[PageRun, ...]  # in address order, as CRIU writes them

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [r.vaddr for r in self.runs]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    @property
    def pages_bytes(self) -> int:
        return sum(r.nr_pages * PAGE_SIZE for r in self.runs if r.present)

    def ranges(self, *, lazy: bool) -> list[tuple[int, int]]:
        """(offset, length) in the pages image of the lazy runs, or of the others (what a restore
        reads itself), adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for r in self.runs:
            if not r.present or r.lazy != lazy:
                continue
            n = r.nr_pages * PAGE_SIZE
            if out and out[-1][0] + out[-1][1] == r.offset:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((r.offset, n))
        return out

    def locate(self, vaddr: int, nr_pages: int) -> tuple[int, int]:
        """(offset in the pages image, pages) for up to ``nr_pages`` lazy pages from ``vaddr``, all
        in one run (fewer when the run ends first, as CRIU's page server may answer). ValueError
        when ``vaddr`` is in no lazy run: a request no dump of ours could cause."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0 or vaddr >= self.runs[i].end or not self.runs[i].lazy or vaddr % PAGE_SIZE or nr_pages < 1:
            raise ValueError(f"no lazy pages of pid {self.vpid} at {vaddr:#x}")
        r = self.runs[i]
        first = (vaddr - r.vaddr) // PAGE_SIZE
        return r.offset + first * PAGE_SIZE, min(nr_pages, r.nr_pages - first)


def read_pagemap(path: Path, vpid: int) -> Pagemap:
    """One ``pagemap-<vpid>.img``. ValueError when it is not one CRIU wrote."""
    try:
        entries, whole = read_image(path)
    except (OSError, struct.error, IndexError) as e:
        raise ValueError(f"{path.name} cannot be read ({e})") from None
    if not entries or not whole or not isinstance(pages_id := entries[0].get(1), int):
        raise ValueError(f"{path.name} is not a CRIU pagemap (no head, or truncated)")
    runs: list[PageRun] = []
    offset = 0
    for entry in entries[1:]:
        vaddr, nr = entry.get(1), entry.get(5, entry.get(2))  # nr_pages (5) replaced compat_nr_pages (2)
        flags = entry.get(4, PE_PRESENT)  # dumps older than the flags field: every run is in the image
        if not isinstance(vaddr, int) or not isinstance(nr, int) or not isinstance(flags, int) or nr < 1:
            raise ValueError(f"{path.name} has a malformed entry")
        if entry.get(3):  # in_parent, the old spelling of PE_PARENT
            flags |= PE_PARENT
        run = PageRun(vaddr, nr, flags, -1)
        if run.present:
            run = PageRun(vaddr, nr, flags, offset)
            offset += nr * PAGE_SIZE
        if runs and vaddr < runs[-1].end:
            raise ValueError(f"{path.name} has overlapping or unordered runs at {vaddr:#x}")
        runs.append(run)
    return Pagemap(vpid, pages_id, tuple(runs))


def read_pagemaps(image_dir: Path) -> dict[int, Pagemap]:
    """Every process's pagemap in an image directory, by the PID CRIU names it with (its PID
    inside the workload's namespace: the ``dst_id`` a lazy-pages daemon asks with)."""
    out: dict[int, Pagemap] = {}
    for p in image_dir.iterdir():
        m = _NAME.match(p.name)
        if m:
            out[int(m.group(1))] = read_pagemap(p, int(m.group(1)))
    return out
