"""The version handshake between what writes a supervisor's command line and the supervisor that runs it.

The Kubernetes wrap route and the Slurm route write ``cedana-airflow run|slurm-job ...`` into a pod
or a batch script on the Airflow worker; the CLI that runs it is whatever the image or the compute
node has, which may be older. Flags and variables only ever get added, so a newer supervisor runs
an older operator's command; an older one may not understand a newer operator's. The operator says
which supervisor it needs (``CEDANA_MIN_SUPERVISOR``, and who it is: ``CEDANA_OPERATOR_VERSION``); a
supervisor too old refuses before parsing its arguments, in one line with the fix, instead of an
argparse complaint about a flag. (Supervisors before 0.5.1 do not know the variables: for them the
failure stays argparse's "unrecognized arguments".)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from . import __version__
from .config import HEARTBEAT_AUTO_SETTINGS, env_var

__all__ = ["COOPERATIVE_FLOOR", "HEARTBEAT_AUTO_FLOOR", "JOB_FLOOR", "MIN_SUPERVISOR_ENV", "OPERATOR_VERSION_ENV", "SUPERVISOR_FLOOR", "handshake_env",
           "supervisor_refusal"]

MIN_SUPERVISOR_ENV = "CEDANA_MIN_SUPERVISOR"
OPERATOR_VERSION_ENV = "CEDANA_OPERATOR_VERSION"
#: The oldest supervisor that understands every flag and CEDANA_* variable this version's routes write
#: (raise it when a route starts to use something newer).
#: 0.8.0: an older supervisor accepts unsigned manifests and skips the owner check (docs/security.md).
SUPERVISOR_FLOOR = "0.8.0"
#: ... and the oldest that knows ``mode`` and the cooperative settings (0.6.0), for a command that carries them.
COOPERATIVE_FLOOR = "0.6.0"
#: ... and ``--heartbeat auto`` with its settings (0.7.0).
HEARTBEAT_AUTO_FLOOR = "0.7.0"
#: ... and a job of several parts (0.12.0): an older supervisor would run each part as a job of its own,
#: every part fighting the others for the checkpoint ID's lease (docs/jobs.md).
JOB_FLOOR = "0.12.0"
_AUTO_SETTINGS = frozenset(env_var(name) for name in HEARTBEAT_AUTO_SETTINGS)


def _parse(version: str) -> tuple[int, ...] | None:
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return tuple(int(p or 0) for p in m.groups()) if m else None


def handshake_env(carried: Mapping[str, str] | None = None, *, heartbeat_auto: bool = False,
                  job: bool = False) -> dict[str, str]:
    """What an operator puts beside the command it writes; ``carried``: the CEDANA_* settings it passes along
    (a cooperative mode needs a supervisor that knows it: an older one would fail on an unknown setting);
    ``heartbeat_auto``: the command says ``--heartbeat auto``; ``job``: it runs one part of a job."""
    carried = carried or {}
    cooperative = any(k.startswith("CEDANA_COOPERATIVE_") or (k == "CEDANA_MODE" and v != "transparent")
                      for k, v in carried.items())
    auto = heartbeat_auto or any(k in _AUTO_SETTINGS for k in carried)
    job = job or "CEDANA_JOB_PARTS" in carried
    needed = [SUPERVISOR_FLOOR, *([COOPERATIVE_FLOOR] if cooperative else []), *([HEARTBEAT_AUTO_FLOOR] if auto else []),
              *([JOB_FLOOR] if job else [])]
    floor = max(needed, key=lambda v: _parse(v) or ())
    return {MIN_SUPERVISOR_ENV: floor, OPERATOR_VERSION_ENV: __version__}


def supervisor_refusal(environ: Mapping[str, str], own: str = __version__) -> str | None:
    """Why this supervisor must not run the command it was given, or None."""
    wanted = environ.get(MIN_SUPERVISOR_ENV, "").strip()
    if not wanted:
        return None
    need, have = _parse(wanted), _parse(own)
    if need is None or have is None:
        return f"{MIN_SUPERVISOR_ENV}={wanted!r} is not a version like 0.5.1; the operator that wrote it is broken"
    if have >= need:
        return None
    operator = environ.get(OPERATOR_VERSION_ENV, "an unknown version")
    return (f"this command was written by cedana-airflow {operator} on the Airflow worker, which needs a supervisor "
            f"of {wanted} or later; this one is {own}. Upgrade cedana-airflow where the command runs (the pod's "
            f"image: deploy/Containerfile; a Slurm node's install) to {operator}")
