"""Putting a checkpoint's captured files back on this node, where an untrusted manifest cannot aim them.

A manifest comes from the store, and whoever can write the store can write a manifest; a restore
runs as root. Unfenced, every captured path (and the workload's working directory, which a restore
creates when it is missing) would be a root write primitive on each restoring node. So:

- a path must lie under one of the **restore roots** this node allows. A signed manifest (this node
  verified it with the deployment's key: our own supervisor wrote it) goes back where the workload had
  its files, anywhere but a system tree, unless ``Settings.restore_roots`` narrows that. An unsigned
  one is held to ``Settings.restore_roots`` plus the restoring command's working directory: whoever
  can write the store wrote it. System trees (``/etc``, ``/usr``, ``/bin``, ``/sbin``, ``/lib*``,
  ``/boot``, ``/proc``, ``/sys``, ``/dev``) and ``/`` itself are never roots, even when listed;
- every component below the root is opened from its parent's descriptor with ``O_NOFOLLOW``, so a
  symlink anywhere on the way refuses the entry instead of redirecting the write;
- an existing target must be a regular file; the content goes to a fresh ``O_EXCL`` temp file in
  the target's directory, gets permission bits only (no setuid, setgid or sticky), and is renamed
  over the target.

A refused entry refuses its checkpoint (CorruptCheckpoint, one line naming the path and the fix);
the restore then falls back to the next older one. The node's own versions of replaced files are
put back if the restore fails later, so a refused checkpoint changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from ..errors import CorruptCheckpoint
from ..format.manifest import Manifest

__all__ = ["ANYWHERE", "JOURNALS", "SHARED_MEMORY", "SYSTEM_TREES", "CapturedFilesBack", "ensure_cwd", "open_dir", "refusal",
           "restore_roots", "root_of", "system_tree"]

log = logging.getLogger(__name__)

#: Never written by a restore, whatever the manifest or restore_roots say.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/proc", "/sys", "/dev")

#: Files a program keeps beside its data file while a write is in flight (SQLite's rollback journal and WAL).
JOURNALS = ("-journal", "-wal", "-shm")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


#: Under a system tree, but a world-writable tmpfs like /tmp: POSIX shared memory (shm_open) lives there.
SHARED_MEMORY = PurePosixPath("/dev/shm")


def system_tree(p: PurePosixPath) -> str | None:
    """The system tree ``p`` lies in ("/" for the root itself), or None (also for /dev/shm)."""
    if p == PurePosixPath("/"):
        return "/"
    if p == SHARED_MEMORY or SHARED_MEMORY in p.parents:
        return None
    first = "/" + p.parts[1]
    if first in SYSTEM_TREES or p.parts[1].startswith("lib"):
        return first
    return None


#: The one root of a signed checkpoint with no restore_roots configured: anywhere but a system tree.
ANYWHERE = PurePosixPath("/")


def restore_roots(configured: Sequence[Path], cwd: str | None, *, signed: bool = False) -> tuple[PurePosixPath, ...]:
    """The roots a restore may write under: for a ``signed`` checkpoint with none configured, anywhere
    but a system tree; otherwise the configured ones and ``cwd`` (default: ours), less any that is
    ``/`` or a system tree (logged: listing one is a mistake, never a permission)."""
    if signed and not configured:
        return (ANYWHERE,)
    out: list[PurePosixPath] = []
    for root in [*configured, Path(cwd or os.getcwd())]:
        p = PurePosixPath(os.path.normpath(os.path.abspath(root)))
        tree = system_tree(p)
        if tree is not None:
            # A listed one is a mistake worth a warning; the working directory is only a default (a
            # container's is often /), and naming it on every checkpoint would be noise.
            log.log(logging.WARNING if root in configured else logging.DEBUG,
                    "restore root %s is ignored: %s is never written by a restore", p, tree)
            continue
        out.append(p)
    return tuple(dict.fromkeys(out))


def refusal(path: str, roots: Sequence[PurePosixPath]) -> str | None:
    """Why a restore must not write ``path``, or None when it may (it lies strictly under a root)."""
    p = PurePosixPath(path)
    if not p.is_absolute() or os.path.normpath(path) != path:
        return f"{path!r} is not an absolute, normalised path"
    tree = system_tree(p)
    if tree is not None:
        return f"{path} is in {tree}, which a restore never writes"
    if not any(root in p.parents for root in roots):
        return f"{path} is outside the restore roots ({', '.join(map(str, roots)) or 'none'})"
    return None


def root_of(directory: PurePosixPath, roots: Sequence[PurePosixPath]) -> PurePosixPath:
    """The innermost root that is ``directory`` or holds it."""
    return max((r for r in roots if r == directory or r in directory.parents), key=lambda r: len(r.parts))


def open_dir(directory: PurePosixPath, roots: Sequence[PurePosixPath], *, create: bool, mode: int = 0o755,
             owner: tuple[int, int] | None = None, created: Callable[[int, str, PurePosixPath], None] | None = None
             ) -> int:
    """A descriptor of ``directory``, reached from its root one component at a time with O_NOFOLLOW
    (created ``mode`` where missing, when ``create``). The root itself is the node's own setting and may
    be a symlink; nothing below it may. ``created(parent_fd, name, path)`` hears of each directory made,
    right after its mkdir; with ``owner`` (uid, gid) each is then set to exactly ``mode`` (whatever the
    umask) and that owner. An OSError from below the root names the path the walk had reached."""
    root = root_of(directory, roots)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path = root
    try:
        for part in directory.relative_to(root).parts:
            path = path / part
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, mode, dir_fd=fd)
                if created is not None:
                    created(fd, part, path)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                if owner is not None:
                    try:
                        os.fchmod(nfd, mode)
                        os.fchown(nfd, *owner)
                    except OSError:
                        os.close(nfd)
                        raise
            os.close(fd)
            fd = nfd
        return fd
    except OSError as e:
        os.close(fd)
        raise type(e)(e.errno, e.strerror, str(path)) from None
    except BaseException:
        os.close(fd)
        raise


def _refused(m: Manifest, what: str) -> CorruptCheckpoint:
    fix = ("add the directory to restore_roots (CEDANA_RESTORE_ROOTS)" if m.signature is not None else
           "sign manifests (signing_key_file or CEDANA_SIGNING_KEY on every node; under Airflow they are signed "
           "by default) or add the directory to restore_roots (CEDANA_RESTORE_ROOTS)")
    return CorruptCheckpoint(
        f"checkpoint {m.checkpoint_id} seq {m.seq} is refused: {what}. If this node should write there, {fix}; "
        "otherwise the store holds a manifest nobody here wrote")


def ensure_cwd(m: Manifest, roots: Sequence[PurePosixPath]) -> None:
    """The workload's working directory exists (CRIU restores into it); a missing one is created only
    under the restore roots, through the same guarded walk as captured files."""
    if os.path.isdir(m.process.cwd):
        return
    why = refusal(m.process.cwd, roots)
    if why is not None:
        raise _refused(m, f"its working directory {why}")
    try:
        os.close(open_dir(PurePosixPath(m.process.cwd), roots, create=True))
    except OSError as e:
        raise _refused(m, f"its working directory {m.process.cwd} cannot be created safely ({e.strerror}: a "
                          "symlink or a file on the way)") from None


def _copy_into(src: Path, fd: int) -> None:
    with open(src, "rb") as i:
        _copy_fd(i.fileno(), fd)


def _copy_fd(src: int, dst: int) -> None:
    os.lseek(src, 0, os.SEEK_SET)
    while data := os.read(src, 1 << 20):
        os.write(dst, data)


def _write_back(dfd: int, name: str, backup: str, st_mode: int) -> None:
    """Put a file's own content (kept in ``backup``) back into its inode, as it was."""
    fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    bfd = os.open(backup, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        _copy_fd(bfd, fd)
        os.fchmod(fd, st_mode & 0o7777)
    finally:
        os.close(bfd)
        os.close(fd)


class CapturedFilesBack:
    """Puts a checkpoint's captured files in place (CRIU checks their size), and puts the node's own
    versions back if the restore then fails. ``source``: the fetched copies, ``source/<index>``."""

    def __init__(self, m: Manifest, source: Path, roots: Sequence[PurePosixPath]) -> None:
        self.m, self.source, self.roots = m, source, roots
        # (directory fd, name, backup name, the file's own mode when it was written in place)
        self._placed: list[tuple[int, str, str | None, int | None]] = []
        self._kept = False

    def __enter__(self) -> CapturedFilesBack:
        try:
            for c in self.m.captured:  # every entry is judged before any is written
                why = refusal(c.path, self.roots)
                if why is not None:
                    raise _refused(self.m, f"captured file {why}")
            for i, c in enumerate(self.m.captured):
                self._place(PurePosixPath(c.path), self.source / str(i), c.mode)
            captured = {c.path for c in self.m.captured}
            for c in self.m.captured:
                for suffix in JOURNALS:
                    if c.path + suffix not in captured:
                        self._set_aside(PurePosixPath(c.path + suffix))
        except BaseException:
            self.__exit__()
            raise
        return self

    def _place(self, target: PurePosixPath, copy: Path, mode: int) -> None:
        try:
            dfd = open_dir(target.parent, self.roots, create=True)
        except OSError as e:
            raise _refused(self.m, f"captured file {target} cannot be reached safely ({e.strerror}: a symlink "
                                   "or a file on the way)") from None
        name, backup = target.name, None
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISREG(st.st_mode):
                    raise _refused(self.m, f"captured file {target} exists and is not a regular file")
                if st.st_nlink == 1:  # its own inode: written in place (see _in_place)
                    self._placed.append((dfd, name, self._in_place(dfd, name, st, copy, mode, target), st.st_mode))
                    return
                backup = f".{name}.cedana-orig"
                os.replace(name, backup, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = f".{name}.cedana-{secrets.token_hex(6)}"  # not guessable, and O_EXCL: never someone's link
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                _copy_into(copy, fd)
                os.fchmod(fd, mode & 0o777)  # permission bits only, whatever the manifest says
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                raise
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            if backup is not None:
                os.replace(backup, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.close(dfd)
            raise
        self._placed.append((dfd, name, backup, None))

    def _set_aside(self, path: PurePosixPath) -> None:
        """A journal beside a captured file that the checkpoint did not hold: written after it (a node
        that died mid-transaction leaves SQLite's hot journal, which would be rolled back into the
        restored database). Renamed aside; removed when the restore holds, put back when it fails."""
        try:
            dfd = open_dir(path.parent, self.roots, create=False)
        except OSError:
            return
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(dfd)
            return
        if not stat.S_ISREG(st.st_mode):
            os.close(dfd)
            return
        backup = f".{path.name}.cedana-orig-{secrets.token_hex(6)}"
        try:
            os.replace(path.name, backup, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.close(dfd)
            raise
        log.info("set aside %s: written after the checkpoint, beside a file it restores", path)
        self._placed.append((dfd, path.name, backup, None))

    def _in_place(self, dfd: int, name: str, st: os.stat_result, copy: Path, mode: int, target: PurePosixPath) -> str:
        """Write the captured bytes into the existing file's own inode, keeping a copy of what it held;
        return the copy's name. Not a rename: a program that checks its file's identity (SQLite
        compares the inode with the one it opened, and refuses writes to a "moved" database) finds
        the file it had. A file with other hard links is never written through (the rename path)."""
        backup = f".{name}.cedana-orig-{secrets.token_hex(6)}"
        bfd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        fd = -1
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode) or now.st_nlink != 1:
                raise _refused(self.m, f"captured file {target} changed while it was being put back")
            _copy_fd(fd, bfd)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            _copy_into(copy, fd)
            os.fchmod(fd, mode & 0o777)  # permission bits only, whatever the manifest says
        except BaseException:
            if fd >= 0 and os.lseek(bfd, 0, os.SEEK_CUR) == st.st_size:  # the copy is whole: put it back
                with contextlib.suppress(OSError):
                    _write_back(dfd, name, backup, st.st_mode)
            os.unlink(backup, dir_fd=dfd)
            raise
        finally:
            os.close(bfd)
            if fd >= 0:
                os.close(fd)
        return backup

    def keep(self) -> None:
        self._kept = True

    def __exit__(self, *exc: object) -> None:
        # Never raises: after a restore, a leftover backup must not cost the restored workload.
        for dfd, name, backup, in_place_mode in reversed(self._placed):
            try:
                if self._kept:
                    if backup is not None:
                        os.unlink(backup, dir_fd=dfd)
                elif in_place_mode is not None and backup is not None:
                    _write_back(dfd, name, backup, in_place_mode)
                    os.unlink(backup, dir_fd=dfd)
                elif backup is not None:
                    os.replace(backup, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)
            except OSError as e:
                log.warning("captured file %s: clean-up left %s behind: %s", name, backup or name, e)
            finally:
                os.close(dfd)
        self._placed.clear()
