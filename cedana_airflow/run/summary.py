"""A managed run's summary for machines (``cedana-airflow run --json``): how it ended, what it took,
what it restored from, and the time a failure cost. Its fields change only additively (``version``)."""

from __future__ import annotations

import signal
from typing import Any

from ..store.index import conflicts_retried
from .runner import RunResult

__all__ = ["SUMMARY_VERSION", "run_summary", "error_summary"]

SUMMARY_VERSION = 1


def _signal_name(num: int | None) -> str | None:
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def run_summary(result: RunResult, checkpoint_id: str, node: str) -> dict[str, Any]:
    """``result`` as one JSON object (see docs/cli.md#run---json for each field)."""
    m = result.restored_from
    stop = result.stop
    return {
        "version": SUMMARY_VERSION,
        "checkpoint_id": checkpoint_id,
        "node": node,
        "exit_code": result.exit_code,
        "outcome": result.outcome,
        "restored_from": None if m is None else {
            "seq": m.seq, "node": m.node, "try_number": m.try_number, "created_at": m.created_at.isoformat(),
            "engine": m.engine,  # "criu", or "cooperative": the workload wrote it (docs/cooperative.md)
            "image_bytes": m.image_bytes},  # 0.8.1
        "restore_seconds": round(result.restore_seconds, 3),
        "restore_gap_seconds": round(result.restore_gap_seconds, 3),
        # The work redone plus the downtime: from the restored checkpoint's creation until it ran again.
        "time_lost_seconds": round(result.restore_gap_seconds + result.restore_seconds, 3) if m is not None else None,
        "refused": list(result.skipped),
        "checkpoints": len(result.checkpoints),
        "checkpoint_seqs": [c.seq for c in result.checkpoints],
        "stored_bytes": sum(c.stored_bytes for c in result.checkpoints),
        "skipped_heartbeats": result.skipped_heartbeats,
        # issue 47: heartbeats that failed (the workload kept running), and each kind's latest line and count
        "failed_heartbeats": result.failed_heartbeats,
        "heartbeat_failures": result.heartbeat_failures,
        "stopped_by": stop.cause if stop is not None else _signal_name(result.stopped_by_signal),
        "stopped_by_signal": result.stopped_by_signal,  # 0.8.1: its number (a stop by a signal), or null
        "final_checkpoint_seq": stop.final.seq if stop is not None and stop.final is not None else None,
        "killed_by": _signal_name(result.killed_by_signal),
        "index_conflicts_retried": conflicts_retried(),
        # where the restore's time went (docs/cli.md): spans, CRIU's phases, marks, store reads; null when fresh
        "restore_timings": result.restore_timeline.as_dict() if result.restore_timeline is not None else None,
        # 0.7.0: the heartbeat in use at the end: interval, cost, expected work lost (docs/heartbeat.md); null: none
        "heartbeat": result.heartbeat.model_dump() if result.heartbeat is not None else None,
        # 0.10.0: the heartbeat the run was given and where from, and why nothing a retry could resume from was
        # taken ("" when something was, or the run was itself a restore)
        "heartbeat_in_force": result.heartbeat_in_force,
        "unprotected": result.unprotected,
        "error": None,
    }


def error_summary(checkpoint_id: str, node: str, exit_code: int, error: str) -> dict[str, Any]:
    """The same object for a run that ended in an error before or instead of its workload's end."""
    return {"version": SUMMARY_VERSION, "checkpoint_id": checkpoint_id, "node": node, "exit_code": exit_code,
            "outcome": "error", "error": error}
