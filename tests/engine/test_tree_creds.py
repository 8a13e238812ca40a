"""The credentials a restore writes files with, read from a CRIU image set (issue 48).

Image sets written by hand (field numbers from CRIU 4.2's images/pstree.proto, core.proto and
creds.proto); a real dump's (root: 0) is checked in tests/run/test_preflight.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import criu_image, pb_message, varint

from cedana_airflow.engine import images


def _write(path: Path, *entries: bytes) -> None:
    path.write_bytes(criu_image(*entries))


def _core(fsuid: int, fsgid: int, groups: tuple[int, ...] = (), *, uid: int = 0, packed: bool = False) -> bytes:
    gs = [(14, b"".join(varint(g) for g in groups))] if packed and groups else [(14, g) for g in groups]
    creds = pb_message((1, uid), (2, uid), (3, uid), (4, uid), (5, uid), (6, uid), (7, fsuid), (8, fsgid), (13, 0), *gs)
    return pb_message((1, 1), (5, pb_message((1, 0), (10, creds))))  # core_entry.thread_core.creds


def _tree(d: Path, cores: dict[int, bytes]) -> Path:
    """Task 1 (threads 1 and 2) and its child, task 3."""
    d.mkdir()
    _write(d / "pstree.img", pb_message((1, 1), (2, 0), (3, 1), (4, 1), (5, 1), (5, 2)), pb_message((1, 3), (2, 1), (3, 1), (4, 1), (5, 3)))
    for tid, core in cores.items():
        _write(d / f"core-{tid}.img", core)
    return d


def test_a_trees_files_go_back_as_its_root_tasks_fsuid_unless_any_task_is_root(tmp_path):
    # fsuid, not uid: what the kernel checks files against (a root launcher that setfsuid'd)
    user = _tree(tmp_path / "user", {1: _core(1000, 1000, (1000, 27), uid=0), 2: _core(1000, 1000),
                                     3: _core(1001, 1001, (5, 6), packed=True)})
    assert images.read_creds(user) == images.TreeCreds(1000, 1000, (1000, 27))
    rooted = _tree(tmp_path / "rooted", {1: _core(1000, 1000), 2: _core(1000, 1000), 3: _core(0, 0)})
    assert images.read_creds(rooted) == images.ROOT_CREDS  # CRIU restores that child as root
    (tmp_path / "none").mkdir()
    assert images.read_creds(tmp_path / "none") is None  # not a process tree: CRIU refuses it itself
    with pytest.raises(ValueError, match="cannot be read"):
        images.read_creds(_tree(tmp_path / "missing", {1: _core(1000, 1000), 2: _core(1000, 1000)}))
    with pytest.raises(ValueError, match="holds no credentials"):
        images.read_creds(_tree(tmp_path / "bare", {1: pb_message((1, 1)), 2: _core(0, 0), 3: _core(0, 0)}))


def test_a_zombie_child_is_skipped_whatever_thread_id_criu_wrote_for_it(tmp_path):
    """CRIU 4.2 writes a zombie's core as task_state TASK_DEAD and, in pstree.img, a thread ID it never
    set (seen in CI: core-1565332160.img looked for, a restore refused). A zombie holds no file."""
    d = tmp_path / "zombie"
    d.mkdir()
    _write(d / "pstree.img", pb_message((1, 1), (2, 0), (3, 1), (4, 1), (5, 1)),
         pb_message((1, 14), (2, 1), (3, 1), (4, 1), (5, 1565332160)))
    _write(d / "core-1.img", _core(1000, 1000))
    _write(d / "core-14.img", pb_message((1, 1), (3, pb_message((1, 2), (2, 0)))))  # core_entry.tc.task_state = TASK_DEAD
    assert images.read_creds(d) == images.TreeCreds(1000, 1000, ())
