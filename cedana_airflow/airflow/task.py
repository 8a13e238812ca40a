"""The task adapter: one Airflow task instance turned into what the core needs, the same way on every route.

Every cedana operator (the command operator and ``@task.checkpointed``, the Kubernetes pod operator,
the Slurm operator) mixes in :class:`CedanaTask`: the same arguments (checkpoint ID, heartbeat, store,
and the declarations the DAG-tag rules ask for: ``idempotency_key``, ``max_restore_gap``, ``lease``),
checked when the DAG is parsed, and one :meth:`CedanaTask.cedana_setup` per try. The setup builds the
settings once from every layer, asks the opt-in list where the route says the task runs (a broken list
never fails a task: it runs unprotected and says why), narrows the settings by the list's defaults and
derives the checkpoint ID. :func:`airflow_errors` is the one boundary where core errors become
Airflow's. What a route does differently (where its node is, how it launches) stays in its operator.

The lease and the restore gap are not judged here: both are settings (``lease_seconds``,
``max_restore_gap_seconds``) that the core applies where the restore happens, in a worker, the wrap
route's pod or a Slurm job alike. Only the Kubernetes ``cedana`` route, where Cedana's runtime restores,
judges them in its operator, before the pod exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import shlex
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from airflow.sdk import BaseOperatorLink

from ..airflow_compat import AirflowException, AirflowFailException
from ..config import Settings
from ..errors import CedanaError, CheckpointIdError, ConfigError, SlurmRefused
from ..hooks.store import task_store
from ..ids import derive_checkpoint_id, validate_checkpoint_id
from ..scope.optin import Decision, OptInList, Where, decide, load_optin
from ..store import Store
from ..units import parse_duration
from .config import AirflowOptions, task_settings, with_scope_defaults
from .history import AirflowHistory
from .links import CheckpointsLink

__all__ = ["CEDANA_TEMPLATE_FIELDS", "CedanaTask", "Placement", "TaskSetup", "airflow_errors", "command_argv",
           "scope_decision"]

#: Core errors a retry would meet again: the task fails without retries.
PERMANENT = (ConfigError, CheckpointIdError, SlurmRefused)

#: The arguments every route templates.
CEDANA_TEMPLATE_FIELDS = ("checkpoint_id", "store", "idempotency_key", "lease_renew_command")


@contextlib.contextmanager
def airflow_errors() -> Iterator[None]:
    """The one boundary where core errors become Airflow's: one ``cedana:`` line, no stack trace; a
    configuration error fails the task without retries (a retry would fail the same way)."""
    try:
        yield
    except PERMANENT as e:
        raise AirflowFailException(f"cedana: {e}") from None
    except CedanaError as e:
        raise AirflowException(f"cedana: {e}") from None


#: A duration argument: a timedelta, seconds, or text such as ``"10m"`` or ``"1h30m"``.
Duration = timedelta | float | str


def _duration(name: str, value: Duration | None) -> timedelta | None:
    """``value`` as a timedelta; a text or number that is no duration is the DAG's import error."""
    if value is None or isinstance(value, timedelta):
        return value
    what = "give a timedelta, seconds, or text such as '10m'"
    if isinstance(value, bool):  # float(True) is 1.0: "on" is no duration
        raise ConfigError(f"{name}={value!r} is not a duration: {what}")
    try:
        seconds = parse_duration(value) if isinstance(value, str) else float(value)
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"{value!r} is not a duration of 0 or more seconds")
        return timedelta(seconds=seconds)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{name}: {e}" if isinstance(e, ValueError) else f"{name}={value!r} is not a duration: "
                          f"{what}") from None


def command_argv(command: str | Sequence[str] | None) -> list[str]:
    """A command as an argv list: a string is split with shell rules (no shell runs it)."""
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


@dataclass(frozen=True)
class Placement:
    """Where a route's task runs, as far as the opt-in list cares (the rest comes from the task)."""

    node: str  # a node's name, or how the route picks one, e.g. "(a node labelled k=v)"
    node_labels: Mapping[str, str] = field(default_factory=dict)
    partition: str = ""
    gpu: bool = False
    nvidia: bool | None = None


@dataclass(frozen=True)
class TaskSetup:
    """What one try of a task runs with."""

    settings: Settings  # built once from every layer, then narrowed by the list's defaults when in scope
    options: AirflowOptions
    decision: Decision
    placement: Placement
    checkpoint_id: str

    @property
    def in_scope(self) -> bool:
        return self.decision.in_scope

    def store(self) -> Store:
        """The task's store; an s3:// one through the ``aws_conn_id`` connection when one is named."""
        return task_store(self.settings, self.options.aws_conn_id)


