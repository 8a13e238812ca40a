"""Freeze time per heartbeat: CriuEngine.dump (with the capture action script) vs a bare
``criu dump --leave-running`` of the same process to the same disk.          target <= 1.15x

The figure is CRIU's own frozen time (``stats-dump``); the wall time of the dump call is reported too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import MB, StepSink, bare_dump, dir_bytes, drop_dir, kill, med, say, start_workload

from cedana_airflow.engine.capture import CaptureOnFreeze
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.engine.images import read_dump_stats
from cedana_airflow.run.workload import Workload

TARGET = 1.15
_KEYS = ("frozen", "freezing", "memdump", "memwrite", "wall", "image_bytes")

Dumper = Callable[[Path], float]  # dumps into a new directory, returns the wall seconds of the call


def bench_freeze(engine: CriuEngine, mb: int, reps: int, work: Path) -> dict[str, Any]:
    say(f"freeze: starting a {mb} MB workload")
    w, out, _ = start_workload(mb, step_seconds=0.2, change_fraction=0.01, cwd=work)
    try:
        kinds = _dumpers(engine, w)
        # one untimed dump of each first: CRIU, the loader and the capture module warm in the page cache
        for name, fn in kinds.items():
            d = work / f"freeze-warmup-{name}"
            fn(d)
            drop_dir(d)
        runs = _timed_dumps(kinds, out, reps, work)
        cap_times = _capture_script_alone(w, work)
    finally:
        kill(w)
    return _result(runs, cap_times)


def _dumpers(engine: CriuEngine, w: Workload) -> dict[str, Dumper]:
    def ours(d: Path) -> float:
        t0 = time.monotonic()
        engine.dump(w.pid, d, leave_running=True)
        return time.monotonic() - t0

    return {"bare": lambda d: bare_dump(engine, w.pid, d), "ours": ours}


def _timed_dumps(kinds: dict[str, Dumper], out: StepSink, reps: int, work: Path) -> dict[str, list[dict[str, float]]]:
    """``reps`` dumps of each kind, alternating which goes first, each right after a step line."""
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "ours": []}
    for rep in range(reps):
        order = ["bare", "ours"] if rep % 2 == 0 else ["ours", "bare"]
        for name in order:
            out.wait_step(out.step, timeout=30)  # dump just after a step, like any other moment
            d = work / f"freeze-{name}-{rep}"
            wall = kinds[name](d)
            st = read_dump_stats(d)  # CRIU's dump statistics: seconds for the times, counts for the pages
            img = dir_bytes(d)
            runs[name].append({"wall": wall, "image_bytes": img, **st})
            say(f"  {name:4} rep {rep}: frozen {st.get('frozen', float('nan')):.3f}s "
                f"(memdump {st.get('memdump', 0):.3f} memwrite {st.get('memwrite', 0):.3f}) wall {wall:.3f}s "
                f"image {img / MB:.0f} MB")
            drop_dir(d)
    return runs


def _capture_script_alone(w: Workload, work: Path) -> list[float]:
    """The engine's action script alone (it runs while the tree is frozen), outside CRIU: the
    script's FIFO handshake with the supervisor, which copies the open files meanwhile."""
    env = dict(os.environ, CRTOOLS_SCRIPT_ACTION="post-dump", CRTOOLS_INIT_PID=str(w.pid))
    cap_times = []
    for i in range(5):
        side = work / f"capture-alone-{i}"
        side.mkdir()
        with CaptureOnFreeze(side) as cap:
            t0 = time.monotonic()
            subprocess.run(["sh", str(cap.script)], env=env, check=True)
            cap_times.append(time.monotonic() - t0)
        shutil.rmtree(side, ignore_errors=True)
    return cap_times


def _result(runs: dict[str, list[dict[str, float]]], cap_times: list[float]) -> dict[str, Any]:
    summary = {name: {k: med([r[k] for r in runs[name] if k in r]) for k in _KEYS} for name in runs}
    base, ours = summary["bare"]["frozen"], summary["ours"]["frozen"]
    ratio = ours / base
    return {
        "name": "freeze time per heartbeat",
        "baseline": "bare criu dump --leave-running --file-locks",
        "baseline_seconds": base, "ours_seconds": ours, "ratio": ratio, "target": TARGET,
        "pass": ratio <= TARGET,
        "wall": {"baseline_seconds": summary["bare"]["wall"], "ours_seconds": summary["ours"]["wall"],
                 "ratio": summary["ours"]["wall"] / summary["bare"]["wall"]},
        "median": summary, "capture_script_alone_seconds": med(cap_times),
        "image_mb": summary["bare"]["image_bytes"] / MB, "runs": runs,
    }
