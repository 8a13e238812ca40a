"""One drill, whichever mode, as the CLI and the Airflow DAG both run it: pick the mode, run it on
this node, keep its report in the store."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import ConfigError, EngineUnavailable
from ..keys import node_trust
from ..run.runner import make_engine
from ..scope.optin import load_optin
from ..store.base import Store, StoreConfig
from .canary import canary
from .facts import StoreFacts
from .fleet import Fleet
from .live import live
from .report import DrillReport, save_report
from .trends import trends
from .verify import verify

__all__ = ["LIVE_NEEDS_AIRFLOW", "MODES", "drills_json", "run_drill"]

MODES = ("verify", "canary", "live")
LIVE_NEEDS_AIRFLOW = ("live drills run inside Airflow, where they can fail and clear task instances: enable them with "
                      "live = true under [drills] in the opt-in list and run the cedana_fleet_drill DAG.")


def run_drill(mode: str, store: Store, cfg: StoreConfig, settings: Settings, *, fleet: Fleet | None = None,
              **params: Any) -> DrillReport:
    """Run a ``mode`` drill here with its ``params``; the report is kept in the store and returned.

    ``fleet``: the running tasks a ``live`` drill may fail (Airflow's, through its API); its limits
    are the ``[drills]`` section of this node's opt-in list, read now (not when the DAG was parsed).
    """
    if mode == "live":
        if fleet is None:
            raise ConfigError(LIVE_NEEDS_AIRFLOW)
        report = live(StoreFacts(store, node_trust(settings)), fleet, load_optin(settings.optin_file).drills,
                      node=settings.resolved_node(), **params)
    elif mode == "canary":
        make_engine(settings)  # a canary needs CRIU here: say so before anything starts
        report = canary(store, settings, **params)
    elif mode == "verify":
        try:
            engine = make_engine(settings)
        except EngineUnavailable:
            engine = None  # the report says CRIU itself was not checked
        report = verify(store, cfg, settings, engine, **params)
    else:
        raise ConfigError(f"drill mode {mode!r} is unknown; use one of {', '.join(MODES)}.")
    save_report(store, report)
    return report


def drills_json(reports: list[DrillReport]) -> dict[str, Any]:
    """What `drills --json` prints and the browser's drills API serves."""
    return {"trends": trends(reports), "reports": [r.model_dump(mode="json") for r in reports]}
