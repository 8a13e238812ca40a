"""How lazy restore grows with the image (part "lazy-growth"): time to first progress for images of
0.5, 1, 2 and 4 GB whose workloads touch the same 20 MB after resuming (``train.py
--change-fraction 20/MB``). It should depend on the working set, not the image: target flat, the
4 GB figure <= 1.2x the 0.5 GB one. file:// store, shipped settings, medians of ``--reps`` with
their (min-max); each run keeps its restore timeline.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from harness import StepSink, TailSink, kill, make_checkpointer, med, prewarm, say, spread, start_workload, timeline_median

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.run.workload import become_subreaper
from cedana_airflow.store import open_store

SIZES_MB = (512, 1024, 2048, 4096)
WORKING_SET_MB = 20
STEP_SECONDS = 0.05
TARGET = 1.2


def bench_growth(engine: CriuEngine, reps: int, work: Path, settings: Settings, warm: bool) -> dict[str, Any]:
    become_subreaper()
    sizes: dict[str, Any] = {}
    for mb in SIZES_MB:
        root = work / f"growth-{mb}"
        store = open_store(f"file://{root / 'store'}")
        cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
        w, sink, _ = start_workload(mb, STEP_SECONDS, WORKING_SET_MB / mb, root)
        try:  # two checkpoints: the restored one knows what it wrote anew (fetched first)
            cp = make_checkpointer(engine, store, cfg, "growth", settings, root / "cp")
            sink.wait_step(sink.step, 60)
            cp.checkpoint(w)
            sink.wait_step(sink.step + 3, 60)
            final = cp.checkpoint(w)
        finally:
            kill(w)
        assert final is not None
        runs = []
        for rep in range(reps):
            os.sync()
            if warm:
                prewarm(int(2.5 * final.image_bytes))  # untimed: see prewarm()
            d = root / f"restore-{rep}"
            c = make_checkpointer(engine, store, cfg, "growth", settings.model_copy(update={"restore_mode": "lazy"}), d)
            out = StepSink()
            t0 = time.monotonic()
            wl = c.restore(out, TailSink()).workload
            try:
                out.wait_step(0, 120)
                c.timeline.mark("first_progress", at=out.first_at)
                all_in = c.pages_in_at() - t0
                runs.append({"first_progress": out.first_at - t0, "all_pages_in": all_in, "timeline": c.timeline.as_dict()})
            finally:
                kill(wl)
                c.close()
                shutil.rmtree(d, ignore_errors=True)
            say(f"  lazy growth {mb:5} MB rep {rep}: first progress {runs[-1]['first_progress']:.2f}s, every page in {all_in:.2f}s")
        shutil.rmtree(root, ignore_errors=True)
        firsts = [r["first_progress"] for r in runs]
        sizes[str(mb)] = {"image_mb": final.image_bytes / (1 << 20), "first_progress_seconds": med(firsts),
                          "first_progress_spread": spread(firsts),
                          "all_pages_in_seconds": med([r["all_pages_in"] for r in runs]),
                          "timeline_median": timeline_median([r["timeline"] for r in runs]), "runs": runs}
    small, big = sizes[str(SIZES_MB[0])], sizes[str(SIZES_MB[-1])]
    ratio = big["first_progress_seconds"] / small["first_progress_seconds"]
    return {"lazy_growth": {"name": "lazy restore first progress by image size, same working set",
                            "working_set_mb": WORKING_SET_MB, "sizes": sizes, "ratio": ratio, "target": TARGET,
                            "pass": ratio <= TARGET}}
