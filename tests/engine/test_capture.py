"""The post-dump handshake: CRIU's action script asks, the supervisor copies, the script exits 0/1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cedana_airflow.engine import capture
from cedana_airflow.engine.capture import CaptureOnFreeze
from cedana_airflow.engine.procfs import open_for_writing, tree_pids

HOLDER = """
import subprocess, sys, time
d = sys.argv[1]
a = open(d + "/appended.log", "a"); a.write("x" * 10); a.flush()
open(d + "/read-only.txt", "w").close(); r = open(d + "/read-only.txt")
child = "import sys, time; f = open(sys.argv[1] + '/rw.bin', 'w+'); print(1, flush=True); time.sleep(60)"
c = subprocess.Popen([sys.executable, "-c", child, d], stdout=subprocess.PIPE)
c.stdout.readline(); print("ready", flush=True); time.sleep(60)
"""


def _holder(tmp_path):
    """A process tree: a parent appending to one file, a child holding another for read/write."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture(autouse=True, params=["bash", "sh"])
def shell(request, monkeypatch):
    """Each handshake test with the script a node with bash gets, and the one a node without it does."""
    if request.param == "sh":
        monkeypatch.setattr(capture, "BASH", None)
    return request.param


def _run_script(cap: CaptureOnFreeze, pid: int, action: str = "post-dump") -> int:
    """As CRIU runs it (action-scripts.c: ``sh -c <path>``, so its own first line chooses the shell)."""
    env = dict(os.environ, CRTOOLS_SCRIPT_ACTION=action, CRTOOLS_INIT_PID=str(pid))
    return subprocess.run(["sh", "-c", str(cap.script)], env=env, timeout=30).returncode


def test_files_open_for_writing_in_the_whole_tree_are_found(tmp_path):
    p = _holder(tmp_path)
    try:
        pids = tree_pids(p.pid)
        assert len(pids) == 2
        assert sorted(open_for_writing(pids)) == [str(tmp_path / "appended.log"), str(tmp_path / "rw.bin")]
    finally:
        subprocess.run(["pkill", "-P", str(p.pid)])
        p.kill()


def test_script_hands_over_and_the_supervisor_copies(tmp_path):
    p = _holder(tmp_path)
    side = tmp_path / "side"
    side.mkdir()
    try:
        with CaptureOnFreeze(side) as cap:
            assert _run_script(cap, p.pid, "pre-dump") == 0 and cap.captured == []  # other actions: no-op
            assert _run_script(cap, p.pid) == 0
    finally:
        subprocess.run(["pkill", "-P", str(p.pid)])
        p.kill()
    paths = {path: copy for path, copy, _ in cap.captured}
    assert paths[str(tmp_path / "appended.log")].read_text() == "x" * 10
    assert str(tmp_path / "rw.bin") in paths and cap.error is None


def test_a_failed_capture_fails_the_script_so_criu_fails_the_dump(tmp_path):
    side = tmp_path / "side"
    side.mkdir()
    (side / "captured").write_text("a file where the capture folder should be")
    p = _holder(tmp_path)
    try:
        with CaptureOnFreeze(side) as cap:
            assert _run_script(cap, p.pid) != 0
    finally:
        subprocess.run(["pkill", "-P", str(p.pid)])
        p.kill()
    assert cap.error and "FileExistsError" in cap.error


def test_files_on_another_filesystem_than_the_work_dir_are_captured(tmp_path):
    # outputs on a volume (here tmpfs), the work dir on local disk: the kernel copy says EXDEV
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    assert os.stat(shm).st_dev != os.stat(tmp_path).st_dev
    p = _holder(shm)
    try:
        with open(shm / "appended.log", "a") as more:
            more.write("y" * (3 << 20))  # larger than one read, so the fallback copies in pieces
        side = tmp_path / "side"
        side.mkdir()
        with CaptureOnFreeze(side) as cap:
            assert _run_script(cap, p.pid) == 0, cap.error
        copies = {path: copy for path, copy, _ in cap.captured}
        assert copies[str(shm / "appended.log")].read_bytes() == (shm / "appended.log").read_bytes()
        assert len(copies[str(shm / "appended.log")].read_bytes()) == 10 + (3 << 20)
    finally:
        subprocess.run(["pkill", "-P", str(p.pid)])
        p.kill()
        shutil.rmtree(shm, ignore_errors=True)


def test_the_action_script_gives_up_when_the_supervisor_is_gone(tmp_path):
    # The supervisor died mid-dump: nobody holds the FIFOs any more. The script must fail (so CRIU
    # fails the dump and lets the tree go) instead of blocking on an open that never returns.
    side = tmp_path / "side"
    side.mkdir()
    with CaptureOnFreeze(side, timeout=3) as cap:
        pass  # out of the block: the supervisor's side is closed, as if it had died
    t0 = time.monotonic()
    rc = _run_script(cap, 1)
    assert rc != 0 and time.monotonic() - t0 < 30


def test_the_script_chooses_its_shell(shell, tmp_path):
    with CaptureOnFreeze(tmp_path) as cap:
        first = cap.script.read_text().splitlines()[0]
    assert first == ("#!/bin/sh" if shell == "sh" else f"#!{capture.BASH}"), first


def test_a_file_is_copied_through_the_tree_s_own_descriptor_not_its_path(tmp_path, monkeypatch, shell):
    """Whoever may write the file's folder swaps its path for a symlink to a root-only file between the
    look and the copy: the copy is still the file the tree holds (the review of issue 49's H2)."""
    secret = tmp_path / "root-only"
    secret.write_text("the node's secret")
    secret.chmod(0o600)
    p = _holder(tmp_path)
    real_copy = capture._copy

    def swapped_first(src: str, dst: str) -> None:
        log = tmp_path / "appended.log"
        if log.exists() and not log.is_symlink():
            log.rename(tmp_path / "moved.log")
            log.symlink_to(secret)
        real_copy(src, dst)

    monkeypatch.setattr(capture, "_copy", swapped_first)
    try:
        got = {path: copy.read_text() for path, copy, _ in capture.capture(p.pid, tmp_path / "copies")}
    finally:
        p.kill()
        p.wait()
    assert "the node's secret" not in got.values()
    assert got[str(tmp_path / "appended.log")] == "x" * 10
