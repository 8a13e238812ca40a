"""Load: N supervisors heartbeating to one S3 store at once, with listing, gc and a drill beside them.

    python tests/faults/load.py [--writers 32] [--seconds 180] [--heartbeat 2] [--write docs/faults.md]

Each writer is the real CLI (``cedana-airflow run``) around a small real workload (CRIU dumps it on
every heartbeat) against moto's S3 server; beside them ``checkpoints --json`` lists the store every
5 s, ``gc`` runs every 30 s (default grace) and ``drill verify`` every 45 s. At the end every writer
is stopped with SIGTERM (a final checkpoint each), and the store is checked with every chunk read.
Figures: checkpoints committed, heartbeats failed and those skipped while a gc held the store, heartbeat time (freeze plus
upload and commit) p50/p99, listing-index updates retried on a conflict, and the side commands'.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "scripts")]

from fault_matrix import machine, write_doc  # noqa: E402

BUCKET = "load"
#: Small, so that 32 of them fit 2 cores: the load is on the store and the supervisors, not the workload.
WORKLOAD = [sys.executable, str(REPO / "tests" / "workloads" / "train.py"), "--mb", "8", "--steps", "100000",
            "--step-seconds", "0.2", "--change-fraction", "0.02"]


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run(writers: int, seconds: float, heartbeat: float) -> dict[str, object]:
    import boto3

    from local_parts import moto_server

    root = Path(tempfile.mkdtemp(prefix="cedana-load-"))
    with moto_server() as url:
        boto3.client("s3", endpoint_url=url, aws_access_key_id="t", aws_secret_access_key="t",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AWS_"))}
        env.update(CEDANA_STORE=f"s3://{BUCKET}/load", AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="t",
                   AWS_SECRET_ACCESS_KEY="t", AWS_DEFAULT_REGION="us-east-1", PYTHONUNBUFFERED="1",
                   CEDANA_STOP_WINDOW_SECONDS="30")
        procs = []
        for i in range(writers):
            e = {**env, "CEDANA_NODE": f"node-{i % 4}", "CEDANA_WORK_DIR": str(root / f"work-{i}")}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "cedana_airflow", "run", "--id", f"load-{i:02d}", "--heartbeat", str(heartbeat),
                 "--json-file", str(root / f"w{i}.json"), "--", *WORKLOAD],
                env=e, stdout=subprocess.DEVNULL, stderr=open(root / f"w{i}.err", "wb"), start_new_session=True))
        side: dict[str, list[float]] = {"checkpoints": [], "gc": [], "drill verify": []}
        failures: dict[str, int] = {k: 0 for k in side}
        stop = threading.Event()

        def every(name: str, argv: list[str], period: float) -> None:
            while not stop.wait(period):
                t0 = time.monotonic()
                r = subprocess.run([sys.executable, "-m", "cedana_airflow", *argv], env={**env, "CEDANA_NODE": "side"},
                                   capture_output=True, text=True, timeout=600)
                side[name].append(time.monotonic() - t0)
                failures[name] += r.returncode not in (0,)

        threads = [threading.Thread(target=every, args=a, daemon=True) for a in (
            ("checkpoints", ["checkpoints", "--json"], 5.0), ("gc", ["gc"], 30.0),
            ("drill verify", ["drill", "verify", "--sample", "2"], 45.0))]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)  # a drain: each takes a final checkpoint
        codes = [p.wait(timeout=300) for p in procs]
        for t in threads:
            t.join(timeout=600)
        check = subprocess.run([sys.executable, "-m", "cedana_airflow", "check", "--read-data", "--json"],
                               env={**env, "CEDANA_NODE": "side"}, capture_output=True, text=True, timeout=900)
    beats: list[float] = []
    lost = skipped_for_gc = 0
    committed = conflicts = 0
    for i in range(writers):
        err = (root / f"w{i}.err").read_text(errors="replace")
        # a checkpoint's one line (run/checkpointer.py): how long the workload froze, and the save's time
        beats += [float(m[1]) + float(m[2])
                  for m in re.finditer(r"checkpoint seq=\d+: froze ([\d.]+) s; .*? in ([\d.]+) s", err)]
        try:
            summary = json.loads((root / f"w{i}.json").read_text())
            committed += int(summary.get("checkpoints", 0))
            conflicts += int(summary.get("index_conflicts_retried", 0))
            # each kind of failure is said once in the log and counted in the summary (issue 47)
            kinds = summary.get("heartbeat_failures") or []
        except (OSError, ValueError):
            kinds = [{"cause": f, "count": 1} for f in re.findall(r"heartbeat failed.*", err)]
        gc = sum(k["count"] for k in kinds if "garbage collection by" in k["cause"])  # by design: gc holds the store
        skipped_for_gc += gc
        lost += sum(k["count"] for k in kinds) - gc
    report = json.loads(check.stdout or "{}")
    return {
        "writers": writers, "seconds": seconds, "heartbeat": heartbeat, "committed": committed, "lost": lost,
        "skipped_for_gc": skipped_for_gc,
        "heartbeat_p50": _pct(beats, 50), "heartbeat_p99": _pct(beats, 99), "index_conflicts_retried": conflicts,
        "stopped_cleanly": sum(c == 128 + signal.SIGTERM for c in codes),
        "store_clean": report.get("clean") is True, "chunks_read": report.get("read", 0),
        "side": {k: {"runs": len(v), "failed": failures[k], "p50": _pct(v, 50), "max": max(v, default=float("nan"))}
                 for k, v in side.items()},
        "root": str(root),
    }


def doc(r: dict[str, object]) -> str:
    side = r["side"]
    assert isinstance(side, dict)
    rows = [f"Generated by `make faults` on {time.strftime('%Y-%m-%d')} ({machine()}): {r['writers']} supervisors, "
            f"each around its own workload, heartbeating every {r['heartbeat']} s to one moto S3 store for "
            f"{float(r['seconds']) / 60:.0f} min, then stopped with SIGTERM.", "",
            "| figure | value |", "|---|---|",
            f"| checkpoints committed | {r['committed']} |",
            f"| heartbeats failed | {r['lost']} |",
            f"| heartbeats skipped while a gc held the store | {r['skipped_for_gc']} |",
            f"| heartbeat time p50 / p99 (freeze + upload + commit) | {r['heartbeat_p50']:.2f} s / {r['heartbeat_p99']:.2f} s |",
            f"| listing-index updates retried on a conflict | {r['index_conflicts_retried']} |",
            f"| stopped by SIGTERM with a final checkpoint (exit 143) | {r['stopped_cleanly']} of {r['writers']} |",
            f"| store after: `check --read-data` | {'clean' if r['store_clean'] else 'PROBLEMS'} ({r['chunks_read']} chunks read) |"]
    for name, s in side.items():
        rows.append(f"| beside them: `{name}` | {s['runs']} runs, {s['failed']} failed, p50 {s['p50']:.1f} s, "
                    f"max {s['max']:.1f} s |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    r = run(args.writers, args.seconds, args.heartbeat)
    print(json.dumps(r, indent=1, default=str))
    if args.write:
        write_doc(args.write, "load", doc(r))
    return 0 if r["store_clean"] and r["stopped_cleanly"] == args.writers else 1


if __name__ == "__main__":
    sys.exit(main())
