"""Folders and files a root process may use without trusting anyone else on the node (issue 48).

A path under a directory others may write (``/tmp``, a group-writable share) is theirs to shape:
whoever creates a name there first owns what a root writer later creates, reads or follows through
it. So a private folder is reached from ``/`` one component at a time, each opened relative to its
parent with ``O_NOFOLLOW``, and each must be a directory that only root or we can change: owned by
root or by our effective uid, and writable by neither group nor others. The folder's own files are
written to a fresh ``O_EXCL`` temporary name and renamed into place, and read without following a
link. The file store (``store/file.py``) walks below its root the same way.

No imports from the package: the core, the Airflow layer and the store may all use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path, PurePath, PurePosixPath

__all__ = ["DIR_FLAGS", "UnsafePath", "private_folder", "read_bounded", "replace_file", "secure_base", "unlink"]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A folder or file that others could have shaped: one line naming it and what is wrong."""


def _check_dir(fd: int, path: PurePosixPath | str, euid: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a folder")
    if st.st_uid not in (0, euid):
        owners = "root" if euid == 0 else f"root or uid {euid}"
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by {owners}: another user could replace what "
                         "it holds")
    if st.st_mode & 0o022:
        who = "others" if st.st_mode & 0o002 else "its group"
        raise UnsafePath(f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): whoever may write "
                         "there could plant a name in it first")


def _open_dir(name: str, dir_fd: int, path: PurePosixPath) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(f"{path} is a symbolic link or not a folder; nothing on this path may be one") from None
        raise


def _name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafePath(f"{name!r} is not a single file name")
    return name


def secure_base(path: Path | str, *, below: Path | str | None = None, mode: int = 0o700) -> int:
    """A descriptor of the folder ``path`` (absolute), walked from ``/`` without following a link.

    Every existing component must be a folder owned by root or by our effective uid and writable by
    neither group nor others; a missing one is created (0755, the last one ``mode``), owned by us and
    set to that mode whatever the umask. ``below``: start the walk at this folder instead of ``/``
    (it is checked like the others, its parents are not): for tests, whose temporary folders live
    under ``/tmp``. Raises UnsafePath (one line: the component and what is wrong) or another OSError.
    """
    p = PurePosixPath(path)
    if not p.is_absolute():
        raise UnsafePath(f"{path} is not an absolute path")
    start = PurePosixPath(below) if below is not None else PurePosixPath("/")
    if start != p and start not in p.parents:
        raise UnsafePath(f"{path} is not under {start}")
    rel = p.relative_to(start).parts
    for part in rel:
        _name(part)  # PurePosixPath keeps "..": a path that climbs is refused, never resolved
    euid, egid = os.geteuid(), os.getegid()
    fd = os.open(start, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_dir(fd, start, euid)
        here = start
        for i, part in enumerate(rel):
            here = here / part
            last = i == len(rel) - 1
            try:
                child = _open_dir(part, fd, here)
            except FileNotFoundError:
                want = mode if last else 0o755
                with contextlib.suppress(FileExistsError):  # a racer (root or us: nobody else may write here)
                    os.mkdir(part, want, dir_fd=fd)
                child = _open_dir(part, fd, here)
                try:
                    st = os.fstat(child)
                    if st.st_uid == euid and stat.S_ISDIR(st.st_mode):
                        os.fchown(child, euid, egid)
                        os.fchmod(child, want)  # mkdir's mode went through the umask: set it exactly
                except OSError:
                    os.close(child)
                    raise
            os.close(fd)
            fd = child
            _check_dir(fd, here, euid)
        return fd
    except BaseException:
        os.close(fd)
        raise


def private_folder(base_fd: int, name: str, where: PurePath | str) -> int:
    """A descriptor of the folder ``name`` in ``base_fd``: created 0700, or an existing one that is
    ours (owned by our effective uid, no group or other permissions). ``where``: its path, for messages."""
    _name(name)
    euid = os.geteuid()
    try:
        os.mkdir(name, 0o700, dir_fd=base_fd)
        created = True
    except FileExistsError:
        created = False
    fd = _open_dir(name, base_fd, PurePosixPath(where))
    try:
        st = os.fstat(fd)
        if created and st.st_uid == euid:
            os.fchmod(fd, 0o700)  # a umask of 0o777 would leave it unusable to us
            st = os.fstat(fd)
        if st.st_uid != euid or st.st_mode & 0o077:
            raise UnsafePath(f"{where} is not ours (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; "
                             f"it must be uid {euid}, mode 0700): remove it")
        return fd
    except BaseException:
        os.close(fd)
        raise


def replace_file(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """``name`` in ``dir_fd`` now holds ``data``: written to a fresh temporary name (``O_EXCL``, no link
    followed) and renamed over it, so a link planted at ``name`` is replaced, never written through."""
    _name(name)
    tmp = f".{name}.tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)


def unlink(dir_fd: int, name: str) -> None:
    """Remove ``name`` from ``dir_fd`` if it is there (a link is removed, not followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_name(name), dir_fd=dir_fd)


def read_bounded(dir_fd: int, name: str, limit: int) -> bytes | None:
    """The content of the regular file ``name`` in ``dir_fd``, or None when there is none. A link, a
    non-regular file or one over ``limit`` bytes raises UnsafePath."""
    try:
        fd = os.open(_name(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{name} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{name} is not a regular file")
        if st.st_size > limit:
            raise UnsafePath(f"{name} is {st.st_size} bytes, over the limit of {limit}")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafePath(f"{name} grew over the limit of {limit} bytes while being read")
        return data
    finally:
        os.close(fd)