def scope_decision(optin_file: Any, where: Callable[[OptInList], Where]) -> Decision:
    """The opt-in list's decision for the task ``where`` places. A list that cannot be read or parsed
    never fails a task: the task runs unprotected, and the decision says why."""
    try:
        optin = load_optin(optin_file)
        return decide(optin, where(optin))
    except ConfigError as e:
        return Decision(False, (f"the opt-in list cannot be used: {e}",))


class CedanaTask:
    """Mixin of every cedana operator: the arguments every route takes, and the set-up of each try.

    Every duration takes a timedelta, seconds, or text such as ``"10m"`` or ``"1h30m"``.

    :param checkpoint_id: label of the workload's checkpoints. Default: derived from dag_id, task_id,
        map_index and run_id, so a new DAG run starts fresh and a retry or Clear of the same run resumes.
    :param heartbeat: time between checkpoints, or ``"auto"``: chosen from this task's measured checkpoint cost
        and the failures Airflow saw on its queue (docs/heartbeat.md). Default: [cedana] heartbeat_seconds.
    :param heartbeat_min: / :param heartbeat_max: the bounds of ``"auto"`` (default: [cedana]
        heartbeat_min_seconds / heartbeat_max_seconds, 1 min and 1 h).
    :param mtbf: ``"auto"``'s prior: the mean time between failures this work should expect, e.g. a spot
        fleet's eviction rate (default: [cedana] mtbf_hours, unset).
    :param store: store URL (default: [cedana] store).
    :param aws_conn_id: Airflow connection for an s3:// store (default: [cedana] aws_conn_id). A
        connection that does not exist fails the task; it never falls back silently.
    :param settings: further core settings by name (e.g. ``{"max_checkpoint_bytes": 8 << 30}``).
    :param idempotency_key: required when the DAG declares ``cedana:effects=external`` (the cluster
        policy refuses the DAG otherwise); the workload reads it as CEDANA_IDEMPOTENCY_KEY.
    :param max_restore_gap: a checkpoint older than this is not restored; the workload starts fresh
        and the log says so (required under ``cedana:realtime``).
    :param lease: the license lease length of license-bound software (``cedana:license=NAME``,
        required there): a checkpoint older than the lease is not restored either, since its license is dead.
    :param lease_renew_command: run before restoring a checkpoint older than ``lease`` (with
        CEDANA_CHECKPOINT_ID and CEDANA_RESTORE_GAP_SECONDS in its environment), e.g. to check the
        license out again: exit 0 restores, anything else starts fresh.
    :param mode: ``transparent`` (CRIU, the default), ``cooperative`` (the workload writes its own state when
        asked: cedana_airflow.coop) or ``auto`` (transparent where CRIU can run, else cooperative once the
        workload declares it can). Default: [cedana] mode, or the opt-in list's.
    :param expected_duration: / :param job_server: / :param gpu: what the opt-in list's rules judge
        (short tasks re-run; job-server tasks only on marked queues; GPU tasks only with NVIDIA).
    """

    #: The cluster policy (policy.py) checks the DAG-tag rules on every task that carries this.
    cedana_checkpointed = True
    #: A Checkpoints button on this operator's task instances (links.py); ahead of BaseOperator's in the MRO.
    operator_extra_links: Collection[BaseOperatorLink] = (CheckpointsLink(),)

    heartbeat: timedelta | Literal["auto"] | None
    max_restore_gap: timedelta | None
    lease: timedelta | None
    expected_duration: timedelta | None
    heartbeat_min: timedelta | None
    heartbeat_max: timedelta | None
    mtbf: timedelta | None

    # BaseOperator's, for the type checker
    task_id: str
    queue: str
    pool: str
    log: Any

    def init_cedana(self, *, checkpoint_id: str | None = None, heartbeat: Duration | Literal["auto"] | None = None,
                    store: str | None = None, aws_conn_id: str | None = None, settings: dict[str, Any] | None = None,
                    idempotency_key: str | None = None, max_restore_gap: Duration | None = None,
                    lease: Duration | None = None, lease_renew_command: str | Sequence[str] | None = None,
                    expected_duration: Duration | None = None, job_server: bool = False, gpu: bool = False,
                    route_settings: Mapping[str, Any] | None = None, mode: str | None = None,
                    heartbeat_min: Duration | None = None, heartbeat_max: Duration | None = None,
                    mtbf: Duration | None = None) -> None:
        """Keep the arguments, and check them now: a bad value is the DAG's import error, not a stack
        trace in a worker later. ``route_settings``: settings a route sets from its own arguments."""
        self.checkpoint_id, self.store, self.aws_conn_id = checkpoint_id, store, aws_conn_id
        self.settings = dict(settings or {})
        self.idempotency_key = idempotency_key
        self.lease_renew_command = lease_renew_command
        self.job_server, self.gpu = job_server, gpu
        self.route_settings = dict(route_settings or {})
        self.mode = mode
        try:
            self.heartbeat = "auto" if heartbeat == "auto" else _duration("heartbeat", heartbeat)
            self.max_restore_gap, self.lease = _duration("max_restore_gap", max_restore_gap), _duration("lease", lease)
            self.expected_duration = _duration("expected_duration", expected_duration)
            self.heartbeat_min, self.heartbeat_max = _duration("heartbeat_min", heartbeat_min), _duration("heartbeat_max",
                                                                                                           heartbeat_max)
            self.mtbf = _duration("mtbf", mtbf)
            task_settings(self.cedana_overrides())
        except CedanaError as e:
            raise AirflowException(f"{self.task_id}: {e}") from None

    @classmethod
    def pop_cedana_args(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments :meth:`init_cedana` takes, taken out of an operator's ``kwargs`` (the rest go to
        the Airflow operator it extends): for an operator that names only its own arguments."""
        names = inspect.signature(cls.init_cedana).parameters.keys() - {"self", "route_settings", "mode"}
        return {name: kwargs.pop(name) for name in list(kwargs) if name in names}

    def cedana_overrides(self) -> dict[str, Any]:
        """The operator's arguments as settings: they win over every other layer."""
        out: dict[str, Any] = {**self.settings, "aws_conn_id": self.aws_conn_id}
        if self.heartbeat is not None:
            out["heartbeat_seconds"] = self.heartbeat if self.heartbeat == "auto" else self.heartbeat.total_seconds()
        for name, value in (("heartbeat_min_seconds", self.heartbeat_min), ("heartbeat_max_seconds", self.heartbeat_max)):
            if value is not None:
                out[name] = value.total_seconds()
        if self.mtbf is not None:
            out["mtbf_hours"] = self.mtbf.total_seconds() / 3600
        if self.mode is not None:
            out["mode"] = self.mode
        if self.max_restore_gap is not None:  # the core refuses each too-old candidate, fallbacks included
            out["max_restore_gap_seconds"] = self.max_restore_gap.total_seconds()
        if self.lease is not None:
            out["lease_seconds"] = self.lease.total_seconds()
        if self.lease_renew_command:
            out["lease_renew_command"] = shlex.join(command_argv(self.lease_renew_command))
        if self.store and "{{" not in self.store:  # templated: rendered by the time the task runs
            out["store"] = self.store
        return {**out, **self.route_settings}

    def cedana_setup(self, context: Mapping[str, Any], placement: Callable[[OptInList | None, Settings], Placement]
                     ) -> TaskSetup:
        """This try's settings, the opt-in list's decision (written into the task log) and checkpoint ID.
        ``placement``: where the route runs the task (it may read the list, e.g. its node label)."""
        ti, dag = context["ti"], context.get("dag")
        overrides = self.cedana_overrides()
        settings, options = task_settings(overrides)
        placed: list[Placement] = []
        history = AirflowHistory(self.log)
        queue = getattr(ti, "queue", "") or self.queue

        def where(optin: OptInList | None) -> Where:
            placed.append(placement(optin, settings))
            p = placed[-1]
            expected, source = (self.expected_duration.total_seconds(), "declared") if self.expected_duration else (
                history.duration(ti.dag_id, ti.task_id) if optin and optin.rules.min_expected_seconds else (None, ""))
            return Where(ti.dag_id, ti.task_id, p.node, dict(p.node_labels), queue, self.pool or "",
                         tuple(getattr(dag, "tags", None) or ()), expected, self.job_server, p.gpu, p.nvidia,
                         p.partition, expected_source=source)

        decision = scope_decision(settings.optin_file, where)
        for line in decision.explain().splitlines():
            self.log.info("cedana: %s", line.strip())
        if decision.in_scope:
            settings = with_scope_defaults(settings, decision.defaults, overrides)
            if settings.heartbeat_auto and settings.failure_history is None:
                settings = settings.model_copy(update={"failure_history": history.failures(queue, self.pool or "")})
        return TaskSetup(settings, options, decision, placed[-1] if placed else placement(None, settings),
                         self.checkpoint_id_for(context))

    def checkpoint_id_for(self, context: Mapping[str, Any]) -> str:
        """The (validated) checkpoint ID of this task instance: the argument, else the derived default."""
        ti = context["ti"]
        if self.checkpoint_id:
            return validate_checkpoint_id(self.checkpoint_id)
        return derive_checkpoint_id(ti.dag_id, ti.task_id, context["run_id"], map_index=ti.map_index)

    def cedana_env(self, checkpoint_id: str | None) -> dict[str, str]:
        """What every route's workload reads of ours: the idempotency key and the checkpoint ID."""
        env = {"CEDANA_IDEMPOTENCY_KEY": self.idempotency_key} if self.idempotency_key else {}
        return {**env, "CEDANA_CHECKPOINT_ID": checkpoint_id} if checkpoint_id else env
