"""One workload the agent runs for a caller: the whole run (writer lease, owner check, heartbeats, the
final checkpoint at a stop) is run/runner.py's, in a thread of the agent; only the start differs: the
tree is started by a shim (shim.py) as the caller, and the caller, not the agent, reads its output.

What a request may set is a task's business only (:data:`TASK_SETTINGS`): the store, the key, CRIU,
the work dir and every command the agent would run as root are the node's (its own configuration).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import errors
from ..config import Settings, load_settings
from ..engine.criu import CriuEngine
from ..engine.images import read_external_mounts, read_mountpoints
from ..format.manifest import AirflowTask, Manifest
from ..run.environment import workload_env
from ..run.no_io_uring import filter_program
from ..coop import ENV_RESTORE
from ..run.cooperative import Cooperation
from ..run.runner import RunResult, run_workload
from ..run.summary import run_summary
from ..run.workload import Sink, Workload, pipe_name
from . import protocol, shim, trees
from .remembered import Remembered, control_socket, forget, remember
from .said import Said
from .callers import Caller
from .protocol import TASK_SETTINGS, Peer

__all__ = ["START_SECONDS", "TASK_SETTINGS", "Run", "ShimWorkload", "task_settings"]

log = logging.getLogger(__name__)

#: How long a shim has to say its workload started (today's _child_of waits as long).
START_SECONDS = 10.0

def task_settings(node: Mapping[str, str], requested: Mapping[str, Any], *, bounded: bool = True) -> Settings:
    """The node's settings (``node``: the agent's environment) with a request's task settings over them;
    a setting outside :data:`TASK_SETTINGS` is refused in one line, and (``bounded``: a new start, not a
    run a former agent left, which a lowered bound must not orphan) more kept checkpoints than the node allows."""
    other = sorted(set(requested) - TASK_SETTINGS)
    if other:
        raise errors.Refused(f"setting {other[0][:40]!r} is the node's, not a task's: the agent's configuration "
                             f"sets it. A request may set {', '.join(sorted(TASK_SETTINGS))}")
    # mode (0.8.4): a cooperative checkpoint is the workload's own files, written in folders of the caller's
    # and read as the caller (run/cooperative.py), and restoring one starts its command through the shim,
    # as the caller; a request that names none gets the node's.
    settings = load_settings(dict(requested), node, overrides_source=lambda k: f"the request's settings.{k}")
    if bounded and settings.keep_checkpoints > settings.agent_max_keep_checkpoints:
        raise errors.Refused(f"keep_checkpoints = {settings.keep_checkpoints} is more than this node's agent keeps per "
                             f"checkpoint ID ({settings.agent_max_keep_checkpoints}, agent_max_keep_checkpoints): ask "
                             "for fewer, or have the node's operator raise it")
    return settings


class ShimWorkload(Workload):
    """A tree a shim started as the caller. The agent (root) dumps and signals it like any other; the
    shim reaps it and says how it ended (:meth:`ended`). No output pumps (the caller reads its own
    pipes) and no watchdog (the shim is one): hence not ``Workload.__init__``."""

    def __init__(self, pid: int, command: Sequence[str], cwd: str, stdout_pipe: str, stderr_pipe: str, pidfd: int,
                 own_namespaces: bool) -> None:
        self.pid = pid
        self.own_namespaces = own_namespaces  # a caller other than root's (shim.py): its mounts are named at dump
        self.command = tuple(command)
        self.cwd = cwd
        self.stdout_pipe = stdout_pipe  # what the manifest names them (CRIU's inherit-fd at a restore)
        self.stderr_pipe = stderr_pipe
        self.returncode: int | None = None
        self.signal: int | None = None
        self._ended = threading.Event()
        # The shim's, opened while the tree was its unreaped child: a signal through it reaches this tree or
        # nothing, whoever its parent is later and whatever has the pid since.
        self.pidfd = pidfd
        self._fd_lock = threading.Lock()  # a kill never signals through a number ended() closed and reused

    def ended(self, code: int, sig: int | None) -> None:
        with self._fd_lock:
            self.returncode, self.signal = code, sig
            self._ended.set()
            os.close(self.pidfd)

    def kill(self) -> None:
        """SIGKILL the namespace's init (the kernel ends the rest), through the pidfd; not waited for."""
        with self._fd_lock:
            if not self._ended.is_set():
                with contextlib.suppress(OSError):  # ended already: ESRCH
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def lost(self) -> None:
        """Its shim is gone: nothing watches the tree for its caller any more, so it ends here."""
        self.kill()
        select.select([self.pidfd], [], [], 30)  # readable once it has exited
        self.ended(128 + signal.SIGKILL, signal.SIGKILL)

    def criu_dump_options(self) -> tuple[str, ...]:
        return trees.dump_options(self.pid) if self.own_namespaces else ()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._ended.wait(timeout)
        return self.returncode


