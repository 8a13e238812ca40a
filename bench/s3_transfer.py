"""S3 first checkpoint, heartbeats and restore: cedana-airflow against a naive boto3 user, both on
one S3 server over loopback (part "s3-transfer" on moto's, "seaweedfs-transfer" on SeaweedFS; one
workload, one server):

1. first checkpoint: Checkpointer.checkpoint() to an S3Store vs a bare ``criu dump --leave-running``
   plus boto3 ``upload_file`` of every image file (default settings, one client, one file after
   another).                                                               target <= 1.0x
2. heartbeats 2-4 (exactly one step, 1% of the state, between them): bytes sent vs a full upload
   (target <= 3%) and seconds vs the naive path of 1 (target <= 0.1x).
3. restore (s3_restore.py): Checkpointer.restore() (download + verify + criu restore) vs boto3
   ``download_file`` of every image file plus a bare ``criu restore``.     target <= 1.1x

moto's server is a protocol test double (one Python process), not a storage system: see MOTO_NOTE;
SeaweedFS is a real one (SEAWEEDFS_NOTE).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from harness import MB, PhaseTimes, StepSink, Warm, bare_dump, drop_dir, kill, make_checkpointer, med, say, start_workload
from report import MOTO_NOTE, SEAWEEDFS_NOTE, fmt_ops
from s3_restore import bench_s3_restore
from s3_server import BUCKET, Endpoint, WireCounter, delete_prefix, server, server_name

from cedana_airflow.config import Settings, load_settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.format.manifest import Manifest
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.run.workload import Workload
from cedana_airflow.store import open_store
from cedana_airflow.store.base import Store, StoreConfig

TARGETS = {"checkpoint": 1.0, "heartbeat_bytes": 0.03, "heartbeat_time": 0.10}
CHECKPOINT_ID = "bench-s3"


def bench_transfer(engine: CriuEngine, mb: int, reps: int, work: Path, prewarm_on: bool,
                   naive_defaults: bool) -> dict[str, Any]:
    settings = load_settings(environ={})  # shipped defaults; boto3 takes the endpoint from AWS_ENDPOINT_URL
    warm_bytes = int(2.5 * mb * MB) if prewarm_on else 0
    step_seconds = 3.0  # longer than a dump, so heartbeats can be taken exactly one step apart
    with server(work, "transfer") as srv:
        say(f"s3: starting a {mb} MB workload (a step every {step_seconds:.1f}s, 1% of the state per step)")
        w, out, _ = start_workload(mb, step_seconds=step_seconds, change_fraction=0.01, cwd=work)
        try:
            first, chain = _FirstCheckpoints(engine, w, out, work, settings, srv).bench(reps, warm_bytes)
            beats, final, manifest_kb = _heartbeats(w, out, srv, first, chain)
        finally:
            if w.poll() is None:
                kill(w)
        restore = bench_s3_restore(engine, final, chain.prefix, reps, work, settings, srv, warm_bytes, step_seconds,
                                   naive_defaults)
        rss = srv.rss_bytes()
    beats["manifest_kb_of_a_real_checkpoint"] = manifest_kb
    return {"checkpoint": first, "heartbeats": beats, "restore": restore,
            "server": {"name": srv.name, "version": srv.version(), "rss_bytes_at_end": rss},
            "note": MOTO_NOTE if srv.name == "moto" else SEAWEEDFS_NOTE}


def s3_store(prefix: str, settings: Settings) -> tuple[Store, StoreConfig, WireCounter]:
    store = open_store(f"s3://{BUCKET}/{prefix}", settings)
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    return store, cfg, WireCounter(store.client)  # type: ignore[attr-defined]


@dataclass
class Chain:
    """Our Checkpointer into one S3 prefix, with its phase times and wire counter. The last 'ours'
    first checkpoint's chain goes on with heartbeats 2-4 (``first``: its run, heartbeat 1)."""

    prefix: str
    cp: Checkpointer
    phases: PhaseTimes
    wire: WireCounter
    cp_work: Path
    first: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, engine: CriuEngine, prefix: str, settings: Settings, cp_work: Path) -> Chain:
        store, cfg, wire = s3_store(prefix, settings)  # store.open() is setup (the runner does it once)
        phases = PhaseTimes()
        return cls(prefix, make_checkpointer(engine, store, cfg, CHECKPOINT_ID, settings, cp_work, phases),
                   phases, wire, cp_work)


