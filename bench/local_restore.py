"""Restore from the local store: Checkpointer.restore() (fetch + verify + criu restore + adopt) from
the file:// store vs a bare ``criu restore`` of a plain image directory of the same checkpoint.
                                                                             target <= 1.3x
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (MB, PhaseTimes, StepSink, StoredCheckpoint, TailSink, adopt, bare_restore, check_alive, kill,
                     make_checkpointer, med, prewarm, say, spread, timeline_median)

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.run.workload import Workload, become_subreaper

TARGET = 1.30


class _Restores:
    """The two ways to restore ``stored``, each run recorded; restored trees stay in ``live`` until killed."""

    def __init__(self, engine: CriuEngine, stored: StoredCheckpoint, settings: Settings, work: Path,
                 step_seconds: float) -> None:
        self.engine, self.stored, self.settings, self.work = engine, stored, settings, work
        self.step_seconds = step_seconds
        self.phases = PhaseTimes()
        self.runs: dict[str, list[dict[str, Any]]] = {"bare": [], "ours": [], "stream": []}
        self.live: list[Workload] = []  # restored trees not yet killed (killed on the way out, whatever happens)

    def bare(self, rep: int) -> None:
        pidfile = self.work / f"bare-restore-{rep}.pid"
        pidfile.unlink(missing_ok=True)
        process = self.stored.manifest.process
        sink = StepSink()
        t0 = time.monotonic()
        restored = bare_restore(self.engine, self.stored.plain, process, pidfile)
        secs = time.monotonic() - t0
        w = adopt(restored, process, sink)
        self.live.append(w)
        check_alive(w, sink, self.step_seconds, "bare restore")
        kill(w)
        self.runs["bare"].append({"seconds": secs})

    def ours(self, rep: int, via: str = "write") -> None:
        sink = StepSink()
        rw = self.work / f"ours-restore-{rep}"
        s = self.stored
        # the full path (what this figure has always measured); lazy restore has its own: lazy_restore.py
        settings = self.settings.model_copy(update={"restore_mode": "full", "full_restore_via": via})
        c = make_checkpointer(self.engine, s.store, s.cfg, s.checkpoint_id, settings, rw, self.phases)
        self.phases.reset()
        t0 = time.monotonic()
        restored = c.restore(sink, TailSink())
        secs = time.monotonic() - t0
        self.live.append(restored.workload)
        assert restored.manifest.seq == s.manifest.seq, (restored.manifest.seq, s.manifest.seq)
        check_alive(restored.workload, sink, self.step_seconds, "Checkpointer.restore")
        kill(restored.workload)
        fetch, criu = self.phases["fetch"], self.phases["criu_restore"]
        self.runs["ours" if via == "write" else "stream"].append(
            {"seconds": secs, "fetch": fetch, "criu_restore": criu, "other": secs - fetch - criu,
             "timeline": c.timeline.as_dict()})
        shutil.rmtree(rw, ignore_errors=True)


def bench_restore(engine: CriuEngine, stored: StoredCheckpoint, settings: Settings, reps: int, work: Path,
                  step_seconds: float, warm: bool) -> dict[str, Any]:
    """``warm``: touch 2.5x the image of fresh memory (prewarm) before each timed run."""
    warm_bytes = int(2.5 * stored.manifest.image_bytes) if warm else 0
    become_subreaper()
    r = _Restores(engine, stored, settings, work, step_seconds)
    kinds: dict[str, Callable[[int], None]] = {"bare": r.bare, "ours": r.ours,
                                               "stream": lambda rep: r.ours(rep, via="stream")}
    names = list(kinds)
    try:
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:  # rotate who goes first
                os.sync()  # untimed: no run starts with another's writeback pending
                warmed = prewarm(warm_bytes) if warm_bytes else 0.0  # untimed: see prewarm()
                kinds[name](rep)
                run = r.runs[name][-1]
                run["prewarm_seconds"] = warmed
                extra = (f" (fetch+verify {run['fetch']:.2f}s, criu restore {run['criu_restore']:.2f}s, "
                         f"other {run['other']:.2f}s)") if "fetch" in run else ""
                say(f"  {name:10} rep {rep}: {run['seconds']:.2f}s{extra}")
    finally:
        for w in r.live:
            if w.poll() is None:
                kill(w)
    return _result(r.runs, stored, warm_bytes)


def _result(runs: dict[str, list[dict[str, Any]]], stored: StoredCheckpoint, warm_bytes: int) -> dict[str, Any]:
    base = med([r["seconds"] for r in runs["bare"]])
    ours = med([r["seconds"] for r in runs["ours"]])
    stream = med([r["seconds"] for r in runs["stream"]])
    return {
        "name": "restore from the local store",
        "baseline": "bare criu restore -d of a plain image directory (same checkpoint)",
        "baseline_seconds": base, "ours_seconds": ours, "ratio": ours / base, "target": TARGET,
        "pass": ours / base <= TARGET,
        "ours_breakdown_median": {k: med([r[k] for r in runs["ours"]]) for k in ("fetch", "criu_restore", "other")},
        "spread": {k: spread([r["seconds"] for r in v]) for k, v in runs.items()},
        "timeline_median": {k: timeline_median([r["timeline"] for r in runs[k]]) for k in ("ours", "stream")},
        # full_restore_via = stream (streamed_restore.py): pages stream into criu restore, no image dir written
        "stream": {"seconds": stream, "ratio": stream / base},
        "image_mb": stored.manifest.image_bytes / MB,
        "note": "both read from a warm page cache (the checkpoint was just written); nothing was dropped; "
                "os.sync() before each run" + ("; memory prewarmed before each run" if warm_bytes else ""),
        "runs": runs,
    }
