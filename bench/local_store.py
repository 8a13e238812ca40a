"""Bytes stored per heartbeat: what heartbeats 2..4 add to a file:// store vs their image bytes,
with ~1% of the state rewritten between heartbeats.                          target <= 3%

And the time to process each of those heartbeats (cut, hash, store; the dump excluded), in seconds
per GB of image, against the same image cut in full as before the segment memo (same run, same
page cache, same known chunks).                                              target <= 0.5 s/GB

It also diffs consecutive dumps page by page (how much memory really changed), and ends with the
checkpoint the local restore benchmark uses: one dump, kept as a plain directory AND stored.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from harness import MB, PhaseTimes, StepSink, StoredCheckpoint, drop_dir, kill, make_checkpointer, med, say, start_workload

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.engine.images import image_entries
from cedana_airflow.format.manifest import Manifest
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.run.workload import Workload
from cedana_airflow.store import open_store
from cedana_airflow.store.base import Store, StoreConfig
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint

TARGET = 0.03
TARGET_PROCESSING = 0.5  # seconds per GB of image
CHECKPOINT_ID = "bench-heartbeats"
CHANGE = 0.01  # one step rewrites 1% of the state; heartbeats are exactly one step apart


def bench_store(engine: CriuEngine, mb: int, work: Path, settings: Settings,
                step_seconds: float) -> tuple[dict[str, Any], StoredCheckpoint]:
    store = open_store(f"file://{work / 'store'}")
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    phases = PhaseTimes()
    # keep_local: each heartbeat's dump stays until the next one is compared with it page by page
    cp = make_checkpointer(engine, store, cfg, CHECKPOINT_ID, settings.model_copy(update={"keep_local": True}),
                           work / "cp-work", phases)
    dumps = _Dumps(work / "cp-work")
    say(f"store: starting a {mb} MB workload (change fraction {CHANGE} per step, a step every {step_seconds:.1f}s)")
    w, out, _ = start_workload(mb, step_seconds=step_seconds, change_fraction=CHANGE, cwd=work)
    try:
        # Heartbeats are taken right after a step line, and the workload is stopped (SIGSTOP) while
        # the harness uploads: exactly one step (change x state) lies between two heartbeats however
        # long the upload takes. The step period is longer than a dump, so no step lands between
        # the end of the freeze and the SIGSTOP. CRIU itself never sees a stopped process.
        with phases.after("dump", lambda: os.kill(w.pid, signal.SIGSTOP)):
            beats = _heartbeats(cp, w, out, dumps, phases, store, cfg, settings.compression)
        store_res = _result(beats, step_seconds, cfg, settings)
        final, plain = _final_checkpoint(cp, w, out, dumps)
    finally:
        if w.poll() is None:
            kill(w)
    return store_res, StoredCheckpoint(store, cfg, CHECKPOINT_ID, final, plain)


class _Dumps:
    """The checkpointer's dump directories (dump-*/images, its log and captured files beside images/),
    in the order they appeared."""

    def __init__(self, cp_work: Path) -> None:
        self.cp_work = cp_work
        self.kept: list[Path] = []

    def peek(self) -> Path:
        """The images of the dump that appeared last (not yet taken by newest())."""
        dumps = [d for d in self.cp_work.glob("dump-*") if d.is_dir() and d not in self.kept]
        if len(dumps) != 1:
            raise SystemExit(f"expected one new dump directory in {self.cp_work}, found {dumps}")
        return dumps[0] / "images"

    def newest(self) -> Path:
        """The images of the dump that appeared last, taken: the next one is a later dump."""
        images = self.peek()
        self.kept.append(images.parent)
        return images


def _heartbeats(cp: Checkpointer, w: Workload, out: StepSink, dumps: _Dumps, phases: PhaseTimes, store: Store,
                cfg: StoreConfig, compression: str) -> list[dict[str, Any]]:
    """Four heartbeats, each right after the next step line (the workload stops after each dump)."""
    beats: list[dict[str, Any]] = []
    steps_at: list[int] = []
    prev: Manifest | None = None
    for i in range(4):
        s = out.wait_step(steps_at[-1] if steps_at else out.step, timeout=60)
        phases.reset()
        t0 = time.monotonic()
        try:
            m = cp.checkpoint(w)
            secs = time.monotonic() - t0
            stepped = out.step != s
            # the same image again, cut in full, while the workload is still stopped
            full_cut = _full_cut_seconds(store, cfg, dumps.peek(), prev, compression) if prev is not None and m is not None else None
            # compared while the workload is still stopped, so the comparison costs it no step
            changed, changed_runs = _compare_with_previous(dumps)
        finally:
            os.kill(w.pid, signal.SIGCONT)
        assert m is not None, "the checkpoint was skipped (too large?)"
        if stepped:
            say(f"  warning: the workload stepped during the dump ({s} -> {out.step}); "
                "this heartbeat's delta is uncertain")
        steps_at.append(s)
        by_file, runs_by_file = _new_bytes_by_file(prev, m)
        prev = m
        beats.append({"seq": m.seq, "image_bytes": m.image_bytes, "stored_bytes": m.stored_bytes,
                      "new_chunks": m.new_chunks, "chunks": len(m.chunk_digests()),
                      "freeze_seconds": m.freeze_seconds, "seconds": secs, "save_seconds": phases["save"],
                      "full_cut_seconds": full_cut,
                      "steps_since_previous": None if i == 0 else steps_at[i] - steps_at[i - 1],
                      "stepped_during_dump": stepped,
                      "changed_memory_bytes": changed, "changed_memory_runs": changed_runs,
                      "ratio": m.stored_bytes / m.image_bytes, "new_raw_bytes_by_file": by_file,
                      "new_chunk_runs_by_file": runs_by_file})
        _say_heartbeat(beats[-1], s)
    return beats


def _full_cut_seconds(store: Store, cfg: StoreConfig, images: Path, prev: Manifest, compression: str) -> float:
    """Store ``images`` again under another ID the way heartbeats did before the segment memo: every
    segment cut and hashed, knowing the previous heartbeat's chunks (so the same chunks are new)."""
    meta = CheckpointMeta(checkpoint_id=CHECKPOINT_ID + "-full-cut", node="bench", engine_version="bench",
                          process=prev.process)
    t0 = time.monotonic()
    save_checkpoint(store, cfg, meta, images, known_digests=prev.chunk_digests(), compression=compression)
    return time.monotonic() - t0


