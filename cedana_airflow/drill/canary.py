"""The ``canary`` drill: a node loss, staged on purpose, measured end to end.

A deterministic workload (canary_workload.py) runs under full protection, as ``cedana-airflow run``
on "node A" (this machine, its own work dir); after ``heartbeats`` checkpoints the supervisor and the
workload's whole PID namespace are SIGKILLed, as a dying node would leave them; ``cedana-airflow
restore`` on "node B" (another node name and work dir, nothing shared but the store) resumes it; its
final digest must equal the golden digest of an uninterrupted run, computed once per parameter set
and kept in the store (``drills/golden-<params>.txt``). The drill's checkpoint ID is its own and is
deleted afterwards; its report stays.

Measured: lost work (from the last checkpoint to the kill), restore seconds and gap (from the
restore record), time to first progress after the kill (the RTO: restore start-up, fetch, CRIU, and
the first step printed), bytes fetched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from ..config import Settings
from ..engine.procfs import process_start
from ..errors import CedanaError
from ..format.layout import golden_digest_key
from ..store.base import Store
from ..store.gc import delete_checkpoint_id
from ..store.restores import list_restores
from ..store.transfer import load_manifests
from .report import DrillReport, new_drill_id, scratch_dir

__all__ = ["canary", "golden_digest"]

_WORKLOAD = [sys.executable, "-m", "cedana_airflow.drill.canary_workload"]
_CLI = [sys.executable, "-m", "cedana_airflow"]


def _params(mb: int, steps: int) -> list[str]:
    return ["--mb", str(mb), "--steps", str(steps)]


def golden_digest(store: Store, mb: int, steps: int) -> str:
    """The digest of an uninterrupted run (step time 0: the digest does not depend on it), from the
    store when some drill computed it before."""
    key = golden_digest_key(hashlib.sha256(repr(('canary-v1', mb, steps)).encode()).hexdigest()[:16])
    cached = store.get(key)
    if cached:
        return cached.decode().strip()
    out = subprocess.run([*_WORKLOAD, *_params(mb, steps), "--step-seconds", "0"], capture_output=True, text=True,
                         check=True, timeout=600).stdout.strip().splitlines()[-1]
    store.put_if_absent(key, out.encode())
    return out


class _Lines(threading.Thread):
    """A process's stdout, line by line, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines = proc, list[tuple[float, str]]()

    def run(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))


def _env(settings: Settings, node: str, work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CEDANA_NODE", "CEDANA_WORK_DIR", "CEDANA_STORE")}
    return {**env, "CEDANA_STORE": settings.resolved_store(), "CEDANA_NODE": node, "CEDANA_WORK_DIR": str(work),
            "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def _killed_at_exit(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _kill_tree(workload_pid: int) -> None:
    """SIGKILL the init of the workload's PID namespace: everything in it dies with it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(workload_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process_start(workload_pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)


def canary(store: Store, settings: Settings, *, mb: int = 64, steps: int = 60, step_seconds: float = 0.1,
           heartbeat: float = 1.0, heartbeats: int = 2, timeout: float = 600) -> DrillReport:
    started = datetime.now(timezone.utc)
    drill_id = new_drill_id("canary", started)
    cid = f"drill-{drill_id}"
    node = settings.resolved_node()
    node_a, node_b = f"{node}-drill-a", f"{node}-drill-b"
    problems: list[str] = []
    fields: dict[str, object] = {"checkpoint_id": cid, "from_node": node_a, "to_node": node_b}
    golden = golden_digest(store, mb, steps)
    root = scratch_dir(settings, "cedana-canary-")
    deadline = time.monotonic() + timeout
    files = contextlib.ExitStack()
    try:
        a = subprocess.Popen([*_CLI, "run", "--id", cid, "--heartbeat", str(heartbeat), "--", *_WORKLOAD,
                              *_params(mb, steps), "--step-seconds", str(step_seconds)],
                             env=_env(settings, node_a, root / "a"), stdout=subprocess.DEVNULL,
                             stderr=files.enter_context(open(root / "a.err", "wb")), start_new_session=True)
        with _killed_at_exit(a):
            while len(store.list_seqs(cid)) < heartbeats:
                if a.poll() is not None or time.monotonic() > deadline:
                    tail = (root / "a.err").read_text(errors="replace").strip().splitlines()[-1:]
                    raise CedanaError(f"the canary took fewer than {heartbeats} checkpoint(s) before it "
                                      f"{'ended' if a.poll() is not None else 'timed out'}: {' '.join(tail) or 'no output'}. "
                                      "Give it more --steps or a shorter --heartbeat")
                time.sleep(0.1)
            latest = load_manifests(store, cid)[0]
            os.killpg(a.pid, signal.SIGKILL)  # the node dies: supervisor first, then what it ran
            a.wait()
            _kill_tree(latest.process.pid)
        killed_at_wall, killed_at = datetime.now(timezone.utc), time.monotonic()
        latest = load_manifests(store, cid)[0]  # the newest that made it before the kill
        fields["lost_work_seconds"] = round(max(0.0, (killed_at_wall - latest.created_at).total_seconds()), 3)
        shutil.rmtree(root / "a", ignore_errors=True)  # node A is gone: node B has nothing but the store
        b = subprocess.Popen([*_CLI, "restore", "--id", cid, "--try-number", "1", "--heartbeat", "0"],
                             env=_env(settings, node_b, root / "b"), stdout=subprocess.PIPE,
                             stderr=files.enter_context(open(root / "b.err", "wb")), start_new_session=True)
        with _killed_at_exit(b):
            lines = _Lines(b)
            lines.start()
            try:
                rc = b.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise CedanaError(f"the restored canary did not finish within {timeout:.0f} s") from None
            lines.join(5)
        if rc != 0:
            tail = (root / "b.err").read_text(errors="replace").strip().splitlines()[-1:]
            raise CedanaError(f"the restore on {node_b} exited {rc}: {' '.join(tail) or 'no output'}")
        steps_seen = [(t, s) for t, s in lines.lines if s.startswith("step ")]
        if steps_seen:
            fields["rto_seconds"] = round(steps_seen[0][0] - killed_at, 3)
        final = lines.lines[-1][1] if lines.lines else ""
        fields["digest_match"] = final == golden
        if final != golden:
            problems.append(f"the restored canary printed {final!r}; an uninterrupted run prints {golden!r}")
        records = [r for r in list_restores(store, cid) if r.outcome == "restored"]
        if records:
            fields.update(restored_seq=records[-1].seq, restore_seconds=records[-1].restore_seconds)
        fields["bytes_fetched"] = latest.image_bytes
    except CedanaError as e:
        problems.append(str(e))
    finally:
        files.close()
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(CedanaError):
            delete_checkpoint_id(store, cid)  # the drill's own ID: its report is what stays
    return DrillReport(drill_id=drill_id, mode="canary", ok=not problems and fields.get("digest_match") is True,
                       problems=tuple(problems), node=node, started_at=started, finished_at=datetime.now(timezone.utc),
                       **fields)  # type: ignore[arg-type]
