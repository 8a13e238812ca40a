"""The CRIU engine: find CRIU, freeze and dump a process tree, restore it.

CRIU is found through configuration (``CEDANA_CRIU`` or the config file's ``criu``), else the
private prefix that scripts/install-criu.sh fills on Debian 12, else PATH. CRIU's exit code plus
the tail of its log become one :class:`~cedana_airflow.errors.EngineError` line here, at the
boundary; nothing above this module reads CRIU logs.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import random
import re
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import DumpFailed, EngineUnavailable, NodeInTheWay, RestoreFailed
from . import fds, net_lock, proc_mountpoint
from .capture import CaptureOnFreeze
from .images import read_dump_stats
from .procfs import tree_pids

__all__ = ["CriuBinary", "CriuEngine", "DumpResult", "find_criu", "MIN_CRIU_MAJOR"]

log = logging.getLogger(__name__)

MIN_CRIU_MAJOR = 4
_INSTALL_FIX = "Run 'make setup' (scripts/install-criu.sh) or set CEDANA_CRIU to a CRIU >= 4"


@dataclass(frozen=True)
class CriuBinary:
    path: str
    source: str  # "CEDANA_CRIU", "config", "private prefix", "PATH"
    version: str

    @property
    def major(self) -> int:
        m = re.match(r"(\d+)", self.version)
        return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class DumpResult:
    image_dir: Path
    seconds: float  # wall time of `criu dump`, the action script included
    freeze_seconds: float  # how long CRIU kept the tree frozen (stats-dump), else `seconds`
    captured: tuple[tuple[str, Path, int], ...]  # (original path, copy, mode) for each captured file


def no_plugins_dir() -> str:
    """An empty directory for CRIU's ``-L`` (its plugin directory), so CRIU loads none of its plugins.

    CRIU's CUDA plugin (``cuda_plugin.so``, shipped since CRIU 4.0 where CRIU is built with it) would
    lock and checkpoint the same CUDA processes our engine drives through the driver (engine/cuda.py),
    and bring them back at restore on its own: the two collide. Ours is the one that acts (it needs
    no ``cuda-checkpoint`` binary, and knows the tree's other GPU processes); docs/gpu.md. Made with
    mkdtemp, never a shared path: CRIU dlopens every ``.so`` in it, as root. Checked again at each use,
    not by its name only: a ``/tmp`` cleaner may remove it, and whoever makes a folder of that name
    next (its name is in our command lines) must not choose what CRIU loads."""
    global _no_plugins
    if _no_plugins is None or not _still_ours_and_empty(_no_plugins):
        _no_plugins = tempfile.mkdtemp(prefix="cedana-criu-no-plugins-")
        atexit.register(_remove_dir, _no_plugins)  # one per supervisor: a worker runs thousands of them
    return _no_plugins


def _still_ours_and_empty(path: str) -> bool:
    """A real directory (not a link), ours, closed to others (mkdtemp's 0700) and empty."""
    try:
        st = os.lstat(path)
        return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
                and not os.listdir(path))
    except OSError:
        return False


def _remove_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


_no_plugins: str | None = None


def _version_of(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\S+)", out.stdout)
    return m.group(1) if m else None


def find_criu(configured: str = "", prefix: Path | None = None) -> CriuBinary:
    """Locate a usable CRIU (see module docstring) or raise EngineUnavailable with the fix."""
    candidates: list[tuple[str, str]] = []
    if configured:
        candidates.append((configured, "CEDANA_CRIU / config criu"))
    else:
        if prefix is not None:
            candidates.append((str(prefix / "bin" / "criu"), f"private prefix {prefix}"))
        on_path = shutil.which("criu")
        if on_path:
            candidates.append((on_path, "PATH"))
    too_old: list[str] = []
    for path, source in candidates:
        if not os.path.exists(path):
            if configured:
                raise EngineUnavailable(f"CRIU not found at {path} (from {source}). {_INSTALL_FIX}.")
            continue
        version = _version_of(path)
        if version is None:
            too_old.append(f"{path} does not run")
            continue
        binary = CriuBinary(path, source, version)
        if binary.major >= MIN_CRIU_MAJOR:
            return binary
        too_old.append(f"{path} is CRIU {version}")
        if configured:
            break
    if too_old:
        raise EngineUnavailable(f"CRIU too old or broken ({'; '.join(too_old)}; need >= {MIN_CRIU_MAJOR}). {_INSTALL_FIX}.")
    where = f"{prefix}/bin and PATH" if prefix is not None else "PATH"
    raise EngineUnavailable(f"CRIU not found (looked in {where}). {_INSTALL_FIX}.")


def _dies_with_us() -> list[str]:
    """A prefix that makes ``criu dump`` die with its supervisor (a parent-death signal, set by
    util-linux's setpriv): a dump left running by a dead supervisor would keep the workload frozen.
    When criu dies its ptrace hold ends and the tree runs on, until the watchdog ends it too.

    A supervisor that dies before setpriv has set the signal sends none (the soak caught such an
    orphaned dump still there 40 s later), so a shell between them checks that its parent is still
    the supervisor, after the signal is set, before it becomes criu."""
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return []
    return [setpriv, "--pdeathsig", "KILL", "--", "sh", "-c", '[ "$PPID" = "$0" ] && exec "$@"', str(os.getpid())]


#: Error lines CRIU logs on its way that do not stop it (it carries on after each).
_NOT_FATAL = ("rlimit", "RLIMIT")


def _log_tail(log_path: Path) -> str:
    """The line that names the cause: CRIU's first error that stopped it, not a non-fatal one logged
    on the way nor its closing "... FAILED" summary."""
    try:
        text = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln.strip() for ln in text if "Error" in ln]
    causes = [ln for ln in errors if "FAILED" not in ln and not any(n in ln for n in _NOT_FATAL)]
    return (causes or errors or [ln.strip() for ln in text[-1:]] or [""])[0]


