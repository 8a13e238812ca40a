"""``criu dump`` dies with its supervisor: a parent-death signal, and no criu at all when the
supervisor died before the signal could be set (the race the soak caught: an orphaned dump)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cedana_airflow.engine import criu
from conftest import wait_gone

pytestmark = pytest.mark.skipif(criu.shutil.which("setpriv") is None, reason="util-linux's setpriv is missing")


def test_the_command_runs_while_its_parent_is_the_supervisor(tmp_path):
    r = subprocess.run([*criu._dies_with_us(), "touch", str(tmp_path / "ran")])
    assert r.returncode == 0 and (tmp_path / "ran").exists()


def test_a_command_whose_supervisor_is_already_gone_never_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(criu.os, "getpid", lambda: 1)  # as if we had died and it had been reparented to init
    r = subprocess.run([*criu._dies_with_us(), "touch", str(tmp_path / "ran")])
    assert r.returncode != 0 and not (tmp_path / "ran").exists()


def test_the_command_dies_when_its_supervisor_is_killed(tmp_path):
    marker = tmp_path / "pid"
    code = ("import subprocess, sys; from cedana_airflow.engine import criu\n"
            f"subprocess.run([*criu._dies_with_us(), 'sh', '-c', 'echo $$ > {marker}; exec sleep 60'])")
    sup = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while not marker.exists() or not marker.read_text().strip():
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    pid = int(marker.read_text())
    sup.kill()
    sup.wait()
    wait_gone(pid, 10)  # reaping it, where the tests' session is its subreaper
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{pid}") else "gone"
    assert state in ("gone", "Z")


@pytest.mark.skipif(os.geteuid() != 0, reason="dump() needs root")
def test_a_dump_ended_by_a_signal_says_so_not_what_its_log_last_said(tmp_path, monkeypatch):
    # Seen under load: a SIGTERM to the supervisor's process group ended a heartbeat's criu, and the line
    # blamed CRIU's non-fatal rlimit message ("CRIU needs root"). A signal is named as the cause now.
    monkeypatch.setattr(criu, "_dies_with_us", lambda: ["sh", "-c", "kill -TERM $$", "criu-stand-in"])
    engine = criu.CriuEngine(criu.CriuBinary("/nonexistent/criu", "test", "4.2.1"))
    with pytest.raises(criu.DumpFailed) as e:
        engine.dump(os.getpid(), tmp_path / "images")
    said = str(e.value)
    assert f"criu dump of pid {os.getpid()} was stopped by SIGTERM before it finished" in said
    assert "CRIU needs root" not in said and "\n" not in said