def _compare_with_previous(dumps: _Dumps) -> tuple[int | None, int | None]:
    """Memory changed between the newest dump and the one before (which is then removed); None at first."""
    d = dumps.newest()
    if len(dumps.kept) < 2:
        return None, None
    changed = changed_memory(dumps.kept[-2] / "images", d)
    drop_dir(dumps.kept[-2])
    return changed


def _new_bytes_by_file(prev: Manifest | None, m: Manifest) -> tuple[dict[str, int], dict[str, int]]:
    """Raw bytes of chunks new since the previous heartbeat, by image file (pages-*.img is memory),
    and the runs of consecutive new chunks they form: how scattered the change is."""
    by_file: dict[str, int] = {}
    runs_by_file: dict[str, int] = {}
    if prev is not None:
        old = prev.chunk_digests()
        for f in m.files:
            new = [c.digest not in old for c in f.chunks]
            n = sum(c.size for c, is_new in zip(f.chunks, new) if is_new)
            if n:
                by_file[f.name] = n
                runs_by_file[f.name] = sum(1 for j, x in enumerate(new) if x and (j == 0 or not new[j - 1]))
    return by_file, runs_by_file


def _say_heartbeat(b: dict[str, Any], step: int) -> None:
    changed, by_file = b["changed_memory_bytes"], b["new_raw_bytes_by_file"]
    say(f"  heartbeat {b['seq']} at step {step}: image {b['image_bytes'] / MB:.1f} MB, stored "
        f"{b['stored_bytes'] / MB:.2f} MB ({100 * b['stored_bytes'] / b['image_bytes']:.2f}%), "
        f"{b['new_chunks']} new chunks, dump+store {b['seconds']:.1f}s (store {b['save_seconds']:.2f}s"
        + (f", the same image cut in full {b['full_cut_seconds']:.2f}s)" if b["full_cut_seconds"] is not None else ")")
        + (f"; memory changed since the previous: {changed / MB:.2f} MB in {b['changed_memory_runs']} runs"
           if changed is not None else "")
        + ("; new raw MB by file: " + ", ".join(f"{k} {v / MB:.2f} ({b['new_chunk_runs_by_file'][k]} runs)"
                                                for k, v in by_file.items()) if by_file else ""))


def _result(beats: list[dict[str, Any]], step_seconds: float, cfg: StoreConfig, settings: Settings) -> dict[str, Any]:
    later = beats[1:]
    worst = max(b["ratio"] for b in later)
    return {
        "name": "bytes stored per heartbeat (2nd and later)",
        "baseline": "image bytes of the same heartbeat",
        "change_fraction_between_heartbeats": CHANGE * med([b["steps_since_previous"] for b in later]),
        "changed_memory_fraction": max(b["changed_memory_bytes"] / b["image_bytes"] for b in later),
        "stored_per_changed_byte": max(b["stored_bytes"] / b["changed_memory_bytes"] for b in later),
        "exactly_one_step_between": all(b["steps_since_previous"] == 1 and not b["stepped_during_dump"]
                                        for b in later) and not beats[0]["stepped_during_dump"],
        "step_seconds": step_seconds,
        "baseline_bytes": max(b["image_bytes"] for b in later),
        "ours_bytes": max(b["stored_bytes"] for b in later),
        "ratio": worst, "ratio_mean": sum(b["stored_bytes"] for b in later) / sum(b["image_bytes"] for b in later),
        "first_ratio": beats[0]["ratio"], "target": TARGET, "pass": worst <= TARGET,
        "processing": _processing(later),
        "chunk_avg_bytes": cfg.chunk_avg_bytes, "compression": settings.compression, "heartbeats": beats,
    }


def _processing(later: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per GB of image to cut, hash and store heartbeats 2-4 (worst), ours vs a full cut."""
    ours = max(b["save_seconds"] / (b["image_bytes"] / 1e9) for b in later)
    full = max(b["full_cut_seconds"] / (b["image_bytes"] / 1e9) for b in later)
    return {"ours_s_per_gb": ours, "full_cut_s_per_gb": full, "ratio": ours / full, "target_s_per_gb": TARGET_PROCESSING,
            "pass": ours <= TARGET_PROCESSING}


def _final_checkpoint(cp: Checkpointer, w: Workload, out: StepSink, dumps: _Dumps) -> tuple[Manifest, Path]:
    """The checkpoint both restores use: one dump, kept as a plain directory AND stored."""
    drop_dir(dumps.kept[-1])
    out.wait_step(out.step, timeout=60)
    final = cp.checkpoint(w, leave_running=False)  # CRIU ends the tree after dumping it
    assert final is not None
    plain = dumps.newest()
    w.wait(timeout=60)
    say(f"restore: checkpoint seq {final.seq} ({final.image_bytes / MB:.0f} MB image) kept in {plain.name} and stored")
    return final, plain


# --------------------------------------------------------------------------------------------
# memory pages of two dumps, compared
# --------------------------------------------------------------------------------------------
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
