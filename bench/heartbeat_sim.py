"""``heartbeat = auto`` against fixed intervals (part "heartbeat"): a deterministic simulation of a fleet.

No CRIU and no store: a fleet of tasks, each with a random amount of work (log-uniform, 1 h to 48 h),
runs under failures that come as a Poisson process in wall time (mean ``mtbf``), at five rates from
spot-like (1 h) to stable (7 days). Each task's timeline is simulated event by event, as the runner
and its Heartbeat thread (run/checkpoint_triggers.py) run it:

* a try starts; when a checkpoint was committed, it restores first (R seconds; a failure then fails
  the try and the next one restores again);
* the heartbeat waits its interval (the workload computes), then checkpoints: the workload stands
  still for C (the freeze), then computes on while the checkpoint uploads; the checkpoint is
  committed L seconds after it started (L >= C). The next wait starts at the commit (heartbeats never
  overlap). A failure before the commit loses it: the previous commit stays the latest;
* a failure (at any time: computing, frozen, uploading, restoring) ends the try; the next try starts
  at once from the last committed checkpoint (or from scratch), and the work since it is done again.

A task's time is its wall time from start to finish: work + freezes + work lost + restores.

C, L and R are the measured figures in bench/results.json, per GiB of image, scaled to a 16 GiB
state (see measured_costs). A task's first commit uploads everything (L1, the S3 first checkpoint);
the later ones upload the changed chunks (L, the S3 heartbeats 2-4).

Policies, on the same tasks and the same failure times at each rate (common random numbers):
1. fixed intervals, 30 s to 8 h (40 log-spaced): the best one per rate is the oracle (it knows the rate);
2. the 10-minute fixed interval;
3. ``auto`` through the real code: each try builds ``Settings(heartbeat_seconds="auto",
   failure_history=...)`` with what the fleet saw so far (failures and run time of every earlier try,
   starting from nothing) and a ``Cadence``; ``cadence.observe(C, L)`` after each commit and
   ``cadence.interval()`` for each wait. No mtbf prior; for information, also auto with the true mtbf
   given as ``mtbf_hours``.

Targets: auto's fleet time <= 1.05x the best fixed interval's at every rate, and below the 10-minute
default's at every rate but at most one. Fixed intervals are computed in closed form per try (a fixed
interval repeats one cycle), and checked against the event loop on a sample of tasks.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness import MB, say

from cedana_airflow.config import FailureHistory, Settings
from cedana_airflow.run.cadence import FREEZE_SECONDS_PER_GIB, Cadence, duration_text, estimated_cost, young_daly

GIB = 1 << 30
HOUR = 3600.0
STATE_GIB = 16  # a training state: model + optimizer + data loader
RATES_HOURS = (1.0, 4.0, 12.0, 48.0, 168.0)  # spot-like .. stable
WORK_HOURS = (1.0, 48.0)  # log-uniform
SWEEP = tuple(30.0 * (8 * HOUR / 30.0) ** (k / 39) for k in range(40))  # 30 s .. 8 h
DEFAULT_INTERVAL = 600.0
TARGETS = {"auto_vs_best": 1.05, "default_misses": 1}
CHECKED_TASKS = 40  # tasks per rate on which the closed form is checked against the event loop


# --------------------------------------------------------------------------------------------
# the figures
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    freeze: float  # C: the workload stands still
    commit: float  # L: a heartbeat's start to its commit (changed chunks only)
    first_commit: float  # L1: the first checkpoint of a task (every chunk new)
    restore: float  # R
    per_gib: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


def measured_costs(res: dict[str, Any], gib: float = STATE_GIB) -> Costs:
    """C, L, L1 and R for a ``gib`` GiB state from results.json's measured figures (per GiB of their
    image), naming each; a missing figure falls back and says so."""
    parts = res.get("parts", {})
    per: dict[str, float] = {}
    src: dict[str, str] = {}

    def when(part: str) -> str:
        return f", {part} part run {parts[part]['date']}" if parts.get(part, {}).get("date") else ""

    f = res.get("freeze")
    if f:
        image = f.get("median", {}).get("ours", {}).get("image_bytes") or f["image_mb"] * MB
        per["freeze"] = f["ours_seconds"] / (image / GIB)
        src["freeze"] = (f"freeze.ours_seconds {f['ours_seconds']:.3f} s (CRIU frozen time of our heartbeat dump) for "
                         f"a {image / GIB:.2f} GiB image{when('local')}")
    else:
        per["freeze"] = FREEZE_SECONDS_PER_GIB
        src["freeze"] = f"no measured freeze in results.json: the reference {FREEZE_SECONDS_PER_GIB} s/GiB (cadence.py)"
    s3 = res.get("s3") or {}
    hb = s3.get("heartbeats", {}).get("heartbeats", [])[1:]
    if hb:
        secs = statistics.median(b["seconds"] for b in hb)
        image = statistics.median(b["image_bytes"] for b in hb)
        per["commit"] = secs / (image / GIB)
        src["commit"] = (f"s3.heartbeats 2-{len(hb) + 1}: median {secs:.2f} s from checkpoint() start to commit "
                         f"(dump + upload of ~2% changed chunks + manifest, moto) for a {image / GIB:.2f} GiB image"
                         f"{when('s3-transfer')}")
    else:
        per["commit"] = per["freeze"]
        src["commit"] = "no S3 heartbeat figure in results.json: committed as soon as frozen (L = C)"
    cp = s3.get("checkpoint")
    if cp:
        image = cp["median"]["ours"].get("image_bytes") or cp["runs"]["ours"][0]["image_bytes"]
        per["first_commit"] = cp["ours_seconds"] / (image / GIB)
        src["first_commit"] = (f"s3.checkpoint.ours_seconds {cp['ours_seconds']:.2f} s (first checkpoint: dump + "
                               f"every chunk uploaded, moto) for a {image / GIB:.2f} GiB image{when('s3-transfer')}")
    else:
        per["first_commit"] = per["commit"]
        src["first_commit"] = "no S3 first-checkpoint figure in results.json: as a heartbeat"
    rs = s3.get("restore")
    if rs:
        per["restore"] = rs["ours_seconds"] / (rs["image_mb"] * MB / GIB)
        src["restore"] = (f"s3.restore.ours_seconds {rs['ours_seconds']:.2f} s (download + verify + criu restore, "
                          f"moto) for a {rs['image_mb'] * MB / GIB:.2f} GiB image{when('s3-transfer')}")
    elif (r := res.get("restore")):
        per["restore"] = r["ours_seconds"] / (r["image_mb"] * MB / GIB)
        src["restore"] = f"no S3 restore figure: restore.ours_seconds from file:// {r['ours_seconds']:.2f} s"
    else:
        per["restore"] = 2.0 * FREEZE_SECONDS_PER_GIB
        src["restore"] = f"no measured restore in results.json: {2 * FREEZE_SECONDS_PER_GIB} s/GiB"
    c = per["freeze"] * gib
    return Costs(freeze=c, commit=max(per["commit"] * gib, c), first_commit=max(per["first_commit"] * gib, c),
                 restore=per["restore"] * gib, per_gib=per, sources=src)


# --------------------------------------------------------------------------------------------
# the fleet: task lengths and failure times, the same for every policy
# --------------------------------------------------------------------------------------------
class Fleet:
    """``n`` tasks of log-uniform work, and per task a stream of failure times in unit time (cumulative
    sums of Exp(1)); at mean time between failures M the failures come at M times them: the same
    draws at every rate and for every policy."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        lo, hi = (math.log(h * HOUR) for h in WORK_HOURS)
        self.work = [math.exp(rng.uniform(lo, hi)) for _ in range(n)]
        self._rngs = [random.Random(seed * 1_000_003 + 7919 * (j + 1)) for j in range(n)]
        self._units: list[list[float]] = [[] for _ in range(n)]

    def failure(self, task: int, k: int, mtbf: float) -> float:
        """The k-th failure of ``task`` (0-based), in seconds from the task's start."""
        u = self._units[task]
        while len(u) <= k:
            u.append((u[-1] if u else 0.0) + self._rngs[task].expovariate(1.0))
        return u[k] * mtbf


