"""Freeze per heartbeat after a restore: heartbeats of a workload's restored copies (lazy with our
daemon, lazy with CRIU's on page files, full) against those of the workload itself, from one and
the same checkpoint, in the same run.                              target: after <= 1.15x before

A restored workload pays its freeze at every heartbeat from then on, so a restore that leaves its
memory slower to dump costs at each one. The workload (tests/workloads/train.py, numpy state)
keeps running beside its restored copies (a kill would change nothing for them): every round takes
one heartbeat of each tree, in rotating order, each right after a step line of that tree, so all
see the same machine (a shared 2-core VM here, where one heartbeat's freeze can double from one
minute to the next). Each figure is the median of CRIU's own frozen time (``stats-dump``, as
local_freeze.py) over the rounds; the heartbeats are a Checkpointer's (the path ``cedana-airflow
run`` takes: the restored copies' own restorer takes theirs), after every page is in.

Each kind of restore runs twice: as shipped, where the Checkpointer gives the tree its transparent
huge pages back once every page is in (engine/thp.py), and without that (``huge_pages_back`` off):
the rows "without huge pages back" are what a restore left before. Beside each tree the report
keeps its memory (/proc/PID/smaps): VMAs, anonymous memory in huge pages, VMAs still registered
with a userfaultfd. numpy asks for huge pages (``madvise(MADV_HUGEPAGE)``), a fresh process gets
them; ``criu restore`` and UFFDIO_COPY bring memory back in 4 KiB pages, and CRIU's dump then
handles 512 times as many page mappings (bench/README.md, "Freeze after a restore").
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import MB, StepSink, TailSink, kill, make_checkpointer, med, say, spread, start_workload

from cedana_airflow.config import Settings
from cedana_airflow.engine.criu import CriuEngine, DumpResult
from cedana_airflow.engine.images import read_dump_stats
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.run.workload import Workload, become_subreaper
from cedana_airflow.store import open_store

TARGET = 1.15
STEP_SECONDS, CHANGE = 0.2, 0.01
ID = "lazy-freeze"
#: restore kind -> the settings it restores with
KINDS = {"lazy-ours": {"restore_mode": "lazy", "lazy_pages_via": "ours"},
         "lazy-file": {"restore_mode": "lazy", "lazy_pages_via": "file"},
         "full": {"restore_mode": "full"}}
WITHOUT = " without huge pages back"
_STATS = ("frozen", "memdump", "memwrite")


class StatsEngine(CriuEngine):
    """The engine, remembering CRIU's statistics of its last dump (read before the Checkpointer removes it)."""

    def __init__(self, engine: CriuEngine) -> None:
        super().__init__(engine.binary)
        self.last: dict[str, float] = {}

    def dump(self, pid: int, image_dir: Path, *, leave_running: bool = True, capture: bool = True) -> DumpResult:
        self.last = {}
        res = super().dump(pid, image_dir, leave_running=leave_running, capture=capture)
        self.last = read_dump_stats(image_dir)
        return res


def memory_facts(pids: list[int]) -> dict[str, int]:
    """The tree's VMAs, anonymous and huge-page kB, and VMAs registered with a userfaultfd, from smaps."""
    out = {"vmas": 0, "anon_kb": 0, "anon_huge_kb": 0, "uffd_vmas": 0}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key == "Anonymous":
                out["anon_kb"] += int(rest.split()[0])
            elif key == "AnonHugePages":
                out["anon_huge_kb"] += int(rest.split()[0])
            elif key == "VmFlags":
                out["vmas"] += 1
                out["uffd_vmas"] += any(f in ("um", "uw", "ui") for f in rest.split())
    return out


@dataclass
class Tree:
    """One live tree and the Checkpointer that takes its heartbeats."""

    name: str
    cp: Checkpointer
    workload: Workload
    out: StepSink
    runs: list[dict[str, float]] = field(default_factory=list)
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # when -> memory_facts
    pages_in_seconds: float = 0.0


def bench_lazy_freeze(engine: CriuEngine, mb: int, rounds: int, work: Path, settings: Settings) -> dict[str, Any]:
    become_subreaper()
    eng = StatsEngine(engine)
    store = open_store(f"file://{work / 'lazy-freeze-store'}")
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    say(f"lazy freeze: a {mb} MB workload and its copies restored {len(KINDS)} ways, twice each; {rounds} rounds of heartbeats")
    trees: list[Tree] = []
    try:
        w, out, _ = start_workload(mb, STEP_SECONDS, CHANGE, work)
        trees.append(Tree("before", make_checkpointer(eng, store, cfg, ID, settings, work / "lazy-freeze-src"), w, out))
        out.wait_step(out.step + 2, 60)
        for _ in range(2):  # the restored checkpoint has a parent, as a heartbeat's does
            out.wait_step(out.step, 60)
            _heartbeat(trees[0], eng)
        trees[0].runs.clear()
        for kind, update in KINDS.items():
            for back in (True, False):
                trees.append(_restore(eng, work, settings.model_copy(update=update), kind + ("" if back else WITHOUT), back))
        _settle(trees)
        for t in trees:
            t.memory["first heartbeat"] = memory_facts(t.workload.pids())
        for r in range(rounds):
            for t in trees[r % len(trees):] + trees[: r % len(trees)]:  # rotate who goes first
                t.out.wait_step(t.out.step, 60)  # right after a step line, like any other moment
                _heartbeat(t, eng)
        for t in trees:
            t.memory["last heartbeat"] = memory_facts(t.workload.pids())
    finally:
        for t in trees:
            kill(t.workload)
            t.cp.close()
    return _result(trees, mb)


