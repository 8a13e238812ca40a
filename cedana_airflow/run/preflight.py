"""Before CRIU restores a checkpoint on this node: what its image set needs from this node's files.

CRIU reopens every file the tree had open or mapped by its path, and binds every named unix socket
to its path again. On another node either can fail, deep in CRIU's log: "File /data/train.bin has
bad size 2048 (expect 1048576)", "Can't open file ...: No such file or directory", "Can't bind ...
addr /tmp/pymp-k2x9/listener-3w1q: No such file or directory". :func:`preflight` reads the image
set's ``files.img`` (engine/images.py) first and either fixes what it safely can or explains it in
one line:

- **Files the tree only reads** (opened or mapped ``O_RDONLY``: a dataset on node-local disk, a
  config file, the interpreter and its libraries) that are missing here, or whose size differs from
  the one CRIU recorded, raise :class:`NotRestorableHere`, naming the path and the remedy. Nothing
  is fixed: the content is not in the checkpoint. Older checkpoints of the same workload need the
  same files, so the caller should not try them; the run starts fresh instead (see the class).
  Not judged: files the tree held open for writing (the product captures and puts them back:
  run/captured.py), files deleted while open (CRIU rebuilds them: ``remap-fpath.img``), ``/dev``,
  ``/proc`` and ``/sys``, external files (``--external``), directories, and trees with a mount
  namespace of their own (their paths are not this node's). Only the size is compared, as CRIU
  does by default: a file rewritten at the same size passes here and in CRIU.
- **Unix sockets bound to a path whose directory is missing here** (Python's multiprocessing binds
  listeners in ``/tmp/pymp-XXXX/``, and a fresh node's ``/tmp`` has none) get that directory, mode
  0700, owned like the socket was. Only for absolute socket paths (abstract and relative names are
  skipped), only under the restore roots (run/captured.py) or this node's temp directories (``/tmp``,
  ``/var/tmp``, ``$TMPDIR``), never in a system tree or on the deny-list, and each component below the
  root is opened with ``O_NOFOLLOW``, so a symlink on the way refuses the directory instead of
  redirecting it; below ``/`` and the temp directories, each directory on the way is judged by
  captured.py's owner rule for the tree's credentials. A directory that cannot be created that way
  raises :class:`NotRestorableHere` before anything is created. Sockets CRIU does not bind (connected streams, external peers, deleted paths, which CRIU
  rebuilds and removes itself) are skipped.

Everything is judged before anything is created. :class:`Prepared` says what was created, and
removes it again (with any socket CRIU bound there) when the restore fails.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ..engine.images import ROOT_CREDS, OpenFiles, RegFile, TreeCreds, UnixSocket, read_mounts, read_open_files
from ..errors import NotRestorableHere
from ..format.manifest import Manifest
from .captured import ANYWHERE, DenyList, Unvouched, blocked, node_denied, open_dir, refusal, root_of, system_tree

__all__ = ["Prepared", "preflight"]

log = logging.getLogger(__name__)

#: Paths CRIU reopens that are not files a node can be asked to provide.
_NOT_JUDGED = ("/dev", "/proc", "/sys")
#: Where multiprocessing and most programs put their sockets: socket directories may be created here.
_TEMP_DIRS = ("/tmp", "/var/tmp")
#: sk-unix.c: a peer outside the dumped tree, dumped only to name it.
_USK_EXTERN = 1
_TCP_ESTABLISHED = 1
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: How many further paths a message names after the first.
_MORE = 3


class Prepared:
    """What :func:`preflight` created on this node (socket directories, outermost first).

    :meth:`undo` removes them again (deepest first, with the sockets a failed ``criu restore`` bound
    there, nothing else); :meth:`keep` lets them be. As a context manager: undone when the block
    raises, kept otherwise."""

    def __init__(self) -> None:
        # (descriptor of the parent, name, path, (st_dev, st_ino) as made): undo touches only that folder
        self._made: list[tuple[int, str, str, tuple[int, int]]] = []

    def made(self, parent_fd: int, name: str, path: str) -> None:
        """Record the folder ``name`` of ``parent_fd`` just made (raises OSError where it is not a folder)."""
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} is not the folder just made", path)
        self._made.append((os.dup(parent_fd), name, path, (st.st_dev, st.st_ino)))

    @property
    def created(self) -> tuple[str, ...]:
        return tuple(path for _, _, path, _ in self._made)

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.keep()
        else:
            self.undo()

    def keep(self) -> None:
        for pfd, _, _, _ in self._made:
            os.close(pfd)
        self._made.clear()

    def undo(self) -> None:
        """Never raises: a directory that is not empty after its sockets went stays, with a warning; one
        that is no longer the folder made (another swapped in by name) is left alone."""
        for pfd, name, path, ident in reversed(self._made):
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != ident:
                        log.warning("socket directory %s created for a restore was replaced; left alone", path)
                        continue
                    for entry in os.listdir(fd):
                        if stat.S_ISSOCK(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                            os.unlink(entry, dir_fd=fd)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=pfd)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("socket directory %s created for a restore is left behind: %s", path, e.strerror)
            finally:
                os.close(pfd)
        self._made.clear()


def preflight(image_dir: Path, m: Manifest, roots: Sequence[PurePosixPath], denied: DenyList | None = None,
              creds: TreeCreds = ROOT_CREDS, *, node_root_tree: bool = False) -> Prepared:
    """Check what the image set in ``image_dir`` (checkpoint ``m``) needs from this node before
    ``criu restore`` runs, and create the missing directories of its unix sockets.

    ``roots``: this node's restore roots (:func:`cedana_airflow.run.captured.restore_roots`); socket
    directories may also be created under the temp directories, never on ``denied`` (default: the
    node's deny-list without settings), and through directories judged for ``creds`` (the tree's:
    engine/images.py ``read_creds``). ``node_root_tree``: the tree has a mount namespace of its own whose
    root is this node's ``/`` (the node agent's trees, agent/shim.py): its sockets on that root, or on an
    external mount at the same path as this node's, are bound where the node has them, and their folders
    are made by the tree's user (``creds``) itself. Raises NotRestorableHere (one line:
    the path, what differs, the remedy) before creating anything, and ValueError when files.img is
    malformed. An image set without files.img (not a CRIU dump) needs nothing.
    """
    files = read_open_files(image_dir)
    prepared = Prepared()
    if files is None:
        return prepared
    _check_read_only(files, m)
    same = _same_path_mounts(image_dir) if node_root_tree else frozenset()
    if creds.uid != 0:
        _check_links(files, m, creds, same)
    temp = _temp_roots()
    allowed = tuple(dict.fromkeys(r for r in [*roots, *temp] if system_tree(r) is None))
    wanted = _socket_dirs(files, m, allowed, denied if denied is not None else node_denied(), same, creds)
    try:
        for directory, uid, gid in wanted:
            if node_root_tree and creds.uid != 0:  # a node agent's caller: made by the caller itself
                _make_dir_as_caller(directory, allowed, creds, prepared, m)
                continue
            # the temp dirs are everyone's: judged like / (no operator vouched for what is below them)
            _make_dir(directory, allowed, uid, gid, prepared, m, creds, (ANYWHERE, *temp))
    except BaseException:
        prepared.undo()
        raise
    if prepared.created:
        log.info("socket directories created checkpoint_id=%s seq=%d dirs=%s", m.checkpoint_id, m.seq,
                 ",".join(prepared.created))
    return prepared


def _same_path_mounts(image_dir: Path) -> frozenset[int]:
    """The ids of a node-rooted tree's mounts whose paths are this node's: its root (``--root``, a bind of
    the node's ``/``) and each external mount dumped under its own mountpoint (bound from the node's mount
    there). None where the mount images cannot be read (CRIU judges them; no folder is made for them)."""
    try:
        mounts = read_mounts(image_dir)
    except ValueError:
        return frozenset()
    return frozenset(e.mnt_id for e in mounts.values()
                     if (e.mountpoint == "/" and e.root == "/" and e.ext_key is None) or e.ext_key == e.mountpoint)


def _check_links(files: OpenFiles, m: Manifest, creds: TreeCreds, same: frozenset[int] = frozenset()) -> None:
    """CRIU reopens a tree's files and binds its sockets by path, as root: for a tree that is not root, a
    link its user placed on such a path (``/tmp/u -> /run``) would hand it root's files or sockets. So
    no path CRIU opens for it may pass through a link that is not root's. (What its user swaps in while
    the restore runs is left open: restoring as that user is the fix, its own issue.)"""
    paths = [f.name for f in files.regular if f.id not in files.remapped]
    paths += [p for s in files.unix_sockets if (p := _bound_path(s, same)) is not None]
    for name in dict.fromkeys(paths):
        if not name.startswith("/"):
            continue
        at = "/"
        for part in PurePosixPath(name).parts[1:]:
            at = os.path.join(at, part)
            try:
                st = os.lstat(at)
            except OSError:
                break  # missing from here on: nothing to follow (CRIU or the checks above say what is missing)
            if stat.S_ISLNK(st.st_mode) and st.st_uid != 0:
                raise NotRestorableHere(
                    f"{_what(m)} reopens {name} for a tree of uid {creds.uid}, but {at} on this node is a link of uid "
                    f"{st.st_uid}: the restore (root) would follow it. Remove the link, or start fresh")


def _what(m: Manifest) -> str:
    return f"checkpoint {m.checkpoint_id} seq {m.seq}"


def _judged(f: RegFile, captured: set[str]) -> bool:
    """Whether ``f`` is a file the tree only reads, that a node must provide and CRIU checks."""
    if (f.flags & os.O_ACCMODE) != os.O_RDONLY or f.size is None or f.ext or f.mnt_id is not None:
        return False
    if f.mode is not None and not stat.S_ISREG(f.mode):
        return False
    p = PurePosixPath(f.name)
    if not p.is_absolute() or f.name in captured:
        return False
    return not any(f.name == t or f.name.startswith(t + "/") for t in _NOT_JUDGED)


def _remedy(f: RegFile) -> str:
    software = system_tree(PurePosixPath(f.name)) is not None or bool((f.mode or 0) & 0o111)
    if software:
        return "install the same software at the same path on every node (the same image)"
    return "make the same file available at the same path on every node (a shared volume)"


def _check_read_only(files: OpenFiles, m: Manifest) -> None:
    captured = {c.path for c in m.captured}
    problems: list[tuple[RegFile, str]] = []
    seen: set[str] = set()
    for f in files.regular:
        if f.id in files.remapped or f.name in seen or not _judged(f, captured):
            continue
        seen.add(f.name)
        try:
            st = os.stat(f.name)
        except FileNotFoundError:
            problems.append((f, "is missing on this node"))
            continue
        except OSError as e:
            problems.append((f, f"cannot be read on this node ({e.strerror})"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append((f, "is not a regular file on this node"))
        elif st.st_size != f.size:
            problems.append((f, f"is {st.st_size} bytes on this node"))
    if not problems:
        return
    (first, why), rest = problems[0], problems[1:]
    more = ""
    if rest:
        names = ", ".join(f.name for f, _ in rest[:_MORE]) + (", ..." if len(rest) > _MORE else "")
        more = f" ({len(rest)} more file{'s' if len(rest) > 1 else ''} too: {names})"
    raise NotRestorableHere(
        f"{_what(m)} needs {first.name} (read-only, {first.size} bytes), which {why}{more}: "
        f"{_remedy(first)}, or start fresh")


def _bound_path(s: UnixSocket, same: frozenset[int] = frozenset()) -> str | None:
    """The path on this node CRIU binds ``s`` to on restore, when it is an absolute one; else None. A
    socket of a tree's own mount namespace (``mnt_id``) only on one of its mounts at ``same`` paths."""
    if s.deleted or s.uflags & _USK_EXTERN or (s.mnt_id is not None and s.mnt_id not in same):
        return None  # CRIU rebuilds a deleted path itself; an external peer is not bound; another root's path
    if s.type != socket.SOCK_DGRAM and s.state == _TCP_ESTABLISHED:
        return None  # a connected stream (an accepted one carries the listener's name): never bound
    if not s.name or s.name[0] == 0:
        return None  # unnamed or abstract: nothing on the filesystem
    path = s.name.split(b"\0", 1)[0]  # Python binds path names with their terminating NUL
    return os.fsdecode(path) if path.startswith(b"/") else None