class Run:
    """One caller's workload, from its start request to its end; kept a while after for ``status``."""

    def __init__(self, caller: Caller, settings: Settings, checkpoint_id: str, *, node: str, staging: Path,
                 runs: Path, requested: Mapping[str, Any], coop: Path | None = None) -> None:
        self.wid = f"w-{secrets.token_hex(6)}"
        self.handle = secrets.token_hex(16)  # the owner's proof (server.py); never listed or logged
        self.caller = caller
        self.settings = settings
        self.checkpoint_id = checkpoint_id
        self.node = node
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.workload: ShimWorkload | None = None
        self.result: RunResult | None = None
        self.failure: errors.CedanaError | None = None
        self.lifeline: socket.socket | None = None  # the caller's end, until the start reply carries it
        self.stop = threading.Event()
        self._shim: Any = None
        self._ctl: socket.socket | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._letting_go = False
        self.restore: dict[str, Any] | None = None  # what was restored, once it was (_restored)
        self.cause = ""  # how the tree ended, as its shim said (shim.py)
        self.restored_seq: int | None = None  # the checkpoint its tree was restored from (None: started fresh)
        self.fresh: str | None = None  # why a resume started fresh (nothing to restore, or all refused)
        self._taken_up = False  # a former agent's run: its ID's owner was judged when it began
        # Where a shim builds the mounts of a tree in namespaces of its own (a root-only folder of the agent's):
        # every tree other than a root caller's.
        self.staging = str(staging)
        self.own_mounts = self.staging if caller.peer.uid != 0 else None
        self.runs = runs  # where it is remembered for an agent started after ours (remembered.py)
        self.requested = dict(requested)
        self.try_number = 0
        self.claim: AirflowTask | None = None
        self.said = Said(checkpoint_id)  # the supervisor's lines about it, for its caller's log (status)
        self.coop_base = coop  # where its cooperative folder goes (server.py: Agent.coop), one per workload

    @property
    def peer(self) -> Peer:
        return self.caller.peer

    @property
    def uid(self) -> int:
        return self.caller.peer.uid

    def begin(self, argv: Sequence[str] | None, *, cwd: str, env: Mapping[str, str], try_number: int,
              claim: AirflowTask | None, out_w: int, err_w: int, resume: bool = False) -> None:
        """Run in a thread of the agent; return once the tree started (``resume``: restored from this
        checkpoint ID's newest checkpoint when there is one; ``argv`` None: only that, as `restore` does,
        none being an error), or raise what stopped it (a lease held, another task's checkpoint ID, a
        command that does not exist, nothing to restore): nothing then runs."""
        self.try_number, self.claim = try_number, claim

        def starter(command: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                    stdout: Sink | None = None, stderr: Sink | None = None, isolate: bool = True,
                    deny_io_uring: bool = False) -> Workload:
            return self._start_shim(command, cwd or "/", env or {}, deny_io_uring, out_w, err_w,
                                    restored=Cooperation.restoring(env or {}))

        env_ = workload_env(env, self.settings.keep_env)  # never the store's credentials, whoever sent them
        env_.pop(ENV_RESTORE, None)  # only a restore names a put back state (the start's reply says which)
        self._launch(None if argv is None else list(argv), cwd, env_, resume or argv is None, starter,
                     _ShimRestore(self, out_w, err_w))

    def _launch(self, argv: list[str] | None, cwd: str, env: dict[str, str], resume: bool, starter: Any,
                restore_tree: Any) -> None:
        """The run, in a thread; return once its tree runs, or raise what stopped it."""

        def run() -> None:
            try:
                with self.said:
                    self.result = run_workload(self.settings, self.checkpoint_id, argv, resume=resume,
                                               try_number=self.try_number, cwd=cwd, env=env, handle_signals=False,
                                               stop=self.stop, airflow=self.claim, starter=starter,
                                               restore_tree=restore_tree, on_restore=self._restored,
                                               on_fresh=self._fresh, caller_uid=self.peer.uid,
                                               owner_checked=self._taken_up,
                                               coop_root=self.coop_base / self.wid if self.coop_base else None,
                                               coop_owner=(self.peer.uid, self.peer.gid, tuple(self.peer.groups))
                                               if self.peer.uid else None)
            except errors.CedanaError as e:
                self.failure = e
            except Exception as e:  # noqa: BLE001 (a bug: said, and the caller is not left waiting)
                log.exception("agent: %s failed", self.wid)
                self.failure = errors.CedanaError(f"the agent failed running {self.wid}: {type(e).__name__}: {e}. "
                                                  "Check the agent's log")
            finally:
                self.ended_at = time.time()
                self._letting_go = True  # its shim watches the tree for its caller from here, if it still runs
                forget(self.runs, self.wid)
                self._started.set()
                self._done.set()
                if self._ctl is not None:
                    self._ctl.close()

        threading.Thread(target=run, name=f"cedana-agent-{self.wid}", daemon=True).start()
        self._started.wait()
        if self.workload is None:
            assert self.failure is not None or self.result is not None
            raise self.failure or errors.CedanaError(f"{self.wid} ended before it started. Check the agent's log")

    def _restored(self, result: RunResult) -> None:
        """What was restored, for ``status`` while the run goes on (its summary says it again at the end)."""
        m = result.restored_from
        if m is not None:
            self.restore = {"seq": m.seq, "try_number": m.try_number, "node": m.node,
                            "created_at": m.created_at.isoformat(), "gap_seconds": round(result.restore_gap_seconds, 3),
                            "restore_seconds": round(result.restore_seconds, 3),
                            "restored_on": self.node}  # 0.8.2
            if self.workload is not None:
                self._remember()  # an agent that takes it up says it too

    def _fresh(self, why: str) -> None:
        """Why a resume started fresh: the start's reply says it, so the caller's log does (one printable
        line: it may quote a CRIU log)."""
        self.fresh = protocol.printable(why, 1000)

    def _start_shim(self, command: Sequence[str], cwd: str, env: Mapping[str, str], deny_io_uring: bool,
                    out_w: int, err_w: int, restored: int | None = None) -> ShimWorkload:
        """The command started as the caller; ``restored``: the cooperative checkpoint it resumes (its state
        put back), which the start's reply says."""
        seccomp = filter_program() if deny_io_uring else None
        spec = {"op": "start", "uid": self.peer.uid, "gid": self.peer.gid, "groups": list(self.peer.groups),
                "argv": list(command), "cwd": cwd, "env": dict(env), "seccomp": seccomp.hex() if seccomp else None,
                "start_seconds": START_SECONDS - 2, "own_mounts": self.own_mounts,
                "control": str(control_socket(self.runs, self.wid)), **self.caller.carried()}
        first, pidfd = self._spawn(spec, out_w, err_w)
        self.restored_seq = restored  # None: a fresh start (after a refused restore, too)
        if first.get("ev") != "started":
            line = str(first.get("line") or f"the shim ended without starting it ({first})")
            if first.get("code") == 127:
                raise errors.CommandNotFound(f"cannot start the workload: {line}. Check the command and PATH")
            raise errors.Refused(f"cannot start the workload as {self.peer}: {line}")
        return self._adopt(int(first["pid"]), command, cwd, pipe_name(out_w), pipe_name(err_w), pidfd,
                           self.own_mounts is not None)

    def _spawn(self, spec: Mapping[str, Any], out_w: int, err_w: int) -> tuple[dict[str, Any], int]:
        """A shim for ``spec``, and its first word: ``started`` with the shim's pidfd of the tree (its
        lifeline is then the caller's, in :attr:`lifeline`), or the exit that says why not (the shim is
        then gone; -1)."""
        caller_end, shim_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc, ctl = shim.spawn(spec, shim_end.fileno(), out_w, err_w)
        except OSError as e:
            caller_end.close()
            raise errors.EngineUnavailable(f"the agent could not start a shim: {e}. Check the agent's log") from None
        finally:
            shim_end.close()
        first, fds = _first_event(ctl, START_SECONDS if spec["op"] == "start" else None)
        if first.get("ev") != "started" or len(fds) != 1:
            protocol.close_fds(fds)
            if first.get("ev") == "started":  # a shim of another version: it is not left running
                proc.kill()
                first = {"line": "the shim started it but sent no pidfd"}
            caller_end.close()
            ctl.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:  # a shim that did not answer is not left running as root
                proc.kill()
                proc.wait()
            return first, -1
        if self.lifeline is not None:  # a restore that fell back to a fresh start: the newer shim is the one
            self.lifeline.close()
        if self._ctl is not None:
            self._ctl.close()
        self._shim, self._ctl, self.lifeline = proc, ctl, caller_end
        return first, fds[0]

    def _adopt(self, pid: int, command: Sequence[str], cwd: str, stdout_pipe: str, stderr_pipe: str, pidfd: int,
               own_namespaces: bool) -> ShimWorkload:
        self.workload = ShimWorkload(pid, command, cwd, stdout_pipe, stderr_pipe, pidfd, own_namespaces)
        self._remember()
        threading.Thread(target=self._follow, args=(self._ctl, self.workload, self._shim),
                         name=f"cedana-agent-{self.wid}-shim", daemon=True).start()
        self._started.set()
        return self.workload

    def _remember(self) -> None:
        w = self.workload
        assert w is not None
        try:
            remember(self.runs, Remembered(
                wid=self.wid, handle=self.handle, checkpoint_id=self.checkpoint_id, started_at=self.started_at,
                restored_seq=self.restored_seq, try_number=self.try_number,
                claim=self.claim.model_dump() if self.claim else None, settings=self.requested,
                peer=asdict(self.peer), carried=self.caller.carried(), pid=w.pid, command=list(w.command), cwd=w.cwd,
                stdout_pipe=w.stdout_pipe, stderr_pipe=w.stderr_pipe, own_namespaces=w.own_namespaces,
                fresh=self.fresh, restore=self.restore))
        except OSError as e:  # the tree runs on; only an agent started after ours cannot take it up
            log.warning("agent: %s cannot be remembered in %s (%s): a restarted agent will not take it up",
                        self.wid, self.runs, e)

    @classmethod
    def take_up(cls, r: Remembered, settings: Settings, *, node: str, staging: Path, runs: Path,
                coop: Path | None = None) -> Run | None:
        """A workload a former agent left running (remembered.py), taken up: its shim hands us the tree
        (a pidfd) on its control socket, and the run goes on as it was, heartbeats, handle and stop
        alike; None where the shim is gone (its tree ended with it, or ends with its caller)."""
        ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ctl.connect(str(control_socket(runs, r.wid)))
        except OSError:
            ctl.close()
            forget(runs, r.wid)
            return None
        first, fds = _first_event(ctl, START_SECONDS)
        if first.get("ev") != "started" or len(fds) != 1 or first.get("pid") != r.pid:
            protocol.close_fds(fds)
            ctl.close()
            forget(runs, r.wid)  # it ended meanwhile, or it is not the tree we remember
            return None
        caller = Caller.remembered(Peer(**{**r.peer, "groups": tuple(r.peer["groups"])}), r.carried)
        run = cls(caller, settings, r.checkpoint_id, node=node, staging=staging, runs=runs, requested=r.settings,
                  coop=coop)
        run.wid, run.handle, run.started_at, run.restored_seq = r.wid, r.handle, r.started_at, r.restored_seq
        run.fresh, run.restore, run._taken_up = r.fresh, r.restore, True
        run.try_number = r.try_number
        run.claim = AirflowTask.model_validate(r.claim) if r.claim else None
        run._ctl = ctl
        workload = run._adopt(r.pid, r.command, r.cwd, r.stdout_pipe, r.stderr_pipe, fds[0], r.own_namespaces)

        def starter(*args: Any, **kwargs: Any) -> Workload:
            return workload  # already running: the run only takes it up

        run._launch(r.command, r.cwd, {}, False, starter, None)
        return run

    def _follow(self, ctl: socket.socket, workload: ShimWorkload, proc: Any) -> None:
        """A shim's events until its tree ends (the agent's copy; the caller has its own). A shim gone
        without a word (SIGKILLed, OOM-killed) leaves its tree to us: it is killed."""
        code, cause, sig = 0, "", None
        while True:
            try:
                msg, fds = protocol.recv(ctl)
            except (OSError, errors.Refused):
                break
            protocol.close_fds(fds)
            if msg is None:
                break
            if msg.get("ev") == "exit":
                code, cause = int(msg.get("code", 255)), str(msg.get("cause", ""))
                sig = int(msg["signal"]) if isinstance(msg.get("signal"), int) else None
                break
        if cause:
            self.cause = cause
            workload.ended(code, sig)
        elif self._letting_go:  # we closed our end: the run is over (it failed), the tree is the shim's to watch
            pass
        else:
            log.warning("agent: %s: its shim is gone; its tree is killed, nothing watches it for its caller",
                        self.wid)
            self.cause = "shim-lost"
            workload.lost()
        if proc is not None:  # ours (a tree taken up after a restart has another agent's shim)
            proc.wait()

    def kill(self) -> None:
        if self._ctl is not None and not self._done.is_set():
            try:
                self._ctl.send(b'{"op":"kill"}', socket.MSG_NOSIGNAL)
            except OSError:
                pass

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def ended(self) -> bool:
        return self._done.is_set()

    def public(self, said_since: int | None = None) -> dict[str, Any]:
        """What its owner may see (never the handle); with ``said_since`` (a status), ``said``: the lines
        about it after that one, and ``said_more`` where more are kept than one reply carries."""
        out: dict[str, Any] = {
            "wid": self.wid, "uid": self.uid, "checkpoint_id": self.checkpoint_id, "node": self.node,
            "pid": self.workload.pid if self.workload else None, "started": self.started_at,
            "restored_seq": self.restored_seq, "fresh": self.fresh,
            "state": "ended" if self.ended else "running", "cause": self.cause, "protected": True,
            "checkpoints": len(self.result.checkpoints) if self.result else None}
        if said_since is not None:  # 0.8.3
            out["said"], out["said_more"] = self.said.since(said_since)
        if self.restore is not None:
            out["restore"] = self.restore
        if self.result is not None:
            out["result"] = run_summary(self.result, self.checkpoint_id, self.node)
        if self.failure is not None:
            out["error"] = {"class": type(self.failure).__name__, "line": str(self.failure)}
        return out


