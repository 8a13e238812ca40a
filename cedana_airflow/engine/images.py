"""Reading the few CRIU image fields we need (dump statistics) without pulling in protobuf.

A CRIU image is ``u32 magic`` (plus a second ``u32`` for common/service images), then entries of
``u32 length`` + a protobuf message. We read varints and nested messages: all that ``stats-dump``
and ``pagemap`` need, and, for a restore's preflight (run/preflight.py), the open files of
``files.img`` (regular files and unix sockets) and the ones CRIU remaps itself (``remap-fpath.img``),
and the file-system credentials of the tree (``pstree.img``, ``core-<tid>.img``: run/captured.py).

Field numbers come from CRIU's ``images/*.proto`` (checked against 4.1.1): ``file_entry`` in
fdinfo.proto, ``reg_file_entry`` in regfile.proto, ``unix_sk_entry`` in sk-unix.proto,
``remap_file_path_entry`` in remap-file-path.proto; ``pstree_entry`` in pstree.proto, ``core_entry`` and
``thread_core_entry`` in core.proto, ``creds_entry`` in creds.proto (checked against 4.2).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "OpenFiles",
    "ROOT_CREDS",
    "RegFile",
    "TreeCreds",
    "UnixSocket",
    "fields",
    "image_entries",
    "image_messages",
    "message_fields",
    "message_values",
    "read_dump_stats",
    "read_image",
    "read_creds",
    "read_external_mounts",
    "read_mountpoints",
    "read_task_ids",
    "read_userns_maps",
    "read_open_files",
]

_IMG_COMMON = 0x54564319
_IMG_SERVICE = 0x55105940


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def message_fields(msg: bytes) -> dict[int, int | bytes]:
    """Varint fields as ints, length-delimited fields (nested messages) as bytes; of a repeated field, its last value."""
    return {num: values[-1] for num, values in message_values(msg).items()}


def message_values(msg: bytes) -> dict[int, list[int | bytes]]:
    """Every value of every field, in order: a repeated field keeps all of its values (where
    :func:`message_fields` keeps the last). Varints as ints, length-delimited fields as bytes
    (strings, bytes and nested messages alike: decode them with :func:`message_values` again)."""
    out: dict[int, list[int | bytes]] = {}
    for num, _, value, _, _ in fields(msg):
        if value is not None:
            out.setdefault(num, []).append(value)
    return out


def fields(msg: bytes) -> Iterator[tuple[int, int, int | bytes | None, int, int]]:
    """Each field of ``msg`` in order: (number, wire type, value, start, end), the value an int for a
    varint, bytes for a length-delimited field, None for a fixed-size one; ``msg[start:end]`` is the
    whole field, key included (what a rewrite keeps byte for byte)."""
    i = 0
    while i < len(msg):
        start = i
        key, i = _varint(msg, i)
        num, wire = key >> 3, key & 7
        value: int | bytes | None = None
        if wire == 0:
            value, i = _varint(msg, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = _varint(msg, i)
            if i + n > len(msg):
                raise ValueError(f"field {num} runs {i + n - len(msg)} bytes past the end of its message")
            value = msg[i : i + n]
            i += n
        else:
            raise ValueError(f"field {num} has wire type {wire}, which CRIU images do not use")
        yield num, wire, value, start, i


def _payload_start(buf: bytes) -> int:
    (magic,) = struct.unpack_from("<I", buf, 0)
    return 8 if magic in (_IMG_COMMON, _IMG_SERVICE) else 4


def _messages(path: Path) -> tuple[list[bytes], bool]:
    buf = path.read_bytes()
    off, out = _payload_start(buf), []
    while off + 4 <= len(buf):
        (n,) = struct.unpack_from("<I", buf, off)
        out.append(buf[off + 4 : off + 4 + n])
        off += 4 + n
    return out, off == len(buf)


def image_messages(path: Path) -> list[bytes]:
    """Every entry of a CRIU image file, undecoded (for :func:`message_values`: repeated fields)."""
    return _messages(path)[0]


def read_image(path: Path) -> tuple[list[dict[int, int | bytes]], bool]:
    """Every entry of a CRIU image file, as :func:`message_fields` reads it, and whether the entries
    end exactly at the end of the file (an image of entries only, not truncated, nothing after)."""
    msgs, whole = _messages(path)
    return [message_fields(m) for m in msgs], whole


def image_entries(path: Path) -> list[dict[int, int | bytes]]:
    return read_image(path)[0]


#: stats.proto, dump_stats_entry: times in microseconds, then page counts.
_DUMP_STATS = {1: "freezing", 2: "frozen", 3: "memdump", 4: "memwrite", 5: "pages_scanned", 7: "pages_written"}


def read_dump_stats(image_dir: Path) -> dict[str, float]:
    """``freezing``, ``frozen``, ``memdump``, ``memwrite`` (seconds) and ``pages_scanned``,
    ``pages_written`` (counts) from stats-dump; {} if it is missing or unreadable.

    stats-dump holds one stats_entry whose field 1 is the nested dump_stats_entry.
    """
    return _read_stats(image_dir / "stats-dump", 1, _DUMP_STATS)


#: stats.proto, restore_stats_entry: forking and restore times in microseconds, pages restored.
_RESTORE_STATS = {3: "forking", 4: "restore", 5: "pages_restored"}


def read_restore_stats(image_dir: Path) -> dict[str, float]:
    """``forking`` and ``restore`` (seconds: CRIU forking the tree, then restoring its state) and
    ``pages_restored`` from the stats-restore image ``criu restore`` leaves; {} if missing or
    unreadable. stats-restore holds one stats_entry whose field 2 is the restore_stats_entry."""
    return _read_stats(image_dir / "stats-restore", 2, _RESTORE_STATS)


def _read_stats(path: Path, entry_field: int, names: dict[int, str]) -> dict[str, float]:
    """The named fields of a stats image's nested entry: fields 1-4 are microseconds (as seconds),
    the rest counts."""
    try:
        entries = image_entries(path)
        nested = entries[0].get(entry_field) if entries else None
        f = message_fields(nested) if isinstance(nested, bytes) else {}
    except (OSError, struct.error, IndexError):
        return {}
    return {name: (v / 1e6 if num <= 4 else float(v)) for num, name in names.items() if isinstance(v := f.get(num), int)}


# fdinfo.proto, enum fd_types; file_entry: type = 1, id = 2, reg = 3, usk = 16.
_FD_REG, _FD_UNIXSK = 1, 5
_FE_TYPE, _FE_REG, _FE_USK = 1, 3, 16
# remap-file-path.proto, remap_file_path_entry: orig_id = 1.
_REMAP_ORIG_ID = 1


@dataclass(frozen=True)
class RegFile:
    """A regular file (or directory) the tree had open or mapped: regfile.proto, reg_file_entry.

    ``name`` is the path CRIU reopens, absolute, as seen from the tree's mount namespace root (with
    no mount namespace of its own: the node's ``/``). ``size`` is what CRIU checks on restore ("has
    bad size"); CRIU leaves it out for directories and for files opened O_WRONLY|O_APPEND.
    ``mnt_id`` is set only when the tree had a mount namespace of its own."""

    id: int
    name: str
    flags: int
    size: int | None
    mode: int | None
    ext: bool
    mnt_id: int | None


@dataclass(frozen=True)
class UnixSocket:
    """A unix socket: sk-unix.proto, unix_sk_entry. ``name`` is the raw address (abstract ones start
    with a NUL byte; a path name may end with one, as Python binds them); ``deleted``: its path was
    gone at dump time (CRIU rebuilds it as a ghost and removes it again)."""

    id: int
    ino: int
    type: int
    state: int
    uflags: int
    name: bytes
    name_dir: str | None
    deleted: bool
    uid: int | None
    gid: int | None
    mnt_id: int | None


@dataclass(frozen=True)
class OpenFiles:
    """What ``files.img`` holds that a restore needs from the node's filesystem."""

    regular: tuple[RegFile, ...]
    unix_sockets: tuple[UnixSocket, ...]
    remapped: frozenset[int]  # ids of regular files CRIU remaps itself (ghost or linked: deleted while open)


