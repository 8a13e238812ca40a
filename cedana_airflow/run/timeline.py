"""Where a restore's time goes: its steps, CRIU's own phases, the store's reads, and the moments after.

A restore records a :class:`Timeline` as it goes: spans (the manifests, the checks, the fetch of the
small images, the lazy fill, starting the page source, ``criu restore`` itself, adopting the tree),
CRIU's ``forking_time`` and ``restore_time`` from the ``stats-restore`` image it leaves, and the
store's reads (chunks, bytes, and the seconds spent getting and verifying them, summed over the
fetch threads, so they can exceed the wall time). Then marks from the same clock: the tree runs
(``resumed``), its first output (``first_output``: the nearest thing to its first instruction that
can be seen from outside), every page in (``pages_in``, lazy only).

``cedana-airflow restore --timings`` prints it; bench/ records one per run. Times are seconds from
the restore's start (``time.monotonic()``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..store.read_stats import READS, ReadCounts
from ..units import binary_size

__all__ = ["Timeline"]


@dataclass
class Timeline:
    t0: float = field(default_factory=time.monotonic)
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start, seconds)
    marks: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # CRIU's phases, the mode, page-source counts
    reads_at_start: ReadCounts = field(default_factory=READS.snapshot)
    reads_by_resume: ReadCounts | None = None
    reads_total: ReadCounts | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self.spans.append((name, start - self.t0, time.monotonic() - start))

    def mark(self, name: str, at: float | None = None, *, latest: bool = False) -> None:
        """The first time ``name`` happened (later calls keep the first, unless ``latest``)."""
        with self._lock:
            when = (at if at is not None else time.monotonic()) - self.t0
            self.marks[name] = when if latest else self.marks.get(name, when)
            if name == "resumed":
                self.reads_by_resume = READS.snapshot() - self.reads_at_start
            if self.complete:
                self.reads_total = self.reads_total or READS.snapshot() - self.reads_at_start
                self._done.set()

    @property
    def complete(self) -> bool:
        """Everything that will come has: the first output, and every page (a lazy restore's)."""
        return "first_output" in self.marks and ("pages_in" in self.marks or self.facts.get("mode") != "lazy")

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def as_dict(self) -> dict[str, Any]:
        """The ``timings`` object of ``--json`` and bench/results.json."""
        with self._lock:
            total = self.reads_total or READS.snapshot() - self.reads_at_start
            return {"spans": [{"name": n, "start": round(s, 4), "seconds": round(d, 4)} for n, s, d in sorted(self.spans, key=lambda x: x[1])],
                    "marks": {k: round(v, 4) for k, v in self.marks.items()},
                    "criu": dict(self.facts.get("criu", {})),
                    "page_source": dict(self.facts.get("page_source", {})),
                    "mode": self.facts.get("mode"),
                    "store_reads": {"by_resume": (self.reads_by_resume or total).as_dict(), "total": total.as_dict()}}

    def render(self) -> str:
        """A few aligned lines for a terminal."""
        d = self.as_dict()
        out = [f"restore timeline ({d['mode'] or '?'}; seconds from the restore's start):"]
        for s in d["spans"]:
            out.append(f"  {s['start']:7.3f} +{s['seconds']:.3f}  {s['name']}")
        if d["criu"]:
            out.append("           criu's own: " + ", ".join(_figure(k, v) for k, v in d["criu"].items()))
        for name, at in sorted(d["marks"].items(), key=lambda kv: kv[1]):
            out.append(f"  {at:7.3f}         {name}")
        for when, r in (("by resume", d["store_reads"]["by_resume"]), ("in all", d["store_reads"]["total"])):
            out.append(f"  store reads {when}: {r['chunks']} chunks, {binary_size(r['bytes'])}, get {r['get_seconds']:.3f} s, "
                       f"verify {r['verify_seconds']:.3f} s (summed over threads)")
        if d["page_source"]:
            out.append("  page source: " + ", ".join(_figure(k, v) for k, v in d["page_source"].items()))
        return "\n".join(out)


def _figure(name: str, value: object) -> str:
    """One figure as a person reads it: bytes in binary units, seconds with an ``s``, counts whole
    (``pages_restored 372``, not ``372.000``; ``--json`` keeps the raw numbers)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("_bytes"):
            return f"{name.removesuffix('_bytes')} {binary_size(value)}"
        if name.endswith("_seconds") or name in ("forking", "restore"):
            return f"{name.removesuffix('_seconds')} {value:.3f} s"
        if float(value).is_integer():
            return f"{name} {int(value)}"
    return f"{name} {value}"
