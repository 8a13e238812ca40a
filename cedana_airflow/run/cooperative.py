"""The supervisor's side of a cooperative checkpoint: ask the workload for its state, wait for its
COMPLETE marker, and hand what it wrote to the store (the workload's side: cedana_airflow/coop).

One root per supervisor, in its work directory (root's eyes only, like every dump)::

    coop-<pid>/request     JSON {"request": N, "dir": ..., "deadline": ...}: exists while a request is open
    coop-<pid>/ready       created by a workload that answers, with the PIDs that do (coop.listen)
    coop-<pid>/state-N/    request N's own directory, made empty for it
    coop-<pid>/state       CEDANA_CHECKPOINT_DIR: a link to the open request's directory, gone between requests
    coop-<pid>/taken/      a completed state, renamed out of the workload's way while it is stored
    coop-<pid>/restore-S/  CEDANA_RESTORE_DIR: checkpoint seq S, put back before the command starts

For the node agent's caller (``owner``: its uid, gid and groups), the root is root's and 0711: the
workload reaches the request file and its own folders by name, and can neither list nor change the root
(else it could plant a link where the agent writes). Its folders are the caller's: ``state-N/``, the put
back ``restore-S/`` (given to it before its command starts) and ``answers/``, where its ready file goes.
Root never opens, lists, maps or removes anything in them: a helper running as the caller copies a
completed state into a folder of the agent's own (``private``) and removes the caller's folders
(run/state_copy.py); only the markers are read by root, by name in a folder the workload cannot swap,
never through a link and never from a FIFO.

A request is withdrawn (the file and the link removed, its directory renamed away and deleted) when its
deadline passes, the workload ends, or the run stops: what a late writer still writes lands nowhere
kept, and never in another request's directory unless it writes through the link after the next
request opened (the helper writes into the request's own directory). A COMPLETE holding another
request's number is not this request's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from ..coop import COMPLETE, DONE_PREFIX, ENV_DIR, ENV_READY, ENV_REQUEST, ENV_RESTORE, ENV_SIGNAL
from ..store.transfer import StateSource
from .state_copy import copy_as, remove_as
from .workload import Workload

__all__ = ["Cooperation", "Taken", "catches"]

log = logging.getLogger(__name__)

#: Our markers and their in-flight copies (coop._write_marker): not part of the workload's state.
_MARKERS = re.compile(rf"^(?:{COMPLETE}|{re.escape(DONE_PREFIX)}\d+|\.(?:{COMPLETE}|{re.escape(DONE_PREFIX)}\d+)\.\d+\.tmp)$")


@dataclass(frozen=True)
class Taken:
    """A completed request: what to store, and the directory to delete once it is stored (ours: for the node
    agent's caller, the copy of what it wrote)."""

    source: StateSource
    where: Path

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for _, f, _ in self.source.files)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (/proc/PID/status SigCgt): only those are
    sent a request's signal, since its default action would end a process that has none."""
    return _status(pid)[0] >> (signum - 1) & 1 == 1


def _status(pid: int) -> tuple[int, int]:
    """(the signals it catches, as a mask; its PID in its own namespace, what it wrote in the ready file)."""
    caught, inner = 0, pid
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    caught = int(line.split()[1], 16)
                elif line.startswith("NSpid:"):
                    inner = int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return caught, inner