_HINTS = [
    ("Can't get 1:16 opt", "CRIU before 4.2 cannot dump a TCP or UDP socket on Linux 6.16 and later (the kernel refuses "
     "SO_PASSCRED on inet sockets: checkpoint-restore/criu#2718); run CRIU 4.2 or later, or hold no socket at "
     "heartbeats"),
    ("Can't fork for", "a PID of the checkpoint is in use here; run workloads through 'cedana-airflow run' (own PID namespace)"),
    ("bad size", "a file the workload had open changed size since the checkpoint; it must be captured (open it for writing) or left unchanged"),
    ("Operation not permitted", "CRIU needs root (CAP_SYS_ADMIN); run as root"),
    ("--tcp-established", "the workload holds an established TCP connection, which CRIU refuses to dump by default; connect only between checkpoints or keep connections out of the workload"),
    ("External socket", "the workload holds a UNIX socket to a process outside its tree, which CRIU cannot carry"),
    ("Address already in use", "a port of the checkpoint is held on this node; the checkpoint stays the latest for "
     "the next try"),
    ("Cannot assign requested address", "an address of the checkpoint is not on this node (run/sockets.py moves "
     "the tree's own; this one it could not), or a connection's address pair is still in use here"),
    ("Unknown shit", "the workload holds a kind of file CRIU has no dumper for (named above); keep it out of the "
     "workload"),
]


#: What a restore's log says when the node, not the checkpoint, is in the way.
_NODE_IN_THE_WAY = ("Address already in use",)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _holds_connections(image_dir: Path) -> bool:
    """Whether the images hold a TCP connection CRIU restores as one (run/sockets.py has rewritten those to
    peers outside as closed): only then is a restore's nftables lock worth its table."""
    try:
        return bool(net_lock.image_pairs(image_dir))
    except (OSError, ValueError):
        return True  # CRIU will say what is wrong with the images


def _pairs_now(pid: int, image_dir: Path) -> set[net_lock.Pair]:
    """The connections a dump that just ended may have locked: the live tree's (killed mid-dump, it runs
    on) and its images' (a final dump: the tree is gone)."""
    out: set[net_lock.Pair] = set()
    with contextlib.suppress(OSError, ValueError):
        out |= net_lock.tree_pairs(tree_pids(pid))
    with contextlib.suppress(OSError, ValueError):
        out |= net_lock.image_pairs(image_dir)
    return out


def _beside(image_dir: Path, suffix: str) -> Path:
    return image_dir.with_name(image_dir.name + suffix)


#: How often a dump that collided on proc.crtools is tried in all (proc_mountpoint.py).
_DUMP_ATTEMPTS = 4


