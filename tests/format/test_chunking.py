from __future__ import annotations

import os

import pytest

from cedana_airflow.errors import CorruptCheckpoint
from cedana_airflow.format import chunking


def _chunks(path, avg=64 << 10):
    return [(c.offset, len(c.data), chunking.digest(c.data)) for c in chunking.cut_file(path, avg)]


def test_cuts_cover_the_file_exactly(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(os.urandom(3 << 20))
    cuts = _chunks(p)
    assert cuts[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert sum(c[1] for c in cuts) == 3 << 20


def test_an_inserted_page_does_not_shift_every_later_chunk(tmp_path):
    data = os.urandom(4 << 20)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data[:100_000] + os.urandom(4096) + data[100_000:])
    da, db = {c[2] for c in _chunks(a)}, {c[2] for c in _chunks(b)}
    assert len(da & db) >= len(da) - 3  # only the chunks around the insertion differ


def test_empty_file_has_no_chunks(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert _chunks(p) == []


@pytest.mark.parametrize("data", [bytes(1 << 20), os.urandom(1 << 20), b"abc"])
def test_encode_decode_round_trip(data):
    d = chunking.digest(data)
    assert chunking.decode(chunking.encode(data, "zstd"), d, len(data)) == data
    assert chunking.decode(chunking.encode(data, "none"), d, len(data)) == data


def test_compressible_chunks_are_compressed_and_random_ones_are_not():
    assert len(chunking.encode(bytes(1 << 20), "zstd")) < 10_000
    assert len(chunking.encode(os.urandom(1 << 20), "zstd")) == (1 << 20) + 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "codec", "wrong-name"])
def test_damaged_chunks_are_refused(damage):
    data = bytes(range(256)) * 4096
    blob = bytearray(chunking.encode(data, "zstd"))
    d = chunking.digest(data)
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x10
    elif damage == "truncate":
        del blob[-10:]
    elif damage == "codec":
        blob[0] = 7
    else:
        d = chunking.digest(b"something else")
    with pytest.raises(CorruptCheckpoint):
        chunking.decode(bytes(blob), d, len(data))
