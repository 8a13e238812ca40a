"""max_checkpoint_bytes holds for what is stored, not only for what was estimated.

The estimate (run/estimate.py) is read before the freeze; two things make a real dump bigger than it: a
memfd filled with write() (nobody's resident memory, all of it in CRIU's images) and memory the tree
allocates between the estimate and the freeze. Real CRIU dumps here, a file:// store.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.run import checkpointer as checkpointer_module
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.run.estimate import Estimate, estimate_checkpoint
from cedana_airflow.run.workload import Workload
from cedana_airflow.store import open_store

pytestmark = pytest.mark.integration

LIMIT = 48 << 20
# 64 MB written into a memfd nobody maps: resident memory stays at the interpreter's ~10 MB.
MEMFD = ("import os, sys, time\n"
         "fd = os.memfd_create('blob')\n"
         "for _ in range(64): os.write(fd, os.urandom(1 << 20))\n"
         "print('ready', flush=True)\n"
         "while True: time.sleep(0.05)\n")
# 64 MB of bytes objects the interpreter keeps: resident memory.
RESIDENT = ("import os, time\n"
            "keep = [os.urandom(1 << 20) for _ in range(64)]\n"
            "print('ready', flush=True)\n"
            "while True: time.sleep(0.05)\n")


def _start(tmp_path: Path, source: str) -> Workload:
    out = tmp_path / "out"
    w = Workload.start([sys.executable, "-c", source], stdout=open(out, "wb"), stderr=open("/dev/null", "wb"))
    deadline = time.monotonic() + 30
    while b"ready" not in out.read_bytes():
        assert time.monotonic() < deadline, "the workload never got ready"
        time.sleep(0.05)
    return w


def _checkpointer(tmp_path: Path) -> Checkpointer:
    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=256 << 10)
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    return Checkpointer(engine, store, cfg, "job", Settings(node="node-a", max_checkpoint_bytes=LIMIT),
                        work_dir=tmp_path / "work")


def test_a_memfd_the_workload_filled_counts_in_the_estimate_and_the_heartbeat_is_skipped_before_any_freeze(
        tmp_path, caplog):
    w = _start(tmp_path, MEMFD)
    try:
        e = estimate_checkpoint(w.pids(), gpu=False)
        assert e.rss_bytes < LIMIT and e.memfd_bytes >= 64 << 20  # resident memory alone would let it through
        cp = _checkpointer(tmp_path)
        with caplog.at_level(logging.WARNING, logger="cedana_airflow"):
            assert cp.checkpoint(w) is None
        assert w.poll() is None  # still running
    finally:
        w.stop(1)
    assert cp.skipped == 1 and cp.store.list_seqs("job") == []
    said = [r.getMessage() for r in caplog.records if "heartbeat skipped" in r.getMessage()]
    assert len(said) == 1 and ", memfd 6" in said[0] and f"above max_checkpoint_bytes {LIMIT}" in said[0], said
    assert not list((tmp_path / "work").glob("dump-*"))  # no freeze, no images: the estimate said no


def test_a_tree_that_grew_after_its_estimate_is_dumped_but_not_stored_and_keeps_running(tmp_path, monkeypatch, caplog):
    # The race (a tensor allocated between the estimate and the freeze) made certain: the estimate
    # reads nothing, as if it had been taken a moment before the 64 MB were allocated.
    monkeypatch.setattr(checkpointer_module, "estimate_checkpoint", lambda pids, gpu=True: Estimate(0, 0))
    w = _start(tmp_path, RESIDENT)
    try:
        cp = _checkpointer(tmp_path)
        with caplog.at_level(logging.WARNING, logger="cedana_airflow"):
            assert cp.checkpoint(w) is None
        assert w.poll() is None and cp.skipped == 1 and cp.store.list_seqs("job") == []
        assert not list((tmp_path / "work").glob("dump-*"))  # the images it did write are gone from the disk
        said = [r.getMessage() for r in caplog.records if "heartbeat skipped" in r.getMessage()]
        assert len(said) == 1 and "(the tree grew after its estimate)" in said[0], said
        assert f"above max_checkpoint_bytes {LIMIT}; the workload keeps running" in said[0]
        # A final checkpoint is another matter: CRIU has stopped the tree, its images are all that is left.
        with caplog.at_level(logging.WARNING, logger="cedana_airflow"):
            m = cp.checkpoint(w, leave_running=False)
        assert m is not None and m.image_bytes > LIMIT and cp.store.list_seqs("job") == [m.seq]
        assert any("stored anyway, the workload has stopped" in r.getMessage() for r in caplog.records)
    finally:
        w.stop(1)
