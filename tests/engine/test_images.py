"""CRIU image reading, against a real dump."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.engine.images import image_entries, read_dump_stats
from cedana_airflow.run.workload import Workload

pytestmark = pytest.mark.integration


def test_dump_stats_and_pagemap_of_a_real_dump(tmp_path):
    devnull = open("/dev/null", "wb")
    w = Workload.start([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"], stdout=devnull, stderr=devnull)
    try:
        time.sleep(0.3)
        r = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX))).dump(w.pid, tmp_path / "images")
    finally:
        w.stop(1)
    st = read_dump_stats(r.image_dir)
    assert 0 < st["frozen"] <= r.seconds and st["pages_written"] > 0
    assert r.freeze_seconds == st["frozen"]
    head, *entries = image_entries(next(r.image_dir.glob("pagemap-*.img")))
    # vaddr, and nr_pages: field 5 from CRIU 4.2 (uint64), compat_nr_pages (2) before
    assert entries and all(isinstance(e.get(1), int) and e.get(5, e.get(2, 0)) > 0 for e in entries)
    assert read_dump_stats(tmp_path) == {}  # no stats-dump there


def test_a_failed_criu_step_names_the_error_that_stopped_it_not_a_warning_on_the_way(tmp_path):
    from cedana_airflow.engine.criu import _log_tail

    log = tmp_path / "restore.log"
    log.write_text(
        "(00.000100) Warn  (criu/cr-restore.c:123): something harmless\n"
        "(00.000200) Error (criu/rlimit.c:45): Can't set rlimit 7 to 1048576: Operation not permitted\n"
        "(00.010000) Error (criu/cr-restore.c:1479): Can't fork for 7: File exists\n"
        "(00.020000) Error (criu/cr-restore.c:2415): Restoring FAILED.\n")
    assert _log_tail(log) == "(00.010000) Error (criu/cr-restore.c:1479): Can't fork for 7: File exists"