def _restore(eng: StatsEngine, work: Path, settings: Settings, name: str, back: bool) -> Tree:
    """A copy of the workload, restored from the checkpoint in its own copy of the store (hard links:
    the store renames every file it writes), so its own heartbeats go under the same ID as in a real run."""
    d = work / f"lazy-freeze-{name.replace(' ', '-')}"
    src = work / "lazy-freeze-store"
    shutil.copytree(src, d / "store", copy_function=os.link)
    store = open_store(f"file://{d / 'store'}")
    cfg = store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
    cp = make_checkpointer(eng, store, cfg, ID, settings, d / "work")
    cp.huge_pages_back = back
    sink = StepSink()
    t0 = time.monotonic()
    restored = cp.restore(sink, TailSink())
    t = Tree(name, cp, restored.workload, sink)
    if restored.mode != settings.restore_mode:
        kill(t.workload)
        cp.close()
        raise SystemExit(f"lazy freeze {name}: restored {restored.mode}, not {settings.restore_mode}")
    t.pages_in_seconds = cp.pages_in_at() - t0
    t.memory["pages in"] = memory_facts(t.workload.pids())
    say(f"  {name}: every page in after {t.pages_in_seconds:.2f}s; {_facts(t.memory['pages in'])}")
    return t


def _settle(trees: list[Tree], timeout: float = 60.0) -> None:
    """Wait until no tree's huge pages still grow (the ones given back in the background)."""
    deadline = time.monotonic() + timeout
    last = [-1] * len(trees)
    while time.monotonic() < deadline:
        now = [memory_facts(t.workload.pids())["anon_huge_kb"] for t in trees]
        if now == last:
            return
        last = now
        time.sleep(1.0)


def _heartbeat(t: Tree, eng: StatsEngine) -> None:
    m = t.cp.checkpoint(t.workload)
    if m is None or not eng.last:
        raise SystemExit(f"lazy freeze {t.name}: a heartbeat was skipped")
    st = eng.last
    t.runs.append({"freeze": m.freeze_seconds, **{k: st.get(k, float("nan")) for k in _STATS},
                   "image_bytes": m.image_bytes})
    say(f"  {t.name:36} frozen {m.freeze_seconds:.3f}s (memdump {st.get('memdump', 0):.3f} "
        f"memwrite {st.get('memwrite', 0):.3f}) image {m.image_bytes / MB:.0f} MB")


def _facts(f: dict[str, int]) -> str:
    return (f"{f['vmas']} VMAs, {f['anon_huge_kb'] // 1024} of {f['anon_kb'] // 1024} MB anonymous in huge pages, "
            f"{f['uffd_vmas']} VMAs registered with a userfaultfd")


def _result(trees: list[Tree], mb: int) -> dict[str, Any]:
    per = {t.name: {"freeze_seconds": med([r["freeze"] for r in t.runs]), "spread": spread([r["freeze"] for r in t.runs]),
                    "median": {k: med([r[k] for r in t.runs]) for k in _STATS}, "memory": t.memory,
                    "pages_in_seconds": t.pages_in_seconds, "runs": t.runs} for t in trees}
    base = per["before"]["freeze_seconds"]
    ratios = {name: p["freeze_seconds"] / base for name, p in per.items() if name != "before"}
    targets = {name: TARGET for name in ratios if WITHOUT not in name}
    for t in trees:
        say(f"  {t.name:36} freeze median {per[t.name]['freeze_seconds']:.3f}s"
            + (f" = {ratios[t.name]:.2f}x before" if t.name in ratios else "") + f"; {_facts(t.memory['last heartbeat'])}")
    return {"lazy_freeze": {
        "name": "freeze after a restore", "mb": mb, "rounds": len(trees[0].runs),
        "baseline": "heartbeats of the workload itself (never restored), interleaved with its restored copies'",
        "image_mb": med([r["image_bytes"] for r in trees[0].runs]) / MB, "trees": per, "ratios": ratios,
        "targets": targets, "pass": {k: ratios[k] <= v for k, v in targets.items()}}}
