"""The opt-in list: which nodes, queues and workloads may be checkpointed, written by the cluster operator.

A task is in scope only when all three scopes admit it. A scope that the file does not declare admits
nothing, and an empty or missing file admits nothing at all: nothing is checkpointed until someone
puts it on the list. ``["*"]`` admits everything in a scope. Every decision carries its reasons, so a
task can say why it is (not) in scope (``cedana-airflow explain``).

TOML, or YAML when PyYAML is installed (Airflow brings it)::

    [node]                                   # worker hostnames (fnmatch patterns), Kubernetes node labels,
    hostnames = ["gpu-test-01"]              # or Slurm partitions
    labels = { "cedana.ai/enabled" = "true" }   # the default; labels = {} admits by hostname only
    partitions = ["cedana"]                  # Slurm checkpoint partitions (jobs there opt in with CEDANA_ENABLE)
    [queue]                                  # Airflow queues and/or pools
    queues = ["cedana"]
    [workload]                               # DAG IDs, or DAG_ID.TASK_ID, as patterns
    dags = ["train_*"]
    tasks = ["nightly.finetune"]
    [workload.defaults]                      # core settings for what this scope admits (node < queue < workload)
    heartbeat_seconds = 600

    [rules]                                  # eligibility, each refusal named in the decision
    min_expected_seconds = 600               # tasks expected shorter re-run instead (expected_duration, else
                                             # learned from Airflow's history of the task)
    job_server_queues = ["emr"]              # job_server tasks only on these queues
    gpu_needs_nvidia = true                  # gpu tasks only where an NVIDIA driver is present
    require_dag_opt_in = false               # true: only DAGs tagged cedana:opt-in (tag rules checked at parse)

    [[policies]]                             # trigger + filter + action, applied after the scope defaults
    name = "big-memory"
    trigger = { memory_above_bytes = 60_000_000_000 }   # or schedule_seconds = 600, or signal = "SIGTERM"
    filter = { dags = ["train_*"], queues = ["gpu"], tags = ["team:ml"] }
    action = "checkpoint"                    # or "none": switch that trigger off

    [drills]                                 # the cedana_fleet_drill DAG's live mode (off unless set)
    live = true                              # fail running checkpointed tasks on purpose and follow the retry
    max_per_run = 1                          # blast radius: tasks failed by one drill, per DAG, per pool
    max_per_dag = 1
    max_per_pool = 1
    windows = ["Sat 02:00-06:00"]            # UTC; empty: any time
    max_checkpoint_age_seconds = 900         # only tasks whose latest checkpoint is this fresh
    kill_switch_variable = "cedana_drills_stop"   # set this Airflow Variable (or pause the drill DAG) to stop
    follow_seconds = 900                     # how long a drill follows a retry before reporting
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import Settings
from ..errors import ConfigError
from .windows import Window, parse_window

__all__ = ["DEFAULT_NODE_LABEL", "Decision", "Drills", "OptInList", "Policy", "Where", "decide", "load_optin", "parse_labels"]

#: The node label of the Kubernetes route (issue: the Kubernetes route) when a file names none.
DEFAULT_NODE_LABEL = ("cedana.ai/enabled", "true")


class _Scope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    defaults: dict[str, Any] = Field(default_factory=dict, description="Core settings for what this scope admits.")

    @field_validator("defaults")
    @classmethod
    def _known_settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(Settings.model_fields))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)} in defaults; known: {', '.join(sorted(Settings.model_fields))}")
        return v


class NodeScope(_Scope):
    hostnames: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=lambda: dict([DEFAULT_NODE_LABEL]),
                                   description="All of these labels, on a Kubernetes node (CEDANA_NODE_LABELS there).")
    partitions: tuple[str, ...] = Field(default=(), description="Slurm checkpoint partitions (patterns): the nodes of "
                                        "these partitions are in scope for jobs that carry CEDANA_ENABLE=1.")


class QueueScope(_Scope):
    queues: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()


class WorkloadScope(_Scope):
    dags: tuple[str, ...] = ()
    tasks: tuple[str, ...] = Field(default=(), description="DAG_ID.TASK_ID patterns.")


class PolicyTrigger(BaseModel):
    """Exactly one: memory above N bytes (checkpoint now), a schedule (heartbeat), or SIGTERM / a drain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_above_bytes: int | None = Field(default=None, gt=0)
    schedule_seconds: float | None = Field(default=None, gt=0)
    signal: Literal["SIGTERM"] | None = None

    @model_validator(mode="after")
    def _one(self) -> PolicyTrigger:
        if sum(v is not None for v in (self.memory_above_bytes, self.schedule_seconds, self.signal)) != 1:
            raise ValueError("a trigger is exactly one of memory_above_bytes, schedule_seconds, signal")
        return self


