"""A page file: a read-only file over /dev/fuse whose bytes come from a callback, read as CRIU's
lazy-pages daemon reads a pages image (pread)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from cedana_airflow.engine.page_file import FSTYPE, PageFile, fuse_available, sweep

pytestmark = pytest.mark.skipif(not fuse_available()[0], reason="needs /dev/fuse and root")


def _mounted(path) -> bool:
    return any(f" {path} " in ln and FSTYPE in ln for ln in open("/proc/self/mountinfo"))


def test_reads_anywhere_return_the_sources_bytes_and_close_unmounts(tmp_path):
    data = os.urandom(3 << 20)
    target = tmp_path / "pages-1.img"
    target.touch()
    f = PageFile(target, len(data), lambda off, n: [memoryview(data)[off:off + n]], lambda e: None)
    f.start()
    try:
        fd = os.open(target, os.O_RDONLY)
        assert os.pread(fd, 4096, 5 * 4096) == data[5 * 4096:6 * 4096]  # a fault
        assert os.pread(fd, 1 << 20, 2 << 20) == data[2 << 20:3 << 20]  # a background read
        assert os.fstat(fd).st_size == len(data) and os.pread(fd, 10, len(data)) == b""
        os.close(fd)
        with open(target, "rb") as whole:
            assert whole.read() == data
    finally:
        f.close()
    assert not _mounted(target) and target.stat().st_size == 0


def test_a_failed_read_is_held_until_release_then_fails(tmp_path):
    target = tmp_path / "pages-1.img"
    target.touch()
    failed = threading.Event()

    def source(off, n):
        raise OSError("the store went away")

    f = PageFile(target, 1 << 20, source, lambda e: failed.set())
    f.start()
    got: list[object] = []

    def reader():
        fd = os.open(target, os.O_RDONLY)
        try:
            got.append(os.pread(fd, 4096, 0))
        except OSError as e:
            got.append(e)
        finally:
            os.close(fd)

    t = threading.Thread(target=reader)
    t.start()
    assert failed.wait(5)
    time.sleep(0.3)
    assert t.is_alive() and got == []  # held: the reader (the daemon) stays blocked, no zeros, no error
    f.release()
    t.join(5)
    assert len(got) == 1 and isinstance(got[0], OSError)
    f.close()


def test_sweep_unmounts_what_a_killed_supervisor_left(tmp_path):
    target = tmp_path / "w" / "pages-1.img"
    target.parent.mkdir()
    target.touch()
    f = PageFile(target, 4096, lambda off, n: [b"\0" * n], lambda e: None)  # never closed, as if killed
    assert _mounted(target)
    assert sweep(tmp_path) == 1 and not _mounted(target)
    os.close(f.fd)


def test_sweep_leaves_a_running_process_s_restore_folder_alone(tmp_path):
    """A node agent runs many restores in one process: one restore's sweep must not unmount a page file
    another run is streaming (its folder names this live process); one of a process that is gone goes."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    files = []
    for pid in (os.getpid(), gone.pid):
        target = tmp_path / f"restore-{pid}-0a1b2c3d-2-full" / "images" / "pages-1.img"
        target.parent.mkdir(parents=True)
        target.touch()
        files.append((target, PageFile(target, 4096, lambda off, n: [b"\0" * n], lambda e: None)))
    (live, f_live), (dead, f_dead) = files
    assert sweep(tmp_path) == 1 and _mounted(live) and not _mounted(dead)
    f_live.close()
    os.close(f_dead.fd)


def test_pushed_pages_are_read_without_asking_the_source(tmp_path):
    data = os.urandom(4 << 20)
    target = tmp_path / "pages-1.img"
    target.touch()
    asked: list[tuple[int, int]] = []

    def source(off, n):
        asked.append((off, n))
        return [memoryview(data)[off:off + n]]

    f = PageFile(target, len(data), source, lambda e: None)
    f.start()
    try:
        assert f.push(1 << 20, [memoryview(data)[1 << 20:3 << 20]])  # two pages-aligned MiB, before any read
        fd = os.open(target, os.O_RDONLY)
        assert os.pread(fd, 1 << 20, 1 << 20) == data[1 << 20:2 << 20]
        assert os.pread(fd, 4096, (3 << 20) - 4096) == data[(3 << 20) - 4096:3 << 20]
        assert asked == []  # the kernel had them
        assert os.pread(fd, 4096, 0) == data[:4096] and asked  # not pushed: asked for
        os.close(fd)
    finally:
        f.close()
    assert not f.push(0, [data[:4096]])  # after close: refused, nothing written to a stale fd


def test_a_fail_fast_page_file_answers_a_failed_read_with_an_error_at_once(tmp_path):
    target = tmp_path / "pages-1.img"
    target.touch()

    def source(off, n):
        raise OSError("a corrupt chunk")

    failures: list[BaseException] = []
    f = PageFile(target, 1 << 20, source, failures.append, fail_fast=True)
    f.start()
    try:
        fd = os.open(target, os.O_RDONLY)
        with pytest.raises(OSError):
            os.pread(fd, 4096, 0)  # criu restore in full: fails, and kills what it built
        os.close(fd)
        assert len(failures) == 1
    finally:
        f.close()
