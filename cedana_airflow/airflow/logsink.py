"""The task log: a byte stream that writes whole lines to it (the workload's stdout/stderr), and the
``cedana:`` prefix on every line the core writes there."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["LogSink", "TaskLog", "prefixed"]

_F = TypeVar("_F", bound=Callable[..., Any])
PREFIX = "cedana: "


#: How many of our operators' executes run in this process now (a task process runs one; a test harness
#: may run several at once): the prefix holds while any does.
_running = 0
_lock = threading.Lock()
_installed = False


def _ours(record: logging.LogRecord) -> logging.LogRecord:
    # (logging.makeLogRecord calls the factory with no name and fills the record in after: not ours to touch)
    if (_running and isinstance(record.name, str) and record.name.startswith("cedana_airflow.")
            and isinstance(record.msg, str) and not record.msg.startswith("cedana")):
        record.msg = PREFIX + record.msg
    return record


def _install() -> None:
    """One record factory for the process's life, over whichever it had: set once, never restored, so
    that executes that overlap (rather than nest) cannot leave a stale one behind."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()
        logging.setLogRecordFactory(lambda *a, **kw: _ours(previous(*a, **kw)))
        _installed = True


def prefixed(execute: _F) -> _F:
    """An operator's ``execute`` during which the core's lines (the supervisor's, the store's: loggers
    under ``cedana_airflow.``) carry the ``cedana:`` prefix that the operator's own lines carry, so that a
    reader filters the task log on one word; after it, they do not."""

    @functools.wraps(execute)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _running
        _install()
        with _lock:
            _running += 1
        try:
            return execute(*args, **kwargs)
        finally:
            with _lock:
                _running -= 1

    return run  # type: ignore[return-value]


class TaskLog(Protocol):
    """What we call on a task's logger: a stdlib Logger and Airflow's own (``self.log``) both fit."""

    def info(self, event: Any, *args: Any) -> Any: ...
    def warning(self, event: Any, *args: Any) -> Any: ...
    def log(self, level: int, event: Any, *args: Any) -> Any: ...

_MAX_LINE = 64 << 10  # a line without a newline is logged in pieces of this size, never held forever


class LogSink:
    """``write``/``flush``/``close``, as the supervisor's pipe pumps call them (one pump per sink)."""

    def __init__(self, log: TaskLog, name: str) -> None:
        self.log, self.name = log, name
        self._buf = b""
        self._lock = threading.Lock()

    def write(self, data: bytes) -> int:
        with self._lock:
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            while len(self._buf) > _MAX_LINE:
                lines.append(self._buf[:_MAX_LINE])
                self._buf = self._buf[_MAX_LINE:]
        for line in lines:
            self._emit(line)
        return len(data)

    def _emit(self, line: bytes) -> None:
        self.log.info("%s", line.decode("utf-8", "replace").rstrip("\r"))

    def flush(self) -> None:
        pass  # lines are logged as they complete; a partial line waits for its newline or close()

    def close(self) -> None:
        with self._lock:
            rest, self._buf = self._buf, b""
        if rest:
            self._emit(rest)
