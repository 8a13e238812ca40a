"""A cooperative state another user wrote, copied or removed as that user, never touched as root.

The node agent (root) stores what a caller's workload wrote when asked (run/cooperative.py), and that
workload may race it: swap a folder for a link, truncate a file while it is read, plant a FIFO, fill a
folder with files. So root never opens, maps, lists or removes anything in the caller's folders itself.
A helper process (``python -I -m cedana_airflow.run.state_copy``) starts as root, drops to the caller's
uid, gid and groups at once (no capability survives: the kernel clears them with the uids), and then

- ``copy SRC``: walks SRC by descriptors, no link followed anywhere (``O_NOFOLLOW`` at every step), and
  writes to stdout, per regular file, a JSON header line ``{"path", "mode", "size"}`` and its bytes, then
  ``{"end": true, "ranks": N}``; a link, a FIFO or another special file, a name a manifest cannot carry,
  more than the limits allow, or a file that changed size while read ends it with ``{"error": line}``.
  The agent writes the bytes into a folder of its own (:func:`copy_as`), and cuts its own copies.
- ``remove SRC``: removes what is in SRC (the caller may; SRC's own entry is in a folder of root's, which
  the agent then removes, empty).

The kernel judges every open as it would for the caller; a hung read hangs the helper, which is killed
after its time. Standard library only (and coop/, which is too), nothing imported from the caller's reach
(``-I``).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ..coop import COMPLETE, DONE_PREFIX  # standard library only, as this module

__all__ = ["copy_as", "remove_as"]

#: What one state may hold: files and folders, folder depth, a file's path (relative to the state).
MAX_FILES = 100_000
MAX_DEPTH = 64
MAX_PATH = 1024
#: Free space a copy leaves on the agent's file system at least.
ROOM_BYTES = 1 << 30
_HEADER_BYTES = 64 << 10
_CHUNK = 1 << 20
#: The markers of the contract and their in-flight copies (coop/__init__.py), counted, not kept.
_MARKERS = re.compile(rf"^(?:{COMPLETE}|{re.escape(DONE_PREFIX)}\d+|\.(?:{COMPLETE}|{re.escape(DONE_PREFIX)}\d+)\.\d+\.tmp)$")


# -- the helper (the caller's side) -----------------------------------------------------------------------


def _drop(uid: int, gid: int, groups: Sequence[int]) -> None:
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)  # (imported before the drop: the caller may not read our Python)
    # Not dumpable: a process of the caller's uid may then neither trace us nor open our /proc files (else it
    # could write the stream the agent reads), whatever the node's fs.suid_dumpable; no new privileges.
    if libc.prctl(4, 0, 0, 0, 0) != 0 or libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS
        raise PermissionError("could not make the helper undumpable")
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("CapEff", "CapPrm", "CapAmb", "TracerPid")))
    caps = {k: int(v, 16) for k, v in fields.items() if k.startswith("Cap")}
    if uid != 0 and any(caps.values()):
        raise PermissionError(f"capabilities left after dropping to uid {uid}: {caps}")
    if int(fields.get("TracerPid", "0")) != 0:  # attached in the moment between the drop and the prctl
        raise PermissionError("the helper is being traced")


def _say(doc: dict[str, object]) -> None:
    sys.stdout.buffer.write(json.dumps(doc).encode() + b"\n")


def _name_ok(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return all(ord(c) >= 32 for c in name) and name.isprintable()


def _copy(top: str, max_bytes: int) -> None:
    out = sys.stdout.buffer
    count, total, ranks = 0, 0, 0

    def walk(dfd: int, rel: str, depth: int) -> None:
        nonlocal count, total, ranks
        if depth > MAX_DEPTH:
            raise ValueError(f"the state is more than {MAX_DEPTH} folders deep")
        for name in sorted(os.listdir(dfd)):
            count += 1  # every entry, folders too: a million of them is refused, not walked
            if count > MAX_FILES:
                raise ValueError(f"it holds more than {MAX_FILES} files and folders")
            r = f"{rel}{name}"
            if not _name_ok(name):
                raise ValueError(f"it holds a name a manifest cannot carry, {r!r}; name files with printable UTF-8 only")
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not rel and _MARKERS.match(name):
                ranks += name.startswith(DONE_PREFIX)
            elif stat.S_ISDIR(st.st_mode):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                try:
                    walk(sub, r + "/", depth + 1)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                if len(r.encode()) > MAX_PATH:
                    raise ValueError(f"it holds a path longer than {MAX_PATH} bytes")
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                try:
                    fst = os.fstat(fd)
                    if not stat.S_ISREG(fst.st_mode):
                        raise ValueError(f"{r!r} is no longer a regular file")
                    size = fst.st_size
                    total += size
                    if total > max_bytes:
                        raise ValueError(f"it holds more than {max_bytes} bytes (max_checkpoint_bytes)")
                    _say({"path": r, "mode": stat.S_IMODE(fst.st_mode) & 0o777, "size": size})
                    left = size
                    while left:
                        data = os.read(fd, min(left, _CHUNK))
                        if not data:
                            raise ValueError(f"{r!r} shrank while it was read")
                        out.write(data)
                        left -= len(data)
                finally:
                    os.close(fd)
            else:
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "a special file"
                raise ValueError(f"it holds {what}, {r!r}; a checkpoint holds regular files and folders only")

    dfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    walk(dfd, "", 0)
    _say({"end": True, "ranks": max(ranks, 1)})


def _empty(dfd: int) -> None:
    """Everything in the folder ``dfd``, removed (as the caller: its own files); a folder it made unreadable
    to itself is made readable first, a link is unlinked, never followed, and nothing is waited on."""
    for name in os.listdir(dfd):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                # readable to its owner again first (a link swapped in meanwhile is followed, but chmod changes
                # only what the caller owns: nothing of anyone else's)
                os.chmod(name, 0o700, dir_fd=dfd)
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                try:
                    _empty(sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        except OSError:
            continue  # swapped meanwhile, or not the caller's to remove: left


def _main(argv: Sequence[str]) -> int:
    verb, top, uid, gid, groups = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    _drop(uid, gid, [int(g) for g in groups.split(",") if g])
    if verb == "remove":
        try:
            os.chmod(top, 0o700)  # (top is in a folder of root's: it cannot be swapped)
        except OSError:
            pass
        dfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        _empty(dfd)
        return 0
    try:
        _copy(top, int(argv[5]))
    except (OSError, ValueError) as e:
        sys.stdout.buffer.flush()
        _say({"error": e.strerror if isinstance(e, OSError) and e.strerror else str(e)})
        return 3
    return 0


# -- the agent's side ----------------------------------------------------------------------------------------


def _helper(verb: str, top: Path, owner: tuple[int, int, Sequence[int]], *more: str) -> list[str]:
    uid, gid, groups = owner
    return [sys.executable, "-I", "-m", "cedana_airflow.run.state_copy", verb, str(top), str(uid), str(gid),
            ",".join(str(g) for g in groups), *more]


def _safe_rel(rel: str) -> PurePosixPath:
    p = PurePosixPath(rel)
    if (p.is_absolute() or not p.parts or any(part in ("", ".", "..") for part in p.parts)
            or len(rel.encode(errors="replace")) > MAX_PATH or any(len(part.encode(errors="replace")) > 255 for part in p.parts)):
        raise ValueError(f"the helper named a path outside the state, {rel[:200]!r}")
    return p


def copy_as(owner: tuple[int, int, Sequence[int]], src: Path, dst: Path, *, max_bytes: int,
            timeout: float) -> tuple[tuple[tuple[str, Path, int], ...], int]:
    """``src`` (the caller's) copied, as the caller, into ``dst`` (a new folder of ours, made here): each
    file's path relative to it, our copy, its mode bits; and how many ranks marked their part done.
    ValueError (one line) where the state is refused or cannot be copied here; ``dst`` is then gone. The
    helper is killed after ``timeout`` seconds."""
    dst.mkdir(mode=0o700)
    try:
        return _copy_into(owner, src, dst, max_bytes, timeout)
    except BaseException as e:
        shutil.rmtree(dst, ignore_errors=True)  # ours: nothing of a refused state stays on the agent's disk
        if isinstance(e, OSError):
            raise ValueError(f"it could not be copied here ({e.strerror or e})") from None
        if isinstance(e, (KeyError, TypeError)):
            raise ValueError("the helper's stream was not one it writes") from None
        raise


def _copy_into(owner: tuple[int, int, Sequence[int]], src: Path, dst: Path, max_bytes: int,
               timeout: float) -> tuple[tuple[tuple[str, Path, int], ...], int]:
    proc = subprocess.Popen(_helper("copy", src, owner, str(max_bytes)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env={"PATH": "/usr/bin:/bin"})
    timer = _Killer(proc, timeout)
    files: list[tuple[str, Path, int]] = []
    total = 0
    assert proc.stdout is not None
    try:
        while True:
            line = proc.stdout.readline(_HEADER_BYTES)
            if not line.endswith(b"\n"):
                raise ValueError(_ended(proc, timer, "the copy ended early"))
            head = json.loads(line)
            if not isinstance(head, dict):
                raise ValueError("the helper's stream was not one it writes")
            if "error" in head:
                raise ValueError(str(head["error"])[:500])
            if head.get("end") is True:
                return tuple(files), max(1, int(head["ranks"]))
            rel, size, mode = head["path"], head["size"], head["mode"]
            if not (isinstance(rel, str) and isinstance(size, int) and isinstance(mode, int) and size >= 0):
                raise ValueError("the helper's stream was not one it writes")
            path = dst.joinpath(*_safe_rel(rel).parts)
            total += size
            if total > max_bytes:
                raise ValueError(f"it holds more than {max_bytes} bytes (max_checkpoint_bytes)")
            st = os.statvfs(dst)
            if st.f_bavail * st.f_frsize < size + ROOM_BYTES:
                raise ValueError(f"the agent's work dir has no room for it ({size} bytes more)")
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # ours alone: nothing planted in it
            with open(path, "xb") as f:
                left = size
                while left:
                    data = proc.stdout.read(min(left, _CHUNK))
                    if not data:
                        raise ValueError(_ended(proc, timer, "the copy ended early"))
                    f.write(data)
                    left -= len(data)
            files.append((rel, path, mode & 0o777))
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()


def remove_as(owner: tuple[int, int, Sequence[int]], top: Path, *, timeout: float = 60.0) -> None:
    """What is in ``top`` (the caller's folder, whose own entry is in a folder of ours) removed as the caller,
    then ``top`` itself; what the caller put back meanwhile stays, said in the log by the caller of this."""
    if not top.is_dir() or top.is_symlink():
        return
    try:
        subprocess.run(_helper("remove", top, owner), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin"}, timeout=timeout)
    except subprocess.TimeoutExpired:
        pass  # a FIFO or a hung mount of the caller's: the helper was killed; the folder stays
    try:
        os.rmdir(top)
    except OSError:
        pass


def _ended(proc: subprocess.Popen[bytes], timer: _Killer, what: str) -> str:
    if timer.fired:
        return f"{what}: the copy took longer than {timer.seconds:g} s"
    err = proc.stderr.read(2000).decode(errors="replace").strip().splitlines() if proc.stderr else []
    return f"{what}: {err[-1] if err else 'the helper said nothing'}"


class _Killer:
    def __init__(self, proc: subprocess.Popen[bytes], seconds: float) -> None:
        import threading

        self.seconds, self.fired = seconds, False

        def fire() -> None:
            self.fired = True
            proc.kill()

        self._timer = threading.Timer(seconds, fire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
