"""What the speed work of issue 34 must not cost: a restore that says where its time went
(``restore --timings``), and a full restore whose pages stream into CRIU (``full_restore_via =
stream``) that ends where an uninterrupted run ends, and refuses a corrupt chunk as the plain one does."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from cedana_airflow.engine.page_file import FSTYPE, fuse_available
from cedana_airflow.errors import StoreUnavailable
from cedana_airflow.units import binary_size
from conftest import (TRAIN, cli, cli_env, kill_node, manifests, ours, restore_as_the_s3_store_goes_away, start_cli,
                      uninterrupted_digest, wait_for_checkpoints)

pytestmark = pytest.mark.integration

needs_fuse = pytest.mark.skipif(not fuse_available()[0], reason="no usable /dev/fuse")


def _train(*extra: str) -> list[str]:
    return [sys.executable, str(TRAIN), *extra]


def _checkpointed_and_lost(tmp_path: Path, cid: str, args: list[str], n: int) -> list[dict]:
    proc = start_cli("run", "--id", cid, "--heartbeat", "1", "--", *_train(*args),
                     env=cli_env(tmp_path, "node-a", "work-a"), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", cid, n, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    shutil.rmtree(tmp_path / "work-a")
    return manifests(tmp_path / "store", cid)


def _no_page_files_left(under: Path) -> bool:
    """No page file of this test is mounted (a neighbour's lazy restore may have its own meanwhile)."""
    return not any(FSTYPE in ln and ln.split()[4].startswith(str(under)) for ln in open("/proc/self/mountinfo"))


@pytest.mark.parametrize("mode", ["lazy", "full"])
def test_restore_timings_say_where_the_time_went(tmp_path, mode):
    args = ["--mb", "120", "--steps", "40", "--step-seconds", "0.1"]
    _checkpointed_and_lost(tmp_path, f"tl-{mode}", args, 1)
    r = cli("restore", "--id", f"tl-{mode}", "--timings", "--json",
            env=cli_env(tmp_path, "node-b", "work-b", CEDANA_RESTORE_MODE=mode))
    assert r.returncode == 0, r.stderr
    *out, last = r.stdout.splitlines()
    assert out[-1] == uninterrupted_digest(*args)
    assert f"restore timeline ({mode}; seconds from the restore's start):" in r.stderr
    t = json.loads(last)["restore_timings"]
    names = [s["name"] for s in t["spans"]]
    steps = ["manifests", "checks", "mode", "fetch"] + (["fill", "page_source_start"] if mode == "lazy" else []) \
        + ["criu_restore", "adopt"]
    assert names == steps, names
    assert t["mode"] == mode
    starts = [s["start"] for s in t["spans"]]
    assert starts == sorted(starts) and all(s["seconds"] >= 0 for s in t["spans"])
    # CRIU's own phases, from the stats-restore image it left: it restored every page or (lazy) the eager ones
    assert t["criu"]["restore"] > 0 and t["criu"]["pages_restored"] > 0
    # the same figures on stderr as a person reads them (issue 51): a count whole, seconds with their unit
    assert re.search(rf"pages_restored {t['criu']['pages_restored']:.0f}(,|$)", r.stderr, re.M), r.stderr
    assert f"restore {t['criu']['restore']:.3f} s" in r.stderr, r.stderr
    marks = t["marks"]
    assert 0 < marks["resumed"] <= marks["first_output"]
    assert ("pages_in" in marks) == (mode == "lazy")
    # every page came from the store through verified chunks: the reads cover the pages images
    pages = sum(f["size"] for f in manifests(tmp_path / "store", f"tl-{mode}")[-1]["files"] if f["name"].startswith("pages-"))
    assert t["store_reads"]["total"]["bytes"] >= pages
    assert t["store_reads"]["total"]["verify_seconds"] > 0
    if mode == "lazy":
        assert t["page_source"]["served_bytes"] > 0
        assert f"served {binary_size(t['page_source']['served_bytes'])}" in r.stderr, r.stderr  # not raw bytes
        assert t["store_reads"]["by_resume"]["bytes"] <= t["store_reads"]["total"]["bytes"]


@needs_fuse
def test_a_streamed_full_restore_ends_with_the_uninterrupted_digest(tmp_path):
    # 10 s of steps: after the loss, the restored tree still has time for a heartbeat, on a busy machine too
    args = ["--mb", "150", "--steps", "100", "--step-seconds", "0.1"]
    _checkpointed_and_lost(tmp_path, "stream-1", args, 1)
    r = cli("restore", "--id", "stream-1", "--heartbeat", "1",
            env=cli_env(tmp_path, "node-b", "work-b", CEDANA_RESTORE_MODE="full", CEDANA_FULL_RESTORE_VIA="stream"))
    assert r.returncode == 0, r.stderr
    assert "streamed restore checkpoint_id=stream-1 seq=1 pushed_bytes=" in r.stderr
    assert "(node node-a) on node node-b: " in r.stderr and "checkpoint_id=stream-1, mode full" in r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*args)
    assert any(m["node"] == "node-b" for m in manifests(tmp_path / "store", "stream-1"))  # heartbeats went on
    assert _no_page_files_left(tmp_path)


@needs_fuse
def test_a_corrupt_chunk_in_a_streamed_restore_refuses_that_checkpoint_and_restores_the_older(tmp_path):
    args = ["--mb", "120", "--steps", "60", "--step-seconds", "0.1"]
    ms = _checkpointed_and_lost(tmp_path, "stream-bad", args, 2)
    newest, older = ms[-1], ms[-2]
    # a chunk of the newest's pages that the older one does not hold: only the newest is damaged
    [pages] = [f for f in newest["files"] if f["name"].startswith("pages-")]
    older_digests = {c["digest"] for f in older["files"] for c in f["chunks"]}
    victim = next(c["digest"] for c in pages["chunks"] if c["digest"] not in older_digests)
    path = tmp_path / "store" / "chunks" / victim[:2] / victim
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))

    r = cli("run", "--id", "stream-bad", "--resume", "--", *_train(*args),
            env=cli_env(tmp_path, "node-b", "work-b", CEDANA_RESTORE_MODE="full", CEDANA_FULL_RESTORE_VIA="stream"))
    assert r.returncode == 0, r.stderr
    assert f"checkpoint refused checkpoint_id=stream-bad seq={newest['seq']}" in r.stderr
    assert f"chunk {victim}" in r.stderr and "falling back to the previous one" in r.stderr
    assert f"restored seq {older['seq']} " in r.stderr and "checkpoint_id=stream-bad," in r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*args)
    assert _no_page_files_left(tmp_path)


@needs_fuse
def test_the_store_going_away_mid_stream_fails_the_try_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    # the S3 server stops once the page files are mounted (CRIU is about to read the pages, or reads them)
    failed = restore_as_the_s3_store_goes_away(tmp_path, monkeypatch, reading=lambda: not _no_page_files_left(tmp_path),
                                               restore_mode="full", full_restore_via="stream")
    # the store's fault, not the checkpoint's: the try fails (Airflow retries it), no older one is tried
    assert len(failed) == 1 and isinstance(failed[0], StoreUnavailable), failed
    assert "\n" not in str(failed[0]) and "s3://gone/ckpt" in str(failed[0])
    assert not ours(str(TRAIN)) and not ours("criu restore")
    assert _no_page_files_left(tmp_path)
