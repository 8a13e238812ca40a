"""What Slurm says about a job: ``scontrol show job -o`` parsed, and which states end it.

``scontrol`` answers without accounting storage (a small cluster often has no slurmdbd) for as long
as the controller keeps the job (MinJobAge after it ends); ``sacct`` is asked only when it has
forgotten. A job submitted with ``--requeue`` passes through NODE_FAIL or PREEMPTED on its way
back to PENDING after a node loss, so those states end it only once they stay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["FAILED_STATES", "GIVE_UP_SECONDS", "JobInfo", "JobEnd", "parse_sacct", "parse_show_job"]

#: How long Slurm may fail to answer about a job before following it is given up, in the triggerer or in
#: the worker (the job is then cancelled, so that a retry does not run a second copy beside it).
GIVE_UP_SECONDS = 600

#: States in which a job is over and failed (the try fails with the state and exit code).
FAILED_STATES = frozenset({"FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "CANCELLED", "BOOT_FAIL", "DEADLINE",
                           "PREEMPTED", "SPECIAL_EXIT"})
#: A requeued job passes through these before it is PENDING again.
REQUEUE_STATES = frozenset({"NODE_FAIL", "PREEMPTED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"})
_FIELD = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # JobState, e.g. RUNNING, COMPLETED, NODE_FAIL
    reason: str = ""
    exit_code: str = ""  # "code:signal", e.g. 1:0
    nodes: str = ""  # NodeList
    restarts: int = 0  # times Slurm requeued it
    requeue: bool = False

    @property
    def done(self) -> bool:
        return self.state == "COMPLETED" or self.state in FAILED_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code.split(":")[0] in ("0", "")

    @property
    def may_come_back(self) -> bool:
        """A requeue-able job in a state it passes through on its way back to PENDING."""
        return self.requeue and self.state in REQUEUE_STATES

    def describe(self) -> str:
        where = f" on {self.nodes}" if self.nodes and self.nodes != "(null)" else ""
        why = f", reason {self.reason}" if self.reason and self.reason != "None" else ""
        again = f", requeued {self.restarts} time(s)" if self.restarts else ""
        return f"Slurm job {self.job_id} {self.state} (exit code {self.exit_code or '?'}){where}{why}{again}"


def parse_show_job(text: str) -> JobInfo | None:
    """The first job of ``scontrol show job -o ID`` output; None when there is none."""
    for line in text.splitlines():
        f = dict(_FIELD.findall(line))
        if "JobId" in f and "JobState" in f:
            return JobInfo(job_id=f["JobId"], state=f["JobState"], reason=f.get("Reason", ""),
                           exit_code=f.get("ExitCode", ""), nodes=f.get("NodeList", ""),
                           restarts=int(f.get("Restarts", "0") or 0), requeue=f.get("Requeue") == "1")
    return None


def parse_sacct(text: str, job_id: str) -> JobInfo | None:
    """``sacct -n -P -X -j ID -o JobID,State,ExitCode,NodeList`` (the allocation line only)."""
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 4 and parts[0] == job_id:
            state = parts[1].split()[0] if parts[1] else ""  # "CANCELLED by 0"
            return JobInfo(job_id=job_id, state=state, exit_code=parts[2], nodes=parts[3])
    return None


class JobEnd:
    """Is the job over? A done state is, except a requeue-able one, which must stay that way for
    ``settle_seconds`` (Slurm puts a requeued job back to PENDING within seconds of a node loss)."""

    def __init__(self, settle_seconds: float = 30) -> None:
        self.settle_seconds = settle_seconds
        self._since: float | None = None

    def over(self, info: JobInfo, now: float) -> bool:
        if not info.done:
            self._since = None
            return False
        if not info.may_come_back:
            return True
        if self._since is None:
            self._since = now
        return now - self._since >= self.settle_seconds
