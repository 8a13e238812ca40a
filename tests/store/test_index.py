"""The listing index (index.py, listing.py): fast, never loses a concurrent writer's row, and never
hides or invents a checkpoint when it is stale or damaged. On the file store and on S3 (moto over HTTP)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.store import index, open_store
from cedana_airflow.store.gc import collect_garbage, delete_checkpoint_id
from cedana_airflow.store.listing import list_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


@pytest.fixture
def store(file_or_s3_store):
    return file_or_s3_store


def _save(store, tmp_path: Path, cid: str, n: int):
    s, cfg = store
    d = tmp_path / f"img-{cid}-{n}"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(4096))
    return save_checkpoint(s, cfg, CheckpointMeta(cid, f"node-{n}", "4.1.1", PROC), d)


def _same_shard_ids(n: int) -> list[str]:
    """IDs that all land in one shard, so concurrent writers contend for one document."""
    ids = (f"job{i}" for i in range(10_000))
    return [c for c in ids if hashlib.sha256(c.encode()).hexdigest()[0] == "a"][:n]


def _seqs(listed):
    return {x.checkpoint_id: [r.seq for r in x.checkpoints] for x in listed}


def test_concurrent_writers_of_one_shard_lose_no_row(store, tmp_path):
    s, _ = store
    ids = _same_shard_ids(6)
    saved = {cid: [_save(store, tmp_path, cid, n) for n in range(3)] for cid in ids}
    jobs = [m for ms in saved.values() for m in ms]
    with ThreadPoolExecutor(len(jobs)) as pool:  # every update races every other on one shard
        assert all(pool.map(lambda m: index.record_checkpoint(s, m), jobs))
    entries = index.read_index(s)
    assert {cid: [r.seq for r in entries[cid].checkpoints] for cid in ids} == {cid: [1, 2, 3] for cid in ids}
    assert _seqs(list_store(s)) == {cid: [1, 2, 3] for cid in ids}
    assert all(x.source == "index" for x in list_store(s))


def test_an_id_the_index_missed_is_read_from_its_manifests(store, tmp_path):
    s, _ = store
    index.record_checkpoint(s, _save(store, tmp_path, "indexed", 1))
    _save(store, tmp_path, "missed", 1)  # its writer died before the index update
    _save(store, tmp_path, "missed", 2)
    listed = {x.checkpoint_id: x for x in list_store(s)}
    assert _seqs(listed.values()) == {"indexed": [1], "missed": [1, 2]}
    assert listed["indexed"].source == "index" and listed["missed"].source == "manifests"
    assert listed["missed"].checkpoints[1].node == "node-2"


def test_an_id_deleted_behind_the_index_is_not_listed_and_gc_repairs_the_index(store, tmp_path):
    s, _ = store
    for n in (1, 2):
        index.record_checkpoint(s, _save(store, tmp_path, "kept", n))
    index.record_checkpoint(s, _save(store, tmp_path, "gone", 1))
    s.delete("gone/0000000001/manifest.json")  # removed by hand: the index still names it
    s.delete("kept/0000000002/manifest.json")
    assert "gone" in index.read_index(s)
    assert _seqs(list_store(s)) == {"kept": [1, 2]}  # a stale row inside a listed ID shows until gc
    assert _seqs(list_store(s, exact=True)) == {"kept": [1]}
    collect_garbage(s, grace_seconds=3600)
    assert set(index.read_index(s)) == {"kept"}
    assert _seqs(list_store(s)) == {"kept": [1]}


def test_a_damaged_shard_is_rewritten_and_never_trusted(store, tmp_path):
    s, _ = store
    m = _save(store, tmp_path, "job", 1)
    s.put_if_version(index.shard_key("job"), b"{not json", s.get_versioned(index.shard_key("job"))[1])
    assert _seqs(list_store(s)) == {"job": [1]}  # read from the manifest instead
    assert index.record_checkpoint(s, m)
    assert index.read_index(s)["job"].checkpoints[0].seq == 1


def test_skips_are_counted_for_an_id_without_any_checkpoint_and_deleting_an_id_forgets_it(store, tmp_path):
    s, _ = store
    for _ in range(3):
        index.record_skip(s, "huge", "estimate 80.0 GB is above max_checkpoint_bytes 64.0 GB")
    index.record_checkpoint(s, _save(store, tmp_path, "done", 1))
    listed = {x.checkpoint_id: x for x in list_store(s)}
    assert listed["huge"].skipped_heartbeats == 3 and not listed["huge"].checkpoints
    assert "above max_checkpoint_bytes" in listed["huge"].last_skip
    assert list_store(s, "huge")[0].skipped_heartbeats == 3
    delete_checkpoint_id(s, "done")
    assert set(index.read_index(s)) == {"huge"} and _seqs(list_store(s)) == {"huge": []}


class _Counting:
    """A store that counts shard reads that sent a body, and conditional ones answered "unchanged"
    (a shard nobody wrote yet is asked for again each time: a 404, no body)."""

    def __init__(self, inner):
        self.inner, self.full, self.unchanged = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_versioned(self, key):
        got = self.inner.get_versioned(key)
        self.full += got[0] is not None
        return got

    def get_if_changed(self, key, token):
        got = self.inner.get_if_changed(key, token)
        if got is None:
            self.unchanged += 1
        else:
            self.full += got[0] is not None
        return got


def test_a_cached_listing_revalidates_each_shard_and_rereads_only_what_changed(store, tmp_path):
    s, _ = store
    for cid in ("a1", "b2", "c3"):
        index.record_checkpoint(s, _save(store, tmp_path, cid, 1))
    written = len({index.shard_key(c) for c in ("a1", "b2", "c3")})
    counting, cache = _Counting(s), index.ShardCache()
    first = list_store(counting, cache=cache)
    assert _seqs(first) == {"a1": [1], "b2": [1], "c3": [1]}
    assert counting.full == written and counting.unchanged == 0
    counting.full = 0
    assert _seqs(list_store(counting, cache=cache)) == _seqs(first)
    assert counting.full == 0 and counting.unchanged == written  # S3: 304s, no bodies
    m = _save(store, tmp_path, "a1", 2)
    index.record_checkpoint(s, m)
    counting.unchanged = 0
    assert _seqs(list_store(counting, cache=cache)) == {"a1": [1, 2], "b2": [1], "c3": [1]}  # fresh at once
    assert counting.full == 1 and counting.unchanged == written - 1  # only a1's shard was read again


def test_an_id_whose_every_heartbeat_failed_is_listed_with_the_count_and_the_latest_line(tmp_path):
    from cedana_airflow.store import index as idx
    from cedana_airflow.store.listing import as_json

    s = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    for pid in (7, 8):
        idx.record_failure(s, "serve", f"criu dump of pid {pid} failed (exit 1): Can't get 1:16 opt")
    [x] = list_store(s)
    assert (x.checkpoint_id, x.failed_heartbeats, x.checkpoints) == ("serve", 2, ())
    assert as_json(x)["last_failure"] == "criu dump of pid 8 failed (exit 1): Can't get 1:16 opt"
    assert list_store(s, "serve")[0].failed_heartbeats == 2


def test_no_two_writes_of_a_shard_are_byte_equal(tmp_path):
    """Two writers making the same change from the same shard write different bytes (a nonce, 0.11.0): the S3
    store's read-back after a retried PUT takes bytes equal to its own for its own write, and would have
    counted a rival's equal shard as its own, losing one increment (review of issue 52, F2)."""
    from cedana_airflow.store import index, open_store

    store = open_store(f"file://{tmp_path / 'store'}")
    store.open(create=True, chunk_avg_bytes=64 << 10)
    written: list[bytes] = []
    put = store.put_if_version
    store.put_if_version = lambda key, data, token: written.append(data) or put(key, data, token)  # type: ignore[method-assign]
    for _ in range(2):
        index._update(store, index.shard_key("job"), lambda ids: None)
    assert len(written) == 2 and written[0] != written[1]