def _take(chain: Chain, w: Workload, out: StepSink, srv: Endpoint, stop_after_dump: bool) -> dict[str, Any]:
    """One timed Checkpointer.checkpoint(), right after a step line. With ``stop_after_dump`` the
    workload is SIGSTOPped from the end of the dump until the upload is done (as the local stored
    bytes benchmark does), so exactly one step lies between this checkpoint and the next one."""
    s = out.step
    _, b0 = chain.wire.snapshot()
    mark = srv.mark()
    cpu0 = time.process_time()
    chain.phases.reset()
    stop = chain.phases.after("dump", lambda: os.kill(w.pid, signal.SIGSTOP)) if stop_after_dump else nullcontext()
    try:
        with stop:
            t0 = time.monotonic()
            m = chain.cp.checkpoint(w)
            secs = time.monotonic() - t0
        stepped = out.step != s
    finally:
        if stop_after_dump:
            os.kill(w.pid, signal.SIGCONT)
    cpu = time.process_time() - cpu0
    assert m is not None, "the checkpoint was skipped (too large?)"
    _, b1 = chain.wire.snapshot()
    dump, upload = chain.phases["dump"], chain.phases["save"]
    return {"seq": m.seq, "at_step": s, "seconds": secs, "dump": dump, "upload": upload,
            "other": secs - dump - upload, "image_bytes": m.image_bytes, "stored_bytes": m.stored_bytes,
            "bytes_sent": b1 - b0, "ratio_bytes": (b1 - b0) / m.image_bytes, "new_chunks": m.new_chunks,
            "chunks": len(m.chunk_digests()), "stepped_during_dump": stepped, "client_cpu_seconds": cpu,
            "manifest_bytes": len(m.model_dump_json(indent=1).encode()), **srv.since(mark)}


