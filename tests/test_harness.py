"""The suite's own bookkeeping (tests/harness.py) survives what killed CI's run of stop 55: a test
record cut short by a full disk made the controller's summary crash, failing a run whose tests passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent


def test_a_record_cut_short_by_a_full_disk_is_reported_and_the_rest_are_read(tmp_path, monkeypatch):
    env = {**os.environ, harness.RUN_ENV: str(tmp_path), "PYTEST_XDIST_WORKER": "gw7"}
    record = "harness.record_test('tests/x.py::t{n}', 1.0 + {n}, 2.0 + {n}, 0.5, {{}})"
    subprocess.run([sys.executable, "-c", f"import harness; {record.format(n=1)}"], cwd=HERE, env=env, check=True)
    # the same write on a disk with one byte left: the kernel writes what fits (a file size limit does
    # what a full disk does, to one process), and the worker goes on
    full = ("import resource, signal, harness\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "size = (harness.run_dir() / 'tests-gw7.jsonl').stat().st_size\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1, resource.RLIM_INFINITY))\n"
            f"{record.format(n=2)}\nprint('worker goes on')\n")
    r = subprocess.run([sys.executable, "-c", full], cwd=HERE, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "worker goes on\n", r.stderr
    assert "tests/x.py::t2: its record for the run's timeline was not written (1 of " in r.stderr
    assert (tmp_path / "tests-gw7.jsonl").read_text().endswith("\n[")  # what CI's controller choked on

    (tmp_path / "tests-gw8.jsonl").write_text(json.dumps(["tests/y.py::u", "gw8", 0.5, 0.7, 0.1, []]) + "\n")
    monkeypatch.setenv(harness.RUN_ENV, str(tmp_path))
    timeline, unreadable = harness.recorded_tests()
    assert [t[0] for t in timeline] == ["tests/y.py::u", "tests/x.py::t1"]
    assert unreadable == ["tests-gw7.jsonl:2: '['"]
