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


def _pieces(path, avg=64 << 10, pool=None):
    return [(p.offset, p.size, p.digest) for p in chunking.CutFile(path, avg, pool).pieces()]


def test_a_file_within_one_segment_is_cut_as_one_pass_cuts_it(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(os.urandom(3 << 20))
    assert _pieces(p) == _chunks(p)  # stores written before keep deduplicating
    p.write_bytes(b"")
    assert _pieces(p) == []


def test_segments_cut_in_parallel_cover_the_file_and_give_the_same_chunks_every_time(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(chunking, "SEGMENT_BYTES", 1 << 20)
    data = os.urandom((5 << 20) + 12345)
    p = tmp_path / "f"
    p.write_bytes(data)
    with ThreadPoolExecutor(2) as pool:
        cut = _pieces(p, pool=pool)
        assert _pieces(p, pool=pool) == cut == _pieces(p)  # parallel or not, the same chunks
    assert cut[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(cut, cut[1:])) and sum(c[1] for c in cut) == len(data)
    assert {k << 20 for k in range(6)} <= {c[0] for c in cut}  # every segment starts a chunk
    f = chunking.CutFile(p, 64 << 10)
    assert all(chunking.digest(f.data(piece)) == piece.digest == chunking.digest(data[piece.offset:piece.offset + piece.size])
               for piece in f.pieces())
    # a page changed in segment 3 changes chunks there only
    changed = bytearray(data)
    changed[(3 << 20) + 5000] ^= 0xFF
    p.write_bytes(changed)
    after = _pieces(p)
    assert len({c[2] for c in cut} - {c[2] for c in after}) <= 2


def test_a_checkpoint_of_files_larger_than_a_segment_restores_byte_for_byte(tmp_path, monkeypatch):
    from cedana_airflow.config import load_settings
    from cedana_airflow.format.manifest import ProcessInfo
    from cedana_airflow.store import open_store
    from cedana_airflow.store.transfer import CheckpointMeta, fetch_checkpoint, save_checkpoint

    monkeypatch.setattr(chunking, "SEGMENT_BYTES", 1 << 20)
    s = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    img = tmp_path / "img"
    img.mkdir()
    (img / "pages-1.img").write_bytes(os.urandom((4 << 20) + 777))
    (img / "core-1.img").write_bytes(os.urandom(3000))
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    m = save_checkpoint(s, cfg, CheckpointMeta("seg", "n", "4.1.1", proc), img)
    again = save_checkpoint(s, cfg, CheckpointMeta("seg", "n", "4.1.1", proc), img)
    assert again.new_chunks == 0  # the same bytes, the same chunks: nothing new stored
    fetch_checkpoint(s, m, tmp_path / "out")
    for f in img.iterdir():
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()


def test_a_segment_memo_recalls_unchanged_segments_and_cuts_changed_ones_exactly_as_without_it(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(chunking, "SEGMENT_BYTES", 1 << 20)
    data = bytearray(os.urandom((6 << 20) + 999))
    p = tmp_path / "pages-1.img"
    p.write_bytes(data)
    memo = chunking.SegmentMemo()

    def cut(avg=64 << 10):
        with ThreadPoolExecutor(2) as pool:
            f = chunking.CutFile(p, avg, pool, memo)
            got = [(x.offset, x.size, x.digest) for x in f.pieces()]
        memo.roll()
        assert got == _pieces(p, avg)  # with or without the memo, the same chunks
        return f.segments, f.recalled

    assert cut() == (7, 0)  # nothing seen yet
    assert cut() == (7, 7)  # the same bytes: no segment cut again
    data[(3 << 20) + 5000] ^= 0xFF  # one byte changed in segment 3
    data[-1] ^= 0xFF  # and one in the short last segment
    p.write_bytes(data)
    assert cut() == (7, 5)
    assert cut(avg=32 << 10) == (7, 0)  # another chunk size cuts differently: the memo does not answer
    memo.roll()
    memo.roll()  # only what the last cut saw is kept
    assert cut() == (7, 0)


def test_heartbeats_with_a_memo_store_the_same_manifest_as_without_and_restore_byte_for_byte(tmp_path, monkeypatch):
    from cedana_airflow.config import load_settings
    from cedana_airflow.format.manifest import ProcessInfo
    from cedana_airflow.store import open_store
    from cedana_airflow.store.transfer import CheckpointMeta, fetch_checkpoint, save_checkpoint

    monkeypatch.setattr(chunking, "SEGMENT_BYTES", 1 << 20)
    s = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    img = tmp_path / "img"
    img.mkdir()
    data = bytearray(os.urandom(5 << 20))
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    memo = chunking.SegmentMemo()
    known: set[str] = set()
    for beat in range(3):
        data[(beat << 20) + 100 : (beat << 20) + 200] = os.urandom(100)
        (img / "pages-1.img").write_bytes(data)
        with_memo = save_checkpoint(s, cfg, CheckpointMeta("memo", "n", "4.1.1", proc), img, known_digests=known, memo=memo)
        without = save_checkpoint(s, cfg, CheckpointMeta("plain", "n", "4.1.1", proc), img)
        assert with_memo.files == without.files
        known = with_memo.chunk_digests()
        out = tmp_path / f"out-{beat}"
        fetch_checkpoint(s, with_memo, out)
        assert (out / "pages-1.img").read_bytes() == bytes(data)