def _int(f: dict[int, list[int | bytes]], num: int) -> int | None:
    v = f.get(num)
    return v[-1] if v and isinstance(v[-1], int) else None


def _bytes(f: dict[int, list[int | bytes]], num: int) -> bytes | None:
    v = f.get(num)
    return v[-1] if v and isinstance(v[-1], bytes) else None


def _sint(v: int | None) -> int | None:
    return None if v is None else (v >> 1) ^ -(v & 1)  # zigzag (sint32)


def _reg(msg: bytes) -> RegFile:
    f = message_values(msg)
    name = _bytes(f, 6)
    return RegFile(id=_int(f, 1) or 0, name=os.fsdecode(name or b""), flags=_int(f, 2) or 0, size=_int(f, 8),
                   mode=_int(f, 10), ext=bool(_int(f, 9)), mnt_id=_sint(_int(f, 7)))


def _usk(msg: bytes) -> UnixSocket:
    f = message_values(msg)
    perms = message_values(p) if (p := _bytes(f, 13)) is not None else {}
    name_dir = _bytes(f, 14)
    return UnixSocket(id=_int(f, 1) or 0, ino=_int(f, 2) or 0, type=_int(f, 3) or 0, state=_int(f, 4) or 0,
                      uflags=_int(f, 6) or 0, name=_bytes(f, 11) or b"",
                      name_dir=None if name_dir is None else os.fsdecode(name_dir), deleted=bool(_int(f, 15)),
                      uid=_int(perms, 2), gid=_int(perms, 3), mnt_id=_sint(_int(f, 17)))


