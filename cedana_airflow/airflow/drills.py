"""Fleet drills inside Airflow: what the cedana_fleet_drill DAG's tasks call.

Each task runs one drill of the core (drill/) on its worker against the task's store (``[cedana]
store``, through ``aws_conn_id`` for S3), keeps the report in the store, writes one summary line to
the task log, and fails the task when the drill failed, so Airflow's retries, alerting and the
configured notifier (``[cedana] drill_notifier``) see it.

A drill task that is not root (``[cedana] agent``, as for a workload: agent/route.py) holds neither the
store nor the key: the node agent runs ``verify`` and ``canary`` itself, and a ``live`` drill, which
fails and clears tasks through Airflow's API from the task, reads the store's facts through the agent
and has it keep the report. The drill's user must be in the node's ``agent_drillers`` (docs/agent.md). A drill
DAG that names a store of its own, or a node without an agent (``agent = auto``), reads the store itself.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..agent.client import AgentClient
from ..agent.route import through_agent
from ..config import Settings
from ..drill import run as drill
from ..drill.facts import AgentFacts
from ..drill.live import live
from ..drill.report import DrillReport
from ..errors import AgentUnavailable, CedanaError, ConfigError
from ..hooks.store import task_store
from ..scope.optin import load_optin
from ..units import binary_size
from .config import airflow_options, task_settings
from .live_fleet import ApiFleet
from .task import airflow_errors

__all__ = ["canary_queues", "drill_notifier", "drill_schedule", "live_enabled", "run_drill"]

log = logging.getLogger(__name__)


def drill_schedule() -> str:
    return airflow_options("drill_schedule").drill_schedule


def drill_notifier() -> Callable[..., Any] | None:
    """The configured notifier, ready for ``on_failure_callback``; a bad path is a DAG import error."""
    path = airflow_options("drill_notifier").drill_notifier
    if not path:
        return None
    module, _, name = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"[cedana] drill_notifier = {path!r} cannot be imported ({e}). Give 'module:name' of a "
                          "notifier or a callable.") from None
    notifier = obj() if isinstance(obj, type) else obj
    if not callable(notifier):
        raise ConfigError(f"[cedana] drill_notifier = {path!r} is not callable. Give a notifier or a callable(context).")
    return notifier  # type: ignore[no-any-return]


def canary_queues() -> list[str]:
    """The queues the opt-in list admits by name (a pattern names no queue to run on): one canary each."""
    try:
        optin = load_optin(task_settings()[0].optin_file)
    except ConfigError:
        return []  # an unreadable list: the verify drill still runs, and the task log of any task says why
    queues = optin.queue.queues if optin.queue else ()
    return sorted(q for q in queues if not any(c in q for c in "*?["))


def live_enabled() -> bool:
    """Whether the opt-in list enables live drills (the DAG gets its live task only then)."""
    try:
        return load_optin(task_settings()[0].optin_file).drills.live
    except ConfigError:
        return False


def _summary(report: DrillReport) -> str:
    head = f"cedana: drill {report.drill_id} ({report.mode}) "
    if report.dry_run or report.stopped:
        chosen = [f"{t.dag_id}.{t.task_id} ({t.run_id})" for t in report.targets if t.chosen]
        return head + (f"dry run: would fail {', '.join(chosen) or 'nothing'}" if report.dry_run else f"did nothing: {report.stopped}")
    head += f"{'passed' if report.ok else 'FAILED'} on {report.node}"
    if report.mode == "verify":
        return head + f"; {len(report.checked)} ID(s) verified, {binary_size(report.bytes_fetched)}"
    live = (f"; {report.checkpoint_id} taken on {report.from_node}, restored seq {report.restored_seq} on {report.to_node}; "
            f"retry ran {report.retry_seconds} s after the failure" if report.mode == "live" else "")
    return head + live + f"; RTO {report.rto_seconds} s, restore {report.restore_seconds} s, lost work {report.lost_work_seconds} s"


def _fleet(core: Settings) -> ApiFleet:
    from airflow.sdk import get_current_context

    limits = load_optin(core.optin_file).drills
    api = airflow_options("drill_api_url", "drill_api_conn_id")
    return ApiFleet(api.drill_api_url, api.drill_api_conn_id, get_current_context()["dag"].dag_id,
                    limits.kill_switch_variable)


def _through_agent(mode: str, core: Settings, fleet: ApiFleet | None, params: Mapping[str, Any]) -> DrillReport:
    with AgentClient.connect(core.agent_socket) as agent:
        hello = agent.hello()
        if "drill" not in hello.get("features", ()):
            raise AgentUnavailable(f"the cedana agent at {core.agent_socket} runs {hello.get('agent')}, which runs no "
                                   "drills for a task that is not root (0.8.4 and later do). Upgrade it")
        if not hello.get("drills"):
            raise ConfigError(f"this drill runs as uid {hello.get('you', {}).get('uid')}, for which the node agent at "
                              f"{core.agent_socket} runs no drills: a drill reads every checkpoint. Add its group to the "
                              "node's agent_drillers (docs/drills.md), or run the drill DAG as such a user")
        if mode != "live":
            if mode not in drill.MODES:
                raise ConfigError(f"drill mode {mode!r} is unknown; use one of {', '.join(drill.MODES)}.")
            return DrillReport.model_validate(agent.drill(mode, params)["report"])
        assert fleet is not None
        report = live(AgentFacts(agent), fleet, load_optin(core.optin_file).drills, node=str(hello.get("node")),
                      **params)
        try:  # a keep that fails loses nothing else: the task still says and returns the report
            if not agent.drill("keep", report=report.model_dump(mode="json")).get("kept"):
                log.warning("cedana: drill report %s was not kept in the store (the agent's log says why)",
                            report.drill_id)
        except CedanaError as e:
            log.warning("cedana: drill report %s was not kept in the store: %s", report.drill_id, e)
        return report


def _via_agent(core: Settings, named_store: bool) -> bool:
    """Whether this drill asks the node agent: a task that is not root (``agent = auto``) and names no store of
    its own (a drill DAG aimed at another store reads it itself, as before 0.8.4); where no agent answers and
    ``agent = auto``, it reads the store itself, saying so once."""
    if named_store or not through_agent(core):
        return False
    if core.agent == "auto":
        try:
            AgentClient.connect(core.agent_socket).close()
        except AgentUnavailable as e:
            log.info("cedana: %s; this drill reads the store itself", e)
            return False
    return True


def run_drill(mode: str, settings: Mapping[str, Any] | None = None, **params: Any) -> dict[str, Any]:
    """Run one drill here; return its report (the task's XCom); raise when it failed. ``settings``: core
    settings by name over [cedana] (a drill DAG of its own store or opt-in list), as an operator's."""
    with airflow_errors():
        core, options = task_settings(settings)
        fleet = _fleet(core) if mode == "live" else None
        if _via_agent(core, named_store=bool(settings and (settings.get("store") or settings.get("aws_conn_id")))):
            report = _through_agent(mode, core, fleet, params)
        else:
            store = task_store(core, options.aws_conn_id)
            cfg = store.open(create=True, chunk_avg_bytes=core.chunk_avg_bytes)
            report = drill.run_drill(mode, store, cfg, core, fleet=fleet, **params)
    summary = _summary(report)
    log.info("%s", summary)
    for t in report.targets:
        log.info("cedana: drill %s %s: %s.%s (%s) try %d: %s%s", report.drill_id, "CHOSE" if t.chosen else "passed over",
                 t.dag_id, t.task_id, t.run_id, t.try_number, t.reason, f"; {t.problem}" if t.problem else "")
    if not report.ok:
        from ..airflow_compat import AirflowException

        raise AirflowException(f"{summary}: {'; '.join(report.problems)}")
    return report.model_dump(mode="json")
