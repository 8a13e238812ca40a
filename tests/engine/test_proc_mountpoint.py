"""The proc.crtools that CRIU's parasite makes in a workload's working directory (engine/proc_mountpoint.py):
real workloads in their own PID namespaces, real `criu dump`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX
from cedana_airflow.engine import proc_mountpoint
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import DumpFailed
from cedana_airflow.run.workload import Workload

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dumps need root")


def _engine() -> CriuEngine:
    return CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))


@contextlib.contextmanager
def _workloads(cwd, n):
    ws = [Workload.start(["sleep", "1000"], cwd=str(cwd), stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"))
          for _ in range(n)]
    try:
        yield ws
    finally:
        for w in ws:
            w.kill()
            w.wait(10)


def test_workloads_sharing_a_working_directory_are_dumped_at_once_without_a_failure(tmp_path):
    # Before the retry, 5 of 40 such dumps failed here with "Can't create a directory (-17)".
    engine, shared = _engine(), tmp_path / "shared"
    shared.mkdir()
    failed: list[str] = []
    with _workloads(shared, 8) as ws:
        for rnd in range(4):
            def dump(i, w, rnd=rnd):
                try:
                    engine.dump(w.pid, tmp_path / f"img-{rnd}-{i}" / "images")
                except DumpFailed as e:
                    failed.append(str(e))
            threads = [threading.Thread(target=dump, args=(i, w)) for i, w in enumerate(ws)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert all(w.poll() is None for w in ws)  # every workload still runs
    assert failed == []
    assert not (shared / proc_mountpoint.NAME).exists()


def test_a_stale_leftover_is_removed_and_a_fresh_one_fails_in_one_line_naming_it(tmp_path):
    engine, cwd = _engine(), tmp_path / "work"
    cwd.mkdir()
    left = cwd / proc_mountpoint.NAME
    with _workloads(cwd, 1) as [w]:
        left.mkdir()  # as a dump killed in its moment leaves it: every later dump would fail
        old = time.time() - 120
        os.utime(left, (old, old))
        engine.dump(w.pid, tmp_path / "a" / "images")
        assert not left.exists()

        left.mkdir()  # fresh: it could be another dump's, so it is not touched; the dump fails after its tries
        with pytest.raises(DumpFailed) as e:
            engine.dump(w.pid, tmp_path / "b" / "images")
        said = str(e.value)
        assert "\n" not in said and "Can't create a directory (-17)" in said, said
        assert f"CRIU makes proc.crtools for a moment in the working directory of each process it dumps ({cwd})" in said
        assert "give each workload its own working directory, or remove a leftover proc.crtools" in said
        assert left.is_dir() and w.poll() is None
        assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["images", "images.captured", "images.dump.log"]


def test_a_read_only_working_directory_is_one_line_with_the_fix(tmp_path):
    engine, ro = _engine(), tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        with _workloads(ro, 1) as [w]:
            with pytest.raises(DumpFailed) as e:
                engine.dump(w.pid, tmp_path / "a" / "images")
            said = str(e.value)
            assert "Can't create a directory (-30)" in said and "(Read-only file system)" in said, said
            assert said.count("start the workload from a writable directory") == 1
            assert w.poll() is None
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_only_a_plain_empty_old_directory_counts_as_stale(tmp_path):
    old = time.time() - 120
    for name, make in (("file", lambda p: p.write_text("x")), ("full", lambda p: (p.mkdir(), (p / "x").write_text("x"))),
                       ("link", lambda p: p.symlink_to(tmp_path)), ("young", lambda p: p.mkdir()), ("old", lambda p: p.mkdir())):
        d = tmp_path / name
        d.mkdir()
        make(d / proc_mountpoint.NAME)
        if name != "young":
            os.utime(d / proc_mountpoint.NAME, (old, old), follow_symlinks=False)
    assert proc_mountpoint.clear_stale([str(tmp_path / n) for n in ("file", "full", "link", "young", "old", "gone")]) == [
        str(tmp_path / "old" / proc_mountpoint.NAME)]
    assert all((tmp_path / n / proc_mountpoint.NAME).exists() or (tmp_path / n / proc_mountpoint.NAME).is_symlink()
               for n in ("file", "full", "link", "young"))
