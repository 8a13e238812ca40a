"""Lazy restore from the file:// store: time from the restore's start to the workload's first new
progress (its next step line), against the full path (fetch + verify + criu restore) and a bare
``criu restore`` of a plain image directory of the same checkpoint; and the time until every page
is in, against the full path.          targets: first progress <= 0.3x full and <= 0.5x bare;
                                                 every page in <= 1.1x full

The workload steps every 0.05 s (so the sleep it is restored into adds at most that to all three
alike) and rewrites 2% of its state per step: its first step after a restore touches that much.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from harness import MB, StepSink, TailSink, adopt, bare_dump, bare_restore, kill, make_checkpointer, med, prewarm, say, start_workload

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.run.workload import Workload, become_subreaper
from cedana_airflow.store import open_store

FIRST_VS_FULL, FIRST_VS_BARE, ALL_IN_VS_FULL = 0.30, 0.50, 1.10
STEP_SECONDS, CHANGE = 0.05, 0.02


def bench_lazy(engine: CriuEngine, mb: int, reps: int, work: Path, settings: Settings, warm: bool) -> dict[str, Any]:
    """``warm``: touch 2.5x the image of fresh memory (prewarm) before each timed run, as the other
    restore figures do."""
    become_subreaper()
    store = open_store(f"file://{work / 'lazy-store'}")
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    w, out, _ = start_workload(mb, STEP_SECONDS, CHANGE, work)
    cp = make_checkpointer(engine, store, cfg, "lazy-bench", settings, work / "lazy-cp")
    try:
        out.wait_step(out.step, 60)
        cp.checkpoint(w)  # a parent, so the one restored has recently written chunks of its own
        out.wait_step(out.step + 3, 60)
        final = cp.checkpoint(w)
        assert final is not None
        plain = work / "lazy-plain"
        bare_dump(engine, w.pid, plain)  # same state, near enough: the bare baseline's image
    finally:
        kill(w)
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "full": [], "lazy": []}
    live: list[Workload] = []
    try:
        for rep in range(reps):
            names = ["bare", "full", "lazy"]
            for name in names[rep % 3:] + names[: rep % 3]:  # rotate who goes first
                os.sync()
                if warm:
                    prewarm(int(2.5 * final.image_bytes))  # untimed: see prewarm()
                sink = StepSink()
                t0 = time.monotonic()
                if name == "bare":
                    pidfile = work / f"lazy-bare-{rep}.pid"
                    pidfile.unlink(missing_ok=True)
                    wl = adopt(bare_restore(engine, plain, final.process, pidfile), final.process, sink)
                    done = time.monotonic()
                    c = None
                else:
                    c = make_checkpointer(engine, store, cfg, "lazy-bench",
                                          settings.model_copy(update={"restore_mode": name}), work / f"lazy-{name}-{rep}")
                    wl = c.restore(sink, TailSink()).workload
                    done = time.monotonic()
                live.append(wl)
                sink.wait_step(0, 120)
                first = sink.first_at - t0
                all_in = (c.pages_in_at() if c is not None else done) - t0
                kill(wl)
                if c is not None:
                    c.close()
                shutil.rmtree(work / f"lazy-{name}-{rep}", ignore_errors=True)
                runs[name].append({"restore_returned": done - t0, "first_progress": first, "all_pages_in": all_in})
                say(f"  lazy bench {name:5} rep {rep}: restore returned {done - t0:.2f}s, first progress {first:.2f}s"
                    + (f", every page in {all_in:.2f}s" if name == "lazy" else ""))
    finally:
        for wl in live:
            if wl.poll() is None:
                kill(wl)
    first = {k: med([r["first_progress"] for r in v]) for k, v in runs.items()}
    full_all = med([r["all_pages_in"] for r in runs["full"]])
    lazy_all = med([r["all_pages_in"] for r in runs["lazy"]])
    ratios = {"first_vs_full": first["lazy"] / first["full"], "first_vs_bare": first["lazy"] / first["bare"],
              "all_in_vs_full": lazy_all / full_all}
    targets = {"first_vs_full": FIRST_VS_FULL, "first_vs_bare": FIRST_VS_BARE, "all_in_vs_full": ALL_IN_VS_FULL}
    return {"lazy": {
        "name": "lazy restore from the local store",
        "first_progress_seconds": first, "all_pages_in_seconds": {"full": full_all, "lazy": lazy_all},
        "ratios": ratios, "targets": targets, "pass": {k: ratios[k] <= targets[k] for k in ratios},
        "image_mb": final.image_bytes / MB, "step_seconds": STEP_SECONDS, "change_fraction": CHANGE, "runs": runs,
        "note": "first progress: from the restore's start to the restored workload's next step line (it first "
                "finishes the sleep it was checkpointed in, at most 0.05 s, alike for all three); every page in: "
                "the full path's restore, the lazy path's last page served; os.sync() before each run"
                + ("; memory prewarmed before each run" if warm else ""),
    }}
