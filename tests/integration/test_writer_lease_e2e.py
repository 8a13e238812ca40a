"""Two supervisors of one checkpoint ID, with real CRIU and the CLI: the second one of the same try is
refused, a newer try takes over and the old supervisor stops writing, so seqs never interleave."""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

from conftest import TRAIN, cli, cli_env, manifests, start_cli, wait_for_checkpoints, wait_gone

pytestmark = pytest.mark.integration


def test_a_second_supervisor_is_refused_and_a_newer_try_fences_the_first(tmp_path):
    train = [sys.executable, str(TRAIN), "--mb", "20", "--steps", "1000", "--step-seconds", "0.1"]
    store = tmp_path / "store"
    lease = {"CEDANA_WRITER_LEASE_SECONDS": "3"}
    a = start_cli("run", "--id", "twice", "--heartbeat", "1", "--", *train,
                  env=cli_env(tmp_path, "node-a", "work-a", **lease), out=tmp_path / "a")
    c = None
    try:
        wait_for_checkpoints(store, "twice", 2, a)

        # Same try, while node-a is alive and renewing: refused with one line, nothing started.
        b = cli("run", "--id", "twice", "--heartbeat", "1", "--", *train, env=cli_env(tmp_path, "node-b", "work-b", **lease),
                timeout=60)
        assert b.returncode == 1, b.stderr
        last = b.stderr.strip().splitlines()[-1]
        assert last.startswith("WriterLeaseHeld: checkpoint ID twice is being written by node node-a (try 0"), last
        assert b.stdout == ""  # the workload never started
        assert {m["node"] for m in manifests(store, "twice")} == {"node-a"}

        # A newer try resumes and takes over at once; node-a notices and stops writing.
        c = start_cli("run", "--id", "twice", "--resume", "--try-number", "1", "--heartbeat", "1", "--", *train,
                      env=cli_env(tmp_path, "node-c", "work-c", **lease), out=tmp_path / "c")
        deadline = time.monotonic() + 60
        while "writer lease lost" not in (tmp_path / "a.err").read_text():
            assert time.monotonic() < deadline, (tmp_path / "a.err").read_text()[-2000:]
            assert c.poll() is None, (tmp_path / "c.err").read_text()[-2000:]
            time.sleep(0.2)
        fenced_at = max(m["seq"] for m in manifests(store, "twice"))
        while max(m["seq"] for m in manifests(store, "twice")) < fenced_at + 3:  # retention keeps 3: count seqs
            assert time.monotonic() < deadline + 60 and c.poll() is None, (tmp_path / "c.err").read_text()[-2000:]
            time.sleep(0.2)
        assert a.poll() is None  # node-a's workload runs on; only its checkpoints stopped
    finally:
        for p in (a, c):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in (a, c):
            if p is not None:
                p.wait(60)
    later = [m for m in manifests(store, "twice") if m["seq"] > fenced_at]
    # node-a stopped writing: at most the one commit that was past its last lease check when node-c took
    # over (the documented window of one request: docs/store-format.md, "Fencing"), never more
    fenced = (tmp_path / "a.err").read_text()
    assert len(re.findall(r"checkpoint seq=\d+: ", fenced.split("writer lease lost", 1)[1])) <= 1, fenced[-3000:]
    assert ("node-c", 1) in {(m["node"], m["try_number"]) for m in later}, later
    assert len([m for m in later if (m["node"], m["try_number"]) != ("node-c", 1)]) <= 1, later
    assert fenced.count("node-c") == 1 and "heartbeat failed" not in fenced  # one line names who took over
    for p in (tmp_path / "a.out", tmp_path / "c.out"):
        assert p.exists()
    wait_gone(a.pid, 5)