# --------------------------------------------------------------------------------------------
# 1. first checkpoint
# --------------------------------------------------------------------------------------------
class _FirstCheckpoints:
    """The naive path and ours, alternating, the very last run ours: it is heartbeat 1 of ``chain``."""

    def __init__(self, engine: CriuEngine, w: Workload, out: StepSink, work: Path, settings: Settings,
                 srv: Endpoint) -> None:
        self.engine, self.w, self.out, self.work, self.settings, self.srv = engine, w, out, work, settings, srv
        self.naive_client = boto3.client("s3")  # boto3's defaults, as a naive user would make it
        self.naive_wire = WireCounter(self.naive_client)
        self.chain: Chain | None = None

    def naive(self, rep: int, last: bool) -> dict[str, Any]:
        d = self.work / f"s3-naive-dump-{rep}"
        _, b0 = self.naive_wire.snapshot()
        mark = self.srv.mark()
        cpu0 = time.process_time()
        t0 = time.monotonic()
        t_dump = bare_dump(self.engine, self.w.pid, d)
        files = sorted(f for f in d.iterdir() if f.is_file())
        for f in files:
            self.naive_client.upload_file(str(f), BUCKET, f"naive-{rep}/{f.name}")
        secs = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        _, b1 = self.naive_wire.snapshot()
        img = sum(f.stat().st_size for f in files)
        counts = self.srv.since(mark)
        drop_dir(d)
        delete_prefix(f"naive-{rep}/")
        return {"seconds": secs, "dump": t_dump, "upload": secs - t_dump, "image_bytes": img,
                "bytes_sent": b1 - b0, "files": len(files), "client_cpu_seconds": cpu, **counts}

    def ours(self, rep: int, last: bool) -> dict[str, Any]:
        chain = Chain.open(self.engine, f"first-{rep}", self.settings, self.work / f"s3-first-work-{rep}")
        # the last one is also heartbeat 1 of the heartbeat benchmark: the workload stays stopped from
        # the end of its dump until its upload is done (it sleeps between steps, so this costs nothing)
        r = _take(chain, self.w, self.out, self.srv, stop_after_dump=last)
        if last:
            chain.first = r
            self.chain = chain
        else:
            shutil.rmtree(chain.cp_work, ignore_errors=True)
            delete_prefix(f"{chain.prefix}/")
        return r

    def bench(self, reps: int, warm_bytes: int) -> tuple[dict[str, Any], Chain]:
        runs: dict[str, list[dict[str, Any]]] = {"naive": [], "ours": []}
        kinds = {"naive": self.naive, "ours": self.ours}
        for rep in range(reps):
            order = ["naive", "ours"] if (reps - 1 - rep) % 2 == 0 else ["ours", "naive"]  # the very last run is ours
            for name in order:
                os.sync()  # untimed: no run starts with another's writeback pending
                with Warm(warm_bytes) as warm:  # untimed: see prewarm(); freed right before the run
                    self.out.wait_step(self.out.step, timeout=60)  # each run starts right after a step (heartbeat 1 must)
                r = kinds[name](rep, rep == reps - 1 and name == "ours")
                r["prewarm_seconds"] = warm.seconds
                runs[name].append(r)
                say(f"  first checkpoint {name:5} rep {rep}: {r['seconds']:.2f}s, {r['bytes_sent'] / MB:.0f} MB sent "
                    f"(dump {r['dump']:.2f}s + upload {r['upload']:.2f}s"
                    + (f" + other {r['other']:.2f}s" if "other" in r else "")
                    + f"; {r['requests']} requests: {fmt_ops(r['ops'])}; {server_name()} CPU {r['server_cpu_seconds']:.1f}s, "
                      f"our process CPU {r['client_cpu_seconds']:.1f}s)")
        assert self.chain is not None
        return _first_result(runs, reps), self.chain


def _first_result(runs: dict[str, list[dict[str, Any]]], reps: int) -> dict[str, Any]:
    keys = ("seconds", "dump", "upload", "other", "requests", "server_cpu_seconds", "client_cpu_seconds",
            "bytes_sent", "image_bytes")
    summary = {n: {k: med([r[k] for r in runs[n] if k in r]) for k in keys if any(k in r for r in runs[n])}
               for n in runs}
    b, o = summary["naive"]["seconds"], summary["ours"]["seconds"]
    return {
        "name": "first checkpoint to S3 (dump + upload)",
        "baseline": "bare criu dump --leave-running --file-locks + boto3 upload_file of each image file "
                    "(default TransferConfig: 8 MB multipart parts, 10 threads per file; one client; files in turn)",
        "ours": "Checkpointer.checkpoint() with open_store('s3://bench/first-N', load_settings(environ={}))",
        "baseline_seconds": b, "ours_seconds": o, "ratio": o / b, "target": TARGETS["checkpoint"],
        "pass": o / b <= TARGETS["checkpoint"], "reps": reps, "median": summary, "runs": runs,
    }


