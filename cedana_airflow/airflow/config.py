"""Settings inside Airflow: the core Settings, with airflow.cfg's [cedana] (AIRFLOW__CEDANA__*) on top.

Precedence, rising: core defaults < CEDANA_CONFIG < CEDANA_* < [cedana] < the opt-in list's defaults
for the scopes that admitted the task < operator arguments. A bad value is one ConfigError naming the
option and where it came from, raised when the operator is built (so the DAG shows an import error)
or when the task starts, never deep inside a worker.

The [cedana] section declared to Airflow (provider info) is generated from the two models here:
every core :class:`~cedana_airflow.config.Settings` field, plus :class:`AirflowOptions`, the options
only the Airflow side reads, so a default is written once, in its model. A core option's default is
stated in its description, not declared as its value: Airflow writes declared defaults into a new
airflow.cfg as set values, and [cedana] sits above CEDANA_* and CEDANA_CONFIG, so a declared
``keep_checkpoints = 3`` would silently override ``CEDANA_KEEP_CHECKPOINTS``. The Airflow-only
options have nothing below them and declare theirs.
"""

from __future__ import annotations

import difflib
import logging
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import Settings, load_settings, node_settings_refusal, redact
from ..errors import ConfigError

__all__ = ["AirflowOptions", "ConfigOption", "airflow_options", "config_options", "default_deferrable", "task_settings",
           "with_scope_defaults"]

log = logging.getLogger(__name__)

_ENV_PREFIX = "AIRFLOW__CEDANA__"


class AirflowOptions(BaseModel):
    """[cedana] options that are not core settings: only the operators and the plugin read them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    aws_conn_id: str | None = Field(
        default=None,
        description="Airflow connection for s3:// stores (amazon provider's S3Hook). Unset: boto3's credential chain.")
    same_node_retry: Literal["allow", "fail"] = Field(
        default="allow", description="A retry on the node where the previous try failed: 'allow' (log it) or "
        "'fail' (fail fast so the next retry is placed elsewhere).")
    k8s_route: Literal["cedana", "wrap"] = Field(
        default="cedana", description="CedanaKubernetesPodOperator: 'cedana' (runtime class on a Cedana cluster) or "
        "'wrap' (our CLI wrapped around the container's command).")
    k8s_runtime_class: str = Field(default="cedana", description="The runtime class of the 'cedana' route.")
    k8s_heartbeat_seconds: int = Field(
        default=600, gt=0, description="A pod's heartbeat when neither its operator's heartbeat nor a heartbeat_seconds "
        "set in [cedana], the environment or the opt-in list (not its default) "
        "gives one: both Kubernetes routes need an interval.")
    k8s_key_secret: str = Field(
        default="cedana-node-key", description="The Kubernetes Secret (key node.key) the wrap route mounts, "
        "read-only and mode 0400, for the in-pod supervisor's node key: the same key as the workers' "
        "(kubectl create secret generic cedana-node-key --from-file=node.key=/etc/cedana-airflow/node.key).")
    drill_schedule: str = Field(
        default="@daily", description="Schedule of the cedana_fleet_drill DAG (a cron expression or preset).")
    drill_notifier: str | None = Field(
        default=None, description="Called when a drill fails: 'module:name' of an Airflow notifier instance, a "
        "notifier class (built without arguments) or a callable(context). Unset: the task fails, nothing else.")
    drill_api_url: str | None = Field(
        default=None, description="Airflow's API for live drills (http://HOST:PORT). Unset: the api-server the "
        "workers report to ([core] execution_api_server_url).")
    drill_api_conn_id: str | None = Field(
        default=None, description="Connection whose login and password (or extra {\"token\": ...}) live drills use "
        "on Airflow's API; the user needs edit on the DAGs drilled. Unset: the token of the simple auth manager's "
        "all-admins mode.")
    history_api_url: str | None = Field(
        default=None, description="Airflow's API, where a task reads Airflow's history: its queue's failures "
        "(heartbeat = auto) and its own past durations (the short-task rule). Unset: drill_api_url, else the "
        "api-server the workers report to.")
    history_api_conn_id: str | None = Field(
        default=None, description="Connection (login and password, or extra {\"token\": ...}) for reading that "
        "history; the user needs read access to the task instances and the audit log of the DAGs counted. Unset: "
        "drill_api_conn_id, else the all-admins token.")
    failure_window_days: float = Field(
        default=30.0, gt=0, le=366, description="heartbeat = auto counts the failures of the last this many days.")
    learned_duration_runs: int = Field(
        default=10, ge=0, le=100, description="The short-task rule, for a task without expected_duration: the "
        "median duration of its last this many successful runs (all tries of each). 0 = declared durations only.")
    task_instance_tab: bool = Field(
        default=True, description="Show the Checkpoints tab on task instances (read when the api-server starts). "
        "Airflow shows a plugin's tab on every task instance, of every operator; false: only our operators' "
        "Checkpoints link leads to a task's checkpoints.")


#: Where a core setting's meaning differs inside Airflow, the [cedana] description says so.
_AIRFLOW_WORDING = {
    "store": "Store URL: file:///DIR or s3://bucket/prefix. Unset: file://$AIRFLOW_HOME/cedana/store.",
    "heartbeat_seconds": "Seconds between heartbeat checkpoints for operators without `heartbeat` (default 600: a task "
    "the opt-in list admits is checkpointed every 10 minutes); 0 = none, only a stop's final checkpoint; "
    "auto = chosen from the task's measured checkpoint cost and the failures Airflow saw on its queue (docs/heartbeat.md).",
    "checkpoint_on_term": "Take a final checkpoint when Airflow stops a task (drain, preemption, mark-failed).",
    "work_dir": "Local directory for dumps and restores. Unset: a temp dir per task.",
}


class ConfigOption(NamedTuple):
    name: str
    type: str  # Airflow's option types: string, integer, float, boolean
    default: str | None  # as airflow.cfg would spell it; None: unset
    description: str
    example: str | None = None  # a core option's default, shown (`airflow config list --include-examples`), not set


def _airflow_type(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return {bool: "boolean", int: "integer", float: "float"}.get(annotation, "string")


def _spelled(value: Any) -> str | None:
    if value is None or value == "" or value == ():
        return None
    return str(value)


def config_options() -> tuple[ConfigOption, ...]:
    """The [cedana] section, option by option, from the models' fields (defaults and descriptions)."""
    out = []
    for name, f in Settings.model_fields.items():
        default = _spelled(f.default)
        said = _AIRFLOW_WORDING.get(name, f.description or "")
        if default is not None and "Default: " not in said:
            said = f"{said} Default: {default}."
        out.append(ConfigOption(name, _airflow_type(f.annotation), None, said, default))
    for name, f in AirflowOptions.model_fields.items():
        out.append(ConfigOption(name, _airflow_type(f.annotation), _spelled(f.default), f.description or ""))
    return tuple(out)


