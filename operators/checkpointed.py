"""CheckpointedCommandOperator: run a command as a managed process that is checkpointed on a heartbeat
and, on a retry or a Clear of the same DAG run, restored from its latest checkpoint instead of
starting over.

Thin by design (DESIGN.md, layers): Airflow context in, one run (``run_workload`` in this process, or
``run_via_agent`` through the node agent where the task is not root: agent/route.py), its summary (the
object ``cedana-airflow run --json`` prints) to the Airflow outcome.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from airflow.sdk import BaseOperator

from cedana_airflow.agent.route import fresh_line, run_via_agent, through_agent
from cedana_airflow.airflow.logsink import LogSink, prefixed
from cedana_airflow.airflow.task import (CEDANA_TEMPLATE_FIELDS, CedanaTask, Placement, TaskSetup, airflow_errors,
                                         command_argv)
from cedana_airflow.airflow.task_state import STATE_KEY, TaskState, airflow_task
from cedana_airflow.airflow_compat import AirflowException
from cedana_airflow.config import Settings
from cedana_airflow.engine.cuda import load_driver
from cedana_airflow.errors import AgentUnavailable, ConfigError, EngineUnavailable, GpuUnavailable
from cedana_airflow.keys import node_key
from cedana_airflow.run.environment import workload_env
from cedana_airflow.run.runner import restored_line, run_workload, usable_engine
from cedana_airflow.run.summary import run_summary
from cedana_airflow.run.stop import UNPROTECTED_GRACE_SECONDS
from cedana_airflow.run.workload import run_unprotected
from cedana_airflow.scope.optin import OptInList, parse_labels
from cedana_airflow.signal_safe import SignalSafeEvent

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


class CheckpointedCommandOperator(CedanaTask, BaseOperator):
    """Run ``command`` under cedana-airflow: heartbeat checkpoints, and resume on retry or Clear.

    :param command: argv list, or a string split with shell rules (no shell runs it). Templated.
    :param env: extra environment for the workload (on top of the task's, minus Airflow's own
        settings and connections and the store's credentials; see ``keep_env``). Templated.
    :param cwd: working directory of the workload. Templated.
    :param checkpoint_on_kill: take a final checkpoint when Airflow stops the task (drain, preemption,
        a Clear or mark-failed of the running task). Default: [cedana] checkpoint_on_term (True).
    The arguments every route takes (checkpoint_id, heartbeat, heartbeat_min, heartbeat_max, mtbf, mode, store,
    aws_conn_id, settings,
    idempotency_key, max_restore_gap, lease, lease_renew_command, expected_duration, job_server, gpu)
    are :class:`~cedana_airflow.airflow.task.CedanaTask`'s.

    ================================  =================================================================
    what happened                      the task
    ================================  =================================================================
    the workload exited 0              success; the summary (fresh or restored, checkpoints) is its XCom
    the workload exited N != 0         failed, retries apply; a retry or Clear resumes the latest checkpoint
    the workload was killed            the same; the log names the signal (SIGKILL: a lost node, the OOM killer)
    Airflow stopped the task           final checkpoint (``checkpoint_on_kill``), then failed
    bad configuration or ID            failed without retries (``AirflowFailException``): one line
    the store or the engine failed     failed, retries apply: one ``cedana:`` line naming the cause
    retry on the failing node          logged; with ``same_node_retry = fail`` that try fails at once
    out of scope                       runs unprotected (no CRIU); its exit code decides, as above
    mode transparent, no usable CRIU   runs unprotected, one line says why (mode = auto/cooperative help)
    ================================  =================================================================
    """

    template_fields: Sequence[str] = ("command", "env", "cwd", *CEDANA_TEMPLATE_FIELDS)
    template_fields_renderers = {"command": "bash", "env": "json"}
    ui_color = "#d7ecf9"

    def __init__(self, *, command: str | Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 checkpoint_on_kill: bool | None = None, checkpoint_id: str | None = None,
                 heartbeat: timedelta | Literal["auto"] | None = None,
                 heartbeat_min: timedelta | None = None, heartbeat_max: timedelta | None = None,
                 mtbf: timedelta | None = None, store: str | None = None, aws_conn_id: str | None = None,
                 settings: dict[str, Any] | None = None, idempotency_key: str | None = None,
                 max_restore_gap: timedelta | None = None, lease: timedelta | None = None,
                 lease_renew_command: str | Sequence[str] | None = None, expected_duration: timedelta | None = None,
                 job_server: bool = False, gpu: bool = False, mode: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.command, self.env, self.cwd, self.checkpoint_on_kill = command, env, cwd, checkpoint_on_kill
        self._stop = SignalSafeEvent()
        self.init_cedana(checkpoint_id=checkpoint_id, heartbeat=heartbeat, heartbeat_min=heartbeat_min,
                         heartbeat_max=heartbeat_max, mtbf=mtbf, store=store, aws_conn_id=aws_conn_id,
                         settings=settings, idempotency_key=idempotency_key, max_restore_gap=max_restore_gap,
                         lease=lease, lease_renew_command=lease_renew_command, expected_duration=expected_duration,
                         job_server=job_server, gpu=gpu, route_settings={"checkpoint_on_term": checkpoint_on_kill},
                         mode=mode)

    def _placement(self, optin: OptInList | None, settings: Settings) -> Placement:
        """This worker: its node name and CEDANA_NODE_LABELS; for a GPU task, whether it has NVIDIA's driver."""
        return Placement(settings.resolved_node(), parse_labels(os.environ.get("CEDANA_NODE_LABELS", "")),
                         gpu=self.gpu, nvidia=_has_nvidia() if self.gpu else None)

    # -- execution ---------------------------------------------------------------------------------
    @prefixed
    def execute(self, context: Context) -> dict[str, Any]:
        # A stop belongs to one try. `airflow dags test` and dag.test() run every try on this same object,
        # and Airflow calls on_kill after an execution_timeout: the old event would stop each retry at once.
        self._stop = SignalSafeEvent()
        ti = context["ti"]
        with airflow_errors():
            argv = command_argv(self.command)  # the templated fields are rendered by now
            if not argv:
                raise ConfigError("command is empty. Give the command to run as a list or a string.")
            setup = self.cedana_setup(context, self._placement)
            if not setup.in_scope:
                return self._run_unprotected(argv, self._workload_env(context, None, setup.settings), setup.settings)
            via_agent = through_agent(setup.settings)
            if not via_agent and (why := _criu_missing(setup.settings)) is not None:
                self.log.warning("cedana: this task runs unprotected (mode = transparent): %s A workload that writes "
                                 "its own state can be protected here with mode = auto or cooperative "
                                 "(docs/cooperative.md).", why)
                return self._run_unprotected(argv, self._workload_env(context, None, setup.settings), setup.settings)
            setup = _with_stop_window(setup)
            if via_agent:  # the agent holds the key and the store: this process never opens either
                where = f"the node agent's ({setup.settings.agent_socket})"
            else:
                key = node_key(setup.settings)  # fail closed now, before the workload starts: one line naming the key
                self.log.info("cedana: manifests are signed and verified with node key %s from %s", key.key_id,
                              key.where)
                store = setup.store()
                where = store.url

        cid, settings = setup.checkpoint_id, setup.settings
        node = settings.resolved_node()
        state = TaskState.of(context, self.log)
        previous = state.previous_try(ti.try_number)
        self.log.info("cedana: checkpoint_id=%s node=%s try=%d store=%s; heartbeat %s", cid, node, ti.try_number,
                      where, settings.heartbeat_text())
        if not state.kept and ti.try_number > 1:
            self.log.info("cedana: this Airflow has no task state store (it came in 3.3): where earlier tries ran "
                          "is not known, so a retry on the node of a failed try is not detected "
                          "(same_node_retry = %s is not enforced)", setup.options.same_node_retry)
        self._check_same_node(previous, node, setup.options.same_node_retry)
        state.add_try(ti.try_number, node, checkpoint_id=cid)

        out, err = LogSink(self.log, "stdout"), LogSink(self.log, "stderr")
        env = self._workload_env(context, cid, settings)
        try:
            with airflow_errors():
                if via_agent:
                    try:
                        summary = run_via_agent(settings.agent_socket, cid, argv, cwd=self.cwd, env=env,
                                                try_number=ti.try_number, settings=settings,
                                                claim=airflow_task(context).model_dump(mode="json"), stdout=out,
                                                stderr=err, stop=self._stop,
                                                on_restore=lambda r: self._log_agent_restore(cid, node, r),
                                                on_fresh=lambda why: self.log.info("%s", fresh_line(why, cid)),
                                                on_said=lambda line: self.log.info("cedana (node agent): %s", line))
                    except AgentUnavailable as e:
                        if settings.agent == "require":
                            raise
                        self.log.warning("cedana: this task runs unprotected (agent = auto, not root): %s", e)
                        return self._run_unprotected(argv, env, settings)
                    if summary.get("stopped_by"):
                        final = summary.get("final_checkpoint_seq")
                        self.log.info("cedana: stopped through the node agent checkpoint_id=%s: %s; the workload "
                                      "tree ended", cid, f"final checkpoint seq {final}" if final is not None else
                                      "no final checkpoint (a retry resumes the last heartbeat's)")
                else:
                    result = run_workload(settings, cid, argv, resume=True, try_number=ti.try_number, cwd=self.cwd,
                                          env=env, stdout=out, stderr=err, handle_signals=False, stop=self._stop,
                                          store=store, airflow=airflow_task(context))  # its restore line is ours
                    summary = run_summary(result, cid, node)
        finally:
            out.close()
            err.close()
        return self._outcome(context, state, summary, cid, node, previous)

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

    def _outcome(self, context: Context, state: TaskState, run: dict[str, Any], cid: str, node: str,
                 previous: dict[str, Any] | None) -> dict[str, Any]:
        """Record the try, then map the run's summary (run/summary.py: either route's) to the task's: its
        XCom, or an exception."""
        summary = self._summary(cid, node, run, previous)
        seqs = run.get("checkpoint_seqs") or []
        record: dict[str, Any] = {}
        if seqs:
            record["latest_seq"] = seqs[-1]
        if run.get("restored_from") is not None:
            record["last_restore"] = summary["restore"]
            context["ti"].xcom_push(key=XCOM_RESTORE_KEY, value=summary["restore"])
        if stopped := run.get("stopped_by_signal"):
            how, ended = f"was stopped (signal {stopped})", f"stopped {_signal_name(stopped)}"
        elif killed := run.get("killed_by"):  # not by us: the OOM killer, a lost node, someone's kill -9
            how, ended = f"was killed by {killed}", f"killed {killed}"
        else:
            how = ended = f"exited {run['exit_code']}"
        # How this try ended, in Airflow's task state store: what heartbeat = auto's history reads (airflow/history.py)
        state.update(**record, tries=state.ended(context["ti"].try_number, ended))
        if run["exit_code"] != 0:
            raise AirflowException(
                f"cedana: the workload {how}; {len(seqs)} checkpoint(s) taken this try"
                + (f", the latest is seq {seqs[-1]}: a retry or Clear resumes from it" if seqs else ""))
        return summary

    def _workload_env(self, context: Context, cid: str | None, settings: Settings) -> dict[str, str]:
        """The task's environment less Airflow's own settings and the store's credentials (both would be
        in every checkpoint image), plus ``env``: what the author passes explicitly is kept."""
        ti = context["ti"]
        env = workload_env({k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)},
                           settings.keep_env)
        env.update(self.env or {})
        env.update(self.cedana_env(cid))
        env.update(AIRFLOW_CTX_DAG_ID=ti.dag_id, AIRFLOW_CTX_TASK_ID=ti.task_id,
                   AIRFLOW_CTX_DAG_RUN_ID=context["run_id"], AIRFLOW_CTX_TRY_NUMBER=str(ti.try_number))
        return env

    def _run_unprotected(self, argv: list[str], env: dict[str, str], settings: Settings) -> dict[str, Any]:
        """Out of scope: the command runs as a plain subprocess (no CRIU needed), output into the log."""
        sink = LogSink(self.log, "stdout")
        try:
            rc = run_unprotected(argv, cwd=self.cwd, env=env, sink=sink, stop=self._stop,
                                 grace=settings.stop_grace_seconds or UNPROTECTED_GRACE_SECONDS)
        finally:
            sink.close()
        if rc != 0:
            raise AirflowException(f"cedana: the workload (unprotected: not in scope) exited {rc}")
        return {"outcome": "unprotected", "exit_code": 0, "checkpoints_taken": 0}

    def _summary(self, cid: str, node: str, run: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "checkpoint_id": cid, "node": node, "outcome": run["outcome"], "exit_code": run["exit_code"],
            "checkpoints_taken": run["checkpoints"], "skipped_heartbeats": run["skipped_heartbeats"],
            "failed_heartbeats": run["failed_heartbeats"], "heartbeat_failures": run["heartbeat_failures"],
            "stored_bytes": run["stored_bytes"], "restore": None,
            "heartbeat": run.get("heartbeat"),  # the interval in use at the end, and what it was chosen from
        }
        m = run.get("restored_from")
        if m is not None:
            out["restore"] = {
                "checkpoint_id": cid, "seq": m["seq"], "from_try": m["try_number"], "from_node": m["node"], "node": node,
                "previous_node": previous.get("node") if previous else m["node"],
                "checkpoint_created_at": m["created_at"], "gap_seconds": round(run["restore_gap_seconds"], 1),
                "restore_seconds": round(run["restore_seconds"], 2), "image_bytes": m.get("image_bytes"),
                "engine": m["engine"],  # "criu", or "cooperative" (the workload wrote it)
                "refused": list(run["refused"]),
            }
        return out

    def _log_agent_restore(self, cid: str, node: str, r: dict[str, Any]) -> None:
        """The supervisor's restore line (run/runner.py), from what an agent that does not say its lines
        (older than 0.8.2) says was restored (its ``status``)."""
        self.log.info("cedana: %s (through the node agent)", restored_line(
            r["seq"], r["try_number"], r["node"], node, r["gap_seconds"], r["restore_seconds"], cid))

    def on_kill(self) -> None:
        # Called from Airflow's SIGTERM handler in the task process: the supervision loop sees the
        # event, says so, takes the final checkpoint (unless checkpoint_on_kill=False) and stops the workload.
        # Nothing else here: a log line could wait for ever on a logger's lock this thread held when the
        # signal came (the handler runs in the main thread). The event takes no lock either: a second
        # SIGTERM's handler can run inside this one (sudo relays the one a run_as_user task's group got).
        self._stop.set()