# --------------------------------------------------------------------------------------------
# 2. heartbeats 2-4, then the checkpoint both restores use
# --------------------------------------------------------------------------------------------
def _heartbeats(w: Workload, out: StepSink, srv: Endpoint, first: dict[str, Any],
                chain: Chain) -> tuple[dict[str, Any], Manifest, float]:
    """Heartbeats 2-4 after the last 'ours' first checkpoint (heartbeat 1), exactly one step apart;
    then the checkpoint both restores use."""
    beats: list[dict[str, Any]] = [dict(chain.first, steps_since_previous=None)]
    say(f"  heartbeat 1 = that last first checkpoint (seq {beats[0]['seq']}, at step {beats[0]['at_step']})")
    for _ in range(3):
        out.wait_step(beats[-1]["at_step"], timeout=60)
        beat = _take(chain, w, out, srv, stop_after_dump=True)
        beat["steps_since_previous"] = beat["at_step"] - beats[-1]["at_step"]
        beats.append(beat)
        say(f"  heartbeat {beat['seq']} at step {beat['at_step']}: {beat['seconds']:.2f}s (dump {beat['dump']:.2f} + "
            f"chunk/hash/upload {beat['upload']:.2f} + other {beat['other']:.2f}); sent {beat['bytes_sent'] / MB:.2f} MB "
            f"of a {beat['image_bytes'] / MB:.0f} MB image ({100 * beat['ratio_bytes']:.2f}%); {beat['requests']} "
            f"requests: {fmt_ops(beat['ops'])}"
            + ("; WARNING: the workload stepped during the dump" if beat["stepped_during_dump"] else ""))
    manifest_kb = beats[-1]["manifest_bytes"] / 1024  # what a listing reads per checkpoint of this size
    final = _final_checkpoint(chain, w, out)
    return _heartbeat_result(beats, first), final, manifest_kb


def _final_checkpoint(chain: Chain, w: Workload, out: StepSink) -> Manifest:
    """The checkpoint both restores use: one dump, kept as a plain directory AND stored, and
    uploaded as plain files for the naive restore (untimed)."""
    chain.cp.settings = chain.cp.settings.model_copy(update={"keep_local": True})
    out.wait_step(out.step, timeout=60)
    final = chain.cp.checkpoint(w, leave_running=False)  # CRIU ends the tree after dumping it
    assert final is not None
    w.wait(timeout=60)
    plain = max((d for d in chain.cp_work.glob("dump-*") if d.is_dir()), key=lambda d: d.stat().st_mtime) / "images"
    naive_client = boto3.client("s3")
    for f in sorted(p for p in plain.iterdir() if p.is_file()):  # untimed: what the naive restore downloads
        naive_client.upload_file(str(f), BUCKET, f"naive-restore/{f.name}")
    say(f"  restore: checkpoint seq {final.seq} ({final.image_bytes / MB:.0f} MB image) stored, and uploaded "
        f"as plain files for the naive restore")
    return final


def _heartbeat_result(beats: list[dict[str, Any]], first: dict[str, Any]) -> dict[str, Any]:
    later = beats[1:]
    naive_s = first["median"]["naive"]["seconds"]
    worst_b = max(later, key=lambda b: b["ratio_bytes"])
    worst_t = max(later, key=lambda b: b["seconds"])
    exact = all(b["steps_since_previous"] == 1 and not b["stepped_during_dump"] for b in later) \
        and not beats[0]["stepped_during_dump"]
    return {
        "name": "heartbeats 2-4 to S3",
        "baseline_bytes_desc": "a full upload: the heartbeat's image bytes (all a naive upload sends; the naive "
                               "path of the first-checkpoint benchmark sent "
                               f"{first['median']['naive']['bytes_sent'] / MB:.1f} MB for a "
                               f"{first['median']['naive']['image_bytes'] / MB:.1f} MB image)",
        "baseline_time_desc": "the naive path (bare dump + upload_file of every file), median of the first-checkpoint runs",
        "baseline_bytes": worst_b["image_bytes"], "ours_bytes": worst_b["bytes_sent"],
        "ratio_bytes": worst_b["ratio_bytes"], "target_bytes": TARGETS["heartbeat_bytes"],
        "pass_bytes": worst_b["ratio_bytes"] <= TARGETS["heartbeat_bytes"],
        "baseline_seconds": naive_s, "ours_seconds": worst_t["seconds"], "ratio_time": worst_t["seconds"] / naive_s,
        "target_time": TARGETS["heartbeat_time"], "pass_time": worst_t["seconds"] / naive_s <= TARGETS["heartbeat_time"],
        "exactly_one_step_between": exact, "heartbeats": beats,
    }
