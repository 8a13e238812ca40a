"""The heartbeat's interval: fixed, or (``heartbeat = auto``) chosen from evidence.

A checkpoint too often wastes the workload's time in freezes; too rarely, every failure loses more
work. The optimum is classical: Young (1974), refined by Daly (2006, "A higher order estimate of the
optimum checkpoint interval for restart dumps") for costs that are not small against the mean time
between failures M:

    tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C     for C < 2M, else M

where C is what one checkpoint costs the workload (the time it stands still: CRIU's freeze and the
GPU lock, or a cooperative workload's own write). C is measured on this task's own checkpoints (the
median of the last few, so one slow upload does not swing it); before the first, it is estimated from
the tree's size at the fleet's measured freeze rate. M comes from the failures Airflow saw on this
kind of work (FailureHistory, read by the Airflow adapter) and the operator's prior ``mtbf_hours``,
combined as a Gamma prior counting as one failure in ``mtbf_hours``: M = (prior + run time) / (1 + n).
With neither a failure seen nor a prior, M is unknown and the interval is ``heartbeat_max_seconds``.

Expected work lost per failure is about tau / 2 (a failure lands anywhere in an interval) plus the
time from a checkpoint's start to its commit (until then, the previous one is the latest).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import FailureHistory, Settings
from ..format.manifest import Manifest
from ..store.index import HeartbeatRow
from ..units import duration_text

__all__ = ["COST_WINDOW", "Cadence", "FREEZE_SECONDS_PER_GIB", "HeartbeatChoice", "checkpoint_cost", "duration_text",
           "estimated_cost", "mean_time_between_failures", "young_daly"]

#: CRIU froze 1 GiB in about this long on our reference machine (bench/): the first heartbeat's cost
#: estimate when the store holds no measured freeze to learn the fleet's rate from.
FREEZE_SECONDS_PER_GIB = 0.6
#: Costs the interval is chosen from: the median of this many of the latest checkpoints.
COST_WINDOW = 5
#: A new interval is taken (and said) only when it differs from the current one by this fraction.
CHANGE = 0.10


def young_daly(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints (seconds)."""
    if mtbf <= 0:
        return 0.0
    if cost <= 0:
        return 0.0  # a free checkpoint is best taken all the time: the lower bound decides
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def mean_time_between_failures(history: FailureHistory | None, prior_hours: float | None) -> float | None:
    """M in seconds, or None where nothing says failures happen (no failure seen, no prior)."""
    failures = history.failures if history else 0
    exposure = history.exposure_seconds if history else 0.0
    if prior_hours:
        return (prior_hours * 3600 + exposure) / (1 + failures)
    if failures:
        return max(exposure, 1.0) / failures
    return None


def checkpoint_cost(m: Manifest) -> float:
    """What a checkpoint cost the workload: the time it stood still (freeze_seconds holds CRIU's freeze
    plus the GPU's lock and copy, or a cooperative workload's write)."""
    return m.freeze_seconds


@dataclass(frozen=True)
class HeartbeatChoice:
    """One interval and what it was chosen from: what the task log says and the listing shows."""

    interval_seconds: float
    auto: bool
    cost_seconds: float  # what one checkpoint costs the workload
    cost_source: str  # "measured on 3 checkpoints", "estimated: 2.1 GiB at 0.6 s/GiB"
    commit_seconds: float  # from a checkpoint's start to its commit (0 before one was measured)
    mtbf_seconds: float | None  # None: no failure seen and no prior
    failures_text: str  # "failures every ~9.4 h on queue gpu over 30 days"
    bound: str = ""  # "heartbeat_min_seconds" / "heartbeat_max_seconds" when a bound decided

    @property
    def expected_loss_seconds(self) -> float:
        """Work a failure loses, on average: half an interval, plus the time until a checkpoint commits."""
        return self.interval_seconds / 2 + self.commit_seconds

    def line(self) -> str:
        """The task log's line, e.g. "heartbeat 7m12s: checkpoint costs 3.1 s, failures every ~9.4 h on
        queue gpu over 30 days"."""
        bound = f" ({self.bound})" if self.bound else "" if self.auto else " (fixed)"
        failures = f", {self.failures_text}" if self.auto else ""
        return (f"heartbeat {duration_text(self.interval_seconds)}{bound}: checkpoint costs "
                f"{_seconds_text(self.cost_seconds)} ({self.cost_source}){failures}; expected work lost "
                f"per failure ~{duration_text(self.expected_loss_seconds)}")

    def as_row(self, in_force: str = "") -> HeartbeatRow:
        """What the listing index keeps of it, and what ``run --json`` and the operator's summary say;
        ``in_force``: the setting it came from, as ``explain`` says it (Settings.heartbeat_text)."""
        return HeartbeatRow(interval_seconds=round(self.interval_seconds, 3), auto=self.auto,
                            cost_seconds=round(self.cost_seconds, 4), commit_seconds=round(self.commit_seconds, 3),
                            mtbf_seconds=None if self.mtbf_seconds is None else round(self.mtbf_seconds, 1),
                            expected_loss_seconds=round(self.expected_loss_seconds, 3), reason=self.line(),
                            in_force=in_force)


