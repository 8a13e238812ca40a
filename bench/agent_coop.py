"""Cooperative checkpoints through the node agent (issue 49, part "agent-cooperative"): a workload that
writes its own state when asked (``mode = cooperative``, cedana_airflow.coop) checkpointed through the
agent as uid nobody, against the same workload under the in-process supervisor as root, in the same run,
from the same kind of store (file://).

Through the agent the caller's state is copied into the agent's work dir by a helper that runs as the
caller (run/state_copy.py: a Python start, a walk by descriptor, the bytes through a pipe), where the
in-process supervisor reads the state folder itself. What that costs shows in the cycle: with a 0.2 s
heartbeat the checkpoints run back to back, and the cycle is the time between consecutive manifests
(the request, the workload's write, the copy, the cut, the store).

* cycle: the median interval between consecutive manifests, each side   target ours <= 2.5x
  (the helper's start and the one local copy; the workload's own write time does not change)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from agent import NOBODY, _env, _ThroughAgent, _until
from harness import med, say, spread

TARGET = 2.5
HEARTBEAT = 0.2
CYCLES = 8  # intervals measured per run
KEEP = CYCLES + 4  # none of a run's manifests is pruned before it is read (the agent's bound is 50)
#: The worker environment's Python (scripts/worker_env.sh): nobody can run it, and it has cedana_airflow.coop.
PYTHON = "/opt/cedana-airflow/worker/bin/python"

#: N MB of state, 1% rewritten per 20 ms step; written whole as one file when its supervisor asks.
WORKLOAD = ("import os, sys, time\nfrom cedana_airflow import coop\n"
            "mb = int(sys.argv[1]); b = bytearray(os.urandom(1 << 20) * mb); coop.listen(); step = 0\n"
            "span = len(b) // 100\n"
            "while True:\n"
            "    step += 1; at = (step * 7919 * 4096) % (len(b) - span); b[at:at + span] = os.urandom(span)\n"
            "    time.sleep(0.02)\n"
            "    if coop.request():\n"
            "        with coop.checkpoint(0, 1) as d:\n"
            "            (d / 'state').write_bytes(b)\n")


def _cycles(work: Path, side: str, cid: str) -> list[float]:
    d = work / side / "store" / cid
    ms = sorted((json.loads(p.read_text()) for p in d.glob("*/manifest.json")), key=lambda m: m["seq"])
    t = [datetime.fromisoformat(m["created_at"]).timestamp() for m in ms]
    return [b - a for a, b in zip(t, t[1:])][:CYCLES]


def _count(work: Path, side: str, cid: str) -> int:
    return len(list((work / side / "store" / cid).glob("*/manifest.json")))


def _in_process(work: Path, mb: int, cid: str) -> list[float]:
    """Today: ``cedana-airflow run --mode cooperative`` as root; SIGTERM ends it."""
    side = "in-process"
    env = {**_env(work, side), "CEDANA_KEEP_CHECKPOINTS": str(KEEP)}
    proc = subprocess.Popen([sys.executable, "-m", "cedana_airflow", "run", "--id", cid, "--mode", "cooperative",
                             "--heartbeat", str(HEARTBEAT), "--", PYTHON, "-c", WORKLOAD, str(mb)], env=env, cwd="/tmp",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _until("the in-process cooperative checkpoints", lambda: _count(work, side, cid) >= CYCLES + 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return _cycles(work, side, cid)


def _through_agent(agent: _ThroughAgent, work: Path, mb: int, cid: str) -> list[float]:
    """Through the agent as nobody; the caller's stop ends it."""
    out_r, out_w = os.pipe()
    os.fchown(out_w, NOBODY, NOBODY)  # the caller's pipe: the agent takes no other (server.py)

    def start(c: Any) -> tuple[dict[str, Any], list[int]]:
        s = c.start(cid, [PYTHON, "-c", WORKLOAD, str(mb)], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, stdout=out_w,
                    stderr=out_w, settings={"mode": "cooperative", "heartbeat_seconds": HEARTBEAT,
                                            "keep_checkpoints": KEEP, "cooperative_signal": "none"})
        return {"wid": s.wid, "handle": s.handle}, [s.lifeline.detach()]

    started, lifeline = agent._as_nobody(start)
    os.close(out_w)
    try:
        _until("the cooperative checkpoints through the agent", lambda: _count(work, agent.side, cid) >= CYCLES + 1)
        agent._as_nobody(lambda c: (c.stop(started["wid"], started["handle"]), []))
    finally:
        for fd in (*lifeline, out_r):
            os.close(fd)
    return _cycles(work, agent.side, cid)


def bench_agent_coop(mb: int, reps: int, work: Path) -> dict[str, Any]:
    if not Path(PYTHON).exists():
        raise SystemExit(f"bench agent-cooperative: needs the worker environment's {PYTHON} (make worker)")
    say(f"agent-cooperative: {mb} MB state, heartbeat {HEARTBEAT} s, {CYCLES} cycles x {reps} runs a side, "
        "alternating")
    work.chmod(0o755)  # the agent side's store is root's; only the workload's cwd (/tmp) must be nobody's
    ours = _ThroughAgent(work, mb)
    cycles: dict[str, list[float]] = {"in-process": [], "agent": []}
    try:
        for i in range(reps):
            sides = ("in-process", "agent") if i % 2 == 0 else ("agent", "in-process")
            for side in sides:
                cid = f"bench-coop-{i}"
                got = _in_process(work, mb, cid) if side == "in-process" else _through_agent(ours, work, mb, cid)
                cycles[side] += got
    finally:
        ours.close()
    res: dict[str, Any] = {
        "mb": mb, "reps": reps, "heartbeat_seconds": HEARTBEAT, "target": TARGET, "caller_uid": NOBODY,
        "in_process_cycle_seconds": med(cycles["in-process"]), "agent_cycle_seconds": med(cycles["agent"]),
        "spread": {"in_process": spread(cycles["in-process"]), "agent": spread(cycles["agent"])},
        "samples": cycles,
    }
    res["ratio"] = res["agent_cycle_seconds"] / res["in_process_cycle_seconds"]
    res["pass"] = res["ratio"] <= TARGET
    say(f"agent-cooperative: cycle {res['agent_cycle_seconds']:.2f} s through the agent vs "
        f"{res['in_process_cycle_seconds']:.2f} s in-process ({res['ratio']:.2f}x)")
    return {"agent_cooperative": res}
