"""Limits a heartbeat respects, with real CRIU: files held open for writing too big to copy while frozen
(max_captured_bytes), and a checkpoint that takes longer than a stop leaves (stop_window_seconds)."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import TRAIN, cli, cli_env, kill_node, manifests, start_cli, wait_for_checkpoints

pytestmark = pytest.mark.integration

#: Appends 100 KB per step to out.bin, held open for writing all along.
GROWING = """
import time
with open("out.bin", "ab") as f:
    for i in range(40):
        f.write(bytes([i % 256]) * 100_000)
        f.flush()
        print(f"step {i}", flush=True)
        time.sleep(0.1)
print("done", flush=True)
"""


def test_a_file_held_open_that_grows_past_max_captured_bytes_skips_heartbeats_and_the_workload_is_unharmed(tmp_path):
    env = cli_env(tmp_path, "node-a", "work-a", CEDANA_MAX_CAPTURED_BYTES="1000000")
    r = cli("run", "--id", "cap", "--heartbeat", "0.3", "--", sys.executable, "-c", GROWING, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"step {i}" for i in range(40)] + ["done"]
    assert (tmp_path / "out.bin").stat().st_size == 40 * 100_000  # every write landed, once
    said = re.findall(r"heartbeat skipped checkpoint_id=cap: files it holds open for writing total (\d+) bytes, above "
                      rf"max_captured_bytes 1000000 \(the largest: {re.escape(str(tmp_path / 'out.bin'))}, (\d+) bytes\)",
                      r.stderr)
    assert len(said) == 1 and int(said[0][0]) > 1_000_000, r.stderr[-3000:]  # once, not every heartbeat
    skipped = int(re.search(r"skipped_heartbeats=(\d+)", r.stderr).group(1))
    assert skipped >= 1
    # what was stored holds no copy above the limit
    assert all(sum(c["size"] for c in m["captured"]) <= 1_000_000 for m in manifests(tmp_path / "store", "cap"))


def test_a_checkpoint_longer_than_the_stop_window_is_said_once(tmp_path):
    env = cli_env(tmp_path, "node-a", "work-a", CEDANA_STOP_WINDOW_SECONDS="0.001")
    r = cli("run", "--id", "window", "--heartbeat", "0.5", "--", sys.executable, str(TRAIN),  # 6 s: two heartbeats, loaded too
            "--mb", "20", "--steps", "60", "--step-seconds", "0.1", env=env)
    assert r.returncode == 0, r.stderr
    assert len(manifests(tmp_path / "store", "window")) >= 2
    said = re.findall(r"a stop will fall back to the last heartbeat checkpoint_id=window: this checkpoint \(seq \d+, \d+ "
                      r"bytes\) took [\d.]+ s \(frozen [\d.]+ s\), more than the 0\.0 s a stop leaves", r.stderr)
    assert len(said) == 1, r.stderr[-3000:]
    quiet = cli("run", "--id", "window2", "--heartbeat", "0.5", "--", sys.executable, str(TRAIN),
                "--mb", "20", "--steps", "10", "--step-seconds", "0.1", env=cli_env(tmp_path, "node-a", "work-a"))
    assert quiet.returncode == 0 and "a stop will fall back" not in quiet.stderr  # 0: not checked (the CLI's default)


def test_at_start_a_restored_checkpoint_that_froze_longer_than_the_stop_window_is_said(tmp_path):
    args = ["--mb", "20", "--steps", "40", "--step-seconds", "0.1"]
    proc = start_cli("run", "--id", "start", "--heartbeat", "0.5", "--", sys.executable, str(TRAIN), *args,
                     env=cli_env(tmp_path, "node-a", "work-a"), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "start", 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    env = cli_env(tmp_path, "node-b", "work-b", CEDANA_STOP_WINDOW_SECONDS="0.0001")
    r = cli("restore", "--id", "start", env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"a stop will fall back to the last heartbeat checkpoint_id=start: the restored checkpoint, when "
                     r"it was taken, \(seq \d+, \d+ bytes\) took [\d.]+ s", r.stderr), r.stderr[-3000:]
    assert r.stderr.count("a stop will fall back") == 1
