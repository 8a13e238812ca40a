"""Random-access reads straight from a stored file's chunks: each verified before any byte is returned."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.errors import CorruptCheckpoint
from cedana_airflow.format import chunking
from cedana_airflow.format.manifest import ChunkRef, FileEntry
from cedana_airflow.store import open_store
from cedana_airflow.store.chunk_view import ChunkView


@pytest.fixture
def stored(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    store.open(create=True, chunk_avg_bytes=64 << 10)
    data = os.urandom(300_000)
    refs = []
    for lo in range(0, len(data), 70_000):
        piece = data[lo:lo + 70_000]
        d = chunking.digest(piece)
        store.put_chunk(d, chunking.encode(piece, "zstd"))
        refs.append(ChunkRef(digest=d, size=len(piece)))
    return store, data, FileEntry(name="pages-1.img", size=len(data), chunks=tuple(refs))


def _join(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def test_reads_across_chunk_edges_return_the_file_bytes_and_each_chunk_is_dropped_once_read(stored):
    store, data, entry = stored
    with ThreadPoolExecutor(2) as pool:
        view = ChunkView(store, entry, pool, window_bytes=1 << 20)
        assert _join(view.read(69_000, 2_000)) == data[69_000:71_000]  # two chunks
        assert _join(view.read(0, 69_000)) == data[:69_000]
        assert _join(view.read(71_000, len(data) - 71_000)) == data[71_000:]
        assert view._held_bytes == 0  # every byte was read once: nothing is held any more
        assert _join(view.read(100, 10)) == data[100:110]  # a read that comes back fetches again
        with pytest.raises(ValueError):
            view.read(len(data) - 5, 10)


def test_a_corrupt_chunk_is_never_served_and_its_neighbours_still_are(stored, tmp_path):
    store, data, entry = stored
    bad = entry.chunks[2].digest
    path = tmp_path / "store" / "chunks" / bad[:2] / bad
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    with ThreadPoolExecutor(2) as pool:
        view = ChunkView(store, entry, pool, window_bytes=1 << 20)
        view.prefetch(range(len(entry.chunks)))
        with pytest.raises(CorruptCheckpoint, match=bad):
            view.read(140_000, 10)
        with pytest.raises(CorruptCheckpoint, match=bad):
            view.read(139_990, 20)
        assert _join(view.read(0, 10)) == data[:10]
        view.close()


def test_prefetch_stays_within_its_window(stored):
    store, data, entry = stored
    with ThreadPoolExecutor(2) as pool:
        view = ChunkView(store, entry, pool, window_bytes=100_000)
        view.prefetch(range(len(entry.chunks)))
        import time

        time.sleep(0.5)
        assert 0 < view._held_bytes <= 140_000  # one chunk past the window at most
        assert _join(view.read(0, len(data))) == data
        view.close()


def test_a_range_read_again_is_consumed_once_and_no_chunk_is_fetched_twice(stored):
    """A lazy-pages daemon reads a window, the kernel says "not now" (an event in flight), and it
    reads the window again later: counted twice, the chunk went before its other bytes were
    served, and was fetched and verified again inside the serving thread."""
    store, data, entry = stored
    with ThreadPoolExecutor(2) as pool:
        view = ChunkView(store, entry, pool, window_bytes=1 << 20)
        assert _join(view.read(0, 40_000)) == data[:40_000]
        assert _join(view.read(0, 40_000)) == data[:40_000]  # read again: the same bytes, not 80,000 of them
        assert _join(view.read(40_000, 30_000)) == data[40_000:70_000]
        assert view.fetched_bytes == 70_000  # the first chunk, once
        # the daemon's way: held until it says the pages are in, however often it reads them
        assert _join(view.read(70_000, 70_000, consume=False)) == data[70_000:140_000]
        assert _join(view.read(70_000, 70_000, consume=False)) == data[70_000:140_000]
        view.consume(70_000, 35_000)
        view.consume(70_000, 35_000)  # said twice: still half of it
        assert _join(view.read(105_000, 35_000, consume=False)) == data[105_000:140_000]
        assert view.fetched_bytes == 140_000
        view.consume(100_000, 40_000)  # now every byte: the chunk goes
        assert view._held_bytes == 0
        view.close()
