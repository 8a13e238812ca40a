"""Lazy restore: time from the restore's start to the workload's first new progress (its next step
line), and until every page is in.

- file:// store: lazy against the full path (fetch + verify + criu restore) and a bare
  ``criu restore`` of a plain image directory of the same state.
                              targets: first progress <= 0.3x full and <= 0.5x bare;
                                       every page in <= 1.3x bare
- S3 (moto's server; part "seaweedfs-lazy": SeaweedFS, S3 only): lazy against the naive path (one plain
  GET per image file with boto3, then a bare ``criu restore``) and our full path.
                                                 target: first progress <= 0.3x naive

The workload steps every 0.05 s (so the sleep it is restored into adds at most that to all of them
alike) and rewrites 2% of its state per step: its first step after a restore touches that much.
Each of our runs records the restore's timeline (run/timeline.py); the report shows their medians.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from harness import (MB, StepSink, TailSink, adopt, bare_dump, bare_restore, kill, make_checkpointer, med, prewarm, say,
                     spread, start_workload, timeline_median)
from s3_server import BUCKET, server

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.format.manifest import Manifest
from cedana_airflow.run.workload import Workload, become_subreaper
from cedana_airflow.store import Store, open_store
from cedana_airflow.store.base import StoreConfig

FIRST_VS_FULL, FIRST_VS_BARE, ALL_IN_VS_BARE, S3_FIRST_VS_NAIVE = 0.30, 0.50, 1.30, 0.30
#: (store, mode) -> each run's restore timeline (Checkpointer.timeline.as_dict()), in run order
TIMELINES: dict[tuple[str, str], list[dict[str, Any]]] = {}
STEP_SECONDS, CHANGE = 0.05, 0.02
_ONE_GET = TransferConfig(multipart_threshold=1 << 50)  # see WHY_NO_RANGES in s3_restore.py


def bench_lazy(engine: CriuEngine, mb: int, reps: int, work: Path, settings: Settings, warm: bool,
               wheres: tuple[str, ...] = ("file", "s3")) -> dict[str, Any]:
    """``warm``: touch 2.5x the image of fresh memory (prewarm) before each timed run, as the other
    restore figures do. ``wheres``: the stores (file, s3), the S3 one on s3_server.KIND's server."""
    become_subreaper()
    TIMELINES.clear()
    with server(work, "lazy"):
        stores = {k: open_store(f"file://{work / 'lazy-store'}" if k == "file" else f"s3://{BUCKET}/lazy", settings)
                  for k in wheres}
        cfgs = {k: s.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes) for k, s in stores.items()}
        final, plain = _checkpoint(engine, mb, work, settings, stores, cfgs)
        client = boto3.client("s3")
        for p in plain.iterdir():  # the naive path's objects: the plain image files (untimed)
            client.upload_file(str(p), BUCKET, f"lazy-naive/{p.name}", Config=_ONE_GET)
        out: dict[str, Any] = {}
        for where in wheres:
            kinds: dict[str, Callable[[int, StepSink], tuple[Workload, Callable[[], float] | None]]] = {
                "full": _ours(engine, stores[where], cfgs[where], settings, work, "full", where),
                "lazy": _ours(engine, stores[where], cfgs[where], settings, work, "lazy", where),
            }
            if where == "file":
                kinds["bare"] = lambda rep, sink: (adopt(bare_restore(engine, plain, final.process,
                                                                      work / f"lazy-bare-{rep}.pid"), final.process, sink), None)
            else:
                kinds["naive"] = lambda rep, sink: (_naive(engine, client, final, work / f"lazy-naive-{rep}", sink), None)
            runs = _timed(kinds, reps, warm, final, where)
            out[where] = _summary(runs, where, final)
    return {"lazy": {"name": "lazy restore", "image_mb": final.image_bytes / MB, "step_seconds": STEP_SECONDS,
                     "change_fraction": CHANGE, **out,
                     "note": "first progress: from the restore's start to the restored workload's next step line (it "
                             "first finishes the sleep it was checkpointed in, at most 0.05 s, alike for all); every "
                             "page in: the full path's restore, the lazy path's last page served; os.sync() before "
                             "each run" + ("; memory prewarmed before each run" if warm else "")}}


def _checkpoint(engine: CriuEngine, mb: int, work: Path, settings: Settings, stores: dict[str, Store],
                cfgs: dict[str, StoreConfig]) -> tuple[Manifest, Path]:
    """Two checkpoints into each store (the restored one has a parent, so it knows what it wrote
    anew), then a bare dump of the workload for the baselines."""
    w, out, _ = start_workload(mb, STEP_SECONDS, CHANGE, work)
    try:
        cps = {k: make_checkpointer(engine, s, cfgs[k], "lazy-bench", settings, work / f"lazy-cp-{k}") for k, s in stores.items()}
        out.wait_step(out.step, 60)
        for cp in cps.values():
            cp.checkpoint(w)
        out.wait_step(out.step + 3, 60)
        # one after the other (a stopped tree would be restored stopped): states a step or two apart
        finals = [cp.checkpoint(w) for cp in cps.values()]
        plain = work / "lazy-plain"
        bare_dump(engine, w.pid, plain)
    finally:
        kill(w)
    final = finals[0]
    assert final is not None
    return final, plain


