"""The node agent's cost (issue 49, part "agent"): freeze and restore of a workload a non-root caller runs
through the agent (uid nobody: its tree in user, mount and PID namespaces of its own, started by a shim,
dumped and restored by the agent's CRIU), against today's path, the in-process supervisor as root
(``cedana-airflow run --resume``), in the same run, on the same workload, from the same kind of store
(file://).

The workload is a plain ``python3`` (Debian's: nobody can run it) holding ``--agent-mb`` MB it has
written and rewriting 1% of it between steps. Each side runs it ``reps + 1`` times under one checkpoint
ID: the first start is fresh, each later one resumes the newest checkpoint; each run lasts two
heartbeats and is then stopped, which takes the final checkpoint (SIGTERM to the supervisor; the
agent's ``stop``). The sides alternate, run by run.

* freeze: the manifests' ``freeze_seconds`` (CRIU's frozen time, ``stats-dump``), every heartbeat and
  final checkpoint of both sides                                                 target ours <= 1.15x
* restore: the run's ``restore_seconds`` (the Checkpointer's restore: fetch, verify every chunk,
  ``criu restore``, adopt), and for the agent also the caller's wall time from its ``start`` request
  to the reply (the restore plus the protocol, the shim and the checks)        target ours <= 1.3x
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import REPO, med, say, spread, stored_manifests

from cedana_airflow.agent.client import AgentClient

TARGETS = {"freeze": 1.15, "restore": 1.3}
NOBODY = 65534
HEARTBEAT = 1.0

#: N MB written (so dumped), 1% rewritten per 0.2 s step, a step number printed each time.
WORKLOAD = ("import sys, time\n"
            "mb = int(sys.argv[1]); b = bytearray(mb << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "step, span = 0, max(1, len(b) // 100)\n"
            "while True:\n"
            "    step += 1; at = (step * span) % (len(b) - span); b[at:at + span] = bytes([step % 251]) * span\n"
            "    print(step, flush=True); time.sleep(0.2)\n")


def _env(work: Path, side: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
    env.update(CEDANA_STORE=f"file://{work / side / 'store'}", CEDANA_WORK_DIR=str(work / side / "work"),
               CEDANA_NODE="bench", CEDANA_RESTORE_MODE="full", PYTHONPATH=str(REPO))
    return env


def _manifests(work: Path, side: str, cid: str) -> list[dict[str, Any]]:
    return stored_manifests(work / side / "store", cid)


def _latest(work: Path, side: str) -> int:
    return max((m["seq"] for m in _manifests(work, side, "bench-agent")), default=0)


def _freezes_after(work: Path, side: str, seq: int) -> list[float]:
    """The frozen time of each checkpoint after ``seq`` (read before they are pruned)."""
    return [m["freeze_seconds"] for m in _manifests(work, side, "bench-agent") if m["seq"] > seq]


def _criu_span(summary: dict[str, Any]) -> float | None:
    """The ``criu_restore`` span of a run's restore timings (CRIU under the shim, for the agent)."""
    spans = (summary.get("restore_timings") or {}).get("spans", [])
    return next((s["seconds"] for s in spans if s["name"] == "criu_restore"), None)