def default_deferrable(deferrable: bool | None) -> bool:
    """An operator's ``deferrable`` argument, or Airflow's ``[operators] default_deferrable`` when not given
    (as Airflow's own deferrable operators read it)."""
    if deferrable is not None:
        return deferrable
    from airflow.configuration import conf

    return conf.getboolean("operators", "default_deferrable", fallback=False)


def _where(key: str) -> str:
    return f"airflow.cfg [cedana] {key} / {_ENV_PREFIX}{key.upper()}"


#: Variables already warned about: task_settings runs for every operator a parse builds.
_warned: set[str] = set()


def _warn_unknown_options(environ: Mapping[str, str]) -> None:
    """An AIRFLOW__CEDANA__* variable no option reads is a typo until shown otherwise: say so once per
    process, with the closest option, instead of ignoring it in silence."""
    known = [*Settings.model_fields, *AirflowOptions.model_fields, *_REMOVED]
    for var in environ:
        if not var.startswith(_ENV_PREFIX):
            continue
        name = var[len(_ENV_PREFIX):].lower()
        if name.endswith(("_cmd", "_secret")):
            name = name.rsplit("_", 1)[0]  # Airflow's command and secret forms of an option
        if name not in known and var not in _warned:
            _warned.add(var)
            close = difflib.get_close_matches(name, known, n=1)
            log.warning("%s is not a [cedana] option and is ignored.%s Options: %s", var,
                        f" Did you mean {_ENV_PREFIX}{close[0].upper()}?" if close else "", ", ".join(known))


def _section(names: Sequence[str]) -> dict[str, str]:
    """The [cedana] options the deployment set (airflow.cfg, AIRFLOW__CEDANA__*, commands, secrets);
    an option it did not set reads as None, since core options declare no default (module docstring)."""
    from airflow.configuration import conf

    out = {}
    for name in names:
        value = conf.get("cedana", name, fallback=None)
        if value not in (None, ""):
            out[name] = value
    return out


#: The operator's argument each setting comes from, where the two names differ (task.py): a source names
#: the argument the DAG's author wrote, as `explain` does.
_ARGUMENTS = {"heartbeat_seconds": "heartbeat", "heartbeat_min_seconds": "heartbeat_min",
              "heartbeat_max_seconds": "heartbeat_max", "mtbf_hours": "mtbf", "max_restore_gap_seconds": "max_restore_gap",
              "lease_seconds": "lease"}


