"""S3 restore: Checkpointer.restore() (download + verify + criu restore) vs boto3 ``download_file``
of every image file plus a bare ``criu restore``, on one S3 server.      target <= 1.1x

Run by s3_transfer.py, on the checkpoint its heartbeats end with.
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
from harness import MB, PhaseTimes, StepSink, TailSink, Warm, adopt, bare_restore, check_alive, kill, make_checkpointer, med, prewarm, say
from s3_server import BUCKET, Endpoint, server, server_name

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.format.manifest import Manifest
from cedana_airflow.run.workload import Workload, become_subreaper
from cedana_airflow.store import open_store

TARGET = 1.10

_NO_RANGES = TransferConfig(multipart_threshold=1 << 50)  # download_file with one plain GET per file

WHY_NO_RANGES = ("boto3's default download_file splits a file over 8 MB into ranged GETs (8 MB each, 10 "
                 "threads); moto answers each ranged GET by reading and copying the whole object, so a "
                 "1 GB file costs ~128 whole-object reads: a test-double artefact, not a cost of S3")


class _Restores:
    """The naive restore and ours of ``final`` (stored under ``prefix``; its plain files under
    naive-restore/), each run recorded; restored trees stay in ``live`` until killed."""

    def __init__(self, engine: CriuEngine, final: Manifest, prefix: str, work: Path, settings: Settings, srv: Endpoint,
                 step_seconds: float) -> None:
        self.engine, self.final, self.prefix, self.work = engine, final, prefix, work
        self.settings, self.srv, self.step_seconds = settings, srv, step_seconds
        self.runs: dict[str, list[dict[str, Any]]] = {"naive": [], "ours": [], "naive_defaults": []}
        self.live: list[Workload] = []

    def naive(self, rep: int, held: Warm, cfg: TransferConfig | None, label: str) -> dict[str, Any]:
        d = self.work / f"s3-restore-{label}-{rep}" / "images"
        d.mkdir(parents=True)
        client = boto3.client("s3")  # fresh, as a restore on another node would have
        sink = StepSink()
        mark = self.srv.mark()
        cpu0 = time.process_time()
        t0 = time.monotonic()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="naive-restore/").get("Contents", [])]
        for k in keys:
            client.download_file(BUCKET, k, str(d / k.rsplit("/", 1)[1]), Config=cfg)
        t_dl = time.monotonic() - t0
        held.release()  # see the plan in bench_s3_restore
        t1 = time.monotonic()
        restored = bare_restore(self.engine, d, self.final.process, d.with_name("restore.pid"))
        t2 = time.monotonic()
        secs = t2 - t0 - held.release_seconds  # freeing the held memory is not timed
        cpu = time.process_time() - cpu0
        wl = adopt(restored, self.final.process, sink)
        self.live.append(wl)
        r = {"seconds": secs, "download": t_dl, "criu_restore": t2 - t1,
             "other": t1 - t0 - t_dl - held.release_seconds,
             "client_cpu_seconds": cpu, **self.srv.since(mark)}
        check_alive(wl, sink, self.step_seconds, f"naive restore ({label})")
        kill(wl)
        shutil.rmtree(d.parent, ignore_errors=True)
        return r

    def ours(self, rep: int, held: Warm) -> dict[str, Any]:
        rw = self.work / f"s3-restore-ours-{rep}"
        store = open_store(f"s3://{BUCKET}/{self.prefix}", self.settings)  # a fresh client, as on another node
        cfg = store.open(create=False, chunk_avg_bytes=self.settings.chunk_avg_bytes)  # setup, as the runner does
        phases = PhaseTimes()
        settings = self.settings.model_copy(update={"restore_mode": "full"})  # the full path; lazy: lazy_restore.py
        c = make_checkpointer(self.engine, store, cfg, self.final.checkpoint_id, settings, rw, phases)
        sink = StepSink()
        mark = self.srv.mark()
        cpu0 = time.process_time()
        with phases.after("fetch", held.release):  # see the plan in bench_s3_restore
            t0 = time.monotonic()
            restored = c.restore(sink, TailSink())
            secs = time.monotonic() - t0
        secs -= held.release_seconds  # freeing the held memory is not timed
        cpu = time.process_time() - cpu0
        self.live.append(restored.workload)
        assert restored.manifest.seq == self.final.seq, (restored.manifest.seq, self.final.seq)
        f, crit = phases["fetch"], phases["criu_restore"]
        r = {"seconds": secs, "download": f, "criu_restore": crit, "other": secs - f - crit,
             "client_cpu_seconds": cpu, **self.srv.since(mark)}
        check_alive(restored.workload, sink, self.step_seconds, "Checkpointer.restore from S3")
        kill(restored.workload)
        shutil.rmtree(rw, ignore_errors=True)
        return r


def bench_s3_restore(engine: CriuEngine, final: Manifest, prefix: str, reps: int, work: Path, settings: Settings,
                     srv: Endpoint, warm_bytes: int, step_seconds: float, naive_defaults: bool) -> dict[str, Any]:
    become_subreaper()
    warm_bytes = int(2.5 * final.image_bytes) if warm_bytes else 0
    r = _Restores(engine, final, prefix, work, settings, srv, step_seconds)
    # Memory: a restore needs fresh memory twice, for the downloaded image (page cache) and then for
    # the restored process. Memory freed more than ~2 s before it is touched again has gone back to
    # the host (harness.prewarm()), and a download from moto takes 3-10 s, so a prewarm before the
    # run would not cover criu restore: half the prewarm is freed when the run starts, the other half
    # is held and freed right before criu restore (ours: right after the fetch, through the
    # Checkpointer's phase hook); the time the freeing takes is subtracted on both sides.
    kinds: dict[str, Callable[[int, Warm], dict[str, Any]]] = {
        "naive": lambda rep, held: r.naive(rep, held, _NO_RANGES, "naive"), "ours": r.ours}
    names = list(kinds)
    plan = [(rep, name) for rep in range(reps) for name in names[rep % 2:] + names[: rep % 2]]
    if naive_defaults:
        kinds["naive_defaults"] = lambda rep, held: r.naive(rep, held, None, "naive-defaults")
        plan.append((0, "naive_defaults"))
    try:
        for rep, name in plan:
            _run_one(r, kinds[name], rep, name, warm_bytes)
    finally:
        for wl in r.live:
            if wl.poll() is None:
                kill(wl)
    return _result(r.runs, final, warm_bytes)


def _run_one(r: _Restores, kind: Callable[[int, Warm], dict[str, Any]], rep: int, name: str, warm_bytes: int) -> None:
    os.sync()
    with Warm(warm_bytes // 2) as held:
        warm = prewarm(warm_bytes - warm_bytes // 2) if warm_bytes else 0.0
        run = kind(rep, held)
    run["prewarm_seconds"] = warm + held.seconds
    run["held_release_seconds"] = held.release_seconds
    r.runs[name].append(run)
    say(f"  restore {name:14} rep {rep}: {run['seconds']:.2f}s (download{'+verify' if name == 'ours' else ''} "
        f"{run['download']:.2f}s, criu restore {run['criu_restore']:.2f}s, other {run['other']:.2f}s"
        + f"; {run['requests']} requests; {server_name()} CPU {run['server_cpu_seconds']:.1f}s, our process CPU "
          f"{run['client_cpu_seconds']:.1f}s)")


def _result(runs: dict[str, list[dict[str, Any]]], final: Manifest, warm_bytes: int) -> dict[str, Any]:
    keys = ("seconds", "download", "criu_restore", "other", "requests", "server_cpu_seconds", "client_cpu_seconds")
    summary = {n: {k: med([r[k] for r in runs[n] if k in r]) for k in keys if any(k in r for r in runs[n])}
               for n in runs if runs[n]}
    b, o = summary["naive"]["seconds"], summary["ours"]["seconds"]
    res = {
        "name": "restore from S3 (download + verify + criu restore)",
        "baseline": "list_objects_v2 + boto3 download_file of each image file, one plain GET per file "
                    "(TransferConfig(multipart_threshold above the file size)) + bare criu restore -d --inherit-fd",
        "ours": "Checkpointer.restore(): manifests, every chunk fetched and verified, criu restore, adopt",
        "baseline_seconds": b, "ours_seconds": o, "ratio": o / b, "target": TARGET,
        "pass": o / b <= TARGET, "image_mb": final.image_bytes / MB, "median": summary, "runs": runs,
        "why_no_ranges": WHY_NO_RANGES,
        "note": ("moto holds the objects in memory or in its temp files" if server_name() == "moto" else
                 "SeaweedFS holds the objects in its volume files on the local disk") + "; os.sync() before each run"
                + ("; memory prewarmed before each run, half of it held until right before criu restore"
                   if warm_bytes else ""),
    }
    if runs["naive_defaults"]:
        d = summary["naive_defaults"]["seconds"]
        res["defaults"] = {"baseline_seconds": d, "ratio": o / d,
                           "baseline": "the same with boto3's default TransferConfig (ranged GETs)"}
    return res