@dataclass
class Outcome:
    wall: float
    failures: int


# --------------------------------------------------------------------------------------------
# the event loop (any policy) and the closed form (a fixed interval)
# --------------------------------------------------------------------------------------------
class Policy:
    """What the runner's heartbeat does: an interval before each wait, told of each commit."""

    def start_try(self, has_checkpoint: bool) -> None:
        pass

    def interval(self) -> float:
        raise NotImplementedError

    def observe(self, cost: float, commit: float) -> None:
        pass

    def end_try(self, seconds: float, failed: bool) -> None:
        pass


class Fixed(Policy):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def interval(self) -> float:
        return self.seconds


def run_task(work: float, fail_at: Callable[[int], float], k: Costs, policy: Policy) -> Outcome:
    """One task, event by event: tries, restores, waits, freezes, uploads, commits and failures."""
    C, R = k.freeze, k.restore
    t = 0.0
    committed, has = 0.0, False
    nf = 0
    f = fail_at(0)
    while True:  # one try per turn
        start = t
        policy.start_try(has)
        done = None
        if has and f < t + R:
            t = f
        else:
            t += R if has else 0.0
            w = committed
            while True:
                i = policy.interval()
                if work - w <= i:  # ends while computing
                    done = t + work - w
                    break
                if f < t + i:
                    break
                t += i
                w += i
                snap = w
                lat = k.commit if has else k.first_commit
                if f < t + C:  # frozen
                    break
                if work - w <= lat - C:  # ends while its checkpoint uploads
                    done = t + C + work - w
                    break
                if f < t + lat:  # the upload never commits
                    break
                t += lat
                w += lat - C
                committed, has = snap, True
                policy.observe(C, lat)
            if done is not None and done <= f:
                policy.end_try(done - start, False)
                return Outcome(done, nf)
            t = f
        policy.end_try(t - start, True)
        nf += 1
        f = fail_at(nf)


