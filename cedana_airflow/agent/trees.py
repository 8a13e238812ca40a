"""A caller's tree in namespaces of its own (shim.py's ``own_mounts``: a caller other than root): what
CRIU is told when the agent dumps it, and what its images must show before the agent restores one for a
caller.

Its mounts are childless binds of the node's, each an external mount that CRIU names by its mountpoint
(``--external mnt[/dev]:/dev``) and the shim maps back at restore onto this node's; the view of the
node's ``/proc`` under the tree's own proc is found by CRIU itself (``mnt[]``), never named: a key
matches by mountpoint and would take the tree's own proc with it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..engine.images import read_task_ids, read_userns_maps
from ..errors import CorruptCheckpoint, DumpFailed
from . import shim

__all__ = ["check_restorable", "dump_options", "open_to_tree_root"]


def dump_options(pid: int) -> tuple[str, ...]:
    """CRIU's options for dumping the tree at ``pid``, in namespaces of its own: each of its mounts but
    ``/`` and its procs as an external mount named by its mountpoint. Read from the tree itself, so a
    restored tree's (the image's) are named too."""
    options: list[str] = []
    table = shim.mount_table(f"/proc/{pid}/mountinfo")
    masks = {m.mountpoint for m in table if m.fstype == "tmpfs" and m.source == shim.MASK_SOURCE}
    for mp in sorted({m.mountpoint for m in table} - masks):
        if mp == "/" or mp == "/proc" or mp.startswith("/proc/"):
            continue
        if not shim._nameable(mp):  # the shim binds none such: a tree that made one cannot be named to CRIU
            raise DumpFailed(f"criu dump of pid {pid} not started: its mount {mp!r} has a name CRIU's --external "
                             "cannot carry")
        options += ["--external", f"mnt[{mp}]:{mp}"]
    return (*options, "--external", "mnt[]")


def _extents(id_map: str) -> frozenset[tuple[int, int, int]]:
    return frozenset((a, b, c) for line in id_map.splitlines() for a, b, c in [map(int, line.split())])


def check_restorable(image_dir: Path, uid: int, gid: int, groups: Sequence[int], what: str) -> bool:
    """Whether the image set holds a tree in its own namespaces (True) or not (False: a root caller's, in
    the node's); raises CorruptCheckpoint (one line naming ``what``) where restoring it for a caller of
    ``uid``, ``gid`` and ``groups`` other than root would give the tree more than the caller has: a user
    namespace whose maps are not the caller's (shim.id_maps; its groups may be fewer), or a thread whose
    ids are not the caller's, that holds a capability or a bounding set, or lacks no_new_privs (as the
    shim starts every such tree). A root caller may restore anything (``uid`` 0). Not read: securebits
    (without a capability they grant nothing) and LSM labels (CRIU applies the image's; the images are
    the node's, signed: a caller cannot write them)."""
    def refused(why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{what} is refused for uid {uid}: {why}")

    try:
        namespaces = read_userns_maps(image_dir)
        if uid == 0:
            return bool(namespaces)
        if len(namespaces) != 1:
            raise refused("its tree is not in a user namespace of its own (it ran as root, or nests them), so it "
                          f"would come back with more than uid {uid} has")
        uid_map, gid_map = shim.id_maps(uid, gid, groups)
        uids, gids = namespaces[0]
        if uids != _extents(uid_map) or not gids or not gids <= _extents(gid_map):
            raise refused(f"its user namespace maps ids uid {uid} does not have")
        mine = {int(gid), *(int(g) for g in groups)}
        for t in read_task_ids(image_dir):
            # And as the shim started it: an empty bounding set and no_new_privs (CRIU applies both as root).
            if set(t.uids) != {uid} or not set(t.gids) <= mine or not set(t.groups) <= mine or t.capabilities \
                    or t.bounding or not t.no_new_privs:
                raise refused(f"its thread {t.tid} would come back with ids or capabilities uid {uid} does not have")
    except ValueError as e:
        raise refused(str(e)) from None
    return True


def open_to_tree_root(image_dir: Path, gid: int, groups: Sequence[int]) -> None:
    """Let the root of a caller's tree's user namespace read a restore's copy of its image set (fetched
    for this restore, in the root-only work dir): CRIU reads images both before its restored task's ids
    are mapped (as the node's root) and after (as that namespace's root, which has no rights over the
    node's root's files). So: the node's root's, the group that root has (shim.id_maps), readable by that
    group. No process has that group but CRIU restoring a tree, and the folders above stay root's."""
    group = 0 if 0 in {gid, *groups} else shim.NS_ROOT
    for folder, dirs, files in os.walk(image_dir):
        for name in dirs:
            os.chown(os.path.join(folder, name), 0, group, follow_symlinks=False)
            os.chmod(os.path.join(folder, name), 0o750, follow_symlinks=False)
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            os.chown(path, 0, group, follow_symlinks=False)
            os.chmod(path, 0o640)
    os.chown(image_dir, 0, group, follow_symlinks=False)
    os.chmod(image_dir, 0o750)
