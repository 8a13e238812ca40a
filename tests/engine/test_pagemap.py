"""Reading CRIU's pagemap: where each run of pages lies in pages-N.img, and which a lazy restore fills."""

from __future__ import annotations

import struct

import pytest

from conftest import varint

from cedana_airflow.engine.pagemap import PAGE_SIZE, PE_LAZY, PE_PRESENT, read_pagemaps




def _msg(*fields: tuple[int, int]) -> bytes:
    body = b"".join(varint(num << 3) + varint(v) for num, v in fields)
    return struct.pack("<I", len(body)) + body


def _pagemap(pages_id: int, runs: list[tuple[int, int, int]], *, big_nr: bool = False) -> bytes:
    out = struct.pack("<II", 0x54564319, 0x56084025) + _msg((1, pages_id))
    for vaddr, nr, flags in runs:
        out += _msg((1, vaddr), (5 if big_nr else 2, nr), (4, flags))
    return out


LAZY, EAGER, HOLE = PE_PRESENT | PE_LAZY, PE_PRESENT, 0


def test_runs_take_room_in_pagemap_order_and_split_into_lazy_and_eager(tmp_path):
    (tmp_path / "pagemap-1.img").write_bytes(_pagemap(3, [
        (0x10000, 2, EAGER), (0x20000, 4, LAZY), (0x30000, 1, HOLE), (0x40000, 3, LAZY), (0x7f000, 1, EAGER)]))
    [pm] = read_pagemaps(tmp_path).values()
    assert (pm.vpid, pm.pages_file, pm.pages_bytes) == (1, "pages-3.img", 10 * PAGE_SIZE)
    assert [r.offset for r in pm.runs] == [0, 2 * PAGE_SIZE, -1, 6 * PAGE_SIZE, 9 * PAGE_SIZE]
    assert pm.ranges(lazy=False) == [(0, 2 * PAGE_SIZE), (9 * PAGE_SIZE, PAGE_SIZE)]
    assert pm.ranges(lazy=True) == [(2 * PAGE_SIZE, 7 * PAGE_SIZE)]  # adjacent in the image: merged


def test_locate_answers_within_one_lazy_run_and_refuses_anything_else(tmp_path):
    (tmp_path / "pagemap-7.img").write_bytes(_pagemap(1, [(0x10000, 2, EAGER), (0x20000, 4, LAZY)], big_nr=True))
    pm = read_pagemaps(tmp_path)[7]
    assert pm.locate(0x21000, 2) == (3 * PAGE_SIZE, 2)
    assert pm.locate(0x22000, 10) == (4 * PAGE_SIZE, 2)  # fewer: the run ends first
    for vaddr in (0x10000, 0x24000, 0x5000, 0x20001):  # eager, past the run, before any, unaligned
        with pytest.raises(ValueError):
            pm.locate(vaddr, 1)


def test_a_truncated_or_foreign_pagemap_is_refused(tmp_path):
    good = _pagemap(1, [(0x10000, 2, LAZY)])
    (tmp_path / "pagemap-1.img").write_bytes(good[:-2])
    with pytest.raises(ValueError, match="pagemap-1.img"):
        read_pagemaps(tmp_path)
    (tmp_path / "pagemap-1.img").write_bytes(_pagemap(1, [(0x20000, 2, LAZY), (0x10000, 1, LAZY)]))
    with pytest.raises(ValueError, match="unordered"):
        read_pagemaps(tmp_path)