def _with_stop_window(setup: TaskSetup) -> TaskSetup:
    """Airflow's task supervisor SIGKILLs a task AIRFLOW_STOP_WINDOW_SECONDS after its SIGTERM: unless
    stop_window_seconds says otherwise, that is what the final checkpoint has."""
    if setup.settings.stop_window_seconds:
        return setup
    return dataclasses.replace(setup, settings=setup.settings.model_copy(
        update={"stop_window_seconds": AIRFLOW_STOP_WINDOW_SECONDS}))


def _criu_missing(settings: Settings) -> str | None:
    """Why transparent checkpoints cannot be taken on this worker (no usable CRIU), or None. A task is
    never failed for it: like a task out of scope, it runs unprotected and says so in one line."""
    if settings.mode != "transparent":
        return None  # cooperative and auto go on without CRIU (run/runner.py: engine_for)
    try:
        usable_engine(settings)
    except EngineUnavailable as e:
        return str(e)
    return None


def _has_nvidia() -> bool:
    """Whether this node can hold a GPU task's state: the driver's checkpoint API (engine/cuda.py), the
    same detection as ``gpu = require`` and GpuSensor(require_checkpoint_api=True)."""
    try:
        load_driver()
        return True
    except GpuUnavailable:
        return False


def _signal_name(n: int) -> str:
    """SIGKILL, SIGSEGV ...; a real-time signal has no name in the signal module: "signal 35"."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"