class PolicyFilter(BaseModel):
    """Empty fields match everything; a task must match every field that is given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dags: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()


class Policy(BaseModel):
    """trigger + filter + action, e.g. "GPU or host memory above 60 GB -> checkpoint now" for train_* DAGs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    trigger: PolicyTrigger
    filter: PolicyFilter = Field(default_factory=PolicyFilter)
    action: Literal["checkpoint", "none"] = "checkpoint"

    def matches(self, w: Where) -> bool:
        f = self.filter
        return ((not f.dags or _first_match(w.dag_id, f.dags) is not None)
                and (not f.queues or _first_match(w.queue, f.queues) is not None)
                and (not f.tags or any(_first_match(t, f.tags) for t in w.tags)))

    def settings(self) -> dict[str, Any]:
        """The core settings this policy stands for (run/runner.py and run/checkpoint_triggers.py act on them)."""
        t, on = self.trigger, self.action == "checkpoint"
        if t.memory_above_bytes is not None:
            return {"checkpoint_above_bytes": t.memory_above_bytes if on else 0}
        if t.schedule_seconds is not None:
            return {"heartbeat_seconds": t.schedule_seconds if on else 0}
        return {"checkpoint_on_term": on}


class Rules(BaseModel):
    """Eligibility rules: work a checkpoint cannot protect well is kept off, with the rule named."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_expected_seconds: float = Field(default=0, ge=0, description="Tasks expected to be shorter than this re-run "
                                        "instead: declared (expected_duration), else learned from their past runs.")
    job_server_queues: tuple[str, ...] = Field(default=(), description="Queues where job_server tasks may be in scope.")
    gpu_needs_nvidia: bool = Field(default=True, description="GPU tasks only where an NVIDIA driver can hold GPU state.")
    require_dag_opt_in: bool = Field(default=False, description="Only DAGs tagged cedana:opt-in (whose tag rules "
                                     "the cluster policy has checked) may be in scope.")


class Drills(BaseModel):
    """What the live fleet drill may do (drill/live.py). Off unless ``live = true``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    live: bool = Field(default=False, description="Live drills fail running checkpointed tasks on purpose.")
    max_per_run: int = Field(default=1, ge=0, description="Tasks one live drill may fail.")
    max_per_dag: int = Field(default=1, ge=0, description="Of those, per DAG.")
    max_per_pool: int = Field(default=1, ge=0, description="Of those, per pool.")
    windows: tuple[str, ...] = Field(default=(), description="When live drills may act (UTC); empty: any time.")
    max_checkpoint_age_seconds: float = Field(default=900, gt=0, description="Only tasks whose latest checkpoint "
                                              "is younger than this: the work a drill may cost.")
    kill_switch_variable: str = Field(default="cedana_drills_stop", min_length=1,
                                      description="An Airflow Variable that, when set, stops every live drill.")
    follow_seconds: float = Field(default=900, gt=0, description="How long a drill follows a retry.")

    @field_validator("windows")
    @classmethod
    def _windows(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for w in v:
            parse_window(w)  # a ValueError names the bad one
        return v

    def parsed_windows(self) -> tuple[Window, ...]:
        return tuple(parse_window(w) for w in self.windows)


class OptInList(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: NodeScope | None = None
    queue: QueueScope | None = None
    workload: WorkloadScope | None = None
    rules: Rules = Field(default_factory=Rules)
    policies: tuple[Policy, ...] = ()
    drills: Drills = Field(default_factory=Drills)

    def empty(self) -> bool:
        return self.node is None and self.queue is None and self.workload is None


@dataclass(frozen=True)
class Where:
    """Where a task runs, as far as the list cares."""

    dag_id: str
    task_id: str
    node: str = ""
    node_labels: dict[str, str] = field(default_factory=dict)
    queue: str = ""
    pool: str = ""
    tags: tuple[str, ...] = ()
    expected_seconds: float | None = None  # declared by the task (expected_duration), or learned
    job_server: bool = False  # the task drives a third-party job server (EMR, Databricks, Slurm...)
    gpu: bool = False  # the task uses a GPU
    nvidia: bool | None = None  # this node has an NVIDIA driver (None: not asked)
    partition: str = ""  # the Slurm partition a job goes to (the Slurm route)
    expected_source: str = "declared"  # or how it was learned (or why not), e.g. "learned: the median of ..."


@dataclass(frozen=True)
class Decision:
    in_scope: bool
    reasons: tuple[str, ...]  # one per scope, in the order node, queue, workload
    defaults: dict[str, Any] = field(default_factory=dict)  # merged node < queue < workload

    def explain(self) -> str:
        head = "IN SCOPE: checkpointed" if self.in_scope else "OUT OF SCOPE: runs unprotected"
        return "\n".join([head, *(f"  {r}" for r in self.reasons)])


def load_optin(path: str | Path | None) -> OptInList:
    """Read and validate the opt-in file; a missing setting or file means an empty list."""
    if not path:
        return OptInList()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"opt-in file {p} does not exist. Create it, or unset optin_file to checkpoint nothing.") from None
    except OSError as e:
        raise ConfigError(f"opt-in file {p} cannot be read: {e.strerror or e}. Fix its permissions.") from None
    doc = _parse(raw, p)
    try:
        return OptInList.model_validate(doc or {})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise ConfigError(f"opt-in file {p}: {where}: {err['msg']}. Fix the file (see docs: the opt-in list).") from None


def _parse(raw: bytes, p: Path) -> Any:
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"opt-in file {p} is YAML but PyYAML is not installed. pip install pyyaml, or write it as TOML.") from None
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"opt-in file {p} is not valid YAML: {str(e).splitlines()[0]}. Fix the file.") from None
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"opt-in file {p} is not valid TOML: {e}. Fix the file.") from None