def _until(what: str, cond: Any, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench agent: {what} within {seconds:.0f} s")
        time.sleep(0.05)


class _InProcess:
    """Today: ``cedana-airflow run --resume`` as root; SIGTERM stops it with a final checkpoint."""

    side = "in-process"

    def __init__(self, work: Path, mb: int) -> None:
        self.work, self.mb = work, mb

    def run_once(self) -> dict[str, Any]:
        seen = _latest(self.work, self.side)
        out = self.work / self.side / "run.json"
        proc = subprocess.Popen([sys.executable, "-m", "cedana_airflow", "run", "--id", "bench-agent", "--resume",
                                 "--heartbeat", str(HEARTBEAT), "--json-file", str(out), "--", "/usr/bin/python3",
                                 "-c", WORKLOAD, str(self.mb)], env=_env(self.work, self.side), cwd="/tmp",
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _until("two heartbeats of the in-process run", lambda: _latest(self.work, self.side) >= seen + 2)
        proc.send_signal(signal.SIGTERM)
        if proc.wait(120) != 128 + signal.SIGTERM and not out.exists():
            raise SystemExit(f"bench agent: the in-process run ended {proc.returncode} without a summary")
        summary = json.loads(out.read_text())
        return {"restore_seconds": summary["restore_seconds"] if summary["restored_from"] else None,
                "criu_restore": _criu_span(summary), "freezes": _freezes_after(self.work, self.side, seen)}


class _ThroughAgent:
    """Through the agent, as uid nobody (a forked child that became it, per request)."""

    side = "agent"

    def __init__(self, work: Path, mb: int) -> None:
        self.work, self.mb = work, mb
        folder = Path(f"/run/cedana-bench-agent-{os.getpid()}")
        self.sock = folder / "agent.sock"
        self.folder = folder
        log = work / "agent.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "cedana_airflow", "agent", "--socket", str(self.sock)],
                                     env=_env(work, self.side), stderr=open(log, "wb"), start_new_session=True)
        _until("the agent to serve", lambda: b"agent serving on" in log.read_bytes(), 30)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        subprocess.run(["rm", "-rf", str(self.folder)], check=False)

    def _as_nobody(self, ask: Any) -> tuple[Any, list[int]]:
        """``ask(client)`` in a forked child that became nobody: its answer, and the fds it passed back (a
        lifeline must outlive that child: closing it would end the workload)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                mine.close()
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                with AgentClient.connect(self.sock) as c:
                    answer, fds = ask(c)
                socket.send_fds(theirs, [json.dumps(answer).encode()], fds)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        data, fds, _, _ = socket.recv_fds(mine, 1 << 16, 4)
        mine.close()
        os.waitpid(pid, 0)
        if not data:
            raise SystemExit("bench agent: a request as nobody failed; see the agent's log")
        return json.loads(data), fds

    def run_once(self) -> dict[str, Any]:
        seen = _latest(self.work, self.side)
        out_r, out_w = os.pipe()
        os.fchown(out_w, NOBODY, NOBODY)  # the caller's pipe: the agent takes no other (server.py)

        def start(c: AgentClient) -> tuple[dict[str, Any], list[int]]:
            t0 = time.monotonic()
            s = c.start("bench-agent", ["/usr/bin/python3", "-c", WORKLOAD, str(self.mb)], cwd="/tmp",
                        env={"PATH": "/usr/bin:/bin"}, stdout=out_w, stderr=out_w,
                        settings={"heartbeat_seconds": HEARTBEAT}, resume=True)
            wall = time.monotonic() - t0
            return {"wid": s.wid, "handle": s.handle, "wall": wall}, [s.lifeline.detach()]

        started, lifeline = self._as_nobody(start)
        os.close(out_w)
        try:
            _until("two heartbeats through the agent",
                   lambda: _latest(self.work, self.side) >= seen + 2)
            status, _ = self._as_nobody(lambda c: (c.stop(started["wid"], started["handle"]), []))
        finally:
            for fd in (*lifeline, out_r):
                os.close(fd)
        if status.get("error") or not status.get("result"):
            raise SystemExit(f"bench agent: the run through the agent failed: {status}")
        result = status["result"]
        restored = result["restored_from"] is not None
        return {"restore_seconds": result["restore_seconds"] if restored else None,
                "restore_wall": started["wall"] if restored else None, "criu_restore": _criu_span(result),
                "freezes": _freezes_after(self.work, self.side, seen)}


def bench_agent(mb: int, reps: int, work: Path) -> dict[str, Any]:
    if not Path("/usr/bin/python3").exists():
        raise SystemExit("bench agent: needs Debian's /usr/bin/python3 (the workload runs as nobody)")
    say(f"agent: {mb} MB workload, {reps} restores per side, alternating")
    base, ours = _InProcess(work, mb), _ThroughAgent(work, mb)
    runs: dict[str, list[dict[str, Any]]] = {"in-process": [], "agent": []}
    try:
        for i in range(reps + 1):
            for side in (base, ours) if i % 2 == 0 else (ours, base):
                runs[side.side].append(side.run_once())
    finally:
        ours.close()
    freeze = {s: [f for r in runs[s] for f in r["freezes"]] for s in runs}
    restore = {s: [r["restore_seconds"] for r in runs[s] if r["restore_seconds"] is not None] for s in runs}
    walls = [r["restore_wall"] for r in runs["agent"] if r.get("restore_wall") is not None]
    criu = {s: [r["criu_restore"] for r in runs[s] if r.get("criu_restore") is not None] for s in runs}
    res = {
        "mb": mb, "reps": reps, "targets": TARGETS,
        "in_process_freeze_seconds": med(freeze["in-process"]), "agent_freeze_seconds": med(freeze["agent"]),
        "in_process_restore_seconds": med(restore["in-process"]), "agent_restore_seconds": med(restore["agent"]),
        "agent_start_wall_seconds": med(walls),
        "in_process_criu_restore_seconds": med(criu["in-process"]), "agent_criu_restore_seconds": med(criu["agent"]),
        "spread": {"in_process_freeze": spread(freeze["in-process"]), "agent_freeze": spread(freeze["agent"]),
                   "in_process_restore": spread(restore["in-process"]), "agent_restore": spread(restore["agent"]),
                   "agent_start_wall": spread(walls)},
        "samples": {"freeze": freeze, "restore": restore, "agent_start_wall": walls, "criu_restore": criu},
    }
    res["freeze_ratio"] = res["agent_freeze_seconds"] / res["in_process_freeze_seconds"]
    res["restore_ratio"] = res["agent_restore_seconds"] / res["in_process_restore_seconds"]
    res["pass"] = {"freeze": res["freeze_ratio"] <= TARGETS["freeze"], "restore": res["restore_ratio"] <= TARGETS["restore"]}
    say(f"agent: freeze {res['agent_freeze_seconds']:.3f} s vs {res['in_process_freeze_seconds']:.3f} s in-process "
        f"({res['freeze_ratio']:.2f}x); restore {res['agent_restore_seconds']:.2f} s vs "
        f"{res['in_process_restore_seconds']:.2f} s ({res['restore_ratio']:.2f}x), the caller waited "
        f"{res['agent_start_wall_seconds']:.2f} s")
    return {"agent": res}
