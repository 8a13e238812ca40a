"""cedana-airflow benchmarks: ratios against baselines measured in the same run.

    .venv/bin/python bench/run.py [--only local|s3|s3-transfer|s3-listing|job|heartbeat] [--mb 1024] [--reps 5]
                                  [--s3-reps 2] [--s3-naive-defaults] [--keep] [--no-write] [--no-prewarm]
                                  [--heartbeat-tasks 1000] [--heartbeat-seed 20261203]
                                  [--lazy-freeze-mb 256] [--lazy-freeze-rounds 5]

Local benchmarks (part "local"), each on tests/workloads/train.py (numpy state, ~1% rewritten per
step), run as a managed workload (own PID namespace, pipes for stdout/stderr):

1. freeze:  CRIU's frozen time of our engine's heartbeat dump (CriuEngine.dump, with the capture
            action script) vs a bare ``criu dump --leave-running`` of the same process to the same
            disk.                                                       target <= 1.15x  (local_freeze.py)
2. store:   bytes that heartbeats 2..4 add to a file:// store vs their image bytes, with ~1% of
            the state rewritten between heartbeats.                     target <= 3%     (local_store.py)
3. restore: Checkpointer.restore() (fetch + verify + criu restore + adopt) from the local store vs
            a bare ``criu restore`` of a plain image directory of the same checkpoint.
                                                                        target <= 1.3x   (local_restore.py)

Part "lazy-freeze" (lazy_freeze.py): CRIU's frozen time of the heartbeats of a workload's copies
restored lazily (our daemon; CRIU's on page files) and in full, against the workload's own, all
from one checkpoint, interleaved; each restore kind also without the huge pages the Checkpointer
gives back (info).                                                  target <= 1.15x

S3 benchmarks (parts "s3-transfer" and "s3-listing", both "s3") against moto's S3 server on
loopback (s3_server.py): first checkpoint, heartbeats 2-4 (s3_transfer.py), restore (s3_restore.py),
and listing 1,000 IDs x 10 (s3_listing.py); the same against SeaweedFS, a real S3 server (parts
"seaweedfs-transfer", "seaweedfs-listing" and, S3 only, "seaweedfs-lazy", all three "seaweedfs"; issue 52), in
results.json's "s3_seaweedfs" and "lazy_seaweedfs".

Part "heartbeat" (heartbeat_sim.py) is a simulation, seconds of CPU, no CRIU: heartbeat = auto (the
real Settings and Cadence) against fixed intervals on a fleet of tasks under failures, with the
checkpoint and restore costs scaled from the figures the other parts measured (results.json).

Shared pieces are in harness.py, the table and results.* in report.py. Writes bench/results.json
and bench/results.md (a part that did not run keeps its previous results); prints the same table.
Needs root and CRIU >= 4 (CEDANA_CRIU, else the private prefix /opt/cedana-airflow/criu, else
PATH). See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for cedana_airflow

from harness import BENCH, machine, say  # noqa: E402
from local_freeze import bench_freeze  # noqa: E402
from local_restore import bench_restore  # noqa: E402
from local_store import bench_store  # noqa: E402
from report import PARTS, details, merge_results, previous_results, table_rows, text_table, write_results  # noqa: E402

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings  # noqa: E402
from cedana_airflow.engine.criu import CriuEngine, find_criu  # noqa: E402


def parse_only(text: str) -> list[str]:
    out: set[str] = set()
    for word in (w.strip() for w in text.split(",")):
        if word in ("all", ""):
            out |= set(PARTS)
        elif word == "s3":
            out |= {"s3-transfer", "s3-listing"}
        elif word == "seaweedfs":
            out |= {"seaweedfs-transfer", "seaweedfs-listing", "seaweedfs-lazy"}
        elif word in PARTS:
            out.add(word)
        else:
            raise argparse.ArgumentTypeError(f"unknown part {word!r}; choose from all, local, s3, {', '.join(PARTS[1:])}")
    return [p for p in PARTS if p in out]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", type=parse_only, default=list(PARTS),
                    help="run only these parts, comma-separated: local, lazy, lazy-growth, lazy-freeze, talkers, agent, agent-cooperative, "
                         "cooperative, s3 (= s3-transfer,"
                         "s3-listing; moto's server), s3-transfer, s3-listing, seaweedfs (= seaweedfs-transfer, seaweedfs-listing, seaweedfs-lazy: "
                         "the same on SeaweedFS, a real S3 server), heartbeat, plugin (default: all); the others keep their "
                         "previous results in bench/results.*")
    ap.add_argument("--mb", type=int, default=1024, help="workload state size in MB (default 1024; 200 for a quick run)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions for freeze and restore (default 5)")
    ap.add_argument("--job-mb", type=int, default=64, help="the job part: each part's tree, in MiB (default 64)")
    ap.add_argument("--agent-mb", type=int, default=256,
                    help="the agent part's workload size in MB (default 256: each of its runs takes two heartbeats)")
    ap.add_argument("--s3-reps", type=int, default=1,
                    help="repetitions (interleaved, ours last) of the S3 first checkpoint and restore; default 1 "
                         "keeps the S3 part near 6 minutes, each more adds about a minute")
    ap.add_argument("--s3-naive-defaults", action="store_true",
                    help="also time the naive S3 restore with boto3's default download_file (ranged GETs; about "
                         "2 minutes more on moto for 1 GB)")
    ap.add_argument("--listing-ids", type=int, default=1000, help="checkpoint IDs in the listing benchmark (default 1000)")
    ap.add_argument("--listing-seqs", type=int, default=10, help="checkpoints per ID in the listing benchmark (default 10)")
    ap.add_argument("--heartbeat-tasks", type=int, default=1000,
                    help="simulated tasks per failure rate in the heartbeat part (default 1000, about 8 s)")
    ap.add_argument("--heartbeat-seed", type=int, default=20261203, help="the heartbeat simulation's seed")
    ap.add_argument("--lazy-freeze-mb", type=int, default=256,
                    help="workload state size in MB of the lazy-freeze part (default 256: it runs 7 copies, about a minute)")
    ap.add_argument("--lazy-freeze-rounds", type=int, default=5,
                    help="heartbeats of each tree in the lazy-freeze part (default 5)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                    help="do not touch fresh memory before each timed restore (see prewarm() in bench/harness.py)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/results.* alone")
    return ap.parse_args()


def run_local(engine: CriuEngine, settings: Settings, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    freeze = bench_freeze(engine, args.mb, args.reps, work)
    # the heartbeat workload steps less often than a dump lasts (see local_store.py)
    step_seconds = round(max(1.0, 2.5 * freeze["wall"]["ours_seconds"] + 0.3), 1)
    store_res, stored = bench_store(engine, args.mb, work, settings, step_seconds)
    restore_res = bench_restore(engine, stored, settings, args.reps, work, step_seconds, args.prewarm)
    return {"freeze": freeze, "store": store_res, "restore": restore_res}


class Parts:
    """Runs the chosen parts in order, recording when each ran, with which arguments, for how long."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.info: dict[str, dict[str, Any]] = {}

    def run(self, part: str, bench: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        result = bench()
        self.info[part] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "args": vars(self.args),
                           "seconds": time.monotonic() - t0}
        say(f"{part}: {self.info[part]['seconds']:.0f} s")
        return result


