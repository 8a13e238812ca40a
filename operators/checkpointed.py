"""CheckpointedCommandOperator: run a command as a managed process that is checkpointed on a heartbeat
and, on a retry or a Clear of the same DAG run, restored from its latest checkpoint instead of
starting over.

Thin by design (DESIGN.md, layers): Airflow context in, one ``run_workload`` call, Airflow outcome out.
"""

from __future__ import annotations

import os
import shlex
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from cedana_airflow.airflow.config import AirflowOptions, task_settings
from cedana_airflow.airflow.logsink import LogSink
from cedana_airflow.airflow.store import task_store, with_signing_key
from cedana_airflow.airflow.task_state import STATE_KEY, TaskState, airflow_task
from cedana_airflow.config import Settings
from cedana_airflow.engine.cuda import load_driver
from cedana_airflow.errors import CedanaError, CheckpointIdError, ConfigError, GpuUnavailable
from cedana_airflow.format.selection import AgeLimit
from cedana_airflow.ids import derive_checkpoint_id, validate_checkpoint_id
from cedana_airflow.run.environment import workload_env
from cedana_airflow.run.restore_gap import judge_restore_gap
from cedana_airflow.run.runner import RunResult, run_workload
from cedana_airflow.run.workload import run_unprotected
from cedana_airflow.scope.optin import Decision, Where, decide, load_optin, parse_labels
from cedana_airflow.store import Store

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["CheckpointedCommandOperator", "STATE_KEY", "XCOM_RESTORE_KEY"]

#: Airflow 3.3's task supervisor sends SIGKILL this long after its SIGTERM (a fixed escalation): what a
#: stop leaves for the final checkpoint.
AIRFLOW_STOP_WINDOW_SECONDS = 5.0

#: XCom key of the restore record (also in the task log and the state store).
XCOM_RESTORE_KEY = "cedana_restore"

# Airflow's own configuration and connections must not end up in a checkpoint image (process memory
# is stored as it is): the workload gets the task's environment without them.
_PRIVATE_ENV_PREFIXES = ("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_", "_AIRFLOW")


