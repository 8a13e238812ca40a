"""A task's way through the node agent (issue 49): which way a task's workload is checkpointed, and the
run through the agent as its caller sees it.

The caller (an Airflow task process, not root) asks the node's agent to run its workload as itself,
reads the workload's output from its own pipes into its log, turns its stop (Airflow's on_kill) into
the agent's ``stop`` (the final checkpoint), and gets back the run's summary: the same object
``cedana-airflow run --json`` prints (run/summary.py). It never holds the node's key, the store's
credentials or CRIU; the agent signs, stores and restores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import errors
from ..config import Settings
from ..run.workload import Sink
from .client import AgentClient
from .protocol import TASK_SETTINGS

__all__ = ["fresh_line", "through_agent", "run_via_agent"]

log = logging.getLogger(__name__)

#: How often a waiting caller looks at its stop event.
_POLL_SECONDS = 0.2
#: How often it asks for the agent's lines about its run (a heartbeat's are said within this of it).
_SAID_SECONDS = 1.0


def through_agent(settings: Settings) -> bool:
    """Whether a task's workload goes through the node agent (``[cedana] agent``): ``require`` always;
    ``auto`` where this process is not root (root runs CRIU itself, as before the agent); ``off`` never."""
    return settings.agent == "require" or (settings.agent == "auto" and os.geteuid() != 0)


#: Task settings an older agent refuses, each with the hello feature of the first agent that takes it: left
#: out for an older one, where the caller sets none of them itself (the history is the operator's reading).
_NEWER_SETTINGS = {"failure_history": "said", "mode": "cooperative", "cooperative_timeout_seconds": "cooperative",
                   "cooperative_signal": "cooperative"}


def task_request(settings: Settings, features: Sequence[str] = ("said", "cooperative")) -> dict[str, Any]:
    """The task settings a start carries (protocol.TASK_SETTINGS) to an agent with hello's ``features``;
    the node's are the agent's."""
    values = settings.model_dump(mode="json")
    return {k: values[k] for k in sorted(TASK_SETTINGS) if k in values and values[k] is not None
            and (k not in _NEWER_SETTINGS or _NEWER_SETTINGS[k] in features)}


def run_via_agent(path: Path, checkpoint_id: str, argv: Sequence[str], *, cwd: str | None, env: Mapping[str, str],
                  try_number: int, settings: Settings, claim: Mapping[str, Any] | None, stdout: Sink, stderr: Sink,
                  stop: threading.Event, on_restore: Callable[[dict[str, Any]], None] | None = None,
                  on_fresh: Callable[[str], None] | None = None, restore_only: bool = False,
                  resume: bool = True, on_said: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``argv`` as us through the agent at ``path``, resuming ``checkpoint_id``'s newest checkpoint when
    there is one; return the run's summary once it ended. ``stop`` set: the agent takes the final
    checkpoint and ends the workload (as SIGTERM does to a supervisor). ``on_restore``: called with what
    was restored (``status``'s ``restore``) once an agent that does not say its lines (older than 0.8.2)
    says so (one that does says the supervisor's own restore line through ``on_said``); ``on_fresh``: with why, when the
    resume found nothing to restore and the workload started fresh; ``restore_only`` (``argv`` empty): restore
    only, as `restore` does (nothing to restore is CheckpointNotFound); ``resume=False``: start fresh
    whatever is stored (`run` without --resume); ``on_said``: called with each of the agent's lines about
    the run (the heartbeat it chose, a checkpoint saved or skipped), as the run goes (default: this
    module's log, at INFO). Raises AgentUnavailable where no
    agent answers, and what the agent refused with (errors.py classes)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pumps = [_pump(out_r, stdout), _pump(err_r, stderr)]
    try:
        with AgentClient.connect(path) as client:
            hello = client.hello()
            if restore_only and "restore" not in (hello.get("features") or []):
                raise errors.ConfigError(f"the node agent at {path} (cedana-airflow {hello.get('agent', '?')}) cannot "
                                         "restore without a command. Upgrade it to 0.8.2 or later")
            if settings.mode == "cooperative" and "cooperative" not in (hello.get("features") or []):
                raise errors.ConfigError(f"the node agent at {path} (cedana-airflow {hello.get('agent', '?')}) takes no "
                                         "cooperative checkpoints for a caller. Upgrade it to 0.8.4 or later, or use "
                                         "mode = transparent")
            started = client.start(checkpoint_id, argv, cwd=cwd or os.getcwd(), env=env, stdout=out_w, stderr=err_w,
                                   try_number=try_number, settings=task_request(settings, hello.get("features") or ()),
                                   claim=claim,
                                   resume=resume or restore_only, restore_only=restore_only)
    finally:
        os.close(out_w)  # the workload's are its own now: our copies would keep the pumps from their end
        os.close(err_w)
    with started.lifeline:
        if started.fresh and on_fresh is not None:
            try:
                on_fresh(started.fresh)
            except Exception:  # a hook's failure (a closed stderr) must not drop the lifeline: that ends the tree
                log.warning("on_fresh failed", exc_info=True)
        said = _Said(on_said or (lambda line: log.info("node agent: %s", line)))
        # An agent that says its lines says the restore in the supervisor's own line: on_restore is for one
        # that does not (older than 0.8.2), so that the restore is said once either way. Either way it is
        # asked for often until it is said, so that it comes before the restored workload's output.
        says_lines = "said" in (hello.get("features") or ())
        said_restore = started.restored_seq is None
        ended = False
        next_ask = 0.0
        while not ended:
            if stop.is_set():
                said.take(_ask(path, lambda c: c.stop(started.wid, started.handle)))  # the final checkpoint, then the end
                break
            if not said_restore or time.monotonic() >= next_ask:
                status = _ask(path, lambda c: c.status(started.wid, started.handle, said.last))
                said.take(status)
                next_ask = time.monotonic() + _SAID_SECONDS
                if not said_restore and status.get("restore") is not None:
                    said_restore = True
                    if on_restore is not None and not says_lines:
                        on_restore(status["restore"])
            if select.select([started.lifeline], [], [], _POLL_SECONDS)[0]:
                ended = _ended(started.lifeline)
        status = _until_ended(path, started.wid, started.handle, said)
        if not said_restore and status.get("restore") is not None and on_restore is not None and not says_lines:
            on_restore(status["restore"])  # a restored tree that ended before a status said it was restored
    for pump in pumps:
        pump.join()
    if status.get("error"):
        raise errors.CedanaError(str(status["error"].get("line") or status["error"]))
    summary = status.get("result")
    if not isinstance(summary, dict):
        raise errors.CedanaError(f"the node agent ended {started.wid} without a summary ({status.get('cause')})")
    return summary


def fresh_line(why: str, checkpoint_id: str) -> str:
    """The line a caller logs when the agent's resume started fresh (the in-process route's, said again)."""
    head, _, detail = why.partition(": ")
    return f"cedana: {head} checkpoint_id={checkpoint_id}; starting fresh (through the node agent)" + (
        f": {detail}" if detail else "")


def _ended(lifeline: socket.socket) -> bool:
    """Whether the lifeline said its workload ended (or closed: its shim is gone)."""
    try:
        data = lifeline.recv(1 << 16)
    except OSError:
        return True
    return not data or b'"exit"' in data


def _ask(path: Path, request: Callable[[AgentClient], dict[str, Any]], tries: int = 3) -> dict[str, Any]:
    """One request on a connection of its own, tried again while the agent does not answer (a restart:
    the agent started after it takes the workload up, with its handle)."""
    for attempt in range(tries):
        try:
            with AgentClient.connect(path) as client:
                return request(client)
        except errors.AgentUnavailable:
            if attempt == tries - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def _until_ended(path: Path, wid: str, handle: str, said: _Said, seconds: float = 120) -> dict[str, Any]:
    """The run's status once its run has ended (the tree ended first: its last upload, its lease)."""
    deadline = time.monotonic() + seconds
    while True:
        status = _ask(path, lambda c: c.status(wid, handle, said.last))
        said.take(status)
        if (status.get("state") == "ended" and not status.get("said_more")) or time.monotonic() > deadline:
            return status
        if not status.get("said_more"):
            time.sleep(_POLL_SECONDS)


class _Said:
    """The agent's lines about a run (a status's ``said``: ``[n, line]``), each handed on once, in order."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        self.sink, self.last = sink, 0

    def take(self, status: dict[str, Any]) -> None:
        for item in status.get("said") or []:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)) or item[0] <= self.last:
                continue
            self.last = item[0]
            try:
                self.sink(str(item[1]))
            except Exception:  # a hook's failure (a closed stderr) must not drop the lifeline: that ends the tree
                log.warning("on_said failed", exc_info=True)


def _pump(fd: int, sink: Sink) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 1 << 16):
                sink.write(chunk)
        os.close(fd)
        with contextlib.suppress(Exception):
            sink.flush()

    t = threading.Thread(target=run, name="cedana-agent-output", daemon=True)
    t.start()
    return t
