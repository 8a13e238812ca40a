"""S3 benchmarks: cedana-airflow against a naive boto3 user, both on moto's S3 server over loopback.

Run through bench/run.py (``--only s3``, ``--only s3-transfer`` or ``--only s3-listing``); see
bench/README.md. Four figures, each a ratio against a baseline measured in the same run:

1. first checkpoint: Checkpointer.checkpoint() to an S3Store vs a bare ``criu dump --leave-running``
   plus boto3 ``upload_file`` of every image file (default settings, one client, one file after
   another).                                                               target <= 1.0x
2. heartbeats 2-4 (exactly one step, 1% of the state, between them): bytes sent vs a full upload
   (target <= 3%) and seconds vs the naive path of 1 (target <= 0.1x).
3. restore: Checkpointer.restore() (download + verify + criu restore) vs boto3 ``download_file`` of
   every image file plus a bare ``criu restore``.                          target <= 1.1x
4. listing: ``cedana-airflow checkpoints --json`` over 1,000 checkpoint IDs x 10 checkpoints on S3
   through the listing index (and, for comparison, on a file:// store with the same content and
   ``--exact``, which parses every manifest).                              target < 1 s

moto's server is a protocol test double (one Python process), not a storage system: see MOTO_NOTE.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

import run as base  # bench/run.py (it registers itself under this name when it runs as a script)
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.config import Settings, load_settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.ids import derive_checkpoint_id
from cedana_airflow.store.index import rebuild_index
from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.store import open_store
from cedana_airflow.store.base import StoreConfig, manifest_key
from cedana_airflow.run.workload import Workload, become_subreaper

MB = base.MB
say, med = base.say, base.med
BUCKET = "bench"

TARGETS = {"checkpoint": 1.0, "heartbeat_bytes": 0.03, "heartbeat_time": 0.10, "restore": 1.10, "listing_seconds": 1.0}

MOTO_NOTE = ("S3 endpoint: moto's S3 server (python -m moto.server, one Python process on loopback) is a protocol "
             "test double, not a storage system (DESIGN.md measured ~116 MB/s up and 30 MB/s down with boto3 "
             "defaults): these figures say how our requests and bytes fare against it, not what AWS S3, MinIO "
             "or R2 would do")

_NO_RANGES = TransferConfig(multipart_threshold=1 << 50)  # download_file with one plain GET per file


# --------------------------------------------------------------------------------------------
# moto's server, and counting what goes over the wire
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LOG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours the lines of 3xx/4xx/5xx answers


def _op_of(method: str, target: str) -> str:
    """The S3 operation of a request line in moto's (werkzeug's) access log; path-style addressing."""
    path, _, query = target.partition("?")
    has_key = path.strip("/").count("/") >= 1
    if method == "GET":
        return "ListObjectsV2" if "list-type" in query else ("GetObject" if has_key else "ListObjects")
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "PUT":
        return "UploadPart" if "partNumber" in query else ("PutObject" if has_key else "CreateBucket")
    if method == "POST":
        if "delete" in query:
            return "DeleteObjects"
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    if method == "DELETE":
        return "DeleteObject"
    return method


class Moto:
    """moto's S3 server as a subprocess on a free loopback port, with a bucket; sets the AWS_* variables
    of this process for boto3 (restored on exit). Its access log (one line per request) is kept so
    that any window of a run can be counted by operation, whoever sent the requests."""

    def __init__(self, work: Path, name: str) -> None:
        self.log_path = work / f"moto-{name}.log"
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> Moto:
        port = _free_port()
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        aws = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        for k in [*aws, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"]:
            self._saved[k] = os.environ.pop(k, None)
        os.environ.update(aws)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # it answered
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise SystemExit(f"moto's S3 server did not start; see {self.log_path}")
                time.sleep(0.1)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        say(f"moto {_moto_version()} S3 server at {self.url} (pid {self.proc.pid}), bucket {BUCKET}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def mark(self) -> tuple[int, float]:
        """A point in the run: (access log offset, server CPU seconds)."""
        return os.path.getsize(self.log_path), self.cpu_seconds()

    def since(self, mark: tuple[int, float]) -> dict[str, Any]:
        """Requests (by operation, and as 'op status' pairs) and server CPU since ``mark``."""
        time.sleep(0.05)  # the server logs a request right after answering it
        with open(self.log_path, "rb") as f:
            f.seek(mark[0])
            text = _ANSI.sub("", f.read().decode(errors="replace"))
        ops: dict[str, int] = {}
        by_status: dict[str, int] = {}
        for m in _LOG_LINE.finditer(text):
            op = _op_of(m.group(1), m.group(2))
            ops[op] = ops.get(op, 0) + 1
            key = f"{op} {m.group(3)}"
            by_status[key] = by_status.get(key, 0) + 1
        return {"requests": sum(ops.values()), "ops": dict(sorted(ops.items())),
                "ops_by_status": dict(sorted(by_status.items())), "server_cpu_seconds": self.cpu_seconds() - mark[1]}


def _moto_version() -> str:
    try:
        import moto

        return str(moto.__version__)
    except Exception:  # noqa: BLE001
        return "?"


class WireCounter:
    """Request bodies a boto3 client sends (botocore's before-send event, once per attempt)."""

    def __init__(self, client: Any) -> None:
        self.requests = 0
        self.bytes_sent = 0
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3", self._send)

    def _send(self, request: Any, **_: Any) -> None:
        h = request.headers
        n = h.get("X-Amz-Decoded-Content-Length") or h.get("Content-Length")
        if n is None and isinstance(request.body, (bytes, bytearray)):
            n = len(request.body)
        with self._lock:
            self.requests += 1
            self.bytes_sent += int(n or 0)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.requests, self.bytes_sent


def delete_prefix(prefix: str) -> int:
    """Remove every object under ``prefix`` (untimed housekeeping, so moto's memory stays bounded)."""
    c = boto3.client("s3")
    n = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
            n += len(keys)
    return n


class Warm:
    """run.py's prewarm(), held: touch ``nbytes`` of fresh memory on entry, free it on exit. The
    workload steps every few seconds and a run must start right after a step; memory freed while
    waiting for it could go back to the host (run.py's prewarm()), so it is freed only then."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seconds = 0.0
        self._m: mmap.mmap | None = None

    def __enter__(self) -> Warm:
        if self.nbytes:
            t0 = time.monotonic()
            self._m = mmap.mmap(-1, self.nbytes)
            block = b"\1" * (64 * MB)
            for _ in range(self.nbytes // len(block)):
                self._m.write(block)
            self.seconds = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._m is not None:
            t0 = time.monotonic()
            self._m.close()
            self._m = None
            self.release_seconds = time.monotonic() - t0

    release_seconds = 0.0


def make_checkpointer(engine: CriuEngine, store: Any, cfg: StoreConfig, cid: str, settings: Settings, work_dir: Path,
                      node: str) -> Checkpointer:
    """A Checkpointer as ``cedana-airflow run`` builds one (runner.py), from the shipped settings."""
    work_dir.mkdir(parents=True, exist_ok=True)
    return Checkpointer(engine, store, cfg, cid, node=node, work_dir=work_dir, try_number=0,
                        compression=settings.compression, keep_local=settings.keep_local, progress_mode="never",
                        max_checkpoint_bytes=settings.max_checkpoint_bytes, keep_checkpoints=settings.keep_checkpoints)


def s3_store(prefix: str, settings: Settings) -> tuple[Any, StoreConfig, WireCounter]:
    store = open_store(f"s3://{BUCKET}/{prefix}", settings)
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    return store, cfg, WireCounter(store.client)  # type: ignore[attr-defined]


def _fmt_ops(ops: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))


# --------------------------------------------------------------------------------------------
# 1-3: first checkpoint, heartbeats, restore (one 1 GB workload, one moto server)
# --------------------------------------------------------------------------------------------
def bench_transfer(engine: base.TimedEngine, mb: int, reps: int, work: Path, prewarm_on: bool,
                   naive_defaults: bool) -> dict[str, Any]:
    settings = load_settings(environ={})  # shipped defaults; boto3 takes the endpoint from AWS_ENDPOINT_URL
    node = socket.gethostname()
    warm_bytes = int(2.5 * mb * MB) if prewarm_on else 0
    step_seconds = 3.0  # longer than a dump, so heartbeats can be taken exactly one step apart
    with Moto(work, "transfer") as moto:
        say(f"s3: starting a {mb} MB workload (a step every {step_seconds:.1f}s, 1% of the state per step)")
        w, out, _ = base.start_workload(mb, step_seconds=step_seconds, change_fraction=0.01, cwd=work)
        try:
            first, chain = _first_checkpoint(engine, w, out, reps, work, settings, node, moto, warm_bytes)
            beats, final, plain, manifest_kb = _heartbeats(engine, w, out, moto, first, chain)
        finally:
            engine.after_dump = None
            if w.poll() is None:
                base.kill(w)
        restore = _restore(engine, final, plain, chain.prefix, reps, work, settings, node, moto, warm_bytes,
                           step_seconds, naive_defaults)
        rss = moto.rss_bytes()
    beats["manifest_kb_of_a_real_checkpoint"] = manifest_kb
    return {"checkpoint": first, "heartbeats": beats, "restore": restore,
            "moto": {"version": _moto_version(), "rss_bytes_at_end": rss}, "note": MOTO_NOTE}


class Chain:
    """The store and Checkpointer of the last 'ours' first checkpoint: heartbeats 2-4 continue it."""

    def __init__(self, prefix: str, cp: Checkpointer, wire: WireCounter, cp_work: Path, first: dict[str, Any]) -> None:
        self.prefix, self.cp, self.wire, self.cp_work, self.first = prefix, cp, wire, cp_work, first


def _take(engine: base.TimedEngine, cp: Checkpointer, w: Workload, out: base.StepSink, wire: WireCounter,
          moto: Moto, stop_after_dump: bool) -> dict[str, Any]:
    """One timed Checkpointer.checkpoint(), right after a step line. With ``stop_after_dump`` the
    workload is SIGSTOPped from the end of the dump until the upload is done (as run.py's store
    benchmark does), so exactly one step lies between this checkpoint and the next one."""
    s = out.step
    nd = len(engine.dump_seconds)
    _, b0 = wire.snapshot()
    mark = moto.mark()
    cpu0 = time.process_time()
    if stop_after_dump:
        engine.after_dump = lambda: os.kill(w.pid, signal.SIGSTOP)
    try:
        with base.Timed("save_checkpoint") as save:
            t0 = time.monotonic()
            m = cp.checkpoint(w)
            secs = time.monotonic() - t0
        stepped = out.step != s
    finally:
        if stop_after_dump:
            engine.after_dump = None
            os.kill(w.pid, signal.SIGCONT)
    cpu = time.process_time() - cpu0
    assert m is not None, "the checkpoint was skipped (too large?)"
    _, b1 = wire.snapshot()
    dump, upload = sum(engine.dump_seconds[nd:]), sum(save.seconds)
    return {"seq": m.seq, "at_step": s, "seconds": secs, "dump": dump, "upload": upload,
            "other": secs - dump - upload, "image_bytes": m.image_bytes, "stored_bytes": m.stored_bytes,
            "bytes_sent": b1 - b0, "ratio_bytes": (b1 - b0) / m.image_bytes, "new_chunks": m.new_chunks,
            "chunks": len(m.chunk_digests()), "stepped_during_dump": stepped, "client_cpu_seconds": cpu,
            "manifest_bytes": len(m.model_dump_json(indent=1).encode()), **moto.since(mark)}


def _first_checkpoint(engine: base.TimedEngine, w: Workload, out: base.StepSink, reps: int, work: Path,
                      settings: Settings, node: str, moto: Moto, warm_bytes: int) -> tuple[dict[str, Any], Chain]:
    naive_client = boto3.client("s3")  # boto3's defaults, as a naive user would make it
    naive_wire = WireCounter(naive_client)
    runs: dict[str, list[dict[str, Any]]] = {"naive": [], "ours": []}
    chain: Chain | None = None

    def naive(rep: int, last: bool) -> dict[str, Any]:
        d = work / f"s3-naive-dump-{rep}"
        log = d.with_name(d.name + ".dump.log")
        d.mkdir()
        cmd = [engine.binary.path, "dump", "-t", str(w.pid), "-D", str(d), "--leave-running", "--file-locks",
               "-o", str(log)]
        r0, b0 = naive_wire.snapshot()
        mark = moto.mark()
        cpu0 = time.process_time()
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        t_dump = time.monotonic() - t0
        if p.returncode != 0:
            raise SystemExit(f"bare criu dump failed (exit {p.returncode}); see {log}")
        files = sorted(f for f in d.iterdir() if f.is_file())
        for f in files:
            naive_client.upload_file(str(f), BUCKET, f"naive-{rep}/{f.name}")
        secs = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        r1, b1 = naive_wire.snapshot()
        img = sum(f.stat().st_size for f in files)
        counts = moto.since(mark)
        base.drop_dir(d)
        delete_prefix(f"naive-{rep}/")
        return {"seconds": secs, "dump": t_dump, "upload": secs - t_dump, "image_bytes": img,
                "bytes_sent": b1 - b0, "files": len(files), "client_cpu_seconds": cpu, **counts}

    def ours(rep: int, last: bool) -> dict[str, Any]:
        nonlocal chain
        prefix = f"first-{rep}"
        store, cfg, wire = s3_store(prefix, settings)  # store.open() is setup (the runner does it once)
        cp_work = work / f"s3-first-work-{rep}"
        cp = make_checkpointer(engine, store, cfg, "bench-s3", settings, cp_work, node)
        # the last one is also heartbeat 1 of the heartbeat benchmark: the workload stays stopped from
        # the end of its dump until its upload is done (it sleeps between steps, so this costs nothing)
        r = _take(engine, cp, w, out, wire, moto, stop_after_dump=last)
        if last:
            chain = Chain(prefix, cp, wire, cp_work, r)
        else:
            shutil.rmtree(cp_work, ignore_errors=True)
            delete_prefix(f"{prefix}/")
        return r

    kinds = {"naive": naive, "ours": ours}
    for rep in range(reps):
        order = ["naive", "ours"] if (reps - 1 - rep) % 2 == 0 else ["ours", "naive"]  # the very last run is ours
        for name in order:
            os.sync()  # untimed: no run starts with another's writeback pending
            with Warm(warm_bytes) as warm:  # untimed: see run.py's prewarm(); freed right before the run
                out.wait_step(out.step, timeout=60)  # each run starts right after a step (heartbeat 1 must)
            r = kinds[name](rep, rep == reps - 1 and name == "ours")
            r["prewarm_seconds"] = warm.seconds
            runs[name].append(r)
            say(f"  first checkpoint {name:5} rep {rep}: {r['seconds']:.2f}s, {r['bytes_sent'] / MB:.0f} MB sent "
                f"(dump {r['dump']:.2f}s + upload {r['upload']:.2f}s"
                + (f" + other {r['other']:.2f}s" if "other" in r else "")
                + f"; {r['requests']} requests: {_fmt_ops(r['ops'])}; moto CPU {r['server_cpu_seconds']:.1f}s, "
                  f"our process CPU {r['client_cpu_seconds']:.1f}s)")
    assert chain is not None
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
    }, chain


def _heartbeats(engine: base.TimedEngine, w: Workload, out: base.StepSink, moto: Moto, first: dict[str, Any],
                chain: Chain) -> tuple[dict[str, Any], Manifest, Path, float]:
    """Heartbeats 2-4 after the last 'ours' first checkpoint (heartbeat 1), exactly one step apart;
    then the checkpoint both restores use."""
    cp = chain.cp
    beats: list[dict[str, Any]] = [dict(chain.first, steps_since_previous=None)]
    say(f"  heartbeat 1 = that last first checkpoint (seq {beats[0]['seq']}, at step {beats[0]['at_step']})")
    for _ in range(3):
        out.wait_step(beats[-1]["at_step"], timeout=60)
        beat = _take(engine, cp, w, out, chain.wire, moto, stop_after_dump=True)
        beat["steps_since_previous"] = beat["at_step"] - beats[-1]["at_step"]
        beats.append(beat)
        say(f"  heartbeat {beat['seq']} at step {beat['at_step']}: {beat['seconds']:.2f}s (dump {beat['dump']:.2f} + "
            f"chunk/hash/upload {beat['upload']:.2f} + other {beat['other']:.2f}); sent {beat['bytes_sent'] / MB:.2f} MB "
            f"of a {beat['image_bytes'] / MB:.0f} MB image ({100 * beat['ratio_bytes']:.2f}%); {beat['requests']} "
            f"requests: {_fmt_ops(beat['ops'])}"
            + ("; WARNING: the workload stepped during the dump" if beat["stepped_during_dump"] else ""))
    manifest_kb = beats[-1]["manifest_bytes"] / 1024  # what a listing reads per checkpoint of this size

    # The checkpoint both restores use: one dump, kept as a plain directory AND stored.
    cp.keep_local = True
    out.wait_step(out.step, timeout=60)
    final = cp.checkpoint(w, leave_running=False)  # CRIU ends the tree after dumping it
    assert final is not None
    w.wait(timeout=60)
    plain = max((d for d in chain.cp_work.glob("dump-*") if d.is_dir()), key=lambda d: d.stat().st_mtime) / "images"
    naive_client = boto3.client("s3")
    for f in sorted(p for p in plain.iterdir() if p.is_file()):  # untimed: what the naive restore downloads
        naive_client.upload_file(str(f), BUCKET, f"naive-restore/{f.name}")
    say(f"  restore: checkpoint seq {final.seq} ({final.image_bytes / MB:.0f} MB image) stored, and uploaded "
        f"as plain files for the naive restore")

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
    }, final, plain, manifest_kb


def _restore(engine: base.TimedEngine, final: Manifest, plain: Path, prefix: str, reps: int, work: Path,
             settings: Settings, node: str, moto: Moto, warm_bytes: int, step_seconds: float,
             naive_defaults: bool) -> dict[str, Any]:
    become_subreaper()
    warm_bytes = int(2.5 * final.image_bytes) if warm_bytes else 0
    runs: dict[str, list[dict[str, Any]]] = {"naive": [], "ours": [], "naive_defaults": []}
    live: list[Workload] = []

    def check_alive(wl: Workload, sink: base.StepSink, what: str) -> None:
        try:
            sink.wait_step(sink.step, timeout=step_seconds + 30)  # the restored workload runs on (untimed)
        except TimeoutError:
            base.kill(wl)
            raise SystemExit(f"{what}: the restored workload printed no step for {step_seconds + 30:.0f}s")

    def naive(rep: int, held: Warm, cfg: TransferConfig | None, label: str) -> dict[str, Any]:
        d = work / f"s3-restore-{label}-{rep}" / "images"
        d.mkdir(parents=True)
        client = boto3.client("s3")  # fresh, as a restore on another node would have
        sink = base.StepSink()
        mark = moto.mark()
        cpu0 = time.process_time()
        t0 = time.monotonic()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="naive-restore/").get("Contents", [])]
        for k in keys:
            client.download_file(BUCKET, k, str(d / k.rsplit("/", 1)[1]), Config=cfg)
        t_dl = time.monotonic() - t0
        held.release()  # see the plan below
        t1 = time.monotonic()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = CriuEngine.restore(engine, d, inherit={out_w: final.process.stdout_pipe,
                                                         err_w: final.process.stderr_pipe},
                                     pidfile=d.with_name("restore.pid"))
        finally:
            os.close(out_w)
            os.close(err_w)
        t2 = time.monotonic()
        secs = t2 - t0 - held.release_seconds  # freeing the held memory is not timed
        cpu = time.process_time() - cpu0
        wl = Workload.adopt(pid, final.process.command, final.process.cwd, out_r, err_r, sink, base.TailSink())  # type: ignore[arg-type]
        live.append(wl)
        r = {"seconds": secs, "download": t_dl, "criu_restore": t2 - t1,
             "other": t1 - t0 - t_dl - held.release_seconds,
             "client_cpu_seconds": cpu, **moto.since(mark)}
        check_alive(wl, sink, f"naive restore ({label})")
        base.kill(wl)
        shutil.rmtree(d.parent, ignore_errors=True)
        return r

    def ours(rep: int, held: Warm) -> dict[str, Any]:
        rw = work / f"s3-restore-ours-{rep}"
        store = open_store(f"s3://{BUCKET}/{prefix}", settings)  # a fresh client, as on another node
        cfg = store.open(create=False, chunk_avg_bytes=settings.chunk_avg_bytes)  # setup, as the runner does
        c = make_checkpointer(engine, store, cfg, "bench-s3", settings, rw, node)
        sink = base.StepSink()
        nr = len(engine.restore_seconds)
        mark = moto.mark()
        cpu0 = time.process_time()
        engine.before_restore = held.release  # see the plan below
        try:
            with base.Timed("fetch_checkpoint") as fetch:
                t0 = time.monotonic()
                restored = c.restore(sink, base.TailSink())  # type: ignore[arg-type]
                secs = time.monotonic() - t0
        finally:
            engine.before_restore = None
        secs -= held.release_seconds  # freeing the held memory is not timed
        cpu = time.process_time() - cpu0
        live.append(restored.workload)
        assert restored.manifest.seq == final.seq, (restored.manifest.seq, final.seq)
        f, crit = sum(fetch.seconds), sum(engine.restore_seconds[nr:])
        r = {"seconds": secs, "download": f, "criu_restore": crit, "other": secs - f - crit,
             "client_cpu_seconds": cpu, **moto.since(mark)}
        check_alive(restored.workload, sink, "Checkpointer.restore from S3")
        base.kill(restored.workload)
        shutil.rmtree(rw, ignore_errors=True)
        return r

    # Memory: a restore needs fresh memory twice, for the downloaded image (page cache) and then for
    # the restored process. Memory freed more than ~2 s before it is touched again has gone back to
    # the host (run.py's prewarm()), and a download from moto takes 3-10 s, so a prewarm before the
    # run would not cover criu restore: half the prewarm is freed when the run starts, the other half
    # is held and freed right before criu restore (ours: the engine's before_restore hook); the
    # time the freeing takes is subtracted on both sides.
    kinds: dict[str, Callable[[int, Warm], dict[str, Any]]] = {
        "naive": lambda rep, held: naive(rep, held, _NO_RANGES, "naive"), "ours": ours}
    names = list(kinds)
    plan = [(rep, name) for rep in range(reps) for name in names[rep % 2:] + names[: rep % 2]]
    if naive_defaults:
        kinds["naive_defaults"] = lambda rep, held: naive(rep, held, None, "naive-defaults")
        plan.append((0, "naive_defaults"))
    try:
        for rep, name in plan:
            os.sync()
            with Warm(warm_bytes // 2) as held:
                warm = base.prewarm(warm_bytes - warm_bytes // 2) if warm_bytes else 0.0
                r = kinds[name](rep, held)
            r["prewarm_seconds"] = warm + held.seconds
            r["held_release_seconds"] = held.release_seconds
            runs[name].append(r)
            say(f"  restore {name:14} rep {rep}: {r['seconds']:.2f}s (download{'+verify' if name == 'ours' else ''} "
                f"{r['download']:.2f}s, criu restore {r['criu_restore']:.2f}s, other {r['other']:.2f}s"
                + f"; {r['requests']} requests; moto CPU {r['server_cpu_seconds']:.1f}s, our process CPU "
                  f"{r['client_cpu_seconds']:.1f}s)")
    finally:
        for wl in live:
            if wl.poll() is None:
                base.kill(wl)
    keys = ("seconds", "download", "criu_restore", "other", "requests", "server_cpu_seconds", "client_cpu_seconds")
    summary = {n: {k: med([r[k] for r in runs[n] if k in r]) for k in keys if any(k in r for r in runs[n])}
               for n in runs if runs[n]}
    b, o = summary["naive"]["seconds"], summary["ours"]["seconds"]
    res = {
        "name": "restore from S3 (download + verify + criu restore)",
        "baseline": "list_objects_v2 + boto3 download_file of each image file, one plain GET per file "
                    "(TransferConfig(multipart_threshold above the file size)) + bare criu restore -d --inherit-fd",
        "ours": "Checkpointer.restore(): manifests, every chunk fetched and verified, criu restore, adopt",
        "baseline_seconds": b, "ours_seconds": o, "ratio": o / b, "target": TARGETS["restore"],
        "pass": o / b <= TARGETS["restore"], "image_mb": final.image_bytes / MB, "median": summary, "runs": runs,
        "why_no_ranges": "boto3's default download_file splits a file over 8 MB into ranged GETs (8 MB each, 10 "
                         "threads); moto answers each ranged GET by reading and copying the whole object, so a "
                         "1 GB file costs ~128 whole-object reads: a test-double artefact, not a cost of S3",
        "note": "moto holds the objects in memory or in its temp files; os.sync() before each run"
                + ("; memory prewarmed before each run, half of it held until right before criu restore"
                   if warm_bytes else ""),
    }
    if runs["naive_defaults"]:
        d = summary["naive_defaults"]["seconds"]
        res["defaults"] = {"baseline_seconds": d, "ratio": o / d,
                           "baseline": "the same with boto3's default TransferConfig (ranged GETs)"}
    return res


# --------------------------------------------------------------------------------------------
# 4: listing 1,000 checkpoint IDs x 10 checkpoints
# --------------------------------------------------------------------------------------------
def _listing_manifests(n_ids: int, n_seqs: int) -> list[tuple[str, Manifest]]:
    """(key, manifest) for n_ids x n_seqs valid manifests, as save_checkpoint would write them."""
    proc = ProcessInfo(pid=4242, command=("python", "train.py", "--mb", "1024"), cwd="/opt/airflow",
                       rss_bytes=1 << 30, stdout_pipe="pipe:[1001]", stderr_pipe="pipe:[1002]")
    t = datetime(2026, 11, 29, tzinfo=timezone.utc)
    out = []
    for i in range(n_ids):
        cid = derive_checkpoint_id("bench_listing", f"train_{i:04d}", "scheduled__2026-11-29T00:00:00+00:00")
        for seq in range(1, n_seqs + 1):
            m = Manifest(checkpoint_id=cid, seq=seq, node=f"worker-{i % 7}", created_at=t + timedelta(minutes=seq),
                         engine_version="4.1.1", process=proc, files=(), image_bytes=0, stored_bytes=0)
            out.append((manifest_key(cid, seq), m))
    return out


def _cli_listing(store_url: str, *extra: str) -> tuple[float, float, int, str]:
    """Run ``python -m cedana_airflow checkpoints --json``; return (seconds, its CPU seconds, checkpoints listed, stderr tail)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
    env["CEDANA_STORE"] = store_url
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "cedana_airflow", "checkpoints", "--json", *extra], env=env,
                       cwd=str(base.REPO), capture_output=True, text=True, timeout=1800)
    secs = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"cedana-airflow checkpoints --json on {store_url} failed (exit {p.returncode}): "
                         f"{p.stderr.strip()[-500:]}")
    rows = sum(len(x["checkpoints"]) for x in json.loads(p.stdout))
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return secs, cpu, rows, p.stderr.strip()[-300:]


