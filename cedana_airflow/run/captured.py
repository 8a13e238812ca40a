"""Putting a checkpoint's captured files back on this node, where an untrusted manifest cannot aim them.

A manifest comes from the store, and whoever can write the store can write a manifest; a restore
runs as root. Unfenced, every captured path (and the workload's working directory, which a restore
creates when it is missing) would be a root write primitive on each restoring node. So:

- a path must lie under one of the **restore roots** this node allows: ``Settings.restore_roots``
  plus the restoring command's working directory. System trees (``/etc``, ``/usr``, ``/bin``,
  ``/sbin``, ``/lib*``, ``/boot``, ``/proc``, ``/sys``, ``/dev``) and ``/`` itself are never roots,
  even when listed;
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

import logging
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ..errors import CorruptCheckpoint
from ..format.manifest import Manifest

__all__ = ["SYSTEM_TREES", "CapturedFilesBack", "ensure_cwd", "refusal", "restore_roots"]

log = logging.getLogger(__name__)

#: Never written by a restore, whatever the manifest or restore_roots say.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/proc", "/sys", "/dev")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _system_tree(p: PurePosixPath) -> str | None:
    if p == PurePosixPath("/"):
        return "/"
    first = "/" + p.parts[1]
    if first in SYSTEM_TREES or p.parts[1].startswith("lib"):
        return first
    return None


def restore_roots(configured: Sequence[Path], cwd: str | None) -> tuple[PurePosixPath, ...]:
    """The roots a restore may write under: the configured ones and ``cwd`` (default: ours), less any
    that is ``/`` or a system tree (logged: listing one is a mistake, never a permission)."""
    out: list[PurePosixPath] = []
    for root in [*configured, Path(cwd or os.getcwd())]:
        p = PurePosixPath(os.path.normpath(os.path.abspath(root)))
        tree = _system_tree(p)
        if tree is not None:
            log.warning("restore root %s is ignored: %s is never written by a restore", p, tree)
            continue
        out.append(p)
    return tuple(dict.fromkeys(out))


def refusal(path: str, roots: Sequence[PurePosixPath]) -> str | None:
    """Why a restore must not write ``path``, or None when it may (it lies strictly under a root)."""
    p = PurePosixPath(path)
    if not p.is_absolute() or os.path.normpath(path) != path:
        return f"{path!r} is not an absolute, normalised path"
    tree = _system_tree(p)
    if tree is not None:
        return f"{path} is in {tree}, which a restore never writes"
    if not any(root in p.parents for root in roots):
        return f"{path} is outside the restore roots ({', '.join(map(str, roots)) or 'none'})"
    return None


def _root_of(directory: PurePosixPath, roots: Sequence[PurePosixPath]) -> PurePosixPath:
    """The innermost root that is ``directory`` or holds it."""
    return max((r for r in roots if r == directory or r in directory.parents), key=lambda r: len(r.parts))


def _open_dir(directory: PurePosixPath, roots: Sequence[PurePosixPath], *, create: bool) -> int:
    """A descriptor of ``directory``, reached from its root one component at a time with O_NOFOLLOW
    (created 0755 where missing, when ``create``). The root itself is the node's own setting and may
    be a symlink; nothing below it may."""
    root = _root_of(directory, roots)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in directory.relative_to(root).parts:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refused(m: Manifest, what: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"checkpoint {m.checkpoint_id} seq {m.seq} is refused: {what}. If this node should write there, add "
        "the directory to restore_roots (CEDANA_RESTORE_ROOTS); otherwise the store holds a manifest nobody "
        "here wrote")


def ensure_cwd(m: Manifest, roots: Sequence[PurePosixPath]) -> None:
    """The workload's working directory exists (CRIU restores into it); a missing one is created only
    under the restore roots, through the same guarded walk as captured files."""
    if os.path.isdir(m.process.cwd):
        return
    why = refusal(m.process.cwd, roots)
    if why is not None:
        raise _refused(m, f"its working directory {why}")
    try:
        os.close(_open_dir(PurePosixPath(m.process.cwd), roots, create=True))
    except OSError as e:
        raise _refused(m, f"its working directory {m.process.cwd} cannot be created safely ({e.strerror}: a "
                          "symlink or a file on the way)") from None


def _copy_into(src: Path, fd: int) -> None:
    with open(src, "rb") as i:
        while data := i.read(1 << 20):
            os.write(fd, data)


class CapturedFilesBack:
    """Puts a checkpoint's captured files in place (CRIU checks their size), and puts the node's own
    versions back if the restore then fails. ``source``: the fetched copies, ``source/<index>``."""

    def __init__(self, m: Manifest, source: Path, roots: Sequence[PurePosixPath]) -> None:
        self.m, self.source, self.roots = m, source, roots
        self._placed: list[tuple[int, str, str | None]] = []  # (directory fd, name, backup name)
        self._kept = False

    def __enter__(self) -> CapturedFilesBack:
        try:
            for c in self.m.captured:  # every entry is judged before any is written
                why = refusal(c.path, self.roots)
                if why is not None:
                    raise _refused(self.m, f"captured file {why}")
            for i, c in enumerate(self.m.captured):
                self._place(PurePosixPath(c.path), self.source / str(i), c.mode)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _place(self, target: PurePosixPath, copy: Path, mode: int) -> None:
        try:
            dfd = _open_dir(target.parent, self.roots, create=True)
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
        self._placed.append((dfd, name, backup))

    def keep(self) -> None:
        self._kept = True

    def __exit__(self, *exc: object) -> None:
        # Never raises: after a restore, a leftover backup must not cost the restored workload.
        for dfd, name, backup in reversed(self._placed):
            try:
                if self._kept:
                    if backup is not None:
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