def run_parts(parts: Parts, engine: CriuEngine, settings: Settings, work: Path) -> dict[str, Any]:
    """The results of the parts in ``--only``. The S3 modules are imported only when an S3 part runs:
    they need boto3 and moto, which the local part does not."""
    args = parts.args
    new: dict[str, Any] = {}
    if "local" in args.only:
        new.update(parts.run("local", lambda: run_local(engine, settings, args, work)))
    if "lazy" in args.only:
        from lazy_restore import bench_lazy

        new.update(parts.run("lazy", lambda: bench_lazy(engine, args.mb, args.reps, work, settings, args.prewarm)))
    if "lazy-growth" in args.only:
        from lazy_growth import bench_growth

        new.update(parts.run("lazy-growth", lambda: bench_growth(engine, args.reps, work, settings, args.prewarm)))
    if "lazy-freeze" in args.only:
        from lazy_freeze import bench_lazy_freeze

        new.update(parts.run("lazy-freeze", lambda: bench_lazy_freeze(engine, args.lazy_freeze_mb, args.lazy_freeze_rounds,
                                                                      work, settings)))
    if "talkers" in args.only:
        from talkers import bench_talkers

        new.update(parts.run("talkers", lambda: bench_talkers(engine, args.reps, work)))
    if "job" in args.only:
        from jobs import bench_jobs

        (work / "job").mkdir(exist_ok=True)
        new.update(parts.run("job", lambda: bench_jobs(args.job_mb, max(3, args.reps), work / "job")))
    if "agent" in args.only:
        from agent import bench_agent

        new.update(parts.run("agent", lambda: bench_agent(args.agent_mb, args.reps, work)))
    if "agent-cooperative" in args.only:
        from agent_coop import bench_agent_coop

        new.update(parts.run("agent-cooperative", lambda: bench_agent_coop(args.agent_mb, max(2, args.reps // 2), work)))
    if "cooperative" in args.only:
        from cooperative import bench_cooperative

        new.update(parts.run("cooperative", lambda: bench_cooperative(args.mb, max(2, args.reps), work)))
    s3_new: dict[str, Any] = {}
    for key, kind, transfer, listing in (("s3", "moto", "s3-transfer", "s3-listing"),
                                         ("s3_seaweedfs", "seaweedfs", "seaweedfs-transfer", "seaweedfs-listing")):
        if transfer not in args.only and listing not in args.only:
            continue
        import s3_server
        from s3_listing import bench_listing
        from s3_transfer import bench_transfer

        s3_server.KIND = kind
        where = work / kind  # each server's parts in a folder of their own (the listing part makes fixed names)
        where.mkdir(exist_ok=True)
        got: dict[str, Any] = {}
        if transfer in args.only:
            got.update(parts.run(transfer, lambda: bench_transfer(engine, args.mb, args.s3_reps, where,
                                                                  args.prewarm, args.s3_naive_defaults)))
        if listing in args.only:
            got["listing"] = parts.run(listing, lambda: bench_listing(where, args.listing_ids, args.listing_seqs))
        s3_server.KIND = "moto"
        new[key] = got
        if key == "s3":
            s3_new = got
    if "seaweedfs-lazy" in args.only:
        import s3_server
        from lazy_restore import bench_lazy

        s3_server.KIND = "seaweedfs"
        (work / "seaweedfs-lazy").mkdir(exist_ok=True)
        new["lazy_seaweedfs"] = parts.run("seaweedfs-lazy", lambda: bench_lazy(
            engine, args.mb, args.reps, work / "seaweedfs-lazy", settings, args.prewarm, wheres=("s3",)))["lazy"]
        s3_server.KIND = "moto"
    if "plugin" in args.only:
        from plugin_import import bench_plugin

        new.update(parts.run("plugin", lambda: bench_plugin(max(5, args.reps))))
    if "heartbeat" in args.only:
        from heartbeat_sim import bench_heartbeat

        # its costs are the measured figures: this run's over those results.json keeps
        figures = previous_results()
        figures.update({k: v for k, v in new.items() if k not in ("s3", "s3_seaweedfs")})
        figures["s3"] = {**(figures.get("s3") or {}), **s3_new}
        figures["parts"] = {**figures.get("parts", {}), **parts.info}
        new.update(parts.run("heartbeat", lambda: bench_heartbeat(figures, args.heartbeat_tasks, args.heartbeat_seed)))
    return new


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0 and ({"local", "lazy", "lazy-growth", "lazy-freeze", "talkers", "job", "agent", "agent-cooperative",
                                 "s3-transfer", "seaweedfs-transfer", "seaweedfs-lazy"} & set(args.only)):
        print("bench/run.py needs root (CRIU uses CAP_SYS_ADMIN and ptrace); run it with sudo.", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    settings = Settings()  # the shipped defaults (chunk size, compression, retention): what is benchmarked
    engine = CriuEngine(find_criu(os.environ.get("CEDANA_CRIU", ""), Path(DEFAULT_CRIU_PREFIX)))
    work = Path(tempfile.mkdtemp(prefix="cedana-bench-"))
    say(f"CRIU {engine.version} ({engine.binary.path}); work dir {work}; parts: {', '.join(args.only)}")
    parts = Parts(args)
    try:
        new = run_parts(parts, engine, settings, work)
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    res = merge_results(previous_results() if set(args.only) != set(PARTS) else {}, new, args.only)
    res.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "criu_version": engine.version, "args": vars(args),
        "total_seconds": time.monotonic() - t_start,
        "parts": {**res.get("parts", {}), **parts.info},
    })
    res["parts"] = {p: res["parts"][p] for p in PARTS if p in res["parts"]}
    print()
    print(text_table(table_rows(res)))
    print()
    for line in details(res):
        print(line)
    if not args.no_write:
        write_results(res)
        print(f"\nwrote {BENCH / 'results.json'} and {BENCH / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