def _index_as_writers_leave_it(store_url: str, items: list[tuple[str, Manifest]]) -> float:
    """Write the listing index that the writers of these manifests would have kept up (gc's rebuild, in-process)."""
    by_id: dict[str, list[Manifest]] = {}
    for _, m in items:
        by_id.setdefault(m.checkpoint_id, []).append(m)
    store = open_store(store_url, load_settings(environ={}))
    t0 = time.monotonic()
    rebuild_index(store, by_id)
    return time.monotonic() - t0


def bench_listing(work: Path, n_ids: int, n_seqs: int) -> dict[str, Any]:
    settings = load_settings(environ={})
    n = n_ids * n_seqs
    items = _listing_manifests(n_ids, n_seqs)
    blobs = [(k, m.model_dump_json(indent=1).encode()) for k, m in items]
    cfg_json = StoreConfig(chunk_avg_bytes=settings.chunk_avg_bytes).model_dump_json(indent=2).encode()
    manifest_bytes = sum(len(b) for _, b in blobs)

    # the file:// store with the same content
    root = work / "listing-file"
    root.mkdir()
    (root / "store.json").write_bytes(cfg_json)
    for key, data in blobs:
        p = root / key
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    _index_as_writers_leave_it(f"file://{root}", items)
    file_runs, exact_runs = [], []
    for _ in range(3):
        secs, cpu, rows, _tail = _cli_listing(f"file://{root}")
        assert rows == n, (rows, n)
        file_runs.append({"seconds": secs, "cpu_seconds": cpu})
    secs, cpu, rows, _tail = _cli_listing(f"file://{root}", "--exact")
    assert rows == n, (rows, n)
    exact_runs.append({"seconds": secs, "cpu_seconds": cpu})
    empty = work / "listing-empty"
    empty.mkdir()
    (empty / "store.json").write_bytes(cfg_json)
    floor_runs = [_cli_listing(f"file://{empty}")[:2] for _ in range(3)]
    say(f"  listing on file:// ({n} manifests): {med([r['seconds'] for r in file_runs]):.2f}s from the index, "
        f"{exact_runs[0]['seconds']:.2f}s --exact; the same CLI on an empty store (interpreter + imports): "
        f"{med([r[0] for r in floor_runs]):.2f}s")

    with Moto(work, "listing") as moto:
        client = boto3.session.Session().client("s3", config=Config(max_pool_connections=16))
        t0 = time.monotonic()
        client.put_object(Bucket=BUCKET, Key="listing/store.json", Body=cfg_json)
        with ThreadPoolExecutor(16) as pool:
            for _ in pool.map(lambda kv: client.put_object(Bucket=BUCKET, Key=f"listing/{kv[0]}", Body=kv[1]), blobs):
                pass
        populate = time.monotonic() - t0
        index_secs = _index_as_writers_leave_it(f"s3://{BUCKET}/listing", items)
        say(f"  listing: wrote {n} manifests ({manifest_bytes / MB:.1f} MB) to s3://{BUCKET}/listing in {populate:.0f}s "
            f"({n / populate:.0f} PUT/s with 16 threads), and the listing index in {index_secs:.2f}s")

        s3_runs = []
        for _ in range(3):
            mark = moto.mark()
            secs, cpu, rows, tail = _cli_listing(f"s3://{BUCKET}/listing")
            assert rows == n, (rows, n, tail)
            s3_runs.append({"seconds": secs, "client_cpu_seconds": cpu, **moto.since(mark)})
            r = s3_runs[-1]
            say(f"  listing on s3 rep {len(s3_runs) - 1}: {secs:.2f}s, {r['requests']} requests "
                f"({_fmt_ops(r['ops'])}), moto CPU {r['server_cpu_seconds']:.1f}s, CLI CPU {cpu:.1f}s")
    s3_s = med([r["seconds"] for r in s3_runs])
    file_s = med([r["seconds"] for r in file_runs])
    mid = sorted(s3_runs, key=lambda r: r["seconds"])[(len(s3_runs) - 1) // 2]
    return {
        "name": f"cedana-airflow checkpoints --json over {n_ids} checkpoint IDs x {n_seqs} checkpoints",
        "baseline": "the same CLI on a file:// store with the same manifests and index",
        "baseline_seconds": file_s, "ours_seconds": s3_s, "ratio": s3_s / file_s,
        "target_seconds": TARGETS["listing_seconds"], "pass": s3_s < TARGETS["listing_seconds"],
        "ids": n_ids, "seqs": n_seqs, "manifest_bytes_total": manifest_bytes, "populate_seconds": populate,
        "index_write_seconds": index_secs, "file_exact_runs": exact_runs,
        "cli_floor_seconds": med([r[0] for r in floor_runs]), "file_runs": file_runs, "s3_runs": s3_runs,
        "requests": mid["requests"], "ops": mid["ops"], "server_cpu_seconds": mid["server_cpu_seconds"],
        "client_cpu_seconds": mid["client_cpu_seconds"],
        "note": MOTO_NOTE,
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def table_rows(s3: dict[str, Any]) -> list[list[str]]:
    ok = lambda b: "PASS" if b else "MISS"  # noqa: E731
    rows: list[list[str]] = []
    if "checkpoint" in s3:
        c, h, r = s3["checkpoint"], s3["heartbeats"], s3["restore"]
        rows += [
            ["S3 first checkpoint (dump+upload)", f"{c['baseline_seconds']:.2f} s", f"{c['ours_seconds']:.2f} s",
             f"{c['ratio']:.2f}x", f"<= {c['target']:.2f}x", ok(c["pass"])],
            ["S3 heartbeats 2-4: bytes sent (worst)", f"{h['baseline_bytes'] / MB:.1f} MB full",
             f"{h['ours_bytes'] / MB:.2f} MB sent", f"{100 * h['ratio_bytes']:.2f}%",
             f"<= {100 * h['target_bytes']:.0f}%", ok(h["pass_bytes"])],
            ["S3 heartbeats 2-4: time (worst)", f"{h['baseline_seconds']:.2f} s naive", f"{h['ours_seconds']:.2f} s",
             f"{h['ratio_time']:.2f}x", f"<= {h['target_time']:.2f}x", ok(h["pass_time"])],
            ["S3 restore (download+verify+criu restore)", f"{r['baseline_seconds']:.2f} s", f"{r['ours_seconds']:.2f} s",
             f"{r['ratio']:.2f}x", f"<= {r['target']:.2f}x", ok(r["pass"])],
        ]
        if "defaults" in r:
            d = r["defaults"]
            rows.append(["  (vs download_file with boto3 defaults, info)", f"{d['baseline_seconds']:.2f} s",
                         f"{r['ours_seconds']:.2f} s", f"{d['ratio']:.2f}x", "", ""])
    if "listing" in s3:
        li = s3["listing"]
        rows.append([f"S3 listing, {li['ids']:,} IDs x {li['seqs']} (checkpoints --json)",
                     f"{li['baseline_seconds']:.2f} s file://", f"{li['ours_seconds']:.2f} s",
                     f"{li['ratio']:.1f}x", f"< {li['target_seconds']:.0f} s", ok(li["pass"])])
    return rows


def details(s3: dict[str, Any], mb: int | None) -> list[str]:
    lines = [MOTO_NOTE]
    if "checkpoint" in s3:
        c, h, r = s3["checkpoint"], s3["heartbeats"], s3["restore"]
        n, o = c["median"]["naive"], c["median"]["ours"]
        lines.append(
            f"S3 first checkpoint ({c['runs']['ours'][0]['image_bytes'] / MB:.0f} MB image, "
            + (f"medians of {len(c['runs']['ours'])}" if len(c['runs']['ours']) > 1 else "one run each")
            + f"): naive = dump {n['dump']:.2f} s + upload {n['upload']:.2f} s "
            f"({n['requests']:.0f} requests: {_fmt_ops(c['runs']['naive'][-1]['ops'])}; moto CPU "
            f"{n['server_cpu_seconds']:.1f} s, our process CPU {n['client_cpu_seconds']:.1f} s); ours = dump {o['dump']:.2f} s + chunk/hash/compress/upload "
            f"{o['upload']:.2f} s + other {o['other']:.2f} s ({o['requests']:.0f} requests: "
            f"{_fmt_ops(c['runs']['ours'][-1]['ops'])}; moto CPU {o['server_cpu_seconds']:.1f} s, our process CPU "
            f"{o['client_cpu_seconds']:.1f} s); bytes sent naive {n['bytes_sent'] / MB:.0f} MB, ours "
            f"{o['bytes_sent'] / MB:.0f} MB")
        beats = h["heartbeats"]
        lines.append(
            "S3 heartbeats: " + ", ".join(
                f"#{b['seq']} {b['seconds']:.2f} s (dump {b['dump']:.2f} + chunk/hash/upload {b['upload']:.2f} + "
                f"other {b['other']:.2f}), {b['bytes_sent'] / MB:.2f} MB sent ({100 * b['ratio_bytes']:.2f}%), "
                f"{b['requests']} requests" for b in beats)
            + " (#1 is the last first checkpoint above; the workload is stopped from the end of each dump until "
              "its upload is done, so exactly one step lies between heartbeats)"
            + f"; baseline time = naive path of the first checkpoint ({h['baseline_seconds']:.2f} s); bytes sent = "
              "request bodies (chunks, manifest, lock objects) counted on our boto3 client"
            + ("" if h["exactly_one_step_between"] else
               "; WARNING: not exactly one step between heartbeats (see results.json)"))
        nm, om = r["median"]["naive"], r["median"]["ours"]
        lines.append(
            f"S3 restore ({r['image_mb']:.0f} MB image, "
            + (f"medians of {len(r['runs']['ours'])}" if len(r['runs']['ours']) > 1 else "one run each")
            + f"): naive = download {nm['download']:.2f} s + criu restore {nm['criu_restore']:.2f} s + other "
            f"{nm['other']:.2f} s "
            f"({nm['requests']:.0f} requests; moto CPU {nm['server_cpu_seconds']:.1f} s, our process CPU "
            f"{nm['client_cpu_seconds']:.1f} s); ours = "
            f"download+verify {om['download']:.2f} s + criu restore {om['criu_restore']:.2f} s + other "
            f"{om['other']:.2f} s ({om['requests']:.0f} requests; moto CPU {om['server_cpu_seconds']:.1f} s, our "
            f"process CPU {om['client_cpu_seconds']:.1f} s); baseline: one GET per file, because {r['why_no_ranges']}"
            + (f"; with boto3's defaults the naive restore took {r['defaults']['baseline_seconds']:.1f} s"
               if "defaults" in r else "; the defaults variant runs with --s3-naive-defaults (about 2 more minutes)")
            + f"; {r['note']}")
    if "listing" in s3:
        li = s3["listing"]
        lines.append(
            f"S3 listing: {li['requests']:,} requests ({_fmt_ops(li['ops'])}) in {li['ours_seconds']:.2f} s: one key "
            f"listing of the IDs and the 16 shards of the listing index (docs/store-format.md); moto used "
            f"{li['server_cpu_seconds']:.2f} s of CPU and the CLI {li['client_cpu_seconds']:.2f} s; the CLI on an empty "
            f"store takes {li['cli_floor_seconds']:.2f} s (interpreter + imports); on file:// the index listing took "
            f"{li['baseline_seconds']:.2f} s and --exact (every manifest parsed) {li['file_exact_runs'][0]['seconds']:.2f} s; "
            f"writing the index as writers leave it took {li['index_write_seconds']:.2f} s, the {li['ids'] * li['seqs']:,} "
            f"manifests {li['populate_seconds']:.0f} s (untimed). Before the index (2026-11-29, first session) the "
            f"same listing read every manifest: 11,004 requests, 118 s")
    return lines