def read_open_files(image_dir: Path) -> OpenFiles | None:
    """The regular files and unix sockets of an image set's ``files.img``, and which regular files
    ``remap-fpath.img`` says CRIU remaps itself; None when there is no files.img.

    Raises ValueError when either image is malformed (truncated, or not protobuf where it should be).
    """
    try:
        entries, _ = read_image(image_dir / "files.img")
    except FileNotFoundError:
        return None
    except (IndexError, struct.error) as e:
        raise ValueError(f"{image_dir / 'files.img'} is malformed ({e})") from None
    regular: list[RegFile] = []
    sockets: list[UnixSocket] = []
    try:
        for entry in entries:
            kind, reg, usk = entry.get(_FE_TYPE), entry.get(_FE_REG), entry.get(_FE_USK)
            if kind == _FD_REG and isinstance(reg, bytes):
                regular.append(_reg(reg))
            elif kind == _FD_UNIXSK and isinstance(usk, bytes):
                sockets.append(_usk(usk))
        remap_path = image_dir / "remap-fpath.img"
        remaps = image_entries(remap_path) if remap_path.exists() else []
    except (IndexError, struct.error, ValueError) as e:
        raise ValueError(f"{image_dir / 'files.img'} or remap-fpath.img is malformed ({e})") from None
    remapped = frozenset(v for r in remaps if isinstance(v := r.get(_REMAP_ORIG_ID), int))
    return OpenFiles(tuple(regular), tuple(sockets), remapped)


