"""S3 listing (part "s3-listing"): ``cedana-airflow checkpoints --json`` over 1,000 checkpoint IDs x 10
checkpoints on an S3 server (moto's, or SeaweedFS: s3_server.KIND) through the listing index (and, for comparison, on a file:// store
with the same content and ``--exact``, which parses every manifest).         target < 1 s

moto's server is a protocol test double (one Python process), not a storage system: see MOTO_NOTE.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from harness import MB, REPO, med, say
from report import MOTO_NOTE, fmt_ops
from s3_server import BUCKET, Endpoint, server, server_name

from cedana_airflow.config import load_settings
from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.ids import derive_checkpoint_id
from cedana_airflow.store import open_store
from cedana_airflow.store.base import StoreConfig, manifest_key
from cedana_airflow.store.index import ShardCache, rebuild_index
from cedana_airflow.store.listing import as_json, list_store

TARGET_SECONDS = 1.0
WARM_TARGET_SECONDS = 0.3  # the UI's JSON API, its shards revalidated (StoreCache after its TTL)

Run = dict[str, Any]


def bench_listing(work: Path, n_ids: int, n_seqs: int) -> dict[str, Any]:
    settings = load_settings(environ={})
    n = n_ids * n_seqs
    items = _listing_manifests(n_ids, n_seqs)
    blobs = [(k, m.model_dump_json(indent=1).encode()) for k, m in items]
    cfg_json = StoreConfig(chunk_avg_bytes=settings.chunk_avg_bytes).model_dump_json(indent=2).encode()
    manifest_bytes = sum(len(b) for _, b in blobs)
    file_runs, exact_runs, floor_runs = _on_file_store(work, items, blobs, cfg_json)
    with server(work, "listing") as srv:
        populate, index_secs = _populate_s3(items, blobs, cfg_json, manifest_bytes)
        s3_runs = _on_s3(srv, n)
        warm_runs = _warm_on_s3(srv, n)
    s3_s = med([r["seconds"] for r in s3_runs])
    file_s = med([r["seconds"] for r in file_runs])
    mid = sorted(s3_runs, key=lambda r: r["seconds"])[(len(s3_runs) - 1) // 2]
    return {
        "name": f"cedana-airflow checkpoints --json over {n_ids} checkpoint IDs x {n_seqs} checkpoints",
        "baseline": "the same CLI on a file:// store with the same manifests and index",
        "baseline_seconds": file_s, "ours_seconds": s3_s, "ratio": s3_s / file_s,
        "target_seconds": TARGET_SECONDS, "pass": s3_s < TARGET_SECONDS,
        "ids": n_ids, "seqs": n_seqs, "manifest_bytes_total": manifest_bytes, "populate_seconds": populate,
        "index_write_seconds": index_secs, "file_exact_runs": exact_runs,
        "cli_floor_seconds": med([r[0] for r in floor_runs]), "file_runs": file_runs, "s3_runs": s3_runs,
        "requests": mid["requests"], "ops": mid["ops"], "server_cpu_seconds": mid["server_cpu_seconds"],
        "client_cpu_seconds": mid["client_cpu_seconds"],
        "warm_seconds": med([r["seconds"] for r in warm_runs]), "warm_target_seconds": WARM_TARGET_SECONDS,
        "warm_pass": med([r["seconds"] for r in warm_runs]) < WARM_TARGET_SECONDS, "warm_runs": warm_runs,
        "note": MOTO_NOTE,
    }


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
                       cwd=str(REPO), capture_output=True, text=True, timeout=1800)
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


def _on_file_store(work: Path, items: list[tuple[str, Manifest]], blobs: list[tuple[str, bytes]],
                   cfg_json: bytes) -> tuple[list[Run], list[Run], list[tuple[float, float]]]:
    """The same CLI on a file:// store with the same content: from the index (3 runs), --exact (1 run),
    and on an empty store (3 runs: the interpreter + import floor)."""
    n = len(items)
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
    return file_runs, exact_runs, floor_runs


def _populate_s3(items: list[tuple[str, Manifest]], blobs: list[tuple[str, bytes]], cfg_json: bytes,
                 manifest_bytes: int) -> tuple[float, float]:
    """The manifests, store.json and the listing index under s3://bench/listing (untimed by the
    figure); return the seconds the manifests and the index took."""
    n = len(items)
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
    return populate, index_secs


def _on_s3(srv: Endpoint, n: int) -> list[Run]:
    s3_runs = []
    for _ in range(3):
        mark = srv.mark()
        secs, cpu, rows, tail = _cli_listing(f"s3://{BUCKET}/listing")
        assert rows == n, (rows, n, tail)
        s3_runs.append({"seconds": secs, "client_cpu_seconds": cpu, **srv.since(mark)})
        r = s3_runs[-1]
        say(f"  listing on s3 rep {len(s3_runs) - 1}: {secs:.2f}s, {r['requests']} requests "
            f"({fmt_ops(r['ops'])}), {server_name()} CPU {r['server_cpu_seconds']:.1f}s, CLI CPU {cpu:.1f}s")
    return s3_runs


def _warm_on_s3(srv: Endpoint, n: int) -> list[Run]:
    """What the UI's JSON API does for a listing once its StoreCache's TTL ran out, in-process: the
    IDs listed, each index shard revalidated (If-None-Match; nothing changed, so 304s), the listing
    built and serialized. One cold read first (untimed), then 3 timed."""
    store = open_store(f"s3://{BUCKET}/listing", load_settings(environ={}))
    cache = ShardCache()
    list_store(store, cache=cache)
    runs = []
    for _ in range(3):
        mark = srv.mark()
        t0 = time.monotonic()
        body = json.dumps([as_json(x) for x in list_store(store, cache=cache)])
        secs = time.monotonic() - t0
        assert body.count('"seq"') == n
        runs.append({"seconds": secs, **srv.since(mark)})
        say(f"  listing warm (revalidated) rep {len(runs) - 1}: {secs:.3f}s, {runs[-1]['requests']} requests "
            f"({fmt_ops(runs[-1]['ops'])})")
    return runs
