"""The Airflow provider: its info, [cedana] settings and their errors, and the operator's checks at DAG
parse time. Registration (providers list, plugins, config list) is proven on the installed wheel:
tests/integration/test_wheel.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest

pytest.importorskip("airflow")
from airflow.sdk.exceptions import AirflowException  # noqa: E402

from cedana_airflow.airflow import get_provider_info  # noqa: E402
from cedana_airflow.airflow.config import task_settings  # noqa: E402
from cedana_airflow.airflow.logsink import LogSink  # noqa: E402
from cedana_airflow.errors import ConfigError  # noqa: E402
from cedana_airflow.operators import CheckpointedCommandOperator  # noqa: E402


def _airflow(*args: str, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    r = subprocess.run([sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_cedana_section_is_generated_from_the_settings_models():
    from cedana_airflow.airflow.config import AirflowOptions
    from cedana_airflow.config import Settings

    options = get_provider_info()["config"]["cedana"]["options"]
    assert list(options) == [*Settings.model_fields, *AirflowOptions.model_fields]
    for name, field in Settings.model_fields.items():
        assert options[name]["default"] is None, name  # declared, it would sit above CEDANA_* (see below)
        said = options[name]["description"]
        if field.default not in (None, "", ()):  # the stated default parses back to the model's own
            stated = said.rsplit("Default: ", 1)[1].rstrip(".")
            assert Settings.model_validate({name: stated}).model_dump()[name] == field.default, name
        assert said, name
    for name, field in AirflowOptions.model_fields.items():
        declared = options[name]["default"]
        assert (declared is None) if field.default is None else AirflowOptions.model_validate({name: declared}).model_dump()[name] == field.default
    assert options["keep_checkpoints"]["type"] == "integer" and options["delete_on_success"]["type"] == "boolean"
    assert options["stop_grace_seconds"]["type"] == "float" and options["work_dir"]["type"] == "string"
    assert options["heartbeat_seconds"]["type"] == "string"  # seconds, or auto (0.7.0)


def test_cedana_section_sits_between_the_environment_and_operator_arguments(monkeypatch, tmp_path):
    monkeypatch.setenv("CEDANA_HEARTBEAT_SECONDS", "5")
    monkeypatch.setenv("AIRFLOW__CEDANA__HEARTBEAT_SECONDS", "30")
    monkeypatch.setenv("AIRFLOW__CEDANA__STORE", f"file://{tmp_path}")
    settings, options = task_settings({})
    assert settings.heartbeat_seconds == 30 and settings.store == f"file://{tmp_path}"
    assert options.same_node_retry == "allow" and options.aws_conn_id is None
    assert task_settings({"heartbeat_seconds": 90})[0].heartbeat_seconds == 90


def test_the_airflow_cfg_airflow_writes_does_not_hide_the_environment(tmp_path):
    # A new Airflow home gets an airflow.cfg with every declared provider default written as a value;
    # [cedana] sits above CEDANA_*, so a declared core default would beat the environment from then on.
    _airflow("config", "list", tmp_path=tmp_path)
    cfg = (tmp_path / "airflow.cfg").read_text()
    assert "[cedana]" in cfg and "\nsame_node_retry = allow" in cfg
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CEDANA_"))}
    env.update(AIRFLOW_HOME=str(tmp_path), CEDANA_KEEP_CHECKPOINTS="7", CEDANA_HEARTBEAT_SECONDS="60")
    code = ("from cedana_airflow.airflow.config import task_settings\n"
            "s = task_settings({})[0]\nprint(s.keep_checkpoints, s.heartbeat_seconds)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["7", "60.0"], r.stdout + r.stderr[-2000:]


def test_operator_settings_are_checked_by_name_and_aws_conn_id_falls_back_to_the_section(monkeypatch):
    with pytest.raises(ConfigError, match="unknown setting 'keep_checkpoint'"):
        task_settings({"keep_checkpoint": 5})
    monkeypatch.setenv("AIRFLOW__CEDANA__AWS_CONN_ID", "ckpt_s3")
    assert task_settings({"aws_conn_id": ""})[1].aws_conn_id == "ckpt_s3"
    assert task_settings({"aws_conn_id": "other"})[1].aws_conn_id == "other"
    assert task_settings({"same_node_retry": "fail"})[1].same_node_retry == "allow"  # the deployment's choice


def test_an_unknown_cedana_variable_is_a_warning_naming_the_closest_option(monkeypatch, caplog):
    monkeypatch.setenv("AIRFLOW__CEDANA__COMPRESION", "none")
    monkeypatch.setenv("AIRFLOW__CEDANA__COMPRESSION", "none")  # every setting is an option now
    with caplog.at_level("WARNING"):
        settings, _ = task_settings({})
    assert settings.compression == "none"
    assert "AIRFLOW__CEDANA__COMPRESION is not a [cedana] option and is ignored. Did you mean " \
           "AIRFLOW__CEDANA__COMPRESSION?" in caplog.text
    assert "AIRFLOW__CEDANA__COMPRESSION is not" not in caplog.text


def test_the_removed_signing_options_fail_the_task_in_one_line_instead_of_being_ignored(monkeypatch):
    """0.8.0 no longer reads the key from an Airflow connection or Variable: a deployment still naming one
    is told, not left believing its checkpoints are signed with it."""
    monkeypatch.setenv("AIRFLOW__CEDANA__SIGNING_CONN_ID", "signkey")
    with pytest.raises(ConfigError, match=r"\[cedana\] signing_conn_id = 'signkey' is no longer read \(0\.8\.0\): any "
                       r"task could read that connection's password\. The key is now the node key file"):
        task_settings({})


def test_a_bad_cedana_option_is_one_line_naming_its_source(monkeypatch):
    monkeypatch.setenv("AIRFLOW__CEDANA__MAX_CHECKPOINT_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"max_checkpoint_bytes = 'lots' \(from airflow.cfg \[cedana\] max_checkpoint_bytes / "
                                          r"AIRFLOW__CEDANA__MAX_CHECKPOINT_BYTES\) is invalid"):
        task_settings({})
    monkeypatch.delenv("AIRFLOW__CEDANA__MAX_CHECKPOINT_BYTES")
    monkeypatch.setenv("AIRFLOW__CEDANA__SAME_NODE_RETRY", "sometimes")
    with pytest.raises(ConfigError, match="same_node_retry = 'sometimes'.*use 'allow' or 'fail'"):
        task_settings({})


def test_the_operator_refuses_bad_settings_when_the_dag_is_parsed():
    with pytest.raises(AirflowException, match=r"train: setting store = 'ftp://x' \(from operator argument store\) is invalid"):
        CheckpointedCommandOperator(task_id="train", command="python train.py", store="ftp://x")
    with pytest.raises(AirflowException, match="heartbeat_seconds = -5.0"):
        CheckpointedCommandOperator(task_id="train", command="python train.py", heartbeat=timedelta(seconds=-5))
    # a templated store is checked when it is rendered, at run time
    CheckpointedCommandOperator(task_id="ok", command=["python"], store="{{ var.value.store }}")


def test_every_duration_argument_takes_text_seconds_or_a_timedelta(monkeypatch):
    """`heartbeat="10m"` as `--heartbeat 10m` and `CEDANA_HEARTBEAT_SECONDS=10m` (0.11.0): one form everywhere."""
    op = CheckpointedCommandOperator(task_id="t", command="x", heartbeat="10m", lease="1h30m", max_restore_gap=90,
                                     heartbeat_min=timedelta(minutes=2), mtbf="6h")
    assert (op.heartbeat, op.lease, op.max_restore_gap) == (timedelta(minutes=10), timedelta(minutes=90),
                                                            timedelta(seconds=90))
    assert op.cedana_overrides()["heartbeat_seconds"] == 600 and op.cedana_overrides()["mtbf_hours"] == 6
    assert CheckpointedCommandOperator(task_id="a", command="x", heartbeat="auto").cedana_overrides()[
        "heartbeat_seconds"] == "auto"
    for bad, said in ((True, "heartbeat=True is not a duration"), ("ten", "heartbeat: 'ten' is not a duration"),
                      ("-5m", "is not a duration"), (1e20, "is not a duration")):
        with pytest.raises(AirflowException, match=re.escape(f"t: {said}") if "True" in said else said):
            CheckpointedCommandOperator(task_id="t", command="x", heartbeat=bad)
    monkeypatch.setenv("AIRFLOW__CEDANA__HEARTBEAT_SECONDS", "2m")
    settings, _ = task_settings({})
    assert settings.heartbeat_seconds == 120 and "AIRFLOW__CEDANA__HEARTBEAT_SECONDS" in settings.heartbeat_text()
    # where a value came from names the argument the DAG's author wrote
    assert CheckpointedCommandOperator(task_id="h", command="x", heartbeat="30s") and task_settings(
        {"heartbeat_seconds": 30.0})[0].heartbeat_text() == "every 30s (from the operator's heartbeat argument)"


def test_log_sink_logs_whole_lines_and_the_rest_at_close():
    class Rec:
        lines: list[str] = []

        def info(self, fmt, line):
            self.lines.append(line)

    rec = Rec()
    sink = LogSink(rec, "stdout")  # type: ignore[arg-type]
    sink.write(b"step 1\nst")
    sink.write(b"ep 2\r\nno newline")
    assert rec.lines == ["step 1", "step 2"]
    sink.close()
    assert rec.lines == ["step 1", "step 2", "no newline"]


def test_the_provider_info_declares_every_operator_sensor_trigger_and_link_and_fits_airflows_schema():
    import importlib
    import json
    from pathlib import Path

    import airflow
    import jsonschema

    info = get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    integrations = {i["integration-name"] for i in info["integrations"]}
    from airflow.sdk import BaseOperatorLink, BaseSensorOperator
    from airflow.triggers.base import BaseTrigger

    declared = {}
    for kind in ("operators", "sensors", "triggers"):
        [entry] = info[kind]
        assert entry["integration-name"] in integrations
        declared[kind] = entry["python-modules"]
    assert "cedana_airflow.operators.slurm" in declared["operators"]
    assert "cedana_airflow.sensors.node_ready" in declared["sensors"]

    def defines(module: str, base: type) -> list[str]:
        mod = importlib.import_module(module)
        return [n for n, c in vars(mod).items() if isinstance(c, type) and issubclass(c, base)
                and c is not base and c.__module__ == module]

    # each declared module holds what its kind says; hooks/ holds no BaseHook, so none is declared
    assert "hooks" not in info
    assert all(defines(m, BaseTrigger) for m in declared["triggers"]), declared["triggers"]
    assert defines("cedana_airflow.sensors.checkpoint", BaseTrigger) == ["CheckpointTrigger"]
    assert all(defines(m, BaseSensorOperator) for m in declared["sensors"]), declared["sensors"]
    [link] = info["extra-links"]
    module, name = link.rsplit(".", 1)
    assert issubclass(getattr(importlib.import_module(module), name), BaseOperatorLink)
    # every option says the version that added it; a core option shows its default as its example
    from cedana_airflow import __version__

    def version(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    options = info["config"]["cedana"]["options"]
    assert all(version("0.1.0") <= version(o["version_added"]) <= version(__version__) for o in options.values())
    from cedana_airflow.config import Settings

    for name, field in Settings.model_fields.items():
        assert options[name]["default"] is None
        assert options[name]["example"] == (None if field.default in (None, "", ()) else str(field.default)), name


def test_our_operators_carry_the_checkpoints_link_and_it_names_the_task_instance(monkeypatch):
    from types import SimpleNamespace

    from cedana_airflow.airflow.links import CheckpointsLink
    from cedana_airflow.operators import CedanaSlurmOperator

    op = CheckpointedCommandOperator(task_id="train", command="true")
    assert [type(x) for x in op.operator_extra_links] == [CheckpointsLink]
    assert [type(x) for x in CedanaSlurmOperator(task_id="s", command="true", partition="p").operator_extra_links] \
        == [CheckpointsLink]
    key = SimpleNamespace(dag_id="d 1", run_id="manual__2026-01-01T00:00:00+00:00", task_id="train", map_index=2)
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "")
    assert CheckpointsLink().get_link(op, ti_key=key) == (
        "/cedana/ti?dag_id=d+1&run_id=manual__2026-01-01T00%3A00%3A00%2B00%3A00&task_id=train&map_index=2")
    # a worker's base_url may name the api-server by an in-cluster address: only its path is taken
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow-api-server.airflow.svc:8080/prefix/")
    assert CheckpointsLink().get_link(op, ti_key=key).startswith("/prefix/cedana/ti?dag_id=d+1&")


def test_deferrable_follows_airflows_default_deferrable_unless_given(monkeypatch):
    from cedana_airflow.operators import CedanaSlurmOperator
    from cedana_airflow.sensors import CheckpointSensor

    for default, want in (("False", False), ("True", True)):
        monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", default)
        assert CedanaSlurmOperator(task_id="s", command="true", partition="p").deferrable is want
        assert CheckpointSensor(task_id="c", checkpoint_id="x").deferrable is want
        assert CedanaSlurmOperator(task_id="t", command="true", partition="p", deferrable=not want).deferrable is not want


def test_what_airflow_config_list_shows_is_what_the_code_uses(tmp_path):
    """Each default is declared once, in its model: `airflow config list` shows the Airflow-only options'
    values and states each core option's default in its description, and a task resolves exactly those."""
    import re

    from cedana_airflow.airflow.config import AirflowOptions
    from cedana_airflow.config import Settings

    shown = _airflow("config", "list", "--section", "cedana", "--show-values", "--include-descriptions",
                     tmp_path=tmp_path)
    said, values, unset = {}, {}, set()
    description, names = "", {*Settings.model_fields, *AirflowOptions.model_fields}
    for line in shown.splitlines():
        if (m := re.fullmatch(r"(#\s*)?(\w+) = (.*)", line)) and m.group(2) in names:
            said[m.group(2)] = description
            (unset.add(m.group(2)) if m.group(1) else values.__setitem__(m.group(2), m.group(3)))
        elif line.startswith("# "):
            description = line[2:]
    assert set(said) == names
    # the Airflow-only options: the values shown are the model's defaults
    shown_options = AirflowOptions(**{k: v for k, v in values.items() if k in AirflowOptions.model_fields})
    assert shown_options == AirflowOptions()
    # the core options: unset in [cedana], and each stated default is the one a task resolves
    assert unset >= set(Settings.model_fields)
    code = ("from cedana_airflow.airflow.config import task_settings, airflow_options\n"
            "s, _ = task_settings({})\nprint(s.model_dump_json())\nprint(airflow_options().model_dump_json())")
    out = _airflow_python(code, tmp_path=tmp_path).splitlines()
    resolved, options = Settings.model_validate_json(out[-2]), AirflowOptions.model_validate_json(out[-1])
    assert options == AirflowOptions()
    assert said["store"].endswith("Unset: file://$AIRFLOW_HOME/cedana/store.")
    assert resolved.store == f"file://{tmp_path}/cedana/store"
    for name, field in Settings.model_fields.items():
        if name == "store" or "Default: " not in said[name]:
            continue
        stated = said[name].rsplit("Default: ", 1)[1].rstrip(".")
        assert Settings.model_validate({name: stated}).model_dump()[name] == getattr(resolved, name), name