class _Collided(Exception):
    """This try of a dump met another dump's proc.crtools; ``line`` is what to say if it was the last."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def _hint(tail: str) -> str:
    for needle, hint in _HINTS:
        if needle in tail:
            return hint[0].upper() + hint[1:]
    return "See the log for details"


class CriuEngine:
    """Dump and restore process trees with a located CRIU binary."""

    name = "criu"

    def __init__(self, binary: CriuBinary) -> None:
        self.binary = binary
        self._dumping: subprocess.Popen[str] | None = None  # the dump in progress, for abort_dump()

    @property
    def version(self) -> str:
        return self.binary.version

    def _check(self, *args: str, timeout: float = 120) -> tuple[bool, list[str]]:
        """Run ``criu check ARGS``: (it exited 0, the lines it printed, or why it did not run)."""
        try:
            out = subprocess.run([self.binary.path, "check", *args], capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, [f"{' '.join(['criu check', *args])}: {e}"]
        text = (out.stdout + out.stderr).strip().splitlines()
        return out.returncode == 0, text or [f"exit {out.returncode}"]

    def check(self) -> tuple[bool, str]:
        """Run ``criu check``; return (passed, the last line it printed)."""
        ok, text = self._check()
        return ok and any("Looks good" in ln for ln in text), text[-1]

    @staticmethod
    def _require_root(what: str) -> None:
        if os.geteuid() != 0:
            raise EngineUnavailable(f"{what} needs root (CRIU uses CAP_SYS_ADMIN and ptrace); run as root.")

    def dump(self, pid: int, image_dir: Path, *, leave_running: bool = True, capture: bool = True,
             extra: Sequence[str] = (), hold: Callable[[], str | None] | None = None,
             skip_in_flight: bool = True) -> DumpResult:
        """Freeze the tree rooted at ``pid``, write its images to ``image_dir``, resume it (or not).

        With ``capture``, files the tree holds open for writing are copied while it is still frozen
        (into ``<image_dir>.captured/``). CRIU's log goes to ``<image_dir>.dump.log``. A dump that
        collided with another one on ``proc.crtools`` (proc_mountpoint.py) is tried again: CRIU has
        already let the tree run on, and the other dump is done with the directory in milliseconds.
        ``extra``: more of CRIU's options (the node agent's trees name their mounts: agent/trees.py).
        ``hold``: called once the images are written, the tree still frozen (with ``capture``); a line back
        fails the dump (a job's parts waiting for each other: run/job.py). ``skip_in_flight=False``: a
        connection half made while the tree is frozen fails the dump instead of being left out (a job's
        part: its other end may be in another part's image).
        """
        self._require_root("checkpointing")
        pids = tree_pids(pid)
        if bad := fds.uncarried(pids, self.binary.version):  # CRIU would fail on it after freezing the tree
            more = f" (and {len(bad) - 1} more such file(s))" if len(bad) > 1 else ""
            raise DumpFailed(f"criu dump of pid {pid} not started: {bad[0].line()}{more}.")
        dirs = proc_mountpoint.working_dirs(pids)
        proc_mountpoint.clear_stale(dirs)
        pairs: set[net_lock.Pair] = set()
        if fds.carries_inet_sockets(self.binary.version):
            net_lock.sweep()  # a killed dump's lock would drop new connections on its address pairs
            pairs = net_lock.tree_pairs(pids)
        for attempt in range(1, _DUMP_ATTEMPTS + 1):
            try:
                return self._dump_once(pid, image_dir, leave_running, capture, dirs, pairs, extra, hold, skip_in_flight)
            except _Collided as e:
                if attempt == _DUMP_ATTEMPTS:
                    raise DumpFailed(e.line) from None
                log.info("criu dump of pid %s collided with another dump on %s (try %d of %d); trying again",
                         pid, proc_mountpoint.NAME, attempt, _DUMP_ATTEMPTS)
                shutil.rmtree(image_dir, ignore_errors=True)
                shutil.rmtree(_beside(image_dir, ".captured"), ignore_errors=True)
                _beside(image_dir, ".dump.log").unlink(missing_ok=True)
                time.sleep(random.uniform(0.05, 0.25) * attempt)  # jittered: the colliders do not meet again
        raise AssertionError("unreachable")

    def _dump_once(self, pid: int, image_dir: Path, leave_running: bool, capture: bool, dirs: set[str],
                   pairs: set[net_lock.Pair], extra: Sequence[str] = (),
                   hold: Callable[[], str | None] | None = None, skip_in_flight: bool = True) -> DumpResult:
        image_dir.mkdir(parents=True, exist_ok=False)
        log_path = _beside(image_dir, ".dump.log")
        side = _beside(image_dir, ".captured")
        side.mkdir()
        cmd = [self.binary.path, "dump", "-t", str(pid), "-D", str(image_dir), "-o", str(log_path), "--file-locks",
               "-L", no_plugins_dir(), *self._socket_flags(dump=True, connections=bool(pairs), skip_in_flight=skip_in_flight)]
        if leave_running:
            cmd.append("--leave-running")
        cmd += extra
        with contextlib.ExitStack() as stack:
            if capture:
                cap = stack.enter_context(CaptureOnFreeze(side, hold=hold))
                cmd += ["--action-script", str(cap.script)]
            t0 = time.monotonic()
            with subprocess.Popen([*_dies_with_us(), *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) as running:
                self._dumping = running
                try:
                    # what its lock holds, if it is killed or if it is a final dump (CRIU keeps that one)
                    with net_lock.recorded(running, pairs, image_dir, final=not leave_running,
                                           now=lambda: _pairs_now(pid, image_dir)):
                        _, stderr = running.communicate()
                finally:
                    self._dumping = None
            proc = subprocess.CompletedProcess(cmd, running.returncode, "", stderr)
            seconds = time.monotonic() - t0
        # A signal, not CRIU, ended it (a stop's abort_dump, or a signal to the supervisor's process group,
        # which criu shares): its log's last lines would mislead.
        if proc.returncode < 0:
            raise DumpFailed(f"criu dump of pid {pid} was stopped by {_signal_name(-proc.returncode)} before it "
                             f"finished; log: {log_path}.")
        if proc.returncode != 0:
            tail = _log_tail(log_path) or proc.stderr.strip()[-300:]
            if capture and cap.held_back:  # the tree ran on at once; no hint about CRIU applies
                raise DumpFailed(f"{cap.held_back}; log: {log_path}.")
            if capture and cap.error:
                tail = f"capturing open files failed ({cap.error})"
            hint = proc_mountpoint.hint(tail, dirs) or _hint(tail)
            line = f"criu dump of pid {pid} failed (exit {proc.returncode}): {tail}. {hint[0].upper()}{hint[1:]}; log: {log_path}."
            if proc_mountpoint.collided(tail):
                raise _Collided(line)
            raise DumpFailed(line)
        stats = read_dump_stats(image_dir)
        return DumpResult(image_dir, seconds, stats.get("frozen", seconds), tuple(cap.captured) if capture else ())

    def abort_dump(self) -> None:
        """Kill a ``criu dump`` in progress (a stop that cannot wait for it). Its tree must be killed
        first: a traced process that dies is reaped only once its tracer lets go, and criu, its parasite
        gone, would otherwise wait for it forever."""
        running = self._dumping
        if running is not None and running.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                running.kill()
            # (its network lock, left behind, is removed by net_lock.recorded once it has died)

    @functools.cached_property
    def lazy_pages(self) -> tuple[bool, str]:
        """Whether this kernel lets CRIU fill a restored process's memory on demand (userfaultfd,
        with fork and exit events for a tree of processes), and CRIU's answer in words."""
        answers = []
        for feature in ("uffd", "uffd-noncoop"):
            ok, text = self._check("--feature", feature, timeout=60)
            answers.append(text[-1])
            if not ok:
                return False, answers[-1]
        return True, "; ".join(answers)

    def start_lazy_pages(self, image_dir: Path, page_socket: int | None, *, work_dir: Path | None = None,
                         timeout: float = 60.0) -> subprocess.Popen[bytes]:
        """Start CRIU's lazy-pages daemon for ``image_dir``, reading its pages images (page files:
        page_file.py) or, with ``page_socket``, asking for pages over it (page_server.py); return it
        once it listens for the restore, in ``work_dir`` (the restore's image directory: default
        ``image_dir``), where its log goes too. The OOM killer is asked to spare it: were it to die
        while pages stream, the kernel would fill the rest of the process's memory with zeros."""
        self._require_root("restoring")
        work = work_dir or image_dir
        log_path = work.with_name(work.name + ".lazy-pages.log")
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        cmd = [self.binary.path, "lazy-pages", "-D", str(image_dir), "-W", str(work), "--status-fd", str(ready_w),
               "-o", str(log_path), "-L", no_plugins_dir()]
        if page_socket is not None:
            cmd += ["--page-server", "--ps-socket", str(page_socket)]
        try:
            passed = (ready_w,) if page_socket is None else (page_socket, ready_w)
            proc = subprocess.Popen(cmd, pass_fds=passed, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(ready_w)
        try:
            with contextlib.suppress(OSError):
                Path(f"/proc/{proc.pid}/oom_score_adj").write_text("-1000")
            ready = select.select([ready_r], [], [], timeout)[0] and os.read(ready_r, 1)
        finally:
            os.close(ready_r)
        if not ready:
            proc.kill()
            proc.wait()
            tail = _log_tail(log_path) or "it did not say it was ready"
            raise RestoreFailed(f"criu lazy-pages for {image_dir} did not start: {tail}. {_hint(tail)}; log: {log_path}.")
        return proc

    def _socket_flags(self, dump: bool, connections: bool = True, skip_in_flight: bool = True) -> list[str]:
        """Established TCP connections are carried (a torchrun job's store and gloo connections, both ends
        in the tree) where this CRIU can dump sockets at all; run/sockets.py decides what a restore does
        with a connection whose peer was outside the tree. A dump also leaves out connections a listener
        has not accepted yet (``--skip-in-flight``: CRIU refuses the whole dump otherwise, and a serving
        worker under load always has one); the live tree keeps them, a restore never had them.

        The nftables lock is asked for only where the tree held a connection when it was scanned: CRIU
        sets its table up whether or not there is anything to lock (12 ms of a serving worker's 26 ms
        freeze), where its default, iptables, costs nothing until a connection needs it, and still locks
        one made between the scan and the freeze."""
        if not fds.carries_inet_sockets(self.binary.version):
            return []
        lock = list(net_lock.lock_flags(self.binary.path)) if connections else []
        return (["--tcp-established", *(["--skip-in-flight"] if skip_in_flight else []), *lock] if dump
                else ["--tcp-established", *lock])

    def restore(self, image_dir: Path, *, inherit: dict[int, str], pidfile: Path, lazy: bool = False) -> int:
        """Restore the tree detached (``-d``); return the host PID of its root.

        ``inherit`` maps an fd of this process to the CRIU name of the file it replaces
        (``pipe:[1234]``): the restored workload writes into our new pipes. ``lazy``: leave the lazy
        pages to the daemon :meth:`start_lazy_pages` started (the restore returns while they stream). The caller should be a
        child subreaper (see :mod:`cedana_airflow.run.workload`) so the restored root becomes its child.
        """
        cmd, log_path = self.restore_command(image_dir, inherit=inherit, pidfile=pidfile, lazy=lazy)
        proc = subprocess.run(cmd, capture_output=True, text=True, pass_fds=tuple(inherit))
        if proc.returncode != 0:
            raise self.restore_error(image_dir, proc.returncode, log_path, proc.stderr)
        return self.restored_pid(pidfile)

    def restore_command(self, image_dir: Path, *, inherit: dict[int, str], pidfile: Path, lazy: bool = False,
                        extra: Sequence[str] = ()) -> tuple[list[str], Path]:
        """The ``criu restore`` command :meth:`restore` runs, and its log: for a process that runs it as
        its own child (the node agent's shim: the restored root becomes that process's child). ``inherit``'s
        fds are the numbers they must have in CRIU; ``extra``: more of CRIU's options."""
        self._require_root("restoring")
        if fds.carries_inet_sockets(self.binary.version):
            net_lock.sweep()  # a dead dump's lock here would drop the restored connections' packets
        log_path = image_dir.with_name(image_dir.name + ".restore.log")
        cmd = [self.binary.path, "restore", "-D", str(image_dir), "-d", "--pidfile", str(pidfile),
               "-o", str(log_path), "--file-locks", "-L", no_plugins_dir(),
               *self._socket_flags(dump=False, connections=_holds_connections(image_dir))]
        for fd, name in inherit.items():
            cmd += ["--inherit-fd", f"fd[{fd}]:{name}"]
        if lazy:
            cmd.append("--lazy-pages")
        return [*cmd, *extra], log_path

    @staticmethod
    def restore_error(image_dir: Path, returncode: int, log_path: Path, stderr: str) -> RestoreFailed:
        """What a failed ``criu restore`` is: the node's (NodeInTheWay) or the checkpoint's (RestoreFailed)."""
        tail = _log_tail(log_path) or stderr.strip()[-300:]
        # A port taken or an address missing here between run/sockets.py's look and CRIU's bind: the node's.
        kind = NodeInTheWay if any(n in tail for n in _NODE_IN_THE_WAY) else RestoreFailed
        return kind(f"criu restore from {image_dir} failed (exit {returncode}): {tail}. {_hint(tail)}; log: {log_path}.")

    @staticmethod
    def restored_pid(pidfile: Path) -> int:
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise RestoreFailed(f"criu restore succeeded but wrote no PID to {pidfile} ({e}). Report this as a bug.") from None

    def restore_piped(self, image_dir: Path, stdout_pipe: str, stderr_pipe: str, *, pidfile: Path,
                      lazy: bool = False) -> tuple[int, int, int]:
        """:meth:`restore` with two new pipes in place of the checkpointed stdout and stderr (their
        CRIU names, ``pipe:[1234]``): the restored root's PID, and the read ends, which the caller
        owns. Nothing is left open when the restore fails."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self.restore(image_dir, inherit={out_w: stdout_pipe, err_w: stderr_pipe}, pidfile=pidfile, lazy=lazy)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return pid, out_r, err_r
