"""Retention, garbage collection and the locks that keep them from racing checkpoint writers,
on the file store and on S3 (moto's server over HTTP)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from cedana_airflow.errors import StoreBusy
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.store.gc import collect_garbage, delete_checkpoint_id, prune_checkpoints
from cedana_airflow.store.locks import acquire_gc, acquire_writer
from cedana_airflow.store.transfer import CheckpointMeta, fetch_checkpoint, load_manifests, save_checkpoint
from conftest import cli, cli_env

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


@pytest.fixture
def store(file_or_s3_store):
    return file_or_s3_store


def _save(store, tmp_path: Path, n: int, cid: str = "job"):
    s, cfg = store
    d = tmp_path / f"img-{cid}-{n}"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(200_000))  # all-new chunks each time
    return save_checkpoint(s, cfg, CheckpointMeta(cid, "n1", "4.1.1", PROC), d)


def test_retention_keeps_the_newest_and_gc_removes_only_unreferenced_old_chunks(store, tmp_path):
    s, _ = store
    ms = [_save(store, tmp_path, i) for i in range(5)]
    _, removed = prune_checkpoints(s, "job", keep=3)
    assert [m.seq for m in removed] == [2, 1]
    assert [m.seq for m in load_manifests(s, "job")] == [5, 4, 3]

    dry = collect_garbage(s, grace_seconds=0, dry_run=True)
    orphans = set().union(*(m.chunk_digests() for m in ms[:2]))
    assert dry.chunks_removed == len(orphans) and dry.chunks_kept == len(set().union(*(m.chunk_digests() for m in ms[2:])))
    assert all(s.has_chunk(d) for d in orphans)  # a dry run removes nothing

    young = collect_garbage(s, grace_seconds=3600)
    assert young.chunks_removed == 0 and young.young_unreferenced == len(orphans)  # the grace period spares them

    done = collect_garbage(s, grace_seconds=0)
    assert done.chunks_removed == len(orphans) and not any(s.has_chunk(d) for d in orphans)
    for m in load_manifests(s, "job"):
        fetch_checkpoint(s, m, tmp_path / f"out-{m.seq}")  # what is kept still restores


def test_gc_waits_for_writers_and_writers_skip_while_gc_runs(store):
    s, _ = store
    writer = acquire_writer(s)
    with pytest.raises(StoreBusy, match="checkpoint\\(s\\) are still being written \\(e.g. by .*Retry gc"):
        acquire_gc(s)
    writer.release(s)
    gc = acquire_gc(s)
    with pytest.raises(StoreBusy, match="garbage collection by .* is running. This checkpoint is skipped"):
        acquire_writer(s)
    with pytest.raises(StoreBusy, match="already running"):
        acquire_gc(s)
    gc.release(s)
    acquire_writer(s).release(s)


def test_a_lock_left_by_a_dead_process_is_stale(store):
    s, _ = store
    dead = {"kind": "gc", "host": os.uname().nodename, "pid": 2**22 + 7, "time": time.time()}
    assert s.put_if_absent("locks/gc", json.dumps(dead).encode())
    acquire_writer(s).release(s)  # not blocked: the holder is gone
    acquire_gc(s).release(s)


def test_delete_checkpoint_id_removes_every_checkpoint_of_that_id_only(store, tmp_path):
    s, _ = store
    _save(store, tmp_path, 0, "done")
    _save(store, tmp_path, 1, "done")
    _save(store, tmp_path, 2, "other")
    assert delete_checkpoint_id(s, "done") == 2
    assert s.list_seqs("done") == [] and s.list_seqs("other") == [1]


def test_cli_gc_and_delete_on_success(tmp_path):
    env = cli_env(tmp_path, "n", "w", CEDANA_DELETE_ON_SUCCESS="true")
    r = cli("run", "--id", "ok", "--heartbeat", "0.3", "--", "sleep", "1.2", env=env)
    assert r.returncode == 0 and "cedana: checkpoint seq=1: " in r.stderr
    assert "checkpoints deleted checkpoint_id=ok" in r.stderr
    assert json.loads(cli("checkpoints", "--json", env=env).stdout) == []
    g = cli("gc", "--grace", "0", "--dry-run", env=env)
    assert g.returncode == 0 and g.stdout.startswith("would remove ") and "kept 0 chunk(s) named by 0 checkpoint(s)" in g.stdout
    g = cli("gc", "--grace", "0", "--json", env=env)
    report = json.loads(g.stdout)
    assert report["chunks_removed"] > 0 and report["dry_run"] is False
    assert not any(p.is_file() for p in (tmp_path / "store" / "chunks").rglob("*"))


def test_gc_holds_its_lock_while_it_waits_for_the_writers_under_way_and_then_runs(store):
    # Under 32 writers heartbeating every 2 s, a gc that dropped its lock at the first writer it saw
    # never ran (5 of 5 failed, docs/faults.md); one that waits holds new writers off and gets its turn.
    s, _ = store
    writer, releasing = acquire_writer(s), threading.Event()

    def finish() -> None:
        releasing.set()  # before the release: set after it, a gc that saw the release at once read as early
        writer.release(s)

    threading.Timer(1.0, finish).start()
    gc = acquire_gc(s, wait_seconds=60, poll_seconds=0.1)
    assert releasing.is_set()  # it got the store once that writer was done, not before
    with pytest.raises(StoreBusy, match="This checkpoint is skipped"):  # a new writer meanwhile
        acquire_writer(s)
    gc.release(s)

    writer = acquire_writer(s)
    with pytest.raises(StoreBusy, match=r"1 checkpoint\(s\) are still being written after waiting 0.3 s .*gc --wait"):
        acquire_gc(s, wait_seconds=0.3, poll_seconds=0.1)
    writer.release(s)
    acquire_writer(s).release(s)  # a gc that gave up left no lock behind