class _ShimRestore:
    """A run's restores (run/checkpointer.py's RestoreTree): ``criu restore`` under a new shim, with the
    caller's pipes as the tree's stdout and stderr (fds 3 and 4 of CRIU). Cgroups are left alone: the tree
    stays where CRIU runs, the retry's caller's (shim.py), not the dumped tree's, which CRIU would
    otherwise make again, as root."""

    def __init__(self, run: Run, out_w: int, err_w: int) -> None:
        self.run, self.out_w, self.err_w = run, out_w, err_w
        self._own: dict[Path, bool] = {}  # what vet found of each image dir: the shim's spec depends on it

    def vet(self, image_dir: Path, m: Manifest) -> bool:
        """Never more than the caller has: a tree in namespaces of its own with the caller's ids, or root's
        for root (trees.py); checked before anything of the checkpoint is put back. Whether it is the
        former."""
        run = self.run
        own = self._own[image_dir] = trees.check_restorable(image_dir, run.peer.uid, run.peer.gid, run.peer.groups,
                                                             f"checkpoint {run.checkpoint_id} seq={m.seq}")
        return own

    def __call__(self, engine: CriuEngine, image_dir: Path, m: Manifest, pidfile: Path) -> Workload:
        run, out_w, err_w = self.run, self.out_w, self.err_w
        own = self._own.pop(image_dir) if image_dir in self._own else self.vet(image_dir, m)
        if own:
            trees.open_to_tree_root(image_dir, run.peer.gid, run.peer.groups)
        cmd, log_path = engine.restore_command(image_dir, inherit={3: m.process.stdout_pipe, 4: m.process.stderr_pipe},
                                               pidfile=pidfile, extra=("--manage-cgroups=ignore",))
        first, pidfd = run._spawn({"op": "restore", "argv": cmd, "pidfile": str(pidfile),
                                   "control": str(control_socket(run.runs, run.wid)),
                                   "own_mounts": run.staging if own else None, "uid": run.peer.uid,
                                   "gid": run.peer.gid, "groups": list(run.peer.groups),
                                   "external_mounts": read_external_mounts(image_dir) if own else [],
                                   "image_mounts": read_mountpoints(image_dir) if own else [],
                                   **run.caller.carried()}, out_w, err_w)
        if first.get("ev") != "started":
            if first.get("code") == 127 and first.get("line"):  # the shim's, before CRIU: this node's doing
                raise errors.NotRestorableHere(f"checkpoint {run.checkpoint_id} seq={m.seq} is not restorable on "
                                               f"this node: {first['line']}")
            raise engine.restore_error(image_dir, int(first.get("code", 255)), log_path, str(first.get("line", "")))
        run.restored_seq = m.seq
        return run._adopt(int(first["pid"]), m.process.command, m.process.cwd, pipe_name(out_w), pipe_name(err_w),
                          pidfd, own)


def _first_event(ctl: socket.socket, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
    """The shim's first word and the fds with it."""
    ctl.settimeout(timeout)
    try:
        msg, fds = protocol.recv(ctl)
        return (msg if msg is not None else {"line": "the shim ended without a word"}), fds
    except TimeoutError:
        return {"line": f"no word from the shim in {timeout or 0:.0f} s"}, []
    except (OSError, errors.Refused) as e:
        return {"line": f"the shim's first word was unreadable ({e})"}, []
    finally:
        ctl.settimeout(None)
