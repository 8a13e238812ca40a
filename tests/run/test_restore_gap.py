"""The restore gap and license leases: a checkpoint too old to restore makes the workload start fresh."""

from __future__ import annotations

import json
import re
import logging
import os
import time
from datetime import datetime, timedelta, timezone

from cedana_airflow.config import load_settings
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.format.selection import AgeLimit
from cedana_airflow.run.restore_gap import judge_restore_gap
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint


def test_a_checkpoint_older_than_max_restore_gap_or_the_lease_is_not_restored(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    images = tmp_path / "img"
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(5000))
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    save_checkpoint(store, cfg, CheckpointMeta("rt", "n", "4.1.1", proc), images)
    assert judge_restore_gap(store, "rt", [AgeLimit("max_restore_gap", 60)]).resume is True
    assert judge_restore_gap(store, "rt", []).resume is True
    assert judge_restore_gap(store, "nothing-yet", [AgeLimit("lease", 0)]).resume is True  # nothing to refuse
    time.sleep(1.2)
    stale = judge_restore_gap(store, "rt", [AgeLimit("max_restore_gap", 300), AgeLimit("lease", 1)])
    assert stale.resume is False  # the lease ran out: starting fresh, and the log says why
    assert stale.notes[-1][0] == logging.WARNING and "beyond lease = 1 s: starting fresh" in stale.notes[-1][1]
    renewed = judge_restore_gap(store, "rt", [AgeLimit("lease", 1)], ["sh", "-c", 'test "$CEDANA_CHECKPOINT_ID" = rt'])
    assert renewed.resume is True  # the hook re-checked-out the license
    assert "the lease was renewed" in renewed.notes[-1][1]
    refused = judge_restore_gap(store, "rt", [AgeLimit("lease", 1)], ["false"])
    assert refused.resume is False and any("lease_renew_command exited 1" in n for _, n in refused.notes)
    # a renewed lease does not excuse a real-time reader's gap
    assert judge_restore_gap(store, "rt", [AgeLimit("lease", 1), AgeLimit("max_restore_gap", 1)], ["true"]).resume is False


def _two_checkpoints_the_newest_corrupt(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    for n in (1, 2):
        images = tmp_path / f"img{n}"
        images.mkdir()
        (images / "pages-1.img").write_bytes(os.urandom(5000))
        m = save_checkpoint(store, cfg, CheckpointMeta("rt", "n", "4.1.1", proc), images)
        if n == 1:  # an hour old (written back unsigned, as a store writer could): no sleep, no race with load
            path = tmp_path / "store" / "rt" / f"{m.seq:010d}" / "manifest.json"
            doc = json.loads(path.read_text())
            doc["created_at"] = (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat()
            path.write_text(json.dumps(doc))
    chunk = tmp_path / "store" / "chunks" / m.files[0].chunks[0].digest[:2] / m.files[0].chunks[0].digest
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))  # the newest checkpoint no longer verifies


def test_a_fallback_never_restores_a_checkpoint_older_than_max_restore_gap(tmp_path):
    from conftest import cli, cli_env

    _two_checkpoints_the_newest_corrupt(tmp_path)
    # full: its corrupt chunk is in pages-1.img, which a lazy restore would meet only while streaming
    # a node that accepts unsigned manifests (seq 1 was rewritten by hand): the gap is judged per candidate there too
    env = cli_env(tmp_path, "node-b", "work", CEDANA_RESTORE_MODE="full", CEDANA_ALLOW_UNSIGNED="true")
    r = cli("restore", "--id", "rt", "--max-restore-gap", "600", env=env)
    last = r.stderr.strip().splitlines()[-1]  # each refusal is logged as it happens; the error is the last line
    assert r.returncode == 1 and last.startswith("CorruptCheckpoint: no checkpoint under checkpoint ID 'rt'"), r.stderr
    assert "does not match its digest" in last and re.search(r"seq 1 is 36\d\d s old, beyond max_restore_gap = 600 s", last)
    # 0 is a limit too (nothing is young enough), not "no limit"
    never = cli("restore", "--id", "rt", "--max-restore-gap", "0", env=env)
    assert never.returncode == 1 and "beyond max_restore_gap = 0 s" in never.stderr.strip().splitlines()[-1]
    # run --resume: with nothing young enough left, the command starts fresh and says why
    fresh = cli("run", "--id", "rt", "--resume", "--max-restore-gap", "1", "--", "sh", "-c", "echo fresh start", env=env)
    assert fresh.returncode == 0 and fresh.stdout == "fresh start\n"
    assert "beyond max_restore_gap" in fresh.stderr and "starting fresh" in fresh.stderr