class Cooperation:
    """Requests to one workload, one at a time, under ``root``."""

    def __init__(self, root: Path, settings: Settings, owner: tuple[int, int, tuple[int, ...]] | None = None,
                 private: Path | None = None) -> None:
        """``owner``: the uid, gid and groups the workload runs as, where they are not ours (the node agent's
        caller); ``private``: a folder of ours alone (the work dir), where its states are copied."""
        self.root, self.settings, self.owner = root, settings, owner
        self.private = private or root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.request_file, self.ready_file = root / "request", root / "ready"
        if owner is not None:
            root.chmod(0o711)  # reached by name, never listed nor written by the workload
            answers = root / "answers"
            answers.mkdir(mode=0o700, exist_ok=True)  # (there: an agent took up a former agent's run)
            os.lchown(answers, owner[0], owner[1])
            self.ready_file = answers / "ready"
        self.state_link = root / "state"
        self.requests = 0
        self._sig = None if settings.cooperative_signal == "none" else signal.Signals[settings.cooperative_signal]

    def env(self, restore_dir: Path | None = None) -> dict[str, str]:
        """What the workload reads of the contract (coop/__init__.py)."""
        out = {ENV_DIR: str(self.state_link), ENV_REQUEST: str(self.request_file), ENV_READY: str(self.ready_file),
               ENV_SIGNAL: self._sig.name if self._sig is not None else "none"}
        return {**out, ENV_RESTORE: str(restore_dir)} if restore_dir is not None else out

    def restore_dir(self, seq: int) -> Path:
        return self.root / f"restore-{seq}"

    @staticmethod
    def restoring(env: Mapping[str, str]) -> int | None:
        """The checkpoint a workload's environment puts back (:meth:`env` with a :meth:`restore_dir`), if any:
        for a starter that says what it started (the node agent's start reply)."""
        name = Path(env.get(ENV_RESTORE, "")).name
        return int(name.removeprefix("restore-")) if re.fullmatch(r"restore-[0-9]{1,18}", name) else None

    def declared(self) -> bool:
        """Whether the workload said it answers (its ready file): what ``mode = auto`` asks first. Another
        process's handler for the signal (a framework's own use of SIGUSR1) is no such declaration."""
        try:  # not through a link: that would tell whether a path of root's exists
            return stat.S_ISREG(os.lstat(self.ready_file).st_mode)
        except OSError:
            return False

    def _listeners(self) -> set[int]:
        """The PIDs the ready file names (empty: none named, or no file)."""
        try:
            return {int(x) for x in _read_small(self.ready_file, 64 << 10).split() if x.isascii() and x.isdigit()}
        except (OSError, UnicodeDecodeError):
            return set()

    def ask(self, workload: Workload, *, budget: float | None = None, stop: threading.Event | None = None,
            n: int | None = None) -> Taken | str | None:
        """Request a checkpoint and wait for COMPLETE: what was written, why there is nothing to store, or
        None when the workload ended meanwhile (nothing left to protect: no skip to report).
        ``budget``: at most this long (a stop's window), whatever ``cooperative_timeout_seconds`` says.
        ``n``: the request's number (one part of a job asks with its round's seq, so that the ranks on every
        node answer the same number: run/job.py); default the next one."""
        self.requests = max(self.requests + 1, n or 0)
        n = self.requests
        for left in [*self.root.glob("state-*"), self.root / "taken"]:  # a withdrawn request's, a kept one's
            self._remove(left)
        d = self.root / f"state-{n}"
        d.mkdir(mode=0o700)
        if self.owner is not None:
            os.chown(d, self.owner[0], self.owner[1])  # new, in a folder only we write: nothing in its place
        _link(self.state_link, d)
        timeout = self.settings.cooperative_timeout_seconds if budget is None else min(
            budget, self.settings.cooperative_timeout_seconds)
        t0 = time.monotonic()
        _write_json(self.request_file, {"request": n, "dir": str(d), "deadline": time.time() + timeout})
        told = self._tell(workload)
        why = ""
        while not _complete(d / COMPLETE, n):
            if workload.poll() is not None:
                why = "the workload ended before it created COMPLETE"
            elif stop is not None and stop.is_set():
                why = "the run is stopping"
            elif time.monotonic() - t0 > timeout:
                why = (f"the workload did not create COMPLETE in {timeout:g} s (cooperative_timeout_seconds; "
                       f"{'told by ' + told + ' and ' if told else ''}the request file {self.request_file})")
            if why:
                break
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        self.request_file.unlink(missing_ok=True)  # withdrawn or answered: either way no longer open
        self.state_link.unlink(missing_ok=True)
        if why:
            self._remove(d)
            log.debug("cooperative request %d withdrawn: %s", n, why)
            if workload.poll() is not None or why == "the run is stopping":
                return None  # nothing to protect any more, or the stop's own request follows: no skip
            return f"cooperative checkpoint {n} dropped: {why}; nothing of it is kept"
        taken = self.root / "taken"
        os.rename(d, taken)  # out of the workload's way: what it writes now goes nowhere kept
        verify = tuple(shlex.split(self.settings.cooperative_verify_command))
        if self.owner is None:
            try:
                files, ranks = _listing(taken)
            except ValueError as e:
                _remove(taken)
                return f"cooperative checkpoint {n} dropped: {e}"
            return Taken(StateSource(files, request=n, ranks=ranks, write_seconds=seconds, verify_command=verify),
                         taken)
        copy = Path(tempfile.mkdtemp(prefix=f"coop-copy-{n}-", dir=self.private)) / "state"
        try:
            files, ranks = copy_as(self.owner, taken, copy, max_bytes=self.settings.max_checkpoint_bytes or 1 << 40,
                                   timeout=max(60.0, self.settings.cooperative_timeout_seconds))
        except ValueError as e:  # (copy_as leaves nothing of it behind)
            shutil.rmtree(copy.parent, ignore_errors=True)
            return f"cooperative checkpoint {n} dropped: {ENV_DIR} {e}; nothing of it is kept"
        except BaseException:
            shutil.rmtree(copy.parent, ignore_errors=True)
            raise
        finally:
            self._remove(taken)
        return Taken(StateSource(files, request=n, ranks=ranks, write_seconds=seconds, verify_command=verify),
                     copy.parent)

    def _remove(self, path: Path) -> None:
        """A folder of the workload's gone: removed as its user where it is the node agent's caller's."""
        if self.owner is None:
            _remove(path)
            return
        if not path.exists():
            return
        aside = path.with_name(f"{path.name}.gone-{time.monotonic_ns()}")
        with contextlib.suppress(OSError):
            os.rename(path, aside)  # in our folder: the workload cannot put anything in its place
            path = aside
        remove_as(self.owner, path)

    def give(self, restored: Path) -> None:
        """A put back state (``restore_dir``), made by us, to the workload's user before its command starts."""
        if self.owner is None:
            return
        uid, gid = self.owner[0], self.owner[1]
        for top, dirs, names in os.walk(restored):  # ours alone until now: nothing in it was planted
            for name in (*dirs, *names):
                os.lchown(os.path.join(top, name), uid, gid)
        os.lchown(restored, uid, gid)

    def _tell(self, workload: Workload) -> str:
        """The request's signal, to each process of the tree that handles it (of those the ready file names,
        when it names any); its name when any was told."""
        if self._sig is None:
            return ""
        told, named = "", self._listeners()
        for pid in workload.pids():
            caught, inner = _status(pid)  # the ready file holds PIDs as the workload sees them (its namespace)
            if (not named or inner in named) and caught >> (self._sig - 1) & 1:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, self._sig)
                    told = self._sig.name
        return told

    def close(self) -> None:
        if self.settings.keep_local:
            return
        if self.owner is None:
            _remove(self.root)
            return
        if not self.root.is_dir():
            return
        # Never a recursive removal as root over what the caller made: its folders are emptied by the helper, as
        # the caller; ours (entries of our folder, named by us) are removed one by one; what is left stays.
        for child in list(self.root.iterdir()):
            st = child.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_uid == self.owner[0]:
                self._remove(child)
            elif stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):
                    os.rmdir(child)  # a folder of ours: removed only when empty, never recursively
            else:
                child.unlink(missing_ok=True)
        try:
            os.rmdir(self.root)
        except OSError as e:
            log.warning("cooperative folder %s not removed: %s (the workload left something its user cannot "
                        "remove)", self.root, e.strerror or e)