def _temp_roots() -> tuple[PurePosixPath, ...]:
    temp = [*_TEMP_DIRS, os.environ.get("TMPDIR", "")]
    return tuple(PurePosixPath(os.path.normpath(t)) for t in temp if t.startswith("/"))


def _is_dir(path: PurePosixPath) -> bool:
    """A directory there, not a symlink to one (a link there now is created through, so refused)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _socket_dirs(files: OpenFiles, m: Manifest, allowed: Sequence[PurePosixPath], denied: DenyList,
                 same: frozenset[int] = frozenset(), creds: TreeCreds = ROOT_CREDS) -> list[tuple[PurePosixPath, int, int]]:
    """The missing directories of bound sockets (under ``allowed``: the roots and temp dirs), each with
    the owner its socket had (a tree that is not root's: its own user's, whatever the image says); raises
    when one may not be created here."""
    out: dict[PurePosixPath, tuple[int, int]] = {}
    for s in files.unix_sockets:
        path = _bound_path(s, same)
        if path is None:
            continue
        directory = PurePosixPath(path).parent
        if directory in out or _is_dir(directory):
            continue  # there already: CRIU binds in it, nothing is created
        why = refusal(path, allowed, denied)
        if why is not None:
            fix = ("" if system_tree(PurePosixPath(path)) is not None
                   else ", add a directory above it to restore_roots (CEDANA_RESTORE_ROOTS)")
            raise NotRestorableHere(
                f"{_what(m)} binds a unix socket at {path}, whose directory {directory} is missing on this node "
                f"and is not created: {why}. Create it on this node{fix}, or start fresh")
        out[directory] = (s.uid or 0, s.gid or 0) if creds.uid == 0 else (creds.uid, creds.gid)
    return [(d, uid, gid) for d, (uid, gid) in out.items()]


def _make_dir_as_caller(directory: PurePosixPath, roots: Sequence[PurePosixPath], creds: TreeCreds,
                        prepared: Prepared, m: Manifest) -> None:
    """Create ``directory``'s missing components below its root as ``creds`` (`mkdir -m 700` run with its
    ids and groups, by path): the kernel judges each, ACLs and the folders above the root included (not the
    security label: the child keeps the agent's), so a node agent makes for its caller only what the caller
    could make itself. The walk that
    finds them, and the record for :meth:`Prepared.undo`, are root's, one component at a time with
    O_NOFOLLOW, as captured.py's."""
    root = root_of(directory, roots)
    if isinstance(root, Unvouched):
        root = ANYWHERE
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise NotRestorableHere(f"{_what(m)} binds a unix socket in {directory}, which is missing on this node, and "
                                f"its root {root} cannot be opened ({e.strerror}). Create {directory}, or start fresh"
                                ) from None
    path = root
    try:
        for part in directory.relative_to(root).parts:
            path = path / part
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                _mkdir_as(path, creds)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                st = os.fstat(nfd)
                if (st.st_uid, stat.S_IMODE(st.st_mode)) != (creds.uid, 0o700):  # swapped while it was made
                    os.close(nfd)
                    raise OSError(errno.EPERM, "not the caller's new folder", str(path))
                # recorded only now, as the folder checked: undo touches nothing swapped in by name later
                prepared._made.append((os.dup(fd), part, str(path), (st.st_dev, st.st_ino)))
            os.close(fd)
            fd = nfd
    except OSError as e:
        raise NotRestorableHere(
            f"{_what(m)} binds a unix socket in {directory}, which is missing on this node and cannot be created "
            f"as the tree's user, uid {creds.uid} ({e.strerror}). Create {directory} on this node, or start fresh"
        ) from None
    finally:
        os.close(fd)


def _mkdir_as(path: PurePosixPath, creds: TreeCreds) -> None:
    """`mkdir -m 700 PATH` with ``creds``' uid, gid and groups; OSError with its cause where it failed. The
    child is the caller's to signal or trace: nothing of ours is open in it, its output is capped, and a
    stalled one is given up after a few seconds."""
    try:
        done = subprocess.run(["mkdir", "-m", "700", "--", str(path)], user=creds.uid, group=creds.gid,
                              extra_groups=list(creds.groups), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=5, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
                              cwd="/", check=False)
    except (subprocess.SubprocessError, OSError) as e:
        raise OSError(errno.ETIMEDOUT, f"mkdir as uid {creds.uid} did not finish ({type(e).__name__})",
                      str(path)) from None
    if done.returncode != 0:  # mkdir's last words end with the cause: "...: Permission denied"
        said = done.stderr[-300:].decode(errors="replace").strip().splitlines()
        raise OSError(errno.EACCES, said[-1].rsplit(": ", 1)[-1][:100] if said else f"mkdir exited {done.returncode}",
                      str(path))


def _make_dir(directory: PurePosixPath, roots: Sequence[PurePosixPath], uid: int, gid: int, prepared: Prepared,
              m: Manifest, creds: TreeCreds, checked: Sequence[PurePosixPath]) -> None:
    """Create ``directory``'s missing components below its root (0700, owned ``uid``:``gid``) through
    captured.py's guarded walk (the root is the node's own setting, as /tmp may be a symlink; nothing
    below it may be); what was created goes into ``prepared``."""
    root = root_of(directory, roots)

    def made(parent_fd: int, name: str, path: PurePosixPath) -> None:
        prepared.made(parent_fd, name, str(path))

    try:
        os.close(open_dir(directory, roots, create=True, mode=0o700, owner=(uid, gid), created=made, creds=creds,
                          checked=checked))
    except OSError as e:
        if str(e.filename) == str(root):  # the walk never started
            raise NotRestorableHere(f"{_what(m)} binds a unix socket in {directory}, which is missing on this node, "
                                    f"and its root {root} cannot be opened ({e.strerror}). Create {directory}, or "
                                    "start fresh") from None
        raise NotRestorableHere(
            f"{_what(m)} binds a unix socket in {directory}, which is missing on this node and cannot be created "
            f"safely ({blocked(e)}). Create {directory} on this node, or start fresh") from None
