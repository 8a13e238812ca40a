"""Inside a Slurm job: is it protected? Cedana's model, judged on the compute node.

A checkpoint partition (the opt-in list's ``[node] partitions``) limits checkpoint/restore to jobs
submitted there, and inside it ``CEDANA_ENABLE`` is the per-job opt-in. A job missing either runs
its command unchanged, and says why in its output (which reaches the Airflow task log).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from .batch import ENABLE_ENV

__all__ = ["protection"]

_YES = ("1", "true", "yes", "on")


def protection(environ: Mapping[str, str], partitions: tuple[str, ...]) -> tuple[bool, str]:
    """(protected, why) for the job whose environment this is."""
    partition = environ.get("SLURM_JOB_PARTITION", "")
    enabled = environ.get(ENABLE_ENV, "").strip().lower() in _YES
    if not partition:
        return False, "not inside a Slurm batch job (SLURM_JOB_PARTITION is unset): the command runs unprotected"
    if not partitions:
        return False, (f"the opt-in list names no checkpoint partition ([node] partitions), so partition {partition} "
                       "is not one: this job runs unprotected")
    if not any(fnmatchcase(partition, p) for p in partitions):
        return False, (f"partition {partition} is not a checkpoint partition (the opt-in list's [node] partitions: "
                       f"{', '.join(partitions)}): this job runs unprotected")
    if not enabled:
        return False, (f"{ENABLE_ENV} is not set for this job: in checkpoint partition {partition} only jobs carrying "
                       f"{ENABLE_ENV}=1 are checkpointed; this one runs unprotected")
    node = environ.get("SLURMD_NODENAME", "?")
    restarts = environ.get("SLURM_RESTART_COUNT", "0") or "0"
    return True, (f"protected: checkpoint partition {partition}, {ENABLE_ENV}=1; node {node}, "
                  f"Slurm restart {restarts} of job {environ.get('SLURM_JOB_ID', '?')}")