def fixed_task(work: float, fail_at: Callable[[int], float], k: Costs, i: float) -> Outcome:
    """run_task with Fixed(i), in closed form per try: after the first commit every cycle is the same
    (wait i, freeze C, upload until L): it adds i + L - C of work in i + L of time."""
    C, L, R = k.freeze, k.commit, k.restore
    t = 0.0
    committed, has = 0.0, False
    nf = 0
    f = fail_at(0)
    period, gain = i + L, i + L - C
    while True:
        if has:
            if f < t + R:
                t = f
                nf += 1
                f = fail_at(nf)
                continue
            t += R
        w = committed
        if not has:  # the first cycle uploads everything
            d = work - w
            if d <= i:
                if t + d <= f:
                    return Outcome(t + d, nf)
            elif f >= t + i + C and d - i <= k.first_commit - C:
                if t + i + C + d - i <= f:
                    return Outcome(t + i + C + d - i, nf)
            elif f >= t + i + k.first_commit:
                committed, has = w + i, True
                t += i + k.first_commit
                w = committed + k.first_commit - C
            if not has:
                t = f
                nf += 1
                f = fail_at(nf)
                continue
        d = work - w
        n = max(0, math.ceil(d / gain) - 1)  # whole cycles before the one it ends in
        rem = d - n * gain
        end = t + n * period + (rem if rem <= i else rem + C)
        if end <= f:
            return Outcome(end, nf)
        m = int((f - t) // period)  # commits before the failure
        if m >= 1:
            committed = w + (m - 1) * gain + i
        t = f
        nf += 1
        f = fail_at(nf)


# --------------------------------------------------------------------------------------------
# auto: the real Settings and Cadence, learning the fleet's failure rate
# --------------------------------------------------------------------------------------------
class Auto(Policy):
    """``heartbeat = auto`` as the runner runs it: each try a new Cadence on the fleet's history so far."""

    def __init__(self, k: Costs, prior_hours: float | None = None) -> None:
        self.k = k
        self.prior_hours = prior_hours
        self.failures, self.exposure, self.tries = 0, 0.0, 0
        self.fleet_rate: float | None = None  # the store's measured freeze rate, once a checkpoint is in it
        self.cadence: Cadence | None = None
        self.first_failure_task: int | None = None
        self.task = 0
        self.settled: list[float] = []  # each task's last interval (its cadence after its commits)

    def start_try(self, has_checkpoint: bool) -> None:
        history = FailureHistory(failures=self.failures, exposure_seconds=self.exposure, tries=self.tries,
                                 scope="the simulated fleet")
        settings = Settings(heartbeat_seconds="auto", mtbf_hours=self.prior_hours, failure_history=history)
        if has_checkpoint:  # the runner: this ID's earlier checkpoints' median cost
            first, source = self.k.freeze, "measured on earlier checkpoints of this ID"
        else:  # the tree's size at the fleet's measured freeze rate (the reference rate before any)
            first, source = estimated_cost(STATE_GIB * GIB, self.fleet_rate)
        self.cadence = Cadence(settings, first_cost=first, cost_source=source)

    def interval(self) -> float:
        assert self.cadence is not None
        return float(self.cadence.interval())

    def observe(self, cost: float, commit: float) -> None:
        assert self.cadence is not None
        self.cadence.observe(cost, commit)
        self.fleet_rate = self.k.per_gib["freeze"]

    def end_try(self, seconds: float, failed: bool) -> None:
        self.tries += 1
        self.exposure += seconds
        if failed:
            self.failures += 1
            if self.first_failure_task is None:
                self.first_failure_task = self.task
        else:
            assert self.cadence is not None
            self.settled.append(self.cadence.interval())
            self.task += 1


# --------------------------------------------------------------------------------------------
# the part
# --------------------------------------------------------------------------------------------
def bench_heartbeat(res: dict[str, Any], tasks: int = 1000, seed: int = 20261203) -> dict[str, Any]:
    """``res``: the results so far (results.json with this run's parts over it), for the measured figures."""
    k = measured_costs(res)
    say(f"heartbeat simulation: {tasks} tasks per rate, {STATE_GIB} GiB state: C {k.freeze:.2f} s, "
        f"L {k.commit:.2f} s (first {k.first_commit:.1f} s), R {k.restore:.1f} s")
    fleet = Fleet(tasks, seed)
    work_total = sum(fleet.work)
    rates = []
    checked = 0
    for hours in RATES_HOURS:
        mtbf = hours * HOUR
        fails = [(lambda n, j=j: fleet.failure(j, n, mtbf)) for j in range(tasks)]

        def fixed_total(i: float) -> tuple[float, int]:
            outs = [fixed_task(fleet.work[j], fails[j], k, i) for j in range(tasks)]
            return sum(o.wall for o in outs), sum(o.failures for o in outs)

        sweep = [(i, *fixed_total(i)) for i in SWEEP]
        best_i, best_total, _ = min(sweep, key=lambda x: x[1])
        default_total, _ = fixed_total(DEFAULT_INTERVAL)
        for i in (best_i, DEFAULT_INTERVAL, SWEEP[0], SWEEP[-1]):  # the closed form is the event loop
            for j in range(min(CHECKED_TASKS, tasks)):
                a = fixed_task(fleet.work[j], fails[j], k, i)
                b = run_task(fleet.work[j], fails[j], k, Fixed(i))
                assert a.failures == b.failures and math.isclose(a.wall, b.wall, rel_tol=1e-9), (hours, i, j, a, b)
                checked += 1
        runs: dict[str, dict[str, Any]] = {}
        for name, prior in (("auto", None), ("auto_prior", hours)):
            pol = Auto(k, prior)
            outs = [run_task(fleet.work[j], fails[j], k, pol) for j in range(tasks)]
            runs[name] = {"total_seconds": sum(o.wall for o in outs), "failures": sum(o.failures for o in outs),
                          "settled_interval_seconds": statistics.median(pol.settled[len(pol.settled) // 2:]),
                          "first_failure_task": pol.first_failure_task,
                          "learned_mtbf_hours": pol.exposure / pol.failures / HOUR if pol.failures else None}
        auto = runs["auto"]
        r = {"mtbf_hours": hours, "daly_interval_seconds": young_daly(k.freeze, mtbf),
             "best": {"interval_seconds": best_i, "total_seconds": best_total},
             "default": {"interval_seconds": DEFAULT_INTERVAL, "total_seconds": default_total},
             **runs,
             "ratio_best": auto["total_seconds"] / best_total,
             "ratio_default": auto["total_seconds"] / default_total,
             "ratio_prior_best": runs["auto_prior"]["total_seconds"] / best_total,
             "overhead": {n: x / work_total - 1 for n, x in (("best", best_total), ("default", default_total),
                                                              ("auto", auto["total_seconds"]),
                                                              ("auto_prior", runs["auto_prior"]["total_seconds"]))},
             "sweep": [[round(i, 1), round(x / work_total - 1, 6)] for i, x, _ in sweep]}
        r["pass"] = r["ratio_best"] <= TARGETS["auto_vs_best"]
        rates.append(r)
        say(f"  MTBF {duration_text(mtbf)}: best fixed {duration_text(best_i)} +{100 * r['overhead']['best']:.2f}%, "
            f"10m +{100 * r['overhead']['default']:.2f}%, auto +{100 * r['overhead']['auto']:.2f}% "
            f"(settled at {duration_text(auto['settled_interval_seconds'])}; {auto['failures'] / tasks:.1f} failures "
            f"per task), with the prior +{100 * r['overhead']['auto_prior']:.2f}%; auto/best {r['ratio_best']:.4f}x, "
            f"auto/10m {r['ratio_default']:.4f}x")
    beaten = sum(r["ratio_default"] < 1 for r in rates)
    return {"heartbeat": {
        "name": "heartbeat = auto (real Settings + Cadence) vs fixed intervals, simulated fleet",
        "tasks": tasks, "seed": seed, "state_gib": STATE_GIB, "work_hours": list(WORK_HOURS),
        "work_total_hours": work_total / HOUR, "costs": {"freeze_seconds": k.freeze, "commit_seconds": k.commit,
                                                       "first_commit_seconds": k.first_commit,
                                                       "restore_seconds": k.restore, "per_gib": k.per_gib,
                                                       "sources": k.sources},
        "settings": {"heartbeat_min_seconds": Settings().heartbeat_min_seconds,
                     "heartbeat_max_seconds": Settings().heartbeat_max_seconds},
        "sweep_seconds": [SWEEP[0], SWEEP[-1], len(SWEEP)], "closed_form_checked": checked,
        "rates": rates, "default_beaten": beaten, "targets": TARGETS,
        "pass": {"vs_best": all(r["pass"] for r in rates),
                 "vs_default": beaten >= len(rates) - TARGETS["default_misses"]}}}