def _first_match(value: str, patterns: tuple[str, ...]) -> str | None:
    return next((pat for pat in patterns if value and fnmatchcase(value, pat)), None)


def _node(s: NodeScope | None, w: Where) -> tuple[bool, str]:
    if s is None:
        return False, "node: refused: the list has no [node] scope (hostnames = [\"*\"] admits every node)"
    if w.partition:  # a Slurm job: its nodes are the partition's
        if pat := _first_match(w.partition, s.partitions):
            return True, (f"node: Slurm partition {w.partition} admitted by partition pattern {pat!r} (inside it, "
                          "the job is checkpointed only with CEDANA_ENABLE=1, which the operator sets when in scope)")
        return False, (f"node: Slurm partition {w.partition} refused: not in partitions {list(s.partitions)} (a job "
                       "there runs unprotected, CEDANA_ENABLE or not)")
    if pat := _first_match(w.node, s.hostnames):
        return True, f"node: {w.node} admitted by hostname pattern {pat!r}"
    if s.labels and w.node_labels and all(w.node_labels.get(k) == v for k, v in s.labels.items()):
        return True, f"node: {w.node or '?'} admitted by its labels {', '.join(f'{k}={v}' for k, v in s.labels.items())}"
    want = [*(repr(h) for h in s.hostnames), *(f"labels {k}={v}" for k, v in s.labels.items())]
    return False, f"node: {w.node or '(unknown)'} refused: matches none of {', '.join(want) or 'nothing (the scope is empty)'}"