@dataclass(frozen=True)
class TreeCreds:
    """Who a restored tree writes files as: fsuid, fsgid and supplementary groups (creds.proto)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


#: A tree with a task whose fsuid is 0: CRIU restores it as root, so root is what its files may be.
ROOT_CREDS = TreeCreds(0, 0)

# pstree.proto, pstree_entry: pid = 1, threads = 5 (repeated). core.proto: core_entry.thread_core = 5,
# thread_core_entry.creds = 10. creds.proto, creds_entry: fsuid = 7, fsgid = 8, groups = 14 (repeated).
_PSTREE_PID, _PSTREE_THREADS = 1, 5
_CORE_THREAD, _THREAD_CREDS = 5, 10
_CORE_TC, _TC_STATE, _TASK_DEAD = 3, 1, 2  # core_entry.tc.task_state; TASK_DEAD: a zombie (cr-dump.c)
_FSUID, _FSGID, _GROUPS = 7, 8, 14


def _uints(f: dict[int, list[int | bytes]], num: int) -> list[int]:
    """A repeated uint32 field, written unpacked (proto2's default) or packed."""
    out: list[int] = []
    for v in f.get(num, ()):
        if isinstance(v, int):
            out.append(v)
        else:
            i = 0
            while i < len(v):
                n, i = _varint(v, i)
                out.append(n)
    return out


def read_creds(image_dir: Path) -> TreeCreds | None:
    """The credentials a restore of this image set writes files with: the root task's (its first
    ``pstree.img`` entry's main thread), or :data:`ROOT_CREDS` when any thread of any task has fsuid 0.
    None when there is no pstree.img (not a process tree: CRIU refuses it itself). Raises ValueError
    when pstree.img or a core image is missing or malformed, or the root task has no creds."""
    try:
        tasks = image_messages(image_dir / "pstree.img")
    except FileNotFoundError:
        return None
    except (IndexError, struct.error) as e:
        raise ValueError(f"{image_dir / 'pstree.img'} is malformed ({e})") from None
    found: list[TreeCreds] = []
    try:
        for tid, c in _live_threads_creds(image_dir, tasks):
            if c is None:
                if not found:  # the root task's main thread: what every file would be written as
                    raise ValueError(f"core-{tid}.img holds no credentials")
                # CRIU then leaves that task as it restores it: root (or an old creds-<pid>.img)
                found.append(ROOT_CREDS)
                continue
            uid, gid = _int(c, _FSUID), _int(c, _FSGID)
            if uid is None or gid is None:
                raise ValueError(f"core-{tid}.img has credentials without fsuid or fsgid")
            found.append(TreeCreds(uid, gid, tuple(_uints(c, _GROUPS))))
    except (OSError, IndexError, struct.error) as e:
        raise ValueError(f"the process tree's core images in {image_dir} cannot be read ({e})") from None
    if not found:
        raise ValueError(f"{image_dir / 'pstree.img'} names no task")
    return ROOT_CREDS if any(c.uid == 0 for c in found) else found[0]


def _live_threads_creds(image_dir: Path,
                        tasks: list[bytes]) -> Iterator[tuple[int, dict[int, list[int | bytes]] | None]]:
    """Each live thread of ``tasks`` (pstree.img's entries), the root task's main thread first, with its
    creds_entry's fields (None: its core image holds none). A zombie is skipped: it holds no file and
    comes back a zombie, and CRIU 4.2 writes no thread ID of its own for it (pstree.c:
    threads[0].ns[0].virt is never set), so none is read. Raises what reading a core image raises."""
    for task in tasks:
        t = message_values(task)
        pid = _int(t, _PSTREE_PID)
        if pid is not None and (main := image_messages(image_dir / f"core-{pid}.img")):
            tc = _bytes(message_values(main[0]), _CORE_TC)
            if tc is not None and _int(message_values(tc), _TC_STATE) == _TASK_DEAD:
                continue
        for tid in _uints(t, _PSTREE_THREADS) or ([pid] if pid is not None else []):
            core = image_messages(image_dir / f"core-{tid}.img")
            thread = _bytes(message_values(core[0]), _CORE_THREAD) if core else None
            creds = _bytes(message_values(thread), _THREAD_CREDS) if thread is not None else None
            yield tid, (message_values(creds) if creds is not None else None)


@dataclass(frozen=True)
class TaskIds:
    """One thread's ids as a restore gives them back (creds.proto), in its user namespace's terms."""

    tid: int
    uids: tuple[int, ...]  # uid, euid, suid, fsuid
    gids: tuple[int, ...]  # gid, egid, sgid, fsgid
    groups: tuple[int, ...]
    capabilities: bool  # any bit of its inheritable, permitted, effective or ambient sets
    bounding: bool = False  # any bit of its bounding set
    no_new_privs: bool = False


def read_task_ids(image_dir: Path) -> list[TaskIds]:
    """Every live thread's ids (a zombie's are skipped: it runs nothing). Raises ValueError where a
    thread's core image or its creds are missing or malformed."""
    out: list[TaskIds] = []
    try:
        for tid, c in _live_threads_creds(image_dir, image_messages(image_dir / "pstree.img")):
            if c is None:
                raise ValueError(f"core-{tid}.img holds no credentials")
            ids = [_int(c, n) for n in (1, 3, 5, 7, 2, 4, 6, 8)]
            if any(i is None for i in ids):
                raise ValueError(f"core-{tid}.img has credentials without every id")
            out.append(TaskIds(tid, tuple(ids[:4]), tuple(ids[4:]), tuple(_uints(c, _GROUPS)),  # type: ignore[arg-type]
                               any(any(_uints(c, n)) for n in (9, 10, 11, 19)), any(_uints(c, 12)),
                               bool(_int(c, 18))))
    except (OSError, IndexError, struct.error) as e:
        raise ValueError(f"the process tree's core images in {image_dir} cannot be read ({e})") from None
    return out


Extent = tuple[int, int, int]  # uid_gid_extent: first (inside), lower_first (outside), count


def read_userns_maps(image_dir: Path) -> list[tuple[frozenset[Extent], frozenset[Extent]]]:
    """The uid and gid maps of each user namespace the image set holds (userns-*.img; none for a tree in
    the node's). Raises ValueError where one is malformed."""
    out = []
    for path in sorted(image_dir.glob("userns-*.img")):
        try:
            entries = image_messages(path)
            f = message_values(entries[0]) if entries else {}
            maps = tuple(frozenset((_int(e, 1) or 0, _int(e, 2) or 0, _int(e, 3) or 0)
                                   for raw in f.get(num, []) if isinstance(raw, bytes)
                                   for e in [message_values(raw)]) for num in (1, 2))
        except (IndexError, struct.error) as e:
            raise ValueError(f"{path} is malformed ({e})") from None
        out.append((maps[0], maps[1]))
    return out


_MNT_MOUNTPOINT, _MNT_EXT_KEY = 7, 18  # mnt.proto, mnt_entry: where it is; the name an external mount was dumped under


def _mount_field(image_dir: Path, num: int) -> list[str]:
    out: set[str] = set()
    for path in sorted(image_dir.glob("mountpoints-*.img")):
        try:
            for entry in image_messages(path):
                value = _bytes(message_values(entry), num)
                if value is not None:
                    out.add(value.decode("utf-8", "surrogateescape"))
        except (IndexError, struct.error) as e:
            raise ValueError(f"{path} is malformed ({e})") from None
    return sorted(out)


@dataclass(frozen=True)
class MountEntry:
    """A mount of the tree's own mount namespace (mnt.proto, mnt_entry): where it is in the tree's view, the
    folder of its file system it shows (``root``), and the key it was dumped under when external."""

    mnt_id: int
    mountpoint: str
    root: str
    ext_key: str | None


def read_mounts(image_dir: Path) -> dict[int, MountEntry]:
    """Every mount of the image set's mount namespaces by its id (none for a tree in the node's). Raises
    ValueError where one is malformed."""
    out: dict[int, MountEntry] = {}
    for path in sorted(image_dir.glob("mountpoints-*.img")):
        try:
            for entry in image_messages(path):
                f = message_values(entry)
                mnt_id, mp, root = _int(f, 2), _bytes(f, _MNT_MOUNTPOINT), _bytes(f, 6)
                if mnt_id is None or mp is None or root is None:
                    raise ValueError(f"{path} has a mount without its id, mountpoint or root")
                key = _bytes(f, _MNT_EXT_KEY)
                out[mnt_id] = MountEntry(mnt_id, mp.decode("utf-8", "surrogateescape"),
                                         root.decode("utf-8", "surrogateescape"),
                                         None if key is None else key.decode("utf-8", "surrogateescape"))
        except (IndexError, struct.error) as e:
            raise ValueError(f"{path} is malformed ({e})") from None
    return out


def read_external_mounts(image_dir: Path) -> list[str]:
    """The keys of the external mounts an image set's mount namespaces hold (mountpoints-*.img), each
    once: a restore must give CRIU a source for each. Raises ValueError where one is malformed."""
    return _mount_field(image_dir, _MNT_EXT_KEY)


def read_mountpoints(image_dir: Path) -> list[str]:
    """Every mountpoint an image set's mount namespaces hold (``/dev``, ...), each once."""
    return _mount_field(image_dir, _MNT_MOUNTPOINT)
