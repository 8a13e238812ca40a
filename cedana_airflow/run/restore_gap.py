"""Whether the latest checkpoint is still worth restoring, or the workload should start fresh.

A DAG tagged ``cedana:realtime`` gives its tasks a ``max_restore_gap``: resuming a reader of live
data after a long gap would compute on a world that has moved on. A DAG tagged ``cedana:license=NAME``
gives a ``lease``: the restored process would hold a license checkout that expired meanwhile. Past
either limit the workload starts fresh, unless a ``lease_renew_command`` renews the lease first
(it runs with CEDANA_CHECKPOINT_ID and CEDANA_RESTORE_GAP_SECONDS; exit 0 restores).

The verdict carries its notes for the caller's log rather than logging them here, so the task log
says in its own words why a retry started over.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from ..config import Settings
from ..errors import CedanaError
from ..format.manifest import Manifest
from ..format.selection import AgeLimit, limits_exceeded
from ..store.base import Store
from ..store.transfer import load_manifests

__all__ = ["GapVerdict", "judge_restore_gap", "judge_settings"]

#: A renew command that hangs must not hold the task forever.
_RENEW_TIMEOUT_SECONDS = 300


@dataclass(frozen=True)
class GapVerdict:
    resume: bool
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, message), in order


def judge_restore_gap(store: Store, checkpoint_id: str, limits: Sequence[AgeLimit],
                      renew_command: Sequence[str] = (), now: datetime | None = None,
                      trusted: Callable[[Manifest], bool] | None = None) -> GapVerdict:
    """Resume unless the latest checkpoint is older than one of ``limits`` (a lease may be renewed).
    With ``trusted``, the latest one it accepts: a forged old manifest must not start a task fresh,
    nor run the renew command."""
    if not limits:
        return GapVerdict(True)
    try:
        latest = [m for m in load_manifests(store, checkpoint_id) if trusted is None or trusted(m)]
    except CedanaError:
        return GapVerdict(True)  # the restore itself will report the store's problem
    if not latest:
        return GapVerdict(True)
    gap, beyond = limits_exceeded(latest[0], now or datetime.now(timezone.utc), limits)
    notes: list[tuple[int, str]] = []
    for limit in beyond:
        if limit.name == "lease" and renew_command and _renew_lease(renew_command, checkpoint_id, gap, notes):
            continue
        notes.append((logging.WARNING, f"the latest checkpoint (seq {latest[0].seq}) is {gap:.0f} s old, beyond "
                                       f"{limit.name} = {limit.seconds:.0f} s: starting fresh instead of restoring it"))
        return GapVerdict(False, tuple(notes))
    return GapVerdict(True, tuple(notes))


def judge_settings(store: Store, checkpoint_id: str, settings: Settings, *, include_gap: bool,
                   trusted: Callable[[Manifest], bool] | None = None) -> GapVerdict:
    """The verdict of the limits ``settings`` set: the lease (``lease_renew_command`` may renew it), and
    ``max_restore_gap_seconds`` when the caller's restore does not refuse each candidate itself
    (run_workload's does; Cedana's runtime, on the Kubernetes ``cedana`` route, does not)."""
    gap = settings.max_restore_gap_seconds if include_gap else None
    limits = [AgeLimit(name, float(v)) for name, v in (("max_restore_gap", gap), ("lease", settings.lease_seconds))
              if v is not None]
    return judge_restore_gap(store, checkpoint_id, limits, shlex.split(settings.lease_renew_command or ""),
                             trusted=trusted)


def _renew_lease(argv: Sequence[str], checkpoint_id: str, gap: float, notes: list[tuple[int, str]]) -> bool:
    env = {**os.environ, "CEDANA_CHECKPOINT_ID": checkpoint_id, "CEDANA_RESTORE_GAP_SECONDS": f"{gap:.0f}"}
    try:
        r = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=_RENEW_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
        notes.append((logging.WARNING, f"lease_renew_command failed to run: {e}"))
        return False
    notes.extend((logging.INFO, f"lease_renew_command: {line}") for line in (r.stdout + r.stderr).splitlines())
    if r.returncode == 0:
        notes.append((logging.INFO, f"the lease was renewed after a {gap:.0f} s gap; restoring"))
        return True
    notes.append((logging.WARNING, f"lease_renew_command exited {r.returncode}"))
    return False
