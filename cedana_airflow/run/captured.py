"""Putting a checkpoint's captured files back on this node, where an untrusted manifest cannot aim them.

A manifest comes from the store, and whoever can write the store can write a manifest; a restore
runs as root. Unfenced, every captured path (and the workload's working directory, which a restore
creates when it is missing) would be a root write primitive on each restoring node. So:

- a path must lie under one of the **restore roots** this node allows. A signed manifest (this node
  verified it with the deployment's key: our own supervisor wrote it) goes back where the workload had
  its files, unless ``Settings.restore_roots`` narrows that. An unsigned one is held to
  ``Settings.restore_roots`` plus the restoring command's working directory: whoever can write the
  store wrote it. System trees (``/etc``, ``/usr``, ``/bin``, ``/sbin``, ``/lib*``, ``/boot``,
  ``/proc``, ``/sys``, ``/dev``) and ``/`` itself are never roots, even when listed;
- whatever the roots, nothing at or below an entry of the **deny-list** (:func:`node_denied`) is
  written: runtime and spool trees, package state, the code the restoring interpreter imports or runs
  (``sys.path``, ``PATH``, CRIU), this node's own configuration and state, ``restore_deny``; nor a
  hidden entry at the top of a home (``~/.ssh``, ``~/.bashrc``, ``~/.local``), unless a restore root
  lies at or below that entry;
- every component below the root is opened from its parent's descriptor with ``O_NOFOLLOW``, so a
  symlink anywhere on the way refuses the entry instead of redirecting the write. Below ``/`` (a
  signed manifest with no restore_roots: no operator vouched for the tree) each directory is judged
  on that descriptor too: owned by root or the workload's user, never writable by others unless
  sticky and root's, and for a workload that is not root, one its user may enter and write;
- files go back as the workload's user (its fsuid/fsgid from the images: engine/images.py
  ``read_creds``): an existing target must be a regular file that user owns; the content goes to a
  fresh ``O_EXCL`` temp file in the target's directory, owned by that user, with permission bits only
  (no setuid, setgid or sticky), and is renamed over the target. SQLite's journals beside a captured
  file are set aside under the same rules, or refuse the checkpoint.

A refused entry refuses its checkpoint (CorruptCheckpoint, one line naming the path and the fix);
the restore then falls back to the next older one. The node's own versions of replaced files are
put back if the restore fails later, so a refused checkpoint changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..config import DEFAULT_CRIU_PREFIX
from ..engine.images import ROOT_CREDS, TreeCreds
from ..errors import CorruptCheckpoint
from ..format.manifest import Manifest

__all__ = ["ANYWHERE", "JOURNALS", "NOBODY", "SHARED_MEMORY", "SYSTEM_TREES", "CapturedFilesBack", "DenyList",
           "blocked", "ensure_cwd", "node_denied", "open_dir", "refusal", "restore_roots", "root_of", "system_tree"]

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

#: The credentials of an image set with no process tree (no pstree.img, which CRIU refuses first
#: thing): files go back as the kernel's overflow user, who owns nothing.
NOBODY = TreeCreds(65534, 65534)

#: How a refusal that no setting lifts ends (the system trees and class A of the deny-list).
NEVER_WRITES = "which a restore never writes"

#: Class A of the deny-list beyond the system trees: what root runs, schedules or trusts. (why, paths)
_NEVER = (
    ("runtime state: systemd units, udev rules, sudo timestamps", ("/run", "/var/run", "/var/lock")),
    ("spooled jobs: cron, at, mail", ("/var/spool",)),
    ("package and service state root acts on", ("/var/lib/systemd", "/var/lib/dpkg", "/var/lib/rpm", "/var/lib/apt",
                                                "/var/lib/dnf", "/var/lib/yum", "/var/lib/polkit-1", "/var/lib/sudo",
                                                "/var/lib/AccountsService")),
    ("what root runs at boot or a cluster agent trusts", ("/var/lib/cloud", "/opt/cni", "/var/lib/kubelet",
                                                          "/var/lib/rancher", "/var/lib/docker",
                                                          "/var/lib/containerd")),
)


@dataclass(frozen=True)
class DenyList:
    """Where a restore never writes, whatever the manifest and the roots say (see :func:`node_denied`).

    ``never``: (path, why) pairs refused at or below the path (class A). ``homes``: home directories
    (and every child of ``/home``, there or not) whose hidden top entries (``~/.ssh``, ``~/.bashrc``,
    ``~/.local``: start-up files, keys, user code, too many to list) are refused unless a restore root
    lies at or below the entry (class B)."""

    never: tuple[tuple[PurePosixPath, str], ...] = ()
    homes: tuple[PurePosixPath, ...] = ()

    def refusal(self, p: PurePosixPath, roots: Sequence[PurePosixPath]) -> str | None:
        for entry, why in self.never:
            if entry == p or entry in p.parents:
                return f"{p} is in {entry} ({why}), {NEVER_WRITES}"
        under_home = (PurePosixPath(*p.parts[:3]),) if len(p.parts) > 3 and p.parts[1] == "home" else ()
        for home in (*self.homes, *under_home):
            if home in p.parents:
                hidden = home / p.relative_to(home).parts[0]
                # only a configured root lifts it: the working directory is the DAG's choice (Unvouched)
                if hidden.name.startswith(".") and not any(
                        r in p.parents and (r == hidden or hidden in r.parents) and not isinstance(r, Unvouched)
                        for r in roots):
                    return (f"{p} is in {hidden}, a hidden entry of the home {home}, which a restore writes only "
                            "under a restore root at or below it")
        return None


def _absolute(paths: Sequence[Any]) -> list[str]:
    """Each absolute path as written and resolved (a captured path is a resolved one), never ``/``."""
    out = []
    for p in paths:
        if p and os.path.isabs(p):
            out += [q for q in (os.path.normpath(p), os.path.realpath(p)) if q != "/"]
    return out


def node_denied(settings: Any = None, *anchors: Any) -> DenyList:
    """This node's deny-list, read now (once per restore): class A is ``_NEVER``, the code the
    restoring interpreter imports and runs (``sys.prefix``s, ``sys.path``, ``PATH``, CRIU), this
    node's own configuration and state (``CEDANA_CONFIG``, the key and credential files, the opt-in
    list, the work dir, a ``file://`` store, ``anchors``: what the caller holds, e.g. the checkpointer's
    store and CRIU binary) and ``settings.restore_deny`` (the Airflow side puts its dags_folder,
    plugins_folder and airflow.cfg there); class B is every home: pwd's, ``/root`` and ``/home/*``
    (DenyList.refusal)."""
    never = [(PurePosixPath(p), why) for why, paths in _NEVER for p in paths]
    cwd = os.getcwd()
    # The restoring command's working directory is on sys.path only by `python -m`, and is a restore
    # root by design (restore_roots): it is not taken for code here.
    code = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
            *(p for p in sys.path if p and os.path.abspath(p) != cwd)]
    s = settings
    criu = getattr(s, "criu", "") or ""
    store = getattr(s, "store", "") or ""
    ours = [getattr(s, name, None) for name in ("work_dir", "optin_file", "signing_key_file", "legacy_key_file",
                                                "store_credentials_dir")]
    ours.append(getattr(s, "criu_prefix", None) or DEFAULT_CRIU_PREFIX)
    ours += [os.environ.get("CEDANA_CONFIG"), os.path.dirname(criu) if criu else None,
             store[len("file://"):] if store.startswith("file://") else None, *anchors]
    for why, paths in (("code the restoring interpreter imports", code),
                       ("on PATH: programs root runs", os.environ.get("PATH", "").split(os.pathsep)),
                       ("this node's own configuration or state", ours),
                       ("restore_deny", getattr(s, "restore_deny", ()) or ())):
        never += [(PurePosixPath(p), why) for p in _absolute(paths)]
    homes = ["/root", *(u.pw_dir for u in pwd.getpwall())]
    return DenyList(tuple(dict.fromkeys(never)), tuple(dict.fromkeys(map(PurePosixPath, _absolute(homes)))))


class Unvouched(PurePosixPath):
    """A restore root nobody configured (the restoring command's working directory, which a DAG's
    ``cwd=`` chooses): it bounds where files go, but the walk to it starts at ``/`` and judges every
    directory on the way (open_dir), as for a signed checkpoint with no roots configured."""


def restore_roots(configured: Sequence[Path], cwd: str | None, *, signed: bool = False) -> tuple[PurePosixPath, ...]:
    """The roots a restore may write under: for a ``signed`` checkpoint with none configured, anywhere
    but a system tree; otherwise the configured ones and ``cwd`` (default: ours), less any that is
    ``/`` or a system tree (logged: listing one is a mistake, never a permission). Each is resolved
    now, on this node (CRIU records resolved paths too), so a link cannot carry one into a system tree
    or the deny-list; ``cwd`` comes back :class:`Unvouched`."""
    if signed and not configured:
        return (ANYWHERE,)
    out: list[PurePosixPath] = []
    for root in [*configured, Path(cwd or os.getcwd())]:
        real = os.path.realpath(os.path.abspath(root))
        p = PurePosixPath(real) if root in configured else Unvouched(real)
        tree = system_tree(p)
        if tree is not None:
            # A listed one is a mistake worth a warning; the working directory is only a default (a
            # container's is often /), and naming it on every checkpoint would be noise.
            log.log(logging.WARNING if root in configured else logging.DEBUG,
                    "restore root %s is ignored: %s is never written by a restore", p, tree)
            continue
        out.append(p)
    return tuple(dict.fromkeys(out))


def refusal(path: str, roots: Sequence[PurePosixPath], denied: DenyList | None = None) -> str | None:
    """Why a restore must not write ``path``, or None when it may: it lies strictly under a root, and
    neither in a system tree nor on the deny-list (``denied``; default: :func:`node_denied` without
    settings)."""
    p = PurePosixPath(path)
    if not p.is_absolute() or os.path.normpath(path) != path:
        return f"{path!r} is not an absolute, normalised path"
    tree = system_tree(p)
    if tree is not None:
        return f"{path} is in {tree}, {NEVER_WRITES}"
    if not any(root in p.parents for root in roots):
        return f"{path} is outside the restore roots ({', '.join(map(str, roots)) or 'none'})"
    return (denied if denied is not None else node_denied()).refusal(p, roots)


def root_of(directory: PurePosixPath, roots: Sequence[PurePosixPath]) -> PurePosixPath:
    """The innermost root that is ``directory`` or holds it."""
    return max((r for r in roots if r == directory or r in directory.parents), key=lambda r: len(r.parts))


def _may(st: os.stat_result, creds: TreeCreds, need: int) -> bool:
    """Whether ``creds`` may ``need`` (1 enter, 2 write, 3 both) the directory ``st`` by its mode bits
    (the kernel's order: owner, then group, then others; ACLs are not read, so an ACL grant is refused)."""
    shift = 6 if st.st_uid == creds.uid else 3 if st.st_gid == creds.gid or st.st_gid in creds.groups else 0
    return ((st.st_mode >> shift) & need) == need


def _judge_dir(fd: int, creds: TreeCreds, need: int) -> None:
    """Rule 3 on a directory the walk holds (fstat of its descriptor, nothing resolved again): owned by
    root or the workload's user; writable by others only when sticky and root's (/tmp's shape); and
    for a workload that is not root, ``need`` (see _may) by its own mode bits."""
    st = os.fstat(fd)
    if st.st_uid not in (0, creds.uid):
        raise PermissionError(errno.EACCES, f"owned by uid {st.st_uid}, neither root nor the workload's user "
                                            f"(uid {creds.uid})")
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        raise PermissionError(errno.EACCES, "writable by others, and not a sticky directory of root's")
    if creds.uid != 0 and not _may(st, creds, need):
        raise PermissionError(errno.EACCES, f"the workload's user (uid {creds.uid}) may not "
                                            f"{'write' if need & 2 else 'enter'} it")


def blocked(e: OSError) -> str:
    """What stopped a walk, for a refusal line."""
    hint = ": a symlink or a file on the way" if e.errno in (errno.ELOOP, errno.ENOTDIR) else ""
    return f"{e.filename}: {e.strerror}{hint}"


def open_dir(directory: PurePosixPath, roots: Sequence[PurePosixPath], *, create: bool, mode: int = 0o755,
             owner: tuple[int, int] | None = None, created: Callable[[int, str, PurePosixPath], None] | None = None,
             creds: TreeCreds | None = None, checked: Collection[PurePosixPath] = (ANYWHERE,), write: bool = False
             ) -> int:
    """A descriptor of ``directory``, reached from its root one component at a time with O_NOFOLLOW
    (created ``mode`` where missing, when ``create``). The root itself is the node's own setting and may
    be a symlink; nothing below it may. ``created(parent_fd, name, path)`` hears of each directory made,
    right after its mkdir; with ``owner`` (uid, gid) each is then set to exactly ``mode`` (whatever the
    umask) and that owner. With ``creds``, when the root is one of ``checked`` (``/``: nobody vouched for
    the tree below it), every directory held on the way is judged (_judge_dir), a directory to mkdir in
    must be writable by ``creds``, and so must ``directory`` itself when ``write``. An OSError from
    below the root names the path the walk had reached."""
    root = root_of(directory, roots)
    if isinstance(root, Unvouched):  # nobody vouched for the way there: walked from / and judged
        root = ANYWHERE
    judged = creds if root in checked else None
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path, made = root, False
    try:
        if judged is not None:
            _judge_dir(fd, judged, 1)
        for part in directory.relative_to(root).parts:
            path = path / part
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                made = False
            except FileNotFoundError:
                if not create:
                    raise
                if judged is not None and judged.uid != 0 and not _may(os.fstat(fd), judged, 3):
                    raise PermissionError(errno.EACCES, f"the workload's user (uid {judged.uid}) may not create it "
                                                        "in its parent") from None
                os.mkdir(part, mode, dir_fd=fd)
                if created is not None:
                    created(fd, part, path)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                made = True
                if owner is not None:
                    try:
                        os.fchmod(nfd, mode)
                        os.fchown(nfd, *owner)
                    except OSError:
                        os.close(nfd)
                        raise
            os.close(fd)
            fd = nfd
            if judged is not None and not made:
                _judge_dir(fd, judged, 1)
        if judged is not None and write and not made and judged.uid != 0 and not _may(os.fstat(fd), judged, 3):
            raise PermissionError(errno.EACCES, f"the workload's user (uid {judged.uid}) may not write it")
        return fd
    except OSError as e:
        os.close(fd)
        raise type(e)(e.errno, e.strerror, str(path)) from None
    except BaseException:
        os.close(fd)
        raise


def _refused(m: Manifest, what: str) -> CorruptCheckpoint:
    if NEVER_WRITES in what:  # no setting lifts it: naming one would mislead
        return CorruptCheckpoint(f"checkpoint {m.checkpoint_id} seq {m.seq} is refused: {what}")
    # an unsigned one got here only under allow_unsigned: its writer holds no key, and signing is ours to do
    fix = ("add the directory to restore_roots (CEDANA_RESTORE_ROOTS)" if m.signature is not None else
           "add the directory to restore_roots (CEDANA_RESTORE_ROOTS); it is unsigned: a checkpoint a node "
           "signed with the node key goes back where it was")
    return CorruptCheckpoint(
        f"checkpoint {m.checkpoint_id} seq {m.seq} is refused: {what}. If this node should write there, {fix}; "
        "otherwise the store holds a manifest nobody here wrote")


def ensure_cwd(m: Manifest, roots: Sequence[PurePosixPath], denied: DenyList | None = None,
               creds: TreeCreds = ROOT_CREDS) -> None:
    """The workload's working directory exists (CRIU restores into it); a missing one (or a symlink
    there now: the recorded one was resolved) is created only where a captured file could be, through
    the same guarded walk, as the workload's user."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(m.process.cwd).st_mode):
            return
    why = refusal(m.process.cwd, roots, denied)
    if why is not None:
        raise _refused(m, f"its working directory {why}")
    try:
        os.close(open_dir(PurePosixPath(m.process.cwd), roots, create=True, creds=creds, write=True,
                          owner=(creds.uid, creds.gid) if creds.uid else None))
    except OSError as e:
        raise _refused(m, f"its working directory {m.process.cwd} cannot be created safely ({blocked(e)})") from None


def _copy_into(src: Path, fd: int, *, users_room: bool = False) -> None:
    with open(src, "rb") as i:
        _copy_fd(i.fileno(), fd, users_room=users_room)


class _NoRoomForUsers(OSError):
    """A copy stopped before it took space only root may use."""


#: Held from the room check to the end of each write, so that the agent's restores at once (threads of one
#: process) cannot each pass the check before the others' writes land (review 49, third review T3).
_ROOM = threading.Lock()


def _no_room(m: Manifest, target: PurePosixPath) -> CorruptCheckpoint:
    return _refused(m, f"captured file {target} cannot be put back: its file system has no more room for users, "
                       "and root's writes there would take the space only root may use. Free space there")


def _copy_fd(src: int, dst: int, *, users_room: bool = False) -> None:
    """``src``'s bytes into ``dst`` (empty), its holes left holes (SEEK_DATA/SEEK_HOLE): a sparse file
    costs what it holds, not its length. Root copies the workload's own files, so a file its user made
    terabytes long and empty must not become terabytes of root's blocks (review 49, F2). ``users_room``:
    before each write, what users may still take on ``dst``'s file system must hold it, so that no copy
    (several restores at once, a file its user fills while it is copied, a file system without holes)
    reaches root's reserve; past that, _NoRoomForUsers."""
    size = os.fstat(src).st_size
    off = 0
    while off < size:
        try:
            start = os.lseek(src, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: nothing but a hole from here on
                raise
            break
        end = os.lseek(src, start, os.SEEK_HOLE)
        if start < off or end <= start:  # a file system that answers otherwise is never looped on
            raise OSError(errno.EIO, f"its file system answered SEEK_DATA {start} and SEEK_HOLE {end} after {off}")
        os.lseek(src, start, os.SEEK_SET)
        os.lseek(dst, start, os.SEEK_SET)
        left = end - start
        while left > 0 and (data := os.read(src, min(left, 1 << 20))):
            with _ROOM if users_room else contextlib.nullcontext():
                if users_room:
                    vfs = os.fstatvfs(dst)
                    if len(data) > vfs.f_bavail * vfs.f_frsize:
                        raise _NoRoomForUsers(errno.ENOSPC, "its file system has no more room for users")
                view = memoryview(data)
                while view:
                    view = view[os.write(dst, view):]
            left -= len(data)
        if left > 0:  # it ended early (it shrank meanwhile): nothing past here
            break
        off = end
    os.ftruncate(dst, size)  # a trailing hole, and a file that shrank meanwhile is not read past


def _write_back(dfd: int, name: str, backup: str, st: os.stat_result) -> None:
    """Put a file's own content (kept in ``backup``) back into its inode, as it was: only the same inode
    (``st``), alone at its name. What the user put at the name meanwhile (a hard link to root's file)
    is never written through."""
    fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode) or now.st_nlink != 1:
            raise OSError(errno.ESTALE, "another file is at its name now; its own content is kept in the backup")
    except BaseException:
        os.close(fd)
        raise
    bfd = os.open(backup, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        _copy_fd(bfd, fd)
        os.fchmod(fd, st.st_mode & 0o777)
    finally:
        os.close(bfd)
        os.close(fd)


class CapturedFilesBack:
    """Puts a checkpoint's captured files in place (CRIU checks their size), and puts the node's own
    versions back if the restore then fails. ``source``: the fetched copies, ``source/<index>``."""

    def __init__(self, m: Manifest, source: Path, roots: Sequence[PurePosixPath], denied: DenyList | None = None,
                 creds: TreeCreds = ROOT_CREDS) -> None:
        self.m, self.source, self.roots, self.creds = m, source, roots, creds
        self.denied = denied if denied is not None else node_denied()
        # (directory fd, name, backup name, the file's own mode when it was written in place)
        self._placed: list[tuple[int, str, str | None, os.stat_result | None]] = []
        self._kept = False

    def __enter__(self) -> CapturedFilesBack:
        try:
            for c in self.m.captured:  # every entry is judged before any is written
                why = refusal(c.path, self.roots, self.denied)
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

    def _dir(self, path: PurePosixPath, *, create: bool) -> int:
        """The directory ``path`` goes into, for writing as the workload's user (open_dir's rules)."""
        c = self.creds
        return open_dir(path.parent, self.roots, create=create, creds=c, write=True,
                        owner=(c.uid, c.gid) if c.uid else None)

    def _not_theirs(self, st: os.stat_result) -> str | None:
        """Rule 4: an existing file is replaced or set aside only when it is a regular one of the workload's user."""
        if not stat.S_ISREG(st.st_mode):
            return "exists and is not a regular file"
        if st.st_uid != self.creds.uid:
            return f"is owned by uid {st.st_uid}, not by the workload's user (uid {self.creds.uid})"
        return None

    def _place(self, target: PurePosixPath, copy: Path, mode: int) -> None:
        try:
            dfd = self._dir(target, create=True)
        except OSError as e:
            raise _refused(self.m, f"captured file {target} cannot be reached safely ({blocked(e)})") from None
        name, backup = target.name, None
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if (why := self._not_theirs(st)) is not None:
                    raise _refused(self.m, f"captured file {target} {why}")
                if st.st_nlink == 1:  # its own inode: written in place (see _in_place)
                    self._placed.append((dfd, name, self._in_place(dfd, name, st, copy, mode, target), st))
                    return
                backup = f".{name}.cedana-orig-{secrets.token_hex(6)}"  # never someone else's name in a shared dir
                os.replace(name, backup, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = f".{name}.cedana-{secrets.token_hex(6)}"  # not guessable, and O_EXCL: never someone's link
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                try:  # root's bytes, the checkpoint's: never into root's reserve either (third review, T2)
                    _copy_into(copy, fd, users_room=True)
                except _NoRoomForUsers:
                    raise _no_room(self.m, target) from None
                if self.creds.uid:
                    os.fchown(fd, self.creds.uid, self.creds.gid)  # the workload's own file, as it had it
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
        restored database). Renamed aside under the captured files' rules; removed when the restore
        holds, put back when it fails. One that may not be set aside refuses the checkpoint: left, it
        would be rolled back into the restored file."""
        what = f"journal {path} (written after the checkpoint, beside a captured file)"
        why = refusal(str(path), self.roots, self.denied)
        if why is not None:
            if os.path.lexists(path):
                raise _refused(self.m, f"journal {why}")
            return
        try:
            dfd = self._dir(path, create=False)
        except OSError as e:
            raise _refused(self.m, f"{what} cannot be reached safely ({blocked(e)})") from None
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(dfd)
            return
        if (why := self._not_theirs(st)) is not None:
            os.close(dfd)
            raise _refused(self.m, f"{what} {why}, so it cannot be set aside")
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
        fd, whole = -1, False
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode) or now.st_nlink != 1:
                raise _refused(self.m, f"captured file {target} changed while it was being put back")
            vfs, held = os.fstatvfs(fd), now.st_blocks * 512
            try:
                if held > vfs.f_bavail * vfs.f_frsize:  # what users may still take: never root's reserve (F2)
                    raise _NoRoomForUsers(errno.ENOSPC, "")
                _copy_fd(fd, bfd, users_room=True)
            except _NoRoomForUsers:
                raise _refused(self.m, f"captured file {target} holds {held} bytes on this node now, more than its "
                                       "file system has free for users: keeping a copy of it while the checkpoint's "
                                       "is put back would fill the disk. Free space there, or remove the file") from None
            whole = True
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            try:
                _copy_into(copy, fd, users_room=True)
            except _NoRoomForUsers:  # what it held goes back below, from the backup
                raise _no_room(self.m, target) from None
            os.fchmod(fd, mode & 0o777)  # permission bits only, whatever the manifest says
        except BaseException:
            kept = False
            if whole:  # the copy is whole, and the file may be cut already: put it back
                try:
                    _write_back(dfd, name, backup, st)
                except OSError as e:  # its only copy now: left where it is, and said
                    kept = True
                    log.warning("captured file %s could not be put back as it was (%s); what it held is in %s beside "
                                "it", target, e.strerror or e, backup)
            if not kept:
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
        for dfd, name, backup, in_place in reversed(self._placed):
            try:
                if self._kept:
                    if backup is not None:
                        os.unlink(backup, dir_fd=dfd)
                elif in_place is not None and backup is not None:
                    _write_back(dfd, name, backup, in_place)
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
