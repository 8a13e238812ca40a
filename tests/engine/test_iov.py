"""Writes of more buffers than one system call takes (IOV_MAX): what a lazy restore's fill and page
server write when a range spans more chunks than that."""

from __future__ import annotations

import os

import pytest

from cedana_airflow.engine.iov import IOV_MAX, advance, pwritev_all, within_iov_max


def test_the_kernel_refuses_more_than_iov_max_buffers_in_one_call(tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            os.pwritev(fd, [b"x"] * (IOV_MAX + 1), 0)  # the EINVAL a lazy restore met
        assert e.value.errno == 22
    finally:
        os.close(fd)


def test_pwritev_all_writes_every_piece_in_order_however_many(tmp_path):
    pieces = [bytes([i % 251]) * (1 + i % 7) for i in range(3 * IOV_MAX + 5)] + [b""]
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        assert pwritev_all(fd, [memoryview(p) for p in pieces], 100) == sum(map(len, pieces))
        assert os.pread(fd, 1 << 20, 100) == b"".join(pieces)
        assert os.pread(fd, 100, 0) == bytes(100)  # nothing before the offset
    finally:
        os.close(fd)


def test_advance_and_one_write_messages_stay_within_the_limit():
    left = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"f")]
    advance(left, 4)  # all of the first, one byte of the second
    assert [bytes(b) for b in left] == [b"e", b"f"]
    pieces = [b"ab"] * (IOV_MAX + 3)
    assert within_iov_max(pieces[:10], reserved=1) == pieces[:10]
    joined = within_iov_max(pieces, reserved=1)
    assert len(joined) == 1 and joined[0] == b"ab" * (IOV_MAX + 3)
