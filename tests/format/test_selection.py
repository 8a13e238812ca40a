from __future__ import annotations

from datetime import datetime, timezone

from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.format.selection import restore_order

PROC = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


def _m(seq: int, try_number: int) -> Manifest:
    return Manifest(checkpoint_id="j", seq=seq, try_number=try_number, node="n",
                    created_at=datetime(2026, 1, 1, tzinfo=timezone.utc), engine_version="4.1.1",
                    process=PROC, files=(), image_bytes=0, stored_bytes=0)


def test_newest_sequence_first_within_a_try():
    assert [m.seq for m in restore_order([_m(1, 1), _m(3, 1), _m(2, 1)])] == [3, 2, 1]


def test_a_stale_writer_of_an_older_try_never_becomes_the_latest():
    order = restore_order([_m(1, 1), _m(2, 2), _m(3, 1)])  # seq 3 came late from try 1
    assert [(m.try_number, m.seq) for m in order] == [(2, 2), (1, 3), (1, 1)]


def test_empty():
    assert restore_order([]) == []