class Cadence:
    """The interval of one run's heartbeat: fixed, or re-chosen after each checkpoint (auto)."""

    def __init__(self, settings: Settings, *, first_cost: float, cost_source: str,
                 earlier: Sequence[float] = ()) -> None:
        """``earlier``: the costs of this ID's latest checkpoints (a retry's): measured, they count with this
        run's own."""
        self.settings = settings
        self.auto = settings.heartbeat_auto
        # a fixed interval asks for no failure rate: the operators read no history for it
        self.mtbf = mean_time_between_failures(settings.failure_history, settings.mtbf_hours) if self.auto else None
        self._failures = _failures_text(settings.failure_history, settings.mtbf_hours, self.mtbf)
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)
        self._commits: deque[float] = deque(maxlen=COST_WINDOW)
        self._costs.extend(earlier)
        self._observed = False
        self.choice = self._choose(first_cost, cost_source, 0.0)

    def interval(self) -> float:
        return self.choice.interval_seconds

    def observe(self, cost: float, commit: float) -> HeartbeatChoice | None:
        """A checkpoint was committed: it cost the workload ``cost`` s and took ``commit`` s from its start.
        Returns the new choice when the interval changed by CHANGE or more (or for the first measurement),
        else None (the figures are updated quietly)."""
        first, self._observed = not self._observed, True
        self._costs.append(max(cost, 0.0))
        self._commits.append(max(commit, cost, 0.0))
        n = len(self._costs)
        new = self._choose(statistics.median(self._costs), f"measured on {n} checkpoint{'s' if n > 1 else ''}",
                           statistics.median(self._commits))
        old, self.choice = self.choice, new
        if first or abs(new.interval_seconds - old.interval_seconds) >= CHANGE * old.interval_seconds:
            return new
        self.choice = replace(new, interval_seconds=old.interval_seconds, bound=old.bound)  # no jitter
        return None

    def _choose(self, cost: float, source: str, commit: float) -> HeartbeatChoice:
        s = self.settings
        if not self.auto:
            return HeartbeatChoice(float(s.heartbeat_seconds), False, cost, source, commit, self.mtbf, self._failures)
        lo, hi = s.heartbeat_min_seconds, s.heartbeat_max_seconds
        ideal = hi if self.mtbf is None else young_daly(cost, self.mtbf)
        bound = "heartbeat_max_seconds" if ideal >= hi else "heartbeat_min_seconds" if ideal <= lo else ""
        return HeartbeatChoice(min(max(ideal, lo), hi), True, cost, source, commit, self.mtbf, self._failures, bound)


def estimated_cost(tree_bytes: int, fleet_seconds_per_gib: float | None) -> tuple[float, str]:
    """The first heartbeat's cost, before any was measured: the tree's size at the fleet's freeze rate."""
    rate = fleet_seconds_per_gib if fleet_seconds_per_gib is not None else FREEZE_SECONDS_PER_GIB
    whose = "the fleet's" if fleet_seconds_per_gib is not None else "the reference"
    gib = tree_bytes / (1 << 30)
    return gib * rate, f"estimated: {gib:.2g} GiB at {whose} {rate:.2g} s/GiB"


def _failures_text(h: FailureHistory | None, prior_hours: float | None, mtbf: float | None) -> str:
    scope = (h.scope or "this work") if h else "this work"
    days = f"{h.window_days:g} days" if h else "its history"
    seen = (f"{h.failures} failure{'s' if h.failures != 1 else ''} in {h.tries} tries ({duration_text(h.exposure_seconds)} "
            f"run) on {scope} over {days}" if h else "no failure history")
    prior = f", mtbf_hours {prior_hours:g} as a prior" if prior_hours else ""
    note = f" [{h.note}]" if h and h.note else ""
    if mtbf is None:
        return f"no failures seen ({seen}){note}"
    return f"failures every ~{duration_text(mtbf)} ({seen}{prior}){note}"


def _seconds_text(s: float) -> str:
    return f"{s:.2g} s" if s < 10 else f"{s:.0f} s"