def _listing(top: Path) -> tuple[tuple[tuple[str, Path, int], ...], int]:
    """Every regular file under ``top`` (relative path, path, mode bits) and how many ranks marked their
    part done. A symlink or a special file refuses the whole state: restoring it could write elsewhere,
    and half a state is no checkpoint."""
    files: list[tuple[str, Path, int]] = []
    ranks = 0

    def walk(d: Path, rel: str) -> None:
        nonlocal ranks
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            r = f"{rel}{e.name}"
            if any(ord(c) < 32 for c in e.name) or not e.name.isprintable() and _undecodable(e.name):
                raise ValueError(f"{ENV_DIR} holds a name a manifest cannot carry, {r!r}; name files with "
                                 "printable UTF-8 only")
            st = e.stat(follow_symlinks=False)
            if not rel and _MARKERS.match(e.name):
                ranks += e.name.startswith(DONE_PREFIX)
            elif stat.S_ISDIR(st.st_mode):
                walk(Path(e.path), r + "/")
            elif stat.S_ISREG(st.st_mode):
                files.append((r, Path(e.path), stat.S_IMODE(st.st_mode) & 0o777))
            else:
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "a special file"
                raise ValueError(f"{ENV_DIR} holds {what}, {r!r}; a checkpoint holds regular files and folders only")

    walk(top, "")
    return tuple(files), max(ranks, 1)


def _undecodable(name: str) -> bool:
    """A name that is not UTF-8 on disk (os.scandir hands it over with surrogate escapes)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return True
    return False


def _complete(marker: Path, n: int) -> bool:
    """COMPLETE, empty or holding this request's number (coop.done writes it): one a late writer of an
    earlier request left is not this one's."""
    try:
        return _read_small(marker, 64).strip() in ("", str(n))
    except (OSError, UnicodeDecodeError):
        return False


def _read_small(path: Path, limit: int) -> str:
    """A marker the workload wrote: a regular file, not through a link at the end, at most ``limit`` bytes
    (more: OSError). Looked at first without opening it (O_PATH), so that a FIFO or a device linked in its
    place is never opened (an open of a device has effects of its own)."""
    where = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(where).st_mode):
            raise OSError(f"{path} is not a regular file")
        fd = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # that same file
    finally:
        os.close(where)
    try:
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data.decode()




def _link(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)  # relative: the root may be seen under another path (a container's mount)
    os.replace(tmp, link)


def _write_json(path: Path, doc: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.chmod(0o644)  # the workload reads it, whatever our umask (an agent's caller runs as another user)
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    """A directory moved aside first, then deleted: a late writer never sees half of it at its name."""
    if not path.exists():
        return
    aside = path.with_name(f"{path.name}.gone-{time.monotonic_ns()}")
    with contextlib.suppress(OSError):
        os.rename(path, aside)
        path = aside
    shutil.rmtree(path, ignore_errors=True)
