"""Progress for long transfers: a single updating line on a terminal, silence in logs."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from ..units import binary_size

__all__ = ["Progress"]


class Progress:
    def __init__(self, label: str, total: int, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = mode == "always" or (mode == "auto" and self.stream.isatty())
        self.label, self.total, self.done = label, max(total, 1), 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._t0 = time.monotonic()

    def advance(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < 0.2 and self.done < self.total:
                return
            self._last = now
            rate = self.done / max(now - self._t0, 1e-6)
            pct = 100 * self.done / self.total
            self.stream.write(f"\r{self.label}: {pct:5.1f}% of {binary_size(self.total)} ({binary_size(rate)}/s)")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()