def _ours(engine: CriuEngine, store: Store, cfg: StoreConfig, settings: Settings, work: Path, mode: str,
          where: str) -> Callable[[int, StepSink], tuple[Workload, Callable[[], float] | None]]:
    def run(rep: int, sink: StepSink) -> tuple[Workload, Callable[[], float] | None]:
        timelines = TIMELINES.setdefault((where, mode), [])
        d = work / f"lazy-{where}-{mode}-{rep}"
        c = make_checkpointer(engine, store, cfg, "lazy-bench", settings.model_copy(update={"restore_mode": mode}), d)
        wl = c.restore(sink, TailSink()).workload

        def all_in() -> float:
            t = c.pages_in_at() if mode == "lazy" else 0.0
            c.timeline.mark("first_progress", at=sink.first_at)
            timelines.append(c.timeline.as_dict())
            c.close()
            shutil.rmtree(d, ignore_errors=True)
            return t
        return wl, all_in
    return run


def _naive(engine: CriuEngine, client: Any, final: Manifest, d: Path, sink: StepSink) -> Workload:
    images = d / "images"
    images.mkdir(parents=True)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="lazy-naive/").get("Contents", [])]
    for k in keys:
        client.download_file(BUCKET, k, str(images / k.rsplit("/", 1)[1]), Config=_ONE_GET)
    wl = adopt(bare_restore(engine, images, final.process, d / "restore.pid"), final.process, sink)
    return wl


def _timed(kinds: dict[str, Callable[[int, StepSink], tuple[Workload, Callable[[], float] | None]]], reps: int,
           warm: bool, final: Manifest, where: str) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    names = list(kinds)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:  # rotate who goes first
            os.sync()
            if warm:
                prewarm(int(2.5 * final.image_bytes))  # untimed: see prewarm()
            sink = StepSink()
            t0 = time.monotonic()
            wl, all_in = kinds[name](rep, sink)
            done = time.monotonic()
            try:
                sink.wait_step(0, 120)
                first = sink.first_at - t0
                t_all = (all_in() if all_in is not None else 0.0) or done
            finally:
                kill(wl)
            runs[name].append({"restore_returned": done - t0, "first_progress": first, "all_pages_in": t_all - t0})
            say(f"  lazy bench {where:4} {name:5} rep {rep}: restore returned {done - t0:.2f}s, first progress "
                f"{first:.2f}s" + (f", every page in {t_all - t0:.2f}s" if name == "lazy" else ""))
    return runs


def _summary(runs: dict[str, list[dict[str, float]]], where: str, final: Manifest) -> dict[str, Any]:
    first = {k: med([r["first_progress"] for r in v]) for k, v in runs.items()}
    all_in = {k: med([r["all_pages_in"] for r in runs[k]]) for k in ("full", "lazy")}
    extra = {"first_progress_spread": {k: spread([r["first_progress"] for r in v]) for k, v in runs.items()},
             "all_pages_in_spread": {k: spread([r["all_pages_in"] for r in runs[k]]) for k in ("full", "lazy")},
             "timeline_median": {m: timeline_median(TIMELINES.get((where, m), [])) for m in ("full", "lazy")},
             "timelines": {m: TIMELINES.get((where, m), []) for m in ("full", "lazy")}}
    if where == "file":
        ratios = {"first_vs_full": first["lazy"] / first["full"], "first_vs_bare": first["lazy"] / first["bare"],
                  "all_in_vs_full": all_in["lazy"] / all_in["full"], "all_in_vs_bare": all_in["lazy"] / first["bare"]}
        targets = {"first_vs_full": FIRST_VS_FULL, "first_vs_bare": FIRST_VS_BARE, "all_in_vs_bare": ALL_IN_VS_BARE}
    else:
        ratios = {"first_vs_naive": first["lazy"] / first["naive"], "first_vs_full": first["lazy"] / first["full"],
                  "all_in_vs_full": all_in["lazy"] / all_in["full"]}
        targets = {"first_vs_naive": S3_FIRST_VS_NAIVE}
    return {"first_progress_seconds": first, "all_pages_in_seconds": all_in, "ratios": ratios, "targets": targets,
            "pass": {k: ratios[k] <= t for k, t in targets.items()}, "runs": runs, **extra}