def _argument(setting: str) -> str:
    if setting in _ARGUMENTS:
        return f"the operator's {_ARGUMENTS[setting]} argument"
    return f"operator argument {setting}"


def airflow_options(*names: str, overrides: Mapping[str, Any] | None = None) -> AirflowOptions:
    """The Airflow-only options ``names`` (all when none are named), from [cedana], then ``overrides``;
    options not asked for keep their defaults, so a bad value of one never breaks a reader of another."""
    wanted = names or tuple(AirflowOptions.model_fields)
    values: dict[str, Any] = dict(_section(wanted))
    source = {k: _where(k) for k in values}
    for k, v in (overrides or {}).items():
        if k in wanted and v not in (None, ""):
            values[k], source[k] = v, f"operator argument {k}"
    try:
        return AirflowOptions(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0])
        why = f"use {err['ctx']['expected']}" if err["type"] == "literal_error" else err["msg"]
        raise ConfigError(f"setting {field} = {redact(values.get(field))!r} (from {source.get(field, field)}) "
                          f"is invalid: {why}.") from None


def _airflow_paths() -> tuple[Path, ...]:
    from airflow.configuration import AIRFLOW_HOME, conf

    home = Path(AIRFLOW_HOME)
    found = [conf.get("core", "dags_folder", fallback=None), conf.get("core", "plugins_folder", fallback=None)]
    return (*(Path(p) for p in found if p and os.path.isabs(p)), home / "airflow.cfg", home / "webserver_config.py")


def _default_store() -> str:
    from airflow.configuration import AIRFLOW_HOME

    return f"file://{Path(AIRFLOW_HOME) / 'cedana' / 'store'}"


def task_settings(overrides: Mapping[str, Any] | None = None) -> tuple[Settings, AirflowOptions]:
    """A task's core settings and the options every route reads (aws_conn_id, same_node_retry,
    k8s_key_secret). Node settings (the key) come only from the node's own configuration. The opt-in list's defaults come on top later (:func:`with_scope_defaults`), once
    the list has admitted the task."""
    _warn_unknown_options(os.environ)
    section = _section(tuple(Settings.model_fields))
    layers = [(_where, section)]
    # Every override but the Airflow-only options goes to the core, so a misspelt setting is an
    # "unknown setting" error when the DAG is parsed, never silently ignored.
    core = {k: v for k, v in (overrides or {}).items() if k not in AirflowOptions.model_fields}
    node_settings_refusal(core, "operator argument settings")
    _removed_options()
    settings = load_settings(core, layers=layers, overrides_source=_argument)
    if not settings.store:
        settings = settings.model_copy(update={"store": _default_store()})
    # Airflow's code and configuration are never a restore's to write, whatever a DAG's settings say.
    settings = settings.model_copy(update={"restore_deny": (*settings.restore_deny, *_airflow_paths())})
    # aws_conn_id is an operator argument; same_node_retry only a deployment's choice ([cedana]).
    return settings, airflow_options("aws_conn_id", "same_node_retry", "k8s_key_secret",
                                     overrides={"aws_conn_id": (overrides or {}).get("aws_conn_id")})


#: [cedana] options 0.8.0 no longer reads, and why: set, they fail the task rather than be ignored.
_REMOVED = {"signing_variable": "any task could read that Variable and anyone who may edit Variables could replace it",
            "signing_conn_id": "any task could read that connection's password"}


def _removed_options() -> None:
    for name, value in _section(tuple(_REMOVED)).items():
        raise ConfigError(f"[cedana] {name} = {value!r} is no longer read (0.8.0): {_REMOVED[name]}. The key is now "
                          "the node key file; remove the option (docs/security.md#migration).")


def with_scope_defaults(settings: Settings, defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> Settings:
    """``settings`` narrowed by what the opt-in list sets for the scopes that admitted the task: above
    [cedana] and the environment, below the operator's arguments (``overrides``, which keep their values)."""
    node_settings_refusal(defaults, "the opt-in list's defaults")
    update = {k: v for k, v in defaults.items() if overrides.get(k) is None}
    if not update:
        return settings
    try:
        return Settings(**{**settings.model_dump(), **update}).with_sources(
            {**settings.sources(), **{k: "the opt-in list's defaults" for k in update}})
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        raise ConfigError(f"setting {field} = {redact(update.get(field))!r} (from the opt-in list's defaults) is "
                          f"invalid: {err['msg']}. Fix the list.") from None
