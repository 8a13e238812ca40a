"""Failpoints are inert unless a test's environment names them, and do exactly what they say when it does
(each in a child process: the actions end or change the process they run in)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cedana_airflow import failpoints

PROBE = """
import time, sys
from cedana_airflow.failpoints import failpoint
before = time.time()
for i in range(3):
    print("hit", i, flush=True)
    failpoint("heartbeat.upload")
print("jump", round(time.time() - before), flush=True)
"""


def _probe(spec: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", failpoints.ENV: spec}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


def test_an_unset_environment_makes_every_failpoint_a_no_op():
    r = _probe("")
    assert r.returncode == 0 and r.stdout.split("\n")[-2] == "jump 0"


def test_the_nth_hit_kills_the_supervisor_as_a_node_loss_would():
    r = _probe("heartbeat.upload=kill-supervisor@2")
    assert r.returncode == -9 and r.stdout.splitlines() == ["hit 0", "hit 1"]


def test_a_clock_jump_and_a_command_run_at_the_step(tmp_path):
    r = _probe(f"heartbeat.upload=run:touch {tmp_path}/ran-by-{{pid}}")
    assert r.returncode == 0 and len(list(tmp_path.glob("ran-by-*"))) == 1
    r = _probe("heartbeat.upload=clock+3600")
    assert r.stdout.splitlines()[-1] == "jump 3600"


def test_an_unknown_step_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown step 'heartbeat.upload-ish'"):
        failpoints._parse("heartbeat.upload-ish=kill-supervisor")