def _airflow_python(code: str, *, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CEDANA_"))}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_a_slurm_job_followed_in_the_worker_survives_slurm_s_silence_and_is_cancelled_when_given_up(monkeypatch):
    """deferrable=False (Airflow's default_deferrable): Slurm may not answer for a while, as in the triggerer;
    once following is given up, the job is cancelled before the try fails, so the retry's job runs alone."""
    import cedana_airflow.operators.slurm as slurm_operator

    from cedana_airflow.errors import SlurmError
    from cedana_airflow.operators import CedanaSlurmOperator
    from cedana_airflow.slurm.jobs import JobInfo

    class Slurm:
        def __init__(self, answers: list[object]) -> None:
            self.answers, self.cancelled, self.closed = answers, [], 0

        def job(self, job_id: str) -> JobInfo:
            answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            if isinstance(answer, Exception):
                raise answer
            return answer  # type: ignore[return-value]

        def read_from(self, path: str, pos: int) -> bytes:
            return b""

        def cancel(self, job_id: str) -> None:
            self.cancelled.append(job_id)

        def close(self) -> None:
            self.closed += 1

        def __enter__(self) -> "Slurm":
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

    done = JobInfo(job_id="7", state="COMPLETED", exit_code="0:0", nodes="n1", restarts=0, reason="None")
    op = CedanaSlurmOperator(task_id="s", command="true", partition="p", deferrable=False,
                             poll_interval=timedelta(seconds=0.01))
    op._job_id = "7"
    silent = SlurmError("scontrol did not answer")
    # a few silent polls, then the job's end: the try succeeds and nothing is cancelled
    slurm = Slurm([silent, silent, done])
    monkeypatch.setattr(slurm_operator, "slurm_client", lambda conn: slurm)
    assert op._follow(slurm, "7", "/out")["state"] == "COMPLETED" and slurm.cancelled == []
    # silent past the give-up time: the job is cancelled, then the try fails (and may retry)
    monkeypatch.setattr(slurm_operator, "GIVE_UP_SECONDS", 0.05)
    slurm = Slurm([silent])
    monkeypatch.setattr(slurm_operator, "slurm_client", lambda conn: slurm)
    with pytest.raises(AirflowException, match="cedana: scontrol did not answer"):
        op._follow(slurm, "7", "/out")
    assert slurm.cancelled == ["7"] and slurm.closed == 1  # on_kill's own login, closed
