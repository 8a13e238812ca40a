"""A stop is a clean cut: the final checkpoint, then the whole tree ends at once.

Whatever stops a supervised workload (SIGTERM from Airflow's mark-failed or a worker's shutdown, a
pod's deletion, Slurm's --signal, execution_timeout), nothing the workload does after its final
checkpoint may survive: the retry resumes from that checkpoint, so any step taken after it is done
twice, with its effects. So the final checkpoint is taken with CRIU's default of killing the tree once
its images are written, and whatever is left is SIGKILLed. A workload pid-namespace init ignores
SIGTERM it has no handler for, so forwarding SIGTERM would only have let it run on until the
escalation (measured: 10 more steps in Airflow's 5 s).

A workload that needs its own shutdown (it flushes to a service) asks for it with
``stop_grace_seconds``: the final checkpoint then leaves it running, SIGTERM goes to its session,
and SIGKILL follows after the grace. Both fit the stop window (``stop_window_seconds``: Airflow's 5 s
from SIGTERM to SIGKILL, a pod's grace period, Slurm's --signal lead): a final checkpoint that cannot
finish inside it is abandoned, the tree ended anyway, and the log says so.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from ..config import Settings
from ..format.manifest import Manifest
from .checkpointer import Checkpointer
from .workload import Workload

__all__ = ["MARGIN_SECONDS", "UNPROTECTED_GRACE_SECONDS", "StopReport", "clean_cut"]

log = logging.getLogger(__name__)

#: What a stop keeps of its window for ending the tree, releasing the writer lease and saying so.
MARGIN_SECONDS = 1.0

#: An unprotected workload has no checkpoint to lose: SIGTERM, then this long (inside Airflow's 5 s)
#: before SIGKILL, unless stop_grace_seconds says otherwise.
UNPROTECTED_GRACE_SECONDS = 3.0


@dataclass
class StopReport:
    """What a stop did, for its one log line."""

    cause: str  # "SIGTERM", "AirflowTaskTimeout", ...
    started: float  # time.monotonic() when the stop began
    final: Manifest | None = None
    why_no_final: str = ""  # when there is no final checkpoint: off, skipped, failed, out of time
    checkpoint_seconds: float = 0.0
    forwarded: bool = False  # SIGTERM went to the workload (stop_grace_seconds)
    ended_seconds: float = 0.0  # from the start of the stop to the tree's end

    def line(self, checkpoint_id: str, lease_released: bool) -> str:
        final = (f"final checkpoint seq {self.final.seq} in {self.checkpoint_seconds:.2f} s" if self.final is not None
                 else f"no final checkpoint ({self.why_no_final}): a retry resumes from the last heartbeat")
        how = "SIGTERM forwarded, then SIGKILL after the grace" if self.forwarded else "SIGKILL"
        lease = "; writer lease released" if lease_released else ""
        return (f"stopped by {self.cause} checkpoint_id={checkpoint_id}: {final}; workload tree ended ({how}) "
                f"{self.ended_seconds:.2f} s after the stop began{lease}")


def clean_cut(settings: Settings, cp: Checkpointer, workload: Workload, cause: str) -> StopReport:
    """Take the final checkpoint (unless checkpoint_on_term is off) within the stop window, then end
    the tree. Never raises for the checkpoint: ending the tree matters more."""
    report = StopReport(cause=cause, started=time.monotonic())
    window = settings.stop_window_seconds
    grace = settings.stop_grace_seconds
    if window:
        grace = min(grace, max(0.0, window - MARGIN_SECONDS) / 2)  # the checkpoint keeps at least half
    if not settings.checkpoint_on_term:
        report.why_no_final = "checkpoint_on_term is off"
    elif workload.poll() is None:
        budget = max(0.0, window - MARGIN_SECONDS - grace) if window else None
        _final_checkpoint(cp, workload, leave_running=grace > 0, budget=budget, report=report)
    if grace > 0 and workload.poll() is None:
        report.forwarded = True
        workload.stop(grace, signal.SIGTERM)
    _end_tree(workload)
    report.ended_seconds = time.monotonic() - report.started
    return report


def _final_checkpoint(cp: Checkpointer, workload: Workload, *, leave_running: bool, budget: float | None,
                      report: StopReport) -> None:
    """The final checkpoint in a thread, waited for ``budget`` seconds at most (None: as long as it takes).
    Past the budget it is abandoned: the tree is ended under it (CRIU then fails, or its upload loses the
    writer lease as this supervisor releases it, so a late commit is fenced: store/writer_lease.py)."""
    got: dict[str, object] = {}

    def take() -> None:
        try:
            got["manifest"] = cp.checkpoint(workload, leave_running=leave_running, final=True, budget=budget)
        except Exception as e:  # stopping matters more than the final checkpoint
            got["error"] = e

    t0 = time.monotonic()
    t = threading.Thread(target=take, name="cedana-final-checkpoint", daemon=True)
    t.start()
    t.join(budget)
    report.checkpoint_seconds = time.monotonic() - t0
    if t.is_alive():
        report.why_no_final = (f"it did not finish within the {budget:.1f} s the stop window "
                               f"({cp.settings.stop_window_seconds:.1f} s) leaves for it")
        log.warning("final checkpoint abandoned checkpoint_id=%s: %s; ending the workload without it",
                    cp.checkpoint_id, report.why_no_final)
        workload.kill()  # the tree first, then its dump (engine/criu.py: abort_dump says why)
        if cp.engine is not None:
            cp.engine.abort_dump()
        return
    if "error" in got:
        report.why_no_final = f"it failed: {got['error']}"
        log.warning("final checkpoint failed checkpoint_id=%s: %s", cp.checkpoint_id, got["error"])
        return
    m = got.get("manifest")
    if isinstance(m, Manifest):
        report.final = m
    else:
        report.why_no_final = "it was skipped (see above)"


def _end_tree(workload: Workload) -> None:
    """SIGKILL the namespace's init (the kernel then kills every process in it) and reap it."""
    if workload.poll() is None:
        workload.stop(0.0, signal.SIGKILL)
    else:
        workload.wait(timeout=30)
