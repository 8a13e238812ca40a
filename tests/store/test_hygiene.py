"""A store that runs for years stays bounded: expired writer leases, settled quarantine records and a
file store's lock files are collected by gc with the grace rule chunks follow, and ``check`` counts
what nothing references. On the file store (ages set with utime) and on S3 (moto's server, grace 0)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import threading
import time
from pathlib import Path

from cedana_airflow.config import load_settings
from cedana_airflow.format.layout import cas_lock_key, chunk_key, lease_key, quarantine_key
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.store import open_store
from cedana_airflow.store.check import check_store
from cedana_airflow.store.gc import collect_garbage
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint
from conftest import cli, cli_env

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
HOUR = 3600.0


def _lease(ttl: float) -> bytes:
    return json.dumps({"holder": "h", "node": "n", "try_number": 1, "host": "x", "boot_id": "b", "pid_ns": "p",
                       "pid": 1, "pid_start": 1, "ttl_seconds": ttl, "acquired_at": 0, "renewed_at": 0}).encode()


def _record(digest: str) -> bytes:
    return json.dumps({"digest": digest, "at": 0, "node": "n", "why": "test"}).encode()


def _store(url: str):
    s = open_store(url, load_settings(environ={}))
    return s, s.open(create=True, chunk_avg_bytes=64 << 10)


def _one_checkpoint(s, cfg, tmp_path: Path):
    d = tmp_path / "img"
    d.mkdir()
    # more than one chunk can hold (four times the 64 KiB average, 256 KiB): never fewer than two chunks
    # (150 KB of os.urandom came out as one chunk in a CI run, and the test that needs two failed)
    (d / "pages-1.img").write_bytes(random.Random(45).randbytes(600_000))
    return save_checkpoint(s, cfg, CheckpointMeta("job", "n1", "4.1.1", PROC), d)


def _age(root: Path, key: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(root / key, (t, t), follow_symlinks=False)


def test_gc_collects_what_has_expired_and_keeps_what_is_still_in_use_file_store(tmp_path):
    root = tmp_path / "store"
    s, cfg = _store(f"file://{root}")
    m = _one_checkpoint(s, cfg, tmp_path)
    named = sorted(m.chunk_digests())
    healed, still_missing, forgotten = named[0], named[1], "f" * 64
    s.delete(chunk_key(still_missing))  # a referenced chunk a writer must upload again: its record must stay
    for d in (healed, still_missing, forgotten):
        s.put_if_absent(quarantine_key(d), _record(d))
        _age(root, quarantine_key(d), 2 * HOUR)
    s.put_if_absent(quarantine_key("e" * 64), _record("e" * 64))  # settled, but young: kept for now
    for cid, ttl, age in (("gone", 60, 2 * HOUR), ("alive", 60, 5), ("long-ttl", 4 * HOUR, 2 * HOUR)):
        s.put_if_version(lease_key(cid), _lease(ttl), "")  # through the sidecar lock, as writers do
        _age(root, lease_key(cid), age)
        _age(root, cas_lock_key(lease_key(cid)), 2 * HOUR)
    held = os.open(root / cas_lock_key(lease_key("alive")), os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a writer in its compare-and-swap right now

    checked = check_store(s)
    assert checked.unreferenced == {"chunks": 0, "chunk_bytes": 0, "young_chunks": 0, "temp": 0, "expired_leases": 1,
                                    "settled_quarantine": 2, "lock_files": 3}
    report = collect_garbage(s)
    os.close(held)
    assert (report.leases_removed, report.quarantine_removed, report.sidecars_removed) == (1, 2, 2)
    leases = sorted(p.name for p in (root / "leases").iterdir())
    assert leases == [".lock-alive.json", "alive.json", "long-ttl.json"]
    assert sorted(p.name for p in (root / "quarantine").iterdir()) == sorted([f"{'e' * 64}.json", f"{still_missing}.json"])
    assert check_store(s).unreferenced["expired_leases"] == 0 and not check_store(s).missing.keys() - {still_missing}


def test_a_writer_waiting_on_a_lock_file_gc_removes_takes_the_new_one_file_store(tmp_path):
    root = tmp_path / "store"
    s, _ = _store(f"file://{root}")
    key = lease_key("job")
    assert s.put_if_version(key, _lease(60), "")
    sidecar = root / cas_lock_key(key)
    a = os.open(sidecar, os.O_RDWR)
    fcntl.flock(a, fcntl.LOCK_EX)  # writer A is inside its compare-and-swap
    token = s.get_versioned(key)[1]
    done: list[bool] = []
    b = threading.Thread(target=lambda: done.append(s.put_if_version(key, _lease(61), token)))
    b.start()  # writer B queues on the same sidecar
    time.sleep(0.2)
    s.delete(cas_lock_key(key))  # gc: A holds it, so it stays
    assert sidecar.exists()
    sidecar.unlink()  # had gc removed it between B's open and B's lock, B must not trust the unlinked one:
    os.close(a)
    b.join(5)
    assert done == [True] and sidecar.exists()  # B locked the file that is there now, and wrote
    assert json.loads(s.get(key))["ttl_seconds"] == 61


def test_gc_collects_expired_leases_and_settled_quarantine_records_on_s3(tmp_path, bucket, s3_env):
    s, cfg = _store(f"s3://{bucket}/hygiene")
    m = _one_checkpoint(s, cfg, tmp_path)
    healed = sorted(m.chunk_digests())[0]
    s.put_if_absent(quarantine_key(healed), _record(healed))
    s.put_if_version(lease_key("gone"), _lease(0), "")
    s.put_if_version(lease_key("alive"), _lease(600), "")
    time.sleep(1.1)  # S3's LastModified has whole seconds
    report = collect_garbage(s, grace_seconds=0)
    assert (report.leases_removed, report.quarantine_removed, report.sidecars_removed) == (1, 1, 0)
    assert s.get(lease_key("gone")) is None and s.get(lease_key("alive")) is not None
    assert s.get(quarantine_key(healed)) is None


def test_cli_check_and_gc_say_what_expired(tmp_path):
    root = tmp_path / "store"
    s, _ = _store(f"file://{root}")
    s.put_if_version(lease_key("gone"), _lease(60), "")
    _age(root, lease_key("gone"), 2 * HOUR)
    env = cli_env(tmp_path, "n", "w")
    r = cli("check", env=env)
    assert r.returncode == 0 and "1 expired writer lease(s)" in r.stdout and r.stdout.rstrip().endswith("clean")
    r = cli("gc", "--json", env=env)
    assert json.loads(r.stdout)["leases_removed"] == 1
    assert not (root / lease_key("gone")).exists()


def test_young_objects_are_spared_whatever_their_kind_file_store(tmp_path):
    root = tmp_path / "store"
    s, _ = _store(f"file://{root}")
    s.put_if_version(lease_key("new"), _lease(0), "")
    s.put_if_absent(quarantine_key("a" * 64), _record("a" * 64))
    report = collect_garbage(s, grace_seconds=HOUR)
    assert (report.leases_removed, report.quarantine_removed, report.sidecars_removed) == (0, 0, 0)
