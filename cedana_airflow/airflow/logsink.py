"""A byte stream that writes whole lines to a logger: the workload's stdout/stderr in the task log."""

from __future__ import annotations

import threading
from typing import Any, Protocol

__all__ = ["LogSink", "TaskLog"]


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
