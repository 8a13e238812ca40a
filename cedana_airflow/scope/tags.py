"""DAG-level ``cedana:`` tags: what a DAG author declares about a workload, and the rules they imply.

    cedana:opt-in              the DAG asks for its checkpointable tasks to be on the list
    cedana:effects=none        no effects outside the task's own outputs
    cedana:effects=external    API calls, DB writes, pull requests: every checkpointed task needs an
                               idempotency_key, or the DAG does not load
    cedana:realtime            reads real-time data: its checkpointed tasks need max_restore_gap
    cedana:license=NAME        license-bound software: its checkpointed tasks need lease_seconds

Pure functions over declarations, so the same rules serve the cluster policy (at parse time), the
operator (at run time) and ``cedana-airflow explain``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DagTags", "TaskDecl", "Violation", "check_dag", "parse_tags", "KNOWN_TAGS"]

PREFIX = "cedana:"
KNOWN_TAGS = ("cedana:opt-in", "cedana:effects=none", "cedana:effects=external", "cedana:realtime", "cedana:license=NAME")
_LICENSE = re.compile(r"cedana:license=([A-Za-z0-9._-]{1,64})")


@dataclass(frozen=True)
class DagTags:
    opt_in: bool = False
    effects: str | None = None  # "none" | "external" | None (undeclared)
    realtime: bool = False
    licenses: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskDecl:
    """What a checkpointed task declares (operator arguments)."""

    task_id: str
    idempotency_key: str | None = None
    max_restore_gap_seconds: float | None = None
    lease_seconds: float | None = None


@dataclass(frozen=True)
class Violation:
    rule: str
    task_id: str | None
    message: str  # the rule, the task and the fix, in one line

    def __str__(self) -> str:
        return self.message


def parse_tags(tags: Iterable[str]) -> DagTags:
    """The ``cedana:`` tags of a DAG (others are ignored); an unknown one is a ConfigError with a did-you-mean."""
    opt_in = realtime = False
    effects: str | None = None
    licenses: list[str] = []
    for tag in tags:
        if not tag.startswith(PREFIX):
            continue
        if tag == "cedana:opt-in":
            opt_in = True
        elif tag in ("cedana:effects=none", "cedana:effects=external"):
            new = tag.split("=", 1)[1]
            if effects and effects != new:
                raise ConfigError("tags cedana:effects=none and cedana:effects=external contradict each other. Keep one.")
            effects = new
        elif tag == "cedana:realtime":
            realtime = True
        elif m := _LICENSE.fullmatch(tag):
            licenses.append(m.group(1))
        else:
            guess = difflib.get_close_matches(tag, [t.replace("=NAME", "=") if "NAME" in t else t for t in KNOWN_TAGS], n=1, cutoff=0.6)
            hint = f" Did you mean {guess[0]!r}?" if guess else ""
            raise ConfigError(f"unknown tag {tag!r}.{hint} Known cedana tags: {', '.join(KNOWN_TAGS)}.")
    return DagTags(opt_in, effects, realtime, tuple(licenses))


def check_dag(dag_id: str, tags: DagTags, tasks: Sequence[TaskDecl]) -> list[Violation]:
    """Every rule an opted-in DAG breaks, each with its fix; a DAG that does not opt in breaks none."""
    if not tags.opt_in:
        return []
    out: list[Violation] = []
    if tags.effects is None:
        out.append(Violation("effects-declared", None, (
            f"DAG {dag_id} has cedana:opt-in but no cedana:effects tag. Add cedana:effects=none, or "
            "cedana:effects=external if its tasks call APIs, write to databases or open pull requests.")))
    for t in tasks:
        if tags.effects == "external" and not t.idempotency_key:
            out.append(Violation("idempotency-key", t.task_id, (
                f"task {dag_id}.{t.task_id}: the DAG declares cedana:effects=external, so a restored task may repeat "
                "an effect. Give it idempotency_key=\"...\" (templated; the workload reads CEDANA_IDEMPOTENCY_KEY).")))
        if tags.realtime and t.max_restore_gap_seconds is None:
            out.append(Violation("realtime-gap", t.task_id, (
                f"task {dag_id}.{t.task_id}: the DAG declares cedana:realtime, so state restored after a long gap is "
                "stale. Give it max_restore_gap=timedelta(...); an older checkpoint then starts fresh.")))
        if tags.licenses and t.lease_seconds is None:
            out.append(Violation("license-lease", t.task_id, (
                f"task {dag_id}.{t.task_id}: the DAG declares cedana:license={','.join(tags.licenses)}, so a restore "
                "after the lease expired holds a dead license. Give it lease=timedelta(...) (the lease length).")))
    return out