def _queue(s: QueueScope | None, w: Where) -> tuple[bool, str]:
    if s is None:
        return False, "queue: refused: the list has no [queue] scope (queues = [\"*\"] admits every queue)"
    if pat := _first_match(w.queue, s.queues):
        return True, f"queue: {w.queue} admitted by queue pattern {pat!r}"
    if pat := _first_match(w.pool, s.pools):
        return True, f"queue: pool {w.pool} admitted by pool pattern {pat!r}"
    return False, (f"queue: queue {w.queue or '(none)'} / pool {w.pool or '(none)'} refused: not in queues "
                   f"{list(s.queues)} or pools {list(s.pools)}")


def _workload(s: WorkloadScope | None, w: Where) -> tuple[bool, str]:
    if s is None:
        return False, "workload: refused: the list has no [workload] scope"
    if pat := _first_match(f"{w.dag_id}.{w.task_id}", s.tasks):
        return True, f"workload: task {w.dag_id}.{w.task_id} admitted by task pattern {pat!r}"
    if pat := _first_match(w.dag_id, s.dags):
        return True, f"workload: DAG {w.dag_id} admitted by DAG pattern {pat!r}"
    return False, f"workload: {w.dag_id}.{w.task_id} refused: not in dags {list(s.dags)} or tasks {list(s.tasks)}"


def _rules(r: Rules, w: Where) -> list[tuple[bool, str]]:
    """Only the rules that concern this task are reported."""
    out = []
    if r.require_dag_opt_in:
        tagged = "cedana:opt-in" in w.tags
        out.append((tagged, "rule dag-opt-in: " + ("the DAG is tagged cedana:opt-in" if tagged else
                    "the DAG is not tagged cedana:opt-in, and require_dag_opt_in is set; its author has not "
                    "declared its effects")))
    if w.expected_seconds is not None and w.expected_seconds < r.min_expected_seconds:
        out.append((False, f"rule short-task: expected {w.expected_seconds:.0f} s ({w.expected_source}) is below "
                           f"min_expected_seconds {r.min_expected_seconds:.0f} s; a retry re-runs it instead"))
    elif r.min_expected_seconds and w.expected_seconds is not None:
        out.append((True, f"rule short-task: expected {w.expected_seconds:.0f} s ({w.expected_source}), at least "
                          f"min_expected_seconds {r.min_expected_seconds:.0f} s"))
    elif r.min_expected_seconds:
        why = w.expected_source if w.expected_source not in ("", "declared") else "no expected_duration declared"
        out.append((True, f"rule short-task: not applied: {why}"))
    if w.job_server:
        ok = _first_match(w.queue, r.job_server_queues) is not None
        out.append((ok, f"rule job-server: queue {w.queue or '(none)'} " + (
            "is marked for job-server tasks" if ok else
            f"is not in job_server_queues {list(r.job_server_queues)}; a job server manages its own jobs")))
    if w.gpu and r.gpu_needs_nvidia and w.nvidia is False:
        out.append((False, f"rule gpu: node {w.node or '?'} has no NVIDIA driver, so GPU state cannot be checkpointed here"))
    return out


def decide(optin: OptInList, where: Where) -> Decision:
    """Is this task in scope? Every scope is judged (not just the first refusal), so the answer is complete."""
    if optin.empty():
        return Decision(False, ("the opt-in list is empty or not configured: nothing is checkpointed "
                                "(set [cedana] optin_file / CEDANA_OPTIN_FILE)",))
    verdicts = [_node(optin.node, where), _queue(optin.queue, where), _workload(optin.workload, where)]
    defaults: dict[str, Any] = {}
    for scope in (optin.node, optin.queue, optin.workload):
        if scope is not None:
            defaults.update(scope.defaults)
    verdicts += _rules(optin.rules, where)
    in_scope = all(ok for ok, _ in verdicts)
    reasons = [r for _, r in verdicts]
    for p in optin.policies:  # in file order: a later policy overrides an earlier one's setting
        if p.matches(where):
            defaults.update(p.settings())
            reasons.append(f"policy {p.name!r} applies: {p.settings()}")
    return Decision(in_scope, tuple(reasons), defaults if in_scope else {})


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (CEDANA_NODE_LABELS, set by the Kubernetes route from the node's labels)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"node label {item!r} is not KEY=VALUE. Fix CEDANA_NODE_LABELS / --label.")
        out[key] = value
    return out