class CheckpointedCommandOperator(BaseOperator):
    """Run ``command`` under cedana-airflow: heartbeat checkpoints, and resume on retry or Clear.

    :param command: argv list, or a string split with shell rules (no shell runs it). Templated.
    :param env: extra environment for the workload (on top of the task's, minus Airflow's own
        settings and connections and the store's credentials; see ``keep_env``). Templated.
    :param cwd: working directory of the workload. Templated.
    :param checkpoint_id: label of this workload's checkpoints. Default: derived from dag_id,
        task_id, map_index and run_id, so a new DAG run starts fresh and a retry or Clear of the
        same run resumes. Templated.
    :param heartbeat: time between checkpoints (default: [cedana] heartbeat_seconds; none if unset).
    :param store: store URL (default: [cedana] store).
    :param aws_conn_id: Airflow connection for an s3:// store (default: [cedana] aws_conn_id). A
        connection that does not exist fails the task; it never falls back silently.
    :param checkpoint_on_kill: take a final checkpoint when Airflow stops the task (drain, preemption,
        a Clear or mark-failed of the running task). Default: [cedana] checkpoint_on_term (True).
    :param settings: further core settings by name (e.g. ``{"max_checkpoint_bytes": 8 << 30}``).
    :param idempotency_key: required when the DAG declares ``cedana:effects=external`` (the cluster
        policy refuses the DAG otherwise); the workload reads it as CEDANA_IDEMPOTENCY_KEY. Templated.
    :param max_restore_gap: a checkpoint older than this is not restored; the workload starts fresh
        and the log says so (required under ``cedana:realtime``).
    :param lease: the license lease length of license-bound software (``cedana:license=NAME``): a
        checkpoint older than the lease is not restored either, since its license is dead.
    :param lease_renew_command: run before restoring a checkpoint older than ``lease`` (with
        CEDANA_CHECKPOINT_ID and CEDANA_RESTORE_GAP_SECONDS in its environment), e.g. to re-check-out
        the license the restored process holds; exit 0 restores, anything else starts fresh.
    :param expected_duration: / :param job_server: / :param gpu: what the opt-in list's rules judge
        (short tasks re-run; job-server tasks only on marked queues; GPU tasks only with NVIDIA).

    ================================  =================================================================
    what happened                      the task
    ================================  =================================================================
    the workload exited 0              success; the summary (fresh or restored, checkpoints) is its XCom
    the workload exited N != 0         failed, retries apply; a retry or Clear resumes the latest checkpoint
    Airflow stopped the task           final checkpoint (``checkpoint_on_kill``), then failed
    bad configuration or ID            failed without retries (``AirflowFailException``): one line
    the store or the engine failed     failed, retries apply: one ``cedana:`` line naming the cause
    retry on the failing node          logged; with ``same_node_retry = fail`` that try fails at once
    out of scope                       runs unprotected (no CRIU); its exit code decides, as above
    ================================  =================================================================
    """

    template_fields: Sequence[str] = ("command", "env", "cwd", "checkpoint_id", "store", "idempotency_key",
                                      "lease_renew_command")
    #: The cluster policy (cedana_airflow/airflow/policy.py) checks the DAG-tag rules on tasks that carry this.
    cedana_checkpointed = True
    template_fields_renderers = {"command": "bash", "env": "json"}
    ui_color = "#d7ecf9"

    def __init__(
        self,
        *,
        command: str | Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        checkpoint_id: str | None = None,
        heartbeat: timedelta | None = None,
        store: str | None = None,
        aws_conn_id: str | None = None,
        checkpoint_on_kill: bool | None = None,
        settings: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        max_restore_gap: timedelta | None = None,
        lease: timedelta | None = None,
        expected_duration: timedelta | None = None,
        job_server: bool = False,
        gpu: bool = False,
        lease_renew_command: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.lease_renew_command = lease_renew_command
        self.idempotency_key, self.max_restore_gap, self.lease = idempotency_key, max_restore_gap, lease
        self.expected_duration, self.job_server, self.gpu = expected_duration, job_server, gpu
        self.command = command
        self.env = env
        self.cwd = cwd
        self.checkpoint_id = checkpoint_id
        self.heartbeat = heartbeat
        self.store = store
        self.aws_conn_id = aws_conn_id
        self.checkpoint_on_kill = checkpoint_on_kill
        self.settings = dict(settings or {})
        self._stop = threading.Event()
        try:  # a bad value is a DAG import error here, not a stack trace in a worker later
            self._resolve()
        except CedanaError as e:
            raise AirflowException(f"{self.task_id}: {e}") from None

    def _resolve(self, scope_defaults: dict[str, Any] | None = None) -> tuple[Settings, AirflowOptions]:
        overrides: dict[str, Any] = {**self.settings, "aws_conn_id": self.aws_conn_id,
                                     "checkpoint_on_term": self.checkpoint_on_kill}
        if self.heartbeat is not None:
            overrides["heartbeat_seconds"] = self.heartbeat.total_seconds()
        if self.max_restore_gap is not None:  # the core refuses each too-old candidate, fallbacks included
            overrides["max_restore_gap_seconds"] = self.max_restore_gap.total_seconds()
        if self.store and "{{" not in self.store:
            overrides["store"] = self.store
        settings, options = task_settings(overrides, scope_defaults)
        if not settings.stop_window_seconds:  # Airflow's task supervisor SIGKILLs a task 5 s after its SIGTERM
            settings = settings.model_copy(update={"stop_window_seconds": AIRFLOW_STOP_WINDOW_SECONDS})
        return settings, options

    def _in_scope(self, context: Context, settings: Settings) -> Decision:
        """The opt-in list's decision for this task on this worker, written into the task log."""
        ti = context["ti"]
        dag = context.get("dag")
        try:
            where = Where(ti.dag_id, ti.task_id, settings.resolved_node(),
                          parse_labels(os.environ.get("CEDANA_NODE_LABELS", "")), getattr(ti, "queue", "") or self.queue,
                          self.pool or "", tuple(getattr(dag, "tags", None) or ()),
                          self.expected_duration.total_seconds() if self.expected_duration else None,
                          self.job_server, self.gpu, _has_nvidia() if self.gpu else None)
            decision = decide(load_optin(settings.optin_file), where)
        except ConfigError as e:  # a broken list never fails a task: it runs unprotected and says why
            decision = Decision(False, (f"the opt-in list cannot be used: {e}",))
        for line in decision.explain().splitlines():
            self.log.info("cedana: %s", line.strip())
        return decision

    # -- execution ---------------------------------------------------------------------------------
    def checkpoint_id_for(self, context: Context) -> str:
        """The (validated) checkpoint ID of this task instance: the argument, else the derived default."""
        ti = context["ti"]
        if self.checkpoint_id:
            return validate_checkpoint_id(self.checkpoint_id)
        return derive_checkpoint_id(ti.dag_id, ti.task_id, context["run_id"], map_index=ti.map_index)

    def execute(self, context: Context) -> dict[str, Any]:
        ti = context["ti"]
        try:
            settings, options = self._resolve()  # the templated fields are rendered by now
            argv = _argv(self.command)
            if not argv:
                raise ConfigError("command is empty. Give the command to run as a list or a string.")
            decision = self._in_scope(context, settings)
            if not decision.in_scope:
                return self._run_unprotected(argv, self._workload_env(context, None, settings), settings)
            settings, options = self._resolve(decision.defaults)
            cid = self.checkpoint_id_for(context)
            settings = with_signing_key(settings, options.signing_conn_id)
            store = task_store(settings, options.aws_conn_id)
        except (ConfigError, CheckpointIdError) as e:
            raise AirflowFailException(f"cedana: {e}") from None  # configuration: a retry would fail the same way
        except CedanaError as e:
            raise AirflowException(f"cedana: {e}") from None

        node = settings.resolved_node()
        state = TaskState.of(context, self.log)
        previous = state.previous_try(ti.try_number)
        self.log.info("cedana: checkpoint_id=%s node=%s try=%d store=%s heartbeat=%ss",
                      cid, node, ti.try_number, store.url, settings.heartbeat_seconds or "off")
        self._check_same_node(previous, node, options.same_node_retry)
        state.add_try(ti.try_number, node, checkpoint_id=cid)

        env = self._workload_env(context, cid, settings)
        out, err = LogSink(self.log, "stdout"), LogSink(self.log, "stderr")
        try:
            result = run_workload(settings, cid, argv, resume=self._may_resume(store, cid), try_number=ti.try_number,
                                  cwd=self.cwd, env=env,
                                  stdout=out, stderr=err, handle_signals=False, stop=self._stop, store=store,
                                  airflow=airflow_task(context))
        except CedanaError as e:
            raise AirflowException(f"cedana: {e}") from None
        finally:
            out.close()
            err.close()
        return self._outcome(context, state, result, cid, node, previous)

    def _check_same_node(self, previous: dict[str, Any] | None, node: str, policy: str) -> None:
        """A retry on the node where the previous try failed: say so, or fail fast (same_node_retry = fail)."""
        if not previous or previous.get("node") != node:
            return
        msg = (f"this retry runs on node {node}, where try {previous['try_number']} ran and failed; "
               "its fault may still be here")
        if policy == "fail":
            raise AirflowException(f"cedana: {msg}. [cedana] same_node_retry = fail, so this try fails fast "
                                   "and the next retry can be placed on another node.")
        self.log.warning("cedana: %s (same_node_retry = allow).", msg)

    def _outcome(self, context: Context, state: TaskState, result: RunResult, cid: str, node: str,
                 previous: dict[str, Any] | None) -> dict[str, Any]:
        """Record the try, then map the run's result to the task's: its summary (the XCom), or an exception."""
        summary = self._summary(cid, node, result, previous)
        record: dict[str, Any] = {}
        if result.checkpoints:
            record["latest_seq"] = result.checkpoints[-1].seq
        if result.restored_from is not None:
            record["last_restore"] = summary["restore"]
            context["ti"].xcom_push(key=XCOM_RESTORE_KEY, value=summary["restore"])
        state.update(**record)
        if result.exit_code != 0:
            how = f"was stopped (signal {result.stopped_by_signal})" if result.stopped_by_signal else f"exited {result.exit_code}"
            raise AirflowException(
                f"cedana: the workload {how}; {len(result.checkpoints)} checkpoint(s) taken this try"
                + (f", the latest is seq {result.checkpoints[-1].seq}: a retry or Clear resumes from it"
                   if result.checkpoints else ""))
        return summary

    def _workload_env(self, context: Context, cid: str | None, settings: Settings) -> dict[str, str]:
        """The task's environment less Airflow's own settings and the store's credentials (both would be
        in every checkpoint image), plus ``env``: what the author passes explicitly is kept."""
        ti = context["ti"]
        env = workload_env({k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)},
                           settings.keep_env)
        env.update(self.env or {})
        if self.idempotency_key:
            env["CEDANA_IDEMPOTENCY_KEY"] = self.idempotency_key
        if cid:
            env["CEDANA_CHECKPOINT_ID"] = cid
        env.update(AIRFLOW_CTX_DAG_ID=ti.dag_id, AIRFLOW_CTX_TASK_ID=ti.task_id,
                   AIRFLOW_CTX_DAG_RUN_ID=context["run_id"], AIRFLOW_CTX_TRY_NUMBER=str(ti.try_number))
        return env

    def _run_unprotected(self, argv: list[str], env: dict[str, str], settings: Settings) -> dict[str, Any]:
        """Out of scope: the command runs as a plain subprocess (no CRIU needed), output into the log."""
        sink = LogSink(self.log, "stdout")
        try:
            rc = run_unprotected(argv, cwd=self.cwd, env=env, sink=sink, stop=self._stop,
                                 grace=settings.stop_grace_seconds)
        finally:
            sink.close()
        if rc != 0:
            raise AirflowException(f"cedana: the workload (unprotected: not in scope) exited {rc}")
        return {"outcome": "unprotected", "exit_code": 0, "checkpoints_taken": 0}

    def _may_resume(self, store: Store, cid: str) -> bool:
        """False when the latest checkpoint is older than the license lease (unless lease_renew_command
        renews it): start fresh, and say so. max_restore_gap is the core's, checked on every candidate."""
        limits = [AgeLimit("lease", self.lease.total_seconds())] if self.lease is not None else []
        verdict = judge_restore_gap(store, cid, limits, _argv(self.lease_renew_command))
        for level, note in verdict.notes:
            self.log.log(level, "cedana: %s", note)
        return verdict.resume

    def _summary(self, cid: str, node: str, result: RunResult, previous: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "checkpoint_id": cid, "node": node, "outcome": result.outcome, "exit_code": result.exit_code,
            "checkpoints_taken": len(result.checkpoints), "skipped_heartbeats": result.skipped_heartbeats,
            "stored_bytes": sum(m.stored_bytes for m in result.checkpoints), "restore": None,
        }
        m = result.restored_from
        if m is not None:
            out["restore"] = {
                "checkpoint_id": cid, "seq": m.seq, "from_try": m.try_number, "from_node": m.node, "node": node,
                "previous_node": previous.get("node") if previous else m.node,
                "checkpoint_created_at": m.created_at.isoformat(), "gap_seconds": round(result.restore_gap_seconds, 1),
                "restore_seconds": round(result.restore_seconds, 2), "image_bytes": m.image_bytes,
                "refused": list(result.skipped),
            }
            self.log.info("cedana: restored checkpoint_id=%s seq=%d (taken by try %d on node %s) on node %s; "
                          "gap %.1f s, restore %.2f s", cid, m.seq, m.try_number, m.node, node,
                          out["restore"]["gap_seconds"], result.restore_seconds)
        return out

    def on_kill(self) -> None:
        # Called from Airflow's SIGTERM handler in the task process: the supervision loop sees the
        # event, takes the final checkpoint (unless checkpoint_on_kill=False) and stops the workload.
        self.log.info("cedana: the task is being stopped; final checkpoint, then SIGTERM to the workload")
        self._stop.set()


def _argv(command: str | Sequence[str] | None) -> list[str]:
    """A command as an argv list: a string is split with shell rules (no shell runs it)."""
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _has_nvidia() -> bool:
    """Whether this node can hold a GPU task's state: the driver's checkpoint API (engine/cuda.py), the
    same detection as ``gpu = require`` and GpuSensor(require_checkpoint_api=True)."""
    try:
        load_driver()
        return True
    except GpuUnavailable:
        return False
