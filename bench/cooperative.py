"""Cooperative heartbeat cost (part "cooperative"): what storing a workload-written checkpoint costs the
supervisor, against a naive upload of the same directory, on moto's S3 server over loopback.

A workload (coop_state.py) holds ``--mb`` MB in 8 files' worth of random bytes and rewrites 2% of it
between requests: one contiguous span per file (the shape of the transparent benchmark's 1%), and, for
information, 512 KiB runs at random places (changes finer than a chunk cost up to a chunk each). Each heartbeat goes through the real path: Checkpointer.checkpoint() asks (request file
and SIGUSR1), the workload writes its 8 files and COMPLETE, the supervisor stores them (phase "save":
list, cut, hash, upload of the new chunks, manifest). Baseline, in the same run and on the same files
(kept with keep_local): boto3 ``upload_file`` of every file, default settings, one after another.

* bytes sent by heartbeats 2..N vs the directory's bytes               target <= 3%
* seconds of the supervisor's save vs the naive upload                 target <= 0.1x
The workload's own write time is the workload's (it is in the manifest as freeze_seconds) and in
neither figure.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import boto3
from harness import MB, PhaseTimes, med, say, spread
from report import MOTO_NOTE
from s3_server import BUCKET, Moto, WireCounter

from cedana_airflow.config import load_settings
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.run.cooperative import Cooperation
from cedana_airflow.run.environment import workload_env
from cedana_airflow.run.workload import Workload
from cedana_airflow.store import open_store

TARGETS = {"bytes": 0.03, "time": 0.10}
WORKLOAD = Path(__file__).resolve().parent / "coop_state.py"


class _Lines:
    """The workload's stdout, line by line (a Sink)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, data: bytes) -> int:
        self.lines += data.decode(errors="replace").splitlines()
        return len(data)

    def flush(self) -> None:
        pass


def bench_cooperative(mb: int, reps: int, work: Path) -> dict[str, Any]:
    settings = load_settings(environ={}).model_copy(update={"mode": "cooperative", "keep_local": True,
                                                            "progress": "never"})
    with Moto(work, "cooperative"):
        spans = _heartbeats(mb, reps, work / "spans", settings, run_kib=0)
        scattered = _heartbeats(mb, 2, work / "scattered", settings, run_kib=512)
    ours, naive_s = [b["save_seconds"] for b in spans["heartbeats"]], [b["naive_seconds"] for b in spans["heartbeats"]]
    worst_bytes = max(b["sent_bytes"] / b["dir_bytes"] for b in spans["heartbeats"])
    ratio_time = med(ours) / med(naive_s)
    return {"cooperative": {
        "name": "cooperative heartbeat: the supervisor's save vs a naive upload of the directory",
        "mb": mb, **spans, "ours_seconds": med(ours), "ours_spread": spread(ours), "naive_seconds": med(naive_s),
        "naive_spread": spread(naive_s), "ratio_time": ratio_time, "ratio_bytes": worst_bytes,
        "dir_bytes": spans["heartbeats"][0]["dir_bytes"],
        "worst_sent_bytes": max(b["sent_bytes"] for b in spans["heartbeats"]),
        "scattered_512k": {**scattered, "ratio_bytes": max(b["sent_bytes"] / b["dir_bytes"]
                                                           for b in scattered["heartbeats"])},
        "targets": TARGETS, "pass": {"time": ratio_time <= TARGETS["time"], "bytes": worst_bytes <= TARGETS["bytes"]},
        "note": MOTO_NOTE}}


def _heartbeats(mb: int, reps: int, work: Path, settings: Any, run_kib: int) -> dict[str, Any]:
    """A first checkpoint, then ``reps`` heartbeats, each followed by the naive upload of the same files."""
    work.mkdir(parents=True)
    store = open_store(f"s3://{BUCKET}/coop-{run_kib}", settings)
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    wire = WireCounter(store.client)  # type: ignore[attr-defined]
    naive = boto3.client("s3")
    coop = Cooperation(work / "coop", settings)
    phases = PhaseTimes()
    cp = Checkpointer(None, store, cfg, "bench-coop", settings, work_dir=work, on_phase=phases, coop=coop,
                      engine_why="(benchmark: cooperative only)")
    out = _Lines()
    w = Workload.start([sys.executable, str(WORKLOAD), "--mb", str(mb), "--run-kib", str(run_kib)],
                       env={**_env(), **coop.env()}, stdout=out, isolate=False)
    how = f"{run_kib} KiB runs at random places" if run_kib else "one span per file"
    try:
        deadline = time.monotonic() + 120
        while "ready" not in out.lines:
            assert w.poll() is None and time.monotonic() < deadline, "the benchmark workload did not start"
            time.sleep(0.05)
        say(f"cooperative ({how}): {mb} MB state, first checkpoint (everything is new)")
        first = cp.checkpoint(w)
        assert first is not None and first.cooperative is not None
        beats = []
        for rep in range(reps):
            phases.reset()
            _, b0 = wire.snapshot()
            m = cp.checkpoint(w)
            assert m is not None and m.cooperative is not None, "a heartbeat was skipped"
            _, b1 = wire.snapshot()
            taken = sorted((coop.root / "taken").rglob("part-*.bin"))
            dir_bytes = sum(f.stat().st_size for f in taken)
            t0 = time.monotonic()
            for f in taken:
                naive.upload_file(str(f), BUCKET, f"naive-{run_kib}-{rep}/{f.name}")
            naive_s = time.monotonic() - t0
            beats.append({"seq": m.seq, "save_seconds": phases["save"], "write_seconds": m.freeze_seconds,
                          "sent_bytes": b1 - b0, "stored_bytes": m.stored_bytes, "dir_bytes": dir_bytes,
                          "naive_seconds": naive_s})
            say(f"  heartbeat {m.seq}: save {phases['save']:.2f}s, sent {(b1 - b0) / MB:.1f} MB of "
                f"{dir_bytes / MB:.0f} MB; naive upload {naive_s:.2f}s; the workload wrote for {m.freeze_seconds:.2f}s")
    finally:
        w.kill()
        w.wait(30)
        coop.close()
    return {"change": how, "first_save_bytes": first.stored_bytes, "heartbeats": beats}


def _env() -> dict[str, str]:
    # the workload imports cedana_airflow from this checkout; it never sees the store's credentials
    return workload_env(os.environ) | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
