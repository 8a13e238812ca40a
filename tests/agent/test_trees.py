"""What a caller's tree's images must show before the agent restores them for a caller other than root
(agent/trees.py): a user namespace with the caller's maps and threads with the caller's ids and no
capability. Image sets written by hand (CRIU 4.2's pstree, core, creds, userns and mnt protos); a real
dump and restore are tests/agent/test_agent.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import criu_image, pb_message

from cedana_airflow.agent import shim, trees
from cedana_airflow.engine.images import read_external_mounts
from cedana_airflow.errors import CorruptCheckpoint

U, G = 1000, 1000


def _write(path: Path, *entries: bytes) -> None:
    path.write_bytes(criu_image(*entries))


def _core(uid: int = U, gid: int = G, groups: tuple[int, ...] = (), caps: int = 0, euid: int | None = None,
          bnd: int = 0, nnp: int = 1) -> bytes:
    ids = [(1, uid), (2, gid), (3, uid if euid is None else euid), (4, gid), (5, uid), (6, gid), (7, uid), (8, gid)]
    creds = pb_message(*ids, (10, caps), (11, caps), (12, bnd), (13, 0), *[(14, g) for g in groups], (18, nnp))
    return pb_message((1, 1), (5, pb_message((1, 0), (10, creds))))


def _maps(uid_map: str, gid_map: str) -> bytes:
    def extents(text: str, num: int) -> list[tuple[int, bytes]]:
        return [(num, pb_message((1, a), (2, b), (3, c))) for line in text.splitlines() for a, b, c in [map(int, line.split())]]
    return pb_message(*extents(uid_map, 1), *extents(gid_map, 2))


def _tree(d: Path, core: bytes, userns: bytes | None = None) -> Path:
    d.mkdir()
    _write(d / "pstree.img", pb_message((1, 1), (2, 0), (3, 1), (4, 1), (5, 1)))
    _write(d / "core-1.img", core)
    if userns is not None:
        _write(d / "userns-11.img", userns)
    return d


def test_a_tree_with_the_caller_s_maps_and_ids_is_restorable_and_anything_more_is_refused(tmp_path):
    ok_maps = _maps(*shim.id_maps(U, G, [27]))
    assert trees.check_restorable(_tree(tmp_path / "ok", _core(groups=(27,)), ok_maps), U, G, [27], "c") is True
    fewer = _maps(*shim.id_maps(U, G, []))  # the caller has gained a group since: still less than it has
    assert trees.check_restorable(_tree(tmp_path / "fewer", _core(), fewer), U, G, [27], "c") is True
    root_tree = _tree(tmp_path / "root", _core(0, 0))
    assert trees.check_restorable(root_tree, 0, 0, [], "c") is False  # root may restore its own tree
    refused = {
        "is not in a user namespace of its own": _tree(tmp_path / "no-userns", _core()),
        "maps ids uid 1000 does not have": _tree(tmp_path / "root-mapped", _core(), _maps("0 0 1\n1000 1000 1\n",
                                                                                         "0 4000000 1\n1000 1000 1\n")),
        "maps ids uid 1000 does not have ": _tree(tmp_path / "other-group", _core(), _maps(
            f"0 {shim.NS_ROOT} 1\n1000 1000 1\n", f"0 {shim.NS_ROOT} 1\n0 0 1\n1000 1000 1\n")),
        "thread 1 would come back with ids": _tree(tmp_path / "ns-root", _core(euid=0), ok_maps),
        "thread 1 would come back with ids ": _tree(tmp_path / "caps", _core(caps=1 << 21), ok_maps),
        "thread 1 would come back with ids  ": _tree(tmp_path / "group", _core(groups=(4,)), ok_maps),
        "thread 1 would come back with ids   ": _tree(tmp_path / "bounding", _core(bnd=1 << 21), ok_maps),
        "thread 1 would come back with ids    ": _tree(tmp_path / "nnp", _core(nnp=0), ok_maps),
    }
    for why, d in refused.items():
        with pytest.raises(CorruptCheckpoint, match=f"^c is refused for uid {U}: .*{why.strip()}"):
            trees.check_restorable(d, U, G, [27], "c")
    with pytest.raises(CorruptCheckpoint, match="is refused for uid 1000: .*cannot be read"):
        trees.check_restorable(_tree(tmp_path / "torn", b"\xff", ok_maps), U, G, [27], "c")


def test_the_mounts_an_image_set_names_are_read_each_once(tmp_path):
    d = tmp_path / "mnt"
    d.mkdir()
    _write(d / "mountpoints-12.img", pb_message((7, b"/dev"), (18, b"/dev")), pb_message((7, b"/"),),
         pb_message((7, b"/dev/shm"), (18, b"/dev/shm")), pb_message((7, b"/dev/shm"), (18, b"/dev/shm")))
    assert read_external_mounts(d) == ["/dev", "/dev/shm"]
