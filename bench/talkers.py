"""Workloads that talk (issue 47): a torchrun job (two ranks, gloo DDP, no checkpoint code) and a serving
worker (an HTTP server answering between dumps), each dumped by bare CRIU and by our
engine, then restored from the same images by bare CRIU and by ours.          target: ours <= 1.10x bare

Bare: ``criu dump -t PID --leave-running --file-locks --tcp-established`` and ``criu restore -d
--tcp-established`` with the workload's output pipes inherited, what a person who knows CRIU would run.
Ours: CriuEngine.dump (the /proc scan for what CRIU cannot carry, the open-file capture, the same flags)
and run/sockets.py's preparation (connections to peers outside closed in files.img, ports probed,
TIME_WAIT leftovers cleared) before the same restore. The figures: CRIU's frozen time (``stats-dump``)
and the dump's wall time; the restore's wall time until ``criu restore -d`` returns, the preparation
included. Dumps alternate (bare, ours) while the workload runs; the tree is then killed and the last
images restored alternately, each restored tree checked alive (a step line, or an HTTP answer) and
killed. Each workload runs with io_uring refused (the default), as ``cedana-airflow run`` starts it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import REPO, StepSink, TailSink, med, say, spread

from cedana_airflow.engine.criu import CriuEngine
from cedana_airflow.engine.images import read_dump_stats
from cedana_airflow.run.sockets import prepare_sockets
from cedana_airflow.run.workload import Workload, become_subreaper

TARGET = 1.10
DDP = REPO / "tests" / "workloads" / "ddp_transparent.py"
SERVE = REPO / "tests" / "workloads" / "serve_counter.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bare_dump(engine: CriuEngine, pid: int, d: Path) -> tuple[float, float]:
    log = d.with_name(d.name + ".dump.log")
    d.mkdir(parents=True)
    t0 = time.monotonic()
    p = subprocess.run([engine.binary.path, "dump", "-t", str(pid), "-D", str(d), "--leave-running", "--file-locks",
                        "--tcp-established", "-o", str(log)], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"bare criu dump failed (exit {p.returncode}); see {log}")
    return wall, read_dump_stats(d).get("frozen", wall)


def _kill(w: Workload) -> None:
    w.stop(0, 9)
    w.wait(timeout=60)


class _Job:
    """One workload: how it starts, how to see it alive."""

    def __init__(self, name: str, port: int = 0) -> None:
        self.name, self.port = name, port

    def command(self) -> list[str]:
        if self.name == "torchrun-ddp":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DDP),
                    "--steps", "100000", "--step-seconds", "0.1"]
        return [sys.executable, str(SERVE), "--port", str(self.port)]

    def alive(self, sink: StepSink, above: int = 0, timeout: float = 120) -> None:
        if self.name == "torchrun-ddp":
            sink.wait_step(above, timeout)
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                # one request, its connection closed: bare CRIU cannot restore a client's connection twice
                # from the same images (its first restore leaves the pair in TIME_WAIT), ours closes it
                import http.client

                client = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                client.request("GET", "/")
                client.getresponse().read()
                client.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.name} did not answer")
                time.sleep(0.2)


def _one(engine: CriuEngine, job: _Job, reps: int, work: Path) -> dict[str, Any]:
    out, err = StepSink(), TailSink()
    w = Workload.start(job.command(), cwd=str(work), stdout=out, stderr=err, deny_io_uring=True)
    bare_freeze, ours_freeze, bare_wall, ours_wall = [], [], [], []
    last: Path | None = None
    try:
        job.alive(out, 2)
        for i in range(reps):
            d = work / f"{job.name}-bare-{i}"
            wall, frozen = _bare_dump(engine, w.pid, d)
            bare_wall.append(wall)
            bare_freeze.append(frozen)
            shutil.rmtree(d, ignore_errors=True)
            job.alive(out, out.step)
            d = work / f"{job.name}-ours-{i}"
            t0 = time.monotonic()
            res = engine.dump(w.pid, d)
            ours_wall.append(time.monotonic() - t0)
            ours_freeze.append(res.freeze_seconds)
            if last is not None:
                shutil.rmtree(last, ignore_errors=True)
            last = d
            job.alive(out, out.step)
        stdout_pipe, stderr_pipe = w.stdout_pipe, w.stderr_pipe
    finally:
        _kill(w)
    assert last is not None
    bare_restore, ours_restore = [], []
    become_subreaper()
    for i in range(reps):
        for kind in ("bare", "ours"):
            copy = work / f"{job.name}-restore-{kind}-{i}"
            shutil.copytree(last, copy)
            t0 = time.monotonic()
            if kind == "ours":
                prepare_sockets(copy, f"{job.name} rep {i}")
            pid, out_r, err_r = engine.restore_piped(copy, stdout_pipe, stderr_pipe, pidfile=copy.with_name(copy.name + ".pid"))
            (ours_restore if kind == "ours" else bare_restore).append(time.monotonic() - t0)
            sink = StepSink()
            restored = Workload.adopt(pid, job.command(), str(work), out_r, err_r, sink, TailSink())
            try:
                job.alive(sink, 0, timeout=60)
            finally:
                _kill(restored)
            shutil.rmtree(copy, ignore_errors=True)
    r = {"bare_freeze_seconds": med(bare_freeze), "ours_freeze_seconds": med(ours_freeze),
         "bare_dump_seconds": med(bare_wall), "ours_dump_seconds": med(ours_wall),
         "bare_restore_seconds": med(bare_restore), "ours_restore_seconds": med(ours_restore),
         "spread": {"bare_freeze": spread(bare_freeze), "ours_freeze": spread(ours_freeze),
                    "bare_restore": spread(bare_restore), "ours_restore": spread(ours_restore)},
         "image_bytes": sum(f.stat().st_size for f in last.rglob("*") if f.is_file())}
    r["freeze_ratio"] = r["ours_freeze_seconds"] / r["bare_freeze_seconds"]
    r["restore_ratio"] = r["ours_restore_seconds"] / r["bare_restore_seconds"]
    r["ok"] = r["freeze_ratio"] <= TARGET and r["restore_ratio"] <= TARGET
    say(f"{job.name}: freeze {r['ours_freeze_seconds']:.3f} s vs bare {r['bare_freeze_seconds']:.3f} s "
        f"({r['freeze_ratio']:.2f}x); restore {r['ours_restore_seconds']:.3f} s vs bare {r['bare_restore_seconds']:.3f} s "
        f"({r['restore_ratio']:.2f}x)")
    return r


def bench_talkers(engine: CriuEngine, reps: int, work: Path) -> dict[str, Any]:
    """Both workloads; ``{"talkers": {name: figures}}``."""
    out = {}
    for job in (_Job("torchrun-ddp"), _Job("serving-worker", _free_port())):
        d = work / job.name
        d.mkdir()
        out[job.name] = _one(engine, job, reps, d)
    return {"talkers": out}


if __name__ == "__main__":  # a quick look: python bench/talkers.py (root)
    import json
    import tempfile

    from cedana_airflow.config import DEFAULT_CRIU_PREFIX
    from cedana_airflow.engine.criu import find_criu

    tmp = Path(tempfile.mkdtemp(prefix="cedana-bench-talkers-"))
    try:
        print(json.dumps(bench_talkers(CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX))), 3, tmp), indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
