"""cedana-airflow benchmarks: ratios against baselines measured in the same run.

    .venv/bin/python bench/run.py [--only local|s3|s3-transfer|s3-listing] [--mb 1024] [--reps 5]
                                  [--s3-reps 2] [--s3-naive-defaults] [--keep] [--no-write] [--no-prewarm]

Local benchmarks (part "local"), each on tests/workloads/train.py (numpy state, ~1% rewritten per
step), run as a managed workload (own PID namespace, pipes for stdout/stderr):

1. freeze:  CRIU's frozen time of our engine's heartbeat dump (CriuEngine.dump, with the capture
            action script) vs a bare ``criu dump --leave-running`` of the same process to the same
            disk.                                                       target <= 1.15x
2. store:   bytes that heartbeats 2..4 add to a file:// store vs their image bytes, with ~1% of
            the state rewritten between heartbeats.                     target <= 3%
3. restore: Checkpointer.restore() (fetch + verify + criu restore + adopt) from the local store vs
            a bare ``criu restore`` of a plain image directory of the same checkpoint.
                                                                        target <= 1.3x

S3 benchmarks (parts "s3-transfer" and "s3-listing", both "s3"; bench/s3.py) against moto's S3
server on loopback: first checkpoint, heartbeats 2-4, restore, and listing 1,000 IDs x 10.

Writes bench/results.json and bench/results.md (a part that did not run keeps its previous results);
prints the same table. Needs root and CRIU >= 4 (CEDANA_CRIU, else the private prefix
/opt/cedana-airflow/criu, else PATH). See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from cedana_airflow.run import checkpointer as checkpointer_mod  # noqa: E402
from cedana_airflow.run.checkpointer import Checkpointer  # noqa: E402
from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings  # noqa: E402
from cedana_airflow.engine.capture import CaptureOnFreeze  # noqa: E402
from cedana_airflow.engine.criu import CriuEngine, find_criu  # noqa: E402
from cedana_airflow.engine.images import image_entries, read_dump_stats  # noqa: E402
from cedana_airflow.format.manifest import Manifest  # noqa: E402
from cedana_airflow.store import open_store  # noqa: E402
from cedana_airflow.run.workload import Workload, become_subreaper  # noqa: E402

# bench/s3.py imports this module as "run"; when it runs as a script, that must be this very module
sys.modules.setdefault("run", sys.modules[__name__])

TRAIN = REPO / "tests" / "workloads" / "train.py"
MB = 1 << 20

TARGETS = {"freeze": 1.15, "store": 0.03, "restore": 1.30}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class StepSink:
    """A stream for a workload's stdout: remembers the last 'step N/M' line and wakes waiters."""

    _STEP = re.compile(rb"^step (\d+)/")

    def __init__(self) -> None:
        self.step = 0
        self.lines = 0
        self._buf = b""
        self._cond = threading.Condition()

    def write(self, data: bytes) -> int:
        with self._cond:
            self._buf += data
            *done, self._buf = self._buf.split(b"\n")
            for line in done:
                self.lines += 1
                m = self._STEP.match(line)
                if m:
                    self.step = int(m.group(1))
            self._cond.notify_all()
        return len(data)

    def flush(self) -> None:
        pass

    def wait_step(self, above: int, timeout: float) -> int:
        """Wait until a step greater than ``above`` was printed; return it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.step <= above:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"workload printed no step after {above} within {timeout:.0f}s")
                self._cond.wait(left)
            return self.step


class TailSink:
    """Keeps the last few KB of a stream (the workload's stderr, for error messages)."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> int:
        self.data = (self.data + data)[-4096:]
        return len(data)

    def flush(self) -> None:
        pass


class TimedEngine(CriuEngine):
    """Our CriuEngine, recording how long each dump and restore took and optionally running a hook after a dump."""

    def __init__(self, binary: Any) -> None:
        super().__init__(binary)
        self.restore_seconds: list[float] = []
        self.dump_seconds: list[float] = []
        self.after_dump: Callable[[], None] | None = None
        self.before_restore: Callable[[], None] | None = None  # runs untimed, right before criu restore

    def dump(self, *a: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        r = super().dump(*a, **kw)
        self.dump_seconds.append(time.monotonic() - t0)
        if self.after_dump:
            self.after_dump()
        return r

    def restore(self, *a: Any, **kw: Any) -> int:
        if self.before_restore:
            self.before_restore()
        t0 = time.monotonic()
        try:
            return super().restore(*a, **kw)
        finally:
            self.restore_seconds.append(time.monotonic() - t0)


def start_workload(mb: int, step_seconds: float, change_fraction: float, cwd: Path) -> tuple[Workload, StepSink, TailSink]:
    out, err = StepSink(), TailSink()
    cmd = [sys.executable, str(TRAIN), "--mb", str(mb), "--steps", "1000000",
           "--step-seconds", str(step_seconds), "--change-fraction", str(change_fraction)]
    w = Workload.start(cmd, cwd=str(cwd), stdout=out, stderr=err)  # type: ignore[arg-type]
    try:
        out.wait_step(0, timeout=120 + mb / 10)  # allocation done, first step taken
    except TimeoutError:
        kill(w)
        raise SystemExit(f"workload did not start: {err.data.decode(errors='replace')[-500:]}")
    return w, out, err


def kill(w: Workload) -> None:
    try:
        os.kill(w.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    w.wait(timeout=60)


def drop_dir(p: Path) -> None:
    """Remove a dump directory and its siblings (logs, scripts), then flush dirty pages, untimed."""
    for q in [p, *p.parent.glob(p.name + ".*")]:
        shutil.rmtree(q, ignore_errors=True) if q.is_dir() else q.unlink(missing_ok=True)
    os.sync()


def dump_stats(image_dir: Path) -> dict[str, float]:
    """CRIU's dump statistics: seconds for the times, counts for the pages."""
    return read_dump_stats(image_dir)


_BLOCK = b"\1" * (64 * MB)


def prewarm(nbytes: int) -> float:
    """Touch ``nbytes`` of fresh anonymous memory and free it again; return the seconds it took.

    On a VM with free page reporting (virtio-balloon; this Firecracker guest reports free 8 MB
    blocks to the host after ~2 s), memory the guest freed a while ago costs a host fault per page
    when it is touched again: restoring 1 GB into such memory took 2-3 s instead of 1 s here. Each
    timed run starts right after this, so every run gets host-backed memory and none is charged
    for the VM's memory management.
    """
    import mmap

    t0 = time.monotonic()
    m = mmap.mmap(-1, nbytes)
    try:
        for off in range(0, nbytes - len(_BLOCK) + 1, len(_BLOCK)):
            m.write(_BLOCK)
    finally:
        m.close()
    return time.monotonic() - t0


_PE_PRESENT = 4


def memory_pages(image_dir: Path) -> dict[tuple[str, int], tuple[Path, int]]:
    """(pagemap file, page address) -> (pages file, offset) for every page stored in a dump."""
    out: dict[tuple[str, int], tuple[Path, int]] = {}
    for pm in sorted(image_dir.glob("pagemap-*.img")):
        head, *entries = image_entries(pm)
        pages = image_dir / f"pages-{head.get(1, 1)}.img"
        off = 0
        for e in entries:
            va, nr, flags = int(e.get(1, 0)), int(e.get(2, 0)), e.get(4)
            present = (int(flags) & _PE_PRESENT) if flags is not None else not e.get(3, 0)
            if not present:
                continue
            for k in range(nr):
                out[(pm.name, va + k * 4096)] = (pages, off)
                off += 4096
    return out


def changed_memory(prev_dir: Path, cur_dir: Path) -> tuple[int, int]:
    """Bytes of memory pages that differ (or are new) between two dumps of the same process tree,
    and the number of contiguous runs they form."""
    a, b = memory_pages(prev_dir), memory_pages(cur_dir)
    data = {p: p.read_bytes() for p in {v[0] for v in a.values()} | {v[0] for v in b.values()}}
    changed, runs, last = 0, 0, None
    for key in sorted(b):
        pb, ob = b[key]
        old = a.get(key)
        differs = old is None or data[old[0]][old[1] : old[1] + 4096] != data[pb][ob : ob + 4096]
        if differs:
            changed += 4096
            if last != (key[0], key[1] - 4096):
                runs += 1
            last = key
    return changed, runs


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"kernel": platform.release(), "cpu": cpu, "cores": os.cpu_count(),
            "ram_gib": round(ram / (1 << 30), 1), "hostname": socket.gethostname()}


# --------------------------------------------------------------------------------------------
# 1. freeze time per heartbeat
# --------------------------------------------------------------------------------------------
def bench_freeze(engine: CriuEngine, mb: int, reps: int, work: Path) -> dict[str, Any]:
    say(f"freeze: starting a {mb} MB workload")
    w, out, _ = start_workload(mb, step_seconds=0.2, change_fraction=0.01, cwd=work)
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "ours": []}
    try:
        def bare(d: Path) -> float:
            log = d.with_name(d.name + ".dump.log")
            cmd = [engine.binary.path, "dump", "-t", str(w.pid), "-D", str(d), "--leave-running",
                   "--file-locks", "-o", str(log)]
            d.mkdir(parents=True)
            t0 = time.monotonic()
            p = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.monotonic() - t0
            if p.returncode != 0:
                raise SystemExit(f"bare criu dump failed (exit {p.returncode}); see {log}")
            return wall

        def ours(d: Path) -> float:
            t0 = time.monotonic()
            engine.dump(w.pid, d, leave_running=True)
            return time.monotonic() - t0

        kinds = {"bare": bare, "ours": ours}
        # one untimed dump of each first: CRIU, the loader and the capture module warm in the page cache
        for name, fn in kinds.items():
            d = work / f"freeze-warmup-{name}"
            fn(d)
            drop_dir(d)
        for rep in range(reps):
            order = ["bare", "ours"] if rep % 2 == 0 else ["ours", "bare"]
            for name in order:
                out.wait_step(out.step, timeout=30)  # dump just after a step, like any other moment
                d = work / f"freeze-{name}-{rep}"
                wall = kinds[name](d)
                st = dump_stats(d)
                img = dir_bytes(d)
                runs[name].append({"wall": wall, "image_bytes": img, **st})
                say(f"  {name:4} rep {rep}: frozen {st.get('frozen', float('nan')):.3f}s "
                    f"(memdump {st.get('memdump', 0):.3f} memwrite {st.get('memwrite', 0):.3f}) wall {wall:.3f}s "
                    f"image {img / MB:.0f} MB")
                drop_dir(d)
        # the engine's action script alone (it runs while the tree is frozen), outside CRIU: the
        # script's FIFO handshake with the supervisor, which copies the open files meanwhile
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
    finally:
        kill(w)

    def agg(name: str, key: str) -> float:
        return med([r[key] for r in runs[name] if key in r])

    summary = {name: {k: agg(name, k) for k in ("frozen", "freezing", "memdump", "memwrite", "wall", "image_bytes")}
               for name in runs}
    base, ours_ = summary["bare"]["frozen"], summary["ours"]["frozen"]
    ratio = ours_ / base
    return {
        "name": "freeze time per heartbeat",
        "baseline": "bare criu dump --leave-running --file-locks",
        "baseline_seconds": base, "ours_seconds": ours_, "ratio": ratio, "target": TARGETS["freeze"],
        "pass": ratio <= TARGETS["freeze"],
        "wall": {"baseline_seconds": summary["bare"]["wall"], "ours_seconds": summary["ours"]["wall"],
                 "ratio": summary["ours"]["wall"] / summary["bare"]["wall"]},
        "median": summary, "capture_script_alone_seconds": med(cap_times),
        "image_mb": summary["bare"]["image_bytes"] / MB, "runs": runs,
    }


# --------------------------------------------------------------------------------------------
# 2. bytes stored per heartbeat  +  3. restore time (same workload, same store)
# --------------------------------------------------------------------------------------------
def bench_store_and_restore(engine: TimedEngine, mb: int, reps: int, work: Path, settings: Settings,
                            step_seconds: float, warm: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    store_dir = work / "store"
    store = open_store(f"file://{store_dir}")
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    node = socket.gethostname()
    cid = "bench-heartbeats"
    change = 0.01  # one step rewrites 1% of the state; heartbeats are exactly one step apart
    # keep_local: each heartbeat's dump stays until the next one is compared with it page by page
    cp = Checkpointer(engine, store, cfg, cid, node=node, work_dir=work / "cp-work",
                      compression=settings.compression, keep_local=True)
    kept: list[Path] = []

    def newest_dump() -> Path:
        # The checkpointer dumps into dump-*/images (its log and captured files beside images/).
        dumps = [d for d in (work / "cp-work").glob("dump-*") if d.is_dir() and d not in kept]
        if len(dumps) != 1:
            raise SystemExit(f"expected one new dump directory in {work / 'cp-work'}, found {dumps}")
        kept.append(dumps[0])
        return dumps[0] / "images"

    (work / "cp-work").mkdir()
    say(f"store: starting a {mb} MB workload (change fraction {change} per step, a step every {step_seconds:.1f}s)")
    w, out, _ = start_workload(mb, step_seconds=step_seconds, change_fraction=change, cwd=work)
    beats: list[dict[str, Any]] = []
    steps_at: list[int] = []
    prev: Manifest | None = None
    try:
        # Heartbeats are taken right after a step line, and the workload is stopped (SIGSTOP) while
        # the harness uploads: exactly one step (change x state) lies between two heartbeats however
        # long the upload takes. The step period is longer than a dump, so no step lands between
        # the end of the freeze and the SIGSTOP. CRIU itself never sees a stopped process.
        engine.after_dump = lambda: os.kill(w.pid, signal.SIGSTOP)
        for i in range(4):
            s = out.wait_step(steps_at[-1] if steps_at else out.step, timeout=60)
            t0 = time.monotonic()
            try:
                m = cp.checkpoint(w)
                secs = time.monotonic() - t0
                stepped = out.step != s
                # compared while the workload is still stopped, so the comparison costs it no step
                d = newest_dump()
                changed, changed_runs = changed_memory(kept[-2] / "images", d) if len(kept) > 1 else (None, None)
                if len(kept) > 1:
                    drop_dir(kept[-2])
            finally:
                os.kill(w.pid, signal.SIGCONT)
            if stepped:
                say(f"  warning: the workload stepped during the dump ({s} -> {out.step}); "
                    "this heartbeat's delta is uncertain")
            steps_at.append(s)
            # raw bytes of chunks new since the previous heartbeat, by image file (pages-*.img is memory)
            by_file: dict[str, int] = {}
            runs_by_file: dict[str, int] = {}  # runs of consecutive new chunks: how scattered the change is
            if prev is not None:
                old = prev.chunk_digests()
                for f in m.files:
                    new = [c.digest not in old for c in f.chunks]
                    n = sum(c.size for c, is_new in zip(f.chunks, new) if is_new)
                    if n:
                        by_file[f.name] = n
                        runs_by_file[f.name] = sum(1 for j, x in enumerate(new) if x and (j == 0 or not new[j - 1]))
            prev = m
            beats.append({"seq": m.seq, "image_bytes": m.image_bytes, "stored_bytes": m.stored_bytes,
                          "new_chunks": m.new_chunks, "chunks": len(m.chunk_digests()),
                          "freeze_seconds": m.freeze_seconds, "seconds": secs,
                          "steps_since_previous": None if i == 0 else steps_at[i] - steps_at[i - 1],
                          "stepped_during_dump": stepped,
                          "changed_memory_bytes": changed, "changed_memory_runs": changed_runs,
                          "ratio": m.stored_bytes / m.image_bytes, "new_raw_bytes_by_file": by_file,
                          "new_chunk_runs_by_file": runs_by_file})
            say(f"  heartbeat {m.seq} at step {s}: image {m.image_bytes / MB:.1f} MB, stored "
                f"{m.stored_bytes / MB:.2f} MB ({100 * m.stored_bytes / m.image_bytes:.2f}%), "
                f"{m.new_chunks} new chunks, dump+store {secs:.1f}s"
                + (f"; memory changed since the previous: {changed / MB:.2f} MB in {changed_runs} runs"
                   if changed is not None else "")
                + (f"; new raw MB by file: " + ", ".join(f"{k} {v / MB:.2f} ({runs_by_file[k]} runs)" for k, v in by_file.items()) if by_file else ""))
        engine.after_dump = None
        later = beats[1:]
        worst = max(b["ratio"] for b in later)
        store_res = {
            "name": "bytes stored per heartbeat (2nd and later)",
            "baseline": "image bytes of the same heartbeat",
            "change_fraction_between_heartbeats": change * med([b["steps_since_previous"] for b in later]),
            "changed_memory_fraction": max(b["changed_memory_bytes"] / b["image_bytes"] for b in later),
            "stored_per_changed_byte": max(b["stored_bytes"] / b["changed_memory_bytes"] for b in later),
            "exactly_one_step_between": all(b["steps_since_previous"] == 1 and not b["stepped_during_dump"]
                                            for b in later) and not beats[0]["stepped_during_dump"],
            "step_seconds": step_seconds,
            "baseline_bytes": max(b["image_bytes"] for b in later),
            "ours_bytes": max(b["stored_bytes"] for b in later),
            "ratio": worst, "ratio_mean": sum(b["stored_bytes"] for b in later) / sum(b["image_bytes"] for b in later),
            "first_ratio": beats[0]["ratio"], "target": TARGETS["store"], "pass": worst <= TARGETS["store"],
            "chunk_avg_bytes": cfg.chunk_avg_bytes, "compression": settings.compression, "heartbeats": beats,
        }

        # The checkpoint both restores use: one dump, kept as a plain directory AND stored.
        drop_dir(kept[-1])
        out.wait_step(out.step, timeout=60)
        final = cp.checkpoint(w, leave_running=False)  # CRIU ends the tree after dumping it
        plain = newest_dump()
        w.wait(timeout=60)
        say(f"restore: checkpoint seq {final.seq} ({final.image_bytes / MB:.0f} MB image) kept in {plain.name} and stored")
    finally:
        engine.after_dump = None
        if w.poll() is None:
            kill(w)

    restore_res = bench_restore(engine, store, cfg, cid, node, plain, final, reps, work, step_seconds,
                                None if warm else 0)
    return store_res, restore_res


class Timed:
    """Wraps a module-level function of cedana_airflow.run.checkpointer (in a ``with``) and records how long each call took."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds: list[float] = []
        self._real: Callable[..., Any] = getattr(checkpointer_mod, name)

    def __enter__(self) -> Timed:
        real = self._real

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.monotonic()
            try:
                return real(*a, **kw)
            finally:
                self.seconds.append(time.monotonic() - t0)

        setattr(checkpointer_mod, self.name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(checkpointer_mod, self.name, self._real)


def bench_restore(engine: TimedEngine, store: Any, cfg: Any, cid: str, node: str, plain: Path,
                  final: Manifest, reps: int, work: Path, step_seconds: float,
                  warm_bytes: int | None = None) -> dict[str, Any]:
    """``warm_bytes``: memory to touch (prewarm) before each timed run; None = 2.5x the image, 0 = none."""
    if warm_bytes is None:
        warm_bytes = int(2.5 * final.image_bytes)
    become_subreaper()
    fetches = Timed("fetch_checkpoint")
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "ours": []}
    live: list[Workload] = []  # restored trees not yet killed (killed on the way out, whatever happens)

    def check_alive(w: Workload, sink: StepSink, what: str) -> None:
        try:
            sink.wait_step(sink.step, timeout=step_seconds + 30)  # the restored workload runs on (untimed)
        except TimeoutError:
            kill(w)
            raise SystemExit(f"{what}: the restored workload printed no step for {step_seconds + 30:.0f}s")

    def bare(rep: int) -> None:
        pidfile = work / f"bare-restore-{rep}.pid"
        pidfile.unlink(missing_ok=True)
        sink = StepSink()
        t0 = time.monotonic()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = CriuEngine.restore(engine, plain, inherit={out_w: final.process.stdout_pipe,
                                                             err_w: final.process.stderr_pipe}, pidfile=pidfile)
        finally:
            os.close(out_w)
            os.close(err_w)
        secs = time.monotonic() - t0
        w = Workload.adopt(pid, final.process.command, final.process.cwd, out_r, err_r, sink, TailSink())  # type: ignore[arg-type]
        live.append(w)
        check_alive(w, sink, "bare restore")
        kill(w)
        runs["bare"].append({"seconds": secs})

    def ours(rep: int) -> None:
        sink = StepSink()
        rw = work / f"ours-restore-{rep}"
        rw.mkdir()
        c = Checkpointer(engine, store, cfg, cid, node=node, work_dir=rw)
        n_f, n_r = len(fetches.seconds), len(engine.restore_seconds)
        t0 = time.monotonic()
        restored = c.restore(sink, TailSink())  # type: ignore[arg-type]
        secs = time.monotonic() - t0
        live.append(restored.workload)
        assert restored.manifest.seq == final.seq, (restored.manifest.seq, final.seq)
        check_alive(restored.workload, sink, "Checkpointer.restore")
        kill(restored.workload)
        fetch = sum(fetches.seconds[n_f:])
        criu = sum(engine.restore_seconds[n_r:])
        runs["ours"].append({"seconds": secs, "fetch": fetch, "criu_restore": criu, "other": secs - fetch - criu})
        shutil.rmtree(rw, ignore_errors=True)

    kinds: dict[str, Callable[[int], None]] = {"bare": bare, "ours": ours}
    names = list(kinds)
    try:
        with fetches:
            for rep in range(reps):
                for name in names[rep % len(names):] + names[: rep % len(names)]:  # rotate who goes first
                    os.sync()  # untimed: no run starts with another's writeback pending
                    warm = prewarm(warm_bytes) if warm_bytes else 0.0  # untimed: see prewarm()
                    kinds[name](rep)
                    r = runs[name][-1]
                    r["prewarm_seconds"] = warm
                    extra = (f" (fetch+verify {r['fetch']:.2f}s, criu restore {r['criu_restore']:.2f}s, "
                             f"other {r['other']:.2f}s)") if "fetch" in r else ""
                    say(f"  {name:10} rep {rep}: {r['seconds']:.2f}s{extra}")
    finally:
        for w in live:
            if w.poll() is None:
                kill(w)
    base = med([r["seconds"] for r in runs["bare"]])
    ours_ = med([r["seconds"] for r in runs["ours"]])
    return {
        "name": "restore from the local store",
        "baseline": "bare criu restore -d of a plain image directory (same checkpoint)",
        "baseline_seconds": base, "ours_seconds": ours_, "ratio": ours_ / base, "target": TARGETS["restore"],
        "pass": ours_ / base <= TARGETS["restore"],
        "ours_breakdown_median": {k: med([r[k] for r in runs["ours"]]) for k in ("fetch", "criu_restore", "other")},
        "image_mb": final.image_bytes / MB,
        "note": "both read from a warm page cache (the checkpoint was just written); nothing was dropped; "
                "os.sync() before each run" + ("; memory prewarmed before each run" if warm_bytes else ""),
        "runs": runs,
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
PARTS = ("local", "s3-transfer", "s3-listing")
PART_KEYS = {"local": ("freeze", "store", "restore")}  # top-level result keys of the local part


def parse_only(text: str) -> list[str]:
    out: set[str] = set()
    for word in (w.strip() for w in text.split(",")):
        if word in ("all", ""):
            out |= set(PARTS)
        elif word == "s3":
            out |= {"s3-transfer", "s3-listing"}
        elif word in PARTS:
            out.add(word)
        else:
            raise argparse.ArgumentTypeError(f"unknown part {word!r}; choose from all, local, s3, {', '.join(PARTS[1:])}")
    return [p for p in PARTS if p in out]


def table_rows(res: dict[str, Any]) -> list[list[str]]:
    ok = lambda b: "PASS" if b else "MISS"  # noqa: E731
    rows: list[list[str]] = []
    if "freeze" in res:
        f, s, r = res["freeze"], res["store"], res["restore"]
        rows += [
            ["freeze per heartbeat (CRIU frozen time)", f"{f['baseline_seconds']:.3f} s", f"{f['ours_seconds']:.3f} s",
             f"{f['ratio']:.2f}x", f"<= {f['target']:.2f}x", ok(f["pass"])],
            ["  (wall time of the dump call, info)", f"{f['wall']['baseline_seconds']:.3f} s",
             f"{f['wall']['ours_seconds']:.3f} s", f"{f['wall']['ratio']:.2f}x", "", ""],
            ["stored bytes, heartbeats 2-4 (worst)", f"{s['baseline_bytes'] / MB:.1f} MB image",
             f"{s['ours_bytes'] / MB:.2f} MB stored", f"{100 * s['ratio']:.2f}%", f"<= {100 * s['target']:.0f}%",
             ok(s["pass"])],
            ["restore (fetch+verify+criu restore)", f"{r['baseline_seconds']:.2f} s", f"{r['ours_seconds']:.2f} s",
             f"{r['ratio']:.2f}x", f"<= {r['target']:.2f}x", ok(r["pass"])],
        ]
    if res.get("s3"):
        import s3

        rows += s3.table_rows(res["s3"])
    return rows


HEAD = ["benchmark", "baseline", "ours", "ratio", "target", "result"]


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(x[i]) for x in [HEAD, *rows]) for i in range(len(HEAD))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(HEAD), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def local_details(res: dict[str, Any], args: dict[str, Any]) -> list[str]:
    f, s, r = res["freeze"], res["store"], res["restore"]
    fb, fo = f["median"]["bare"], f["median"]["ours"]
    lines = [
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
        + ("" if s["exactly_one_step_between"] else
           "; WARNING: not exactly one step between heartbeats (see results.json), the deltas are uncertain"),
        f"restore: image {r['image_mb']:.0f} MB; ours = fetch+verify {r['ours_breakdown_median']['fetch']:.2f} s + "
        f"criu restore {r['ours_breakdown_median']['criu_restore']:.2f} s + other {r['ours_breakdown_median']['other']:.2f} s; "
        f"{r['note']}",
    ]
    return lines


def details(res: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    parts = res.get("parts", {})
    if "freeze" in res:
        lines += local_details(res, parts.get("local", {}).get("args", res.get("args", {})))
    if res.get("s3"):
        import s3

        mb = parts.get("s3-transfer", {}).get("args", {}).get("mb")
        lines += s3.details(res["s3"], mb)
    return lines


def command_of(args: dict[str, Any], part: str) -> str:
    cmd = ["bench/run.py"]
    if args.get("only") and sorted(args["only"]) != sorted(PARTS):
        cmd.append(f"--only {','.join(args['only'])}")
    if part != "s3-listing":
        cmd.append(f"--mb {args['mb']}")
    if part == "local":
        cmd.append(f"--reps {args['reps']}")
    if part == "s3-transfer":
        cmd.append(f"--s3-reps {args['s3_reps']}")
        if args.get("s3_naive_defaults"):
            cmd.append("--s3-naive-defaults")
    if part == "s3-listing" and (args.get("listing_ids"), args.get("listing_seqs")) != (1000, 10):
        cmd.append(f"--listing-ids {args['listing_ids']} --listing-seqs {args['listing_seqs']}")
    if part != "s3-listing" and not args.get("prewarm", True):
        cmd.append("--no-prewarm")
    return " ".join(cmd)


PART_TITLES = {"local": "local (freeze, stored bytes, restore from file://)",
               "s3-transfer": "S3 first checkpoint, heartbeats, restore",
               "s3-listing": "S3 listing"}


def write_results(res: dict[str, Any]) -> None:
    (BENCH / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    rows = table_rows(res)
    m = res["machine"]
    md = [
        "# cedana-airflow benchmark results",
        "",
        f"Linux {m['kernel']}, {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; CRIU {res['criu_version']}.",
        "",
        *(f"- {PART_TITLES[p]}: run {info['date']} with `{command_of(info['args'], p)}`, {info['seconds']:.0f} s"
          for p, info in res.get("parts", {}).items()),
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "|".join("---" for _ in HEAD) + "|",
        *("| " + " | ".join(c or " " for c in row) + " |" for row in rows),
        "",
        *(f"- {line}" for line in details(res)),
        "",
    ]
    (BENCH / "results.md").write_text("\n".join(md))


def previous_results() -> dict[str, Any]:
    """bench/results.json as the last run left it, with per-part run info (older files had one run)."""
    try:
        old = json.loads((BENCH / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if "parts" not in old and "freeze" in old:
        old["parts"] = {"local": {"date": old.get("date"), "args": old.get("args", {}),
                                  "seconds": old.get("total_seconds", 0.0)}}
    return old


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", type=parse_only, default=list(PARTS),
                    help="run only these parts, comma-separated: local, s3 (= s3-transfer,s3-listing), s3-transfer, "
                         "s3-listing (default: all); the others keep their previous results in bench/results.*")
    ap.add_argument("--mb", type=int, default=1024, help="workload state size in MB (default 1024; 200 for a quick run)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions for freeze and restore (default 5)")
    ap.add_argument("--s3-reps", type=int, default=1,
                    help="repetitions (interleaved, ours last) of the S3 first checkpoint and restore; default 1 "
                         "keeps the S3 part near 6 minutes, each more adds about a minute")
    ap.add_argument("--s3-naive-defaults", action="store_true",
                    help="also time the naive S3 restore with boto3's default download_file (ranged GETs; about "
                         "2 minutes more on moto for 1 GB)")
    ap.add_argument("--listing-ids", type=int, default=1000, help="checkpoint IDs in the listing benchmark (default 1000)")
    ap.add_argument("--listing-seqs", type=int, default=10, help="checkpoints per ID in the listing benchmark (default 10)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                    help="do not touch fresh memory before each timed restore (see prewarm())")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/results.* alone")
    args = ap.parse_args()
    if os.geteuid() != 0 and ("local" in args.only or "s3-transfer" in args.only):
        print("bench/run.py needs root (CRIU uses CAP_SYS_ADMIN and ptrace); run it with sudo.", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    settings = Settings()  # the shipped defaults (chunk size, compression): what is benchmarked
    engine = TimedEngine(find_criu(os.environ.get("CEDANA_CRIU", ""), Path(DEFAULT_CRIU_PREFIX)))
    work = Path(tempfile.mkdtemp(prefix="cedana-bench-"))
    say(f"CRIU {engine.version} ({engine.binary.path}); work dir {work}; parts: {', '.join(args.only)}")
    new: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}

    def done(part: str, t0: float) -> None:
        parts[part] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "args": vars(args),
                       "seconds": time.monotonic() - t0}
        say(f"{part}: {parts[part]['seconds']:.0f} s")

    try:
        if "local" in args.only:
            t0 = time.monotonic()
            freeze = bench_freeze(engine, args.mb, args.reps, work)
            # the heartbeat workload steps less often than a dump lasts (see bench_store_and_restore)
            step_seconds = round(max(1.0, 2.5 * freeze["wall"]["ours_seconds"] + 0.3), 1)
            store_res, restore_res = bench_store_and_restore(engine, args.mb, args.reps, work, settings, step_seconds,
                                                             args.prewarm)
            new.update(freeze=freeze, store=store_res, restore=restore_res)
            done("local", t0)
        if "s3-transfer" in args.only or "s3-listing" in args.only:
            import s3

            s3_new: dict[str, Any] = {}
            if "s3-transfer" in args.only:
                t0 = time.monotonic()
                s3_new.update(s3.bench_transfer(engine, args.mb, args.s3_reps, work, args.prewarm,
                                                args.s3_naive_defaults))
                done("s3-transfer", t0)
            if "s3-listing" in args.only:
                t0 = time.monotonic()
                s3_new["listing"] = s3.bench_listing(work, args.listing_ids, args.listing_seqs)
                done("s3-listing", t0)
            new["s3"] = s3_new
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    res = previous_results() if set(args.only) != set(PARTS) else {}
    old_s3 = res.get("s3") or {}
    if "s3" in new:
        if "s3-transfer" in args.only:  # the transfer part replaces its keys; a listing-only run keeps them
            old_s3 = {k: v for k, v in old_s3.items() if k == "listing"}
        new["s3"] = {**old_s3, **new["s3"]}
    res.update(new)
    res.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "criu_version": engine.version, "args": vars(args),
        "total_seconds": time.monotonic() - t_start,
        "parts": {**res.get("parts", {}), **parts},
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
