"""The version handshake: an operator's command run by an older supervisor is refused in one line that
names both versions and the fix, before any flag the older one may not know is parsed."""

from __future__ import annotations

import pytest

from cedana_airflow import __version__
from cedana_airflow.compat import COOPERATIVE_FLOOR, JOB_FLOOR, SUPERVISOR_FLOOR, handshake_env, supervisor_refusal
from conftest import cli, cli_env


@pytest.mark.parametrize("own, need, refused", [
    ("0.5.1", "", False), ("0.5.1", "0.5.1", False), ("0.6.0", "0.5.1", False), ("0.10.0", "0.9.3", False),
    ("0.5.0", "0.5.1", True), ("0.9.9", "0.10", True), ("1.0.0rc1", "1.0.1", True)])
def test_a_supervisor_runs_what_it_understands_and_refuses_what_it_may_not(own, need, refused):
    env = {"CEDANA_MIN_SUPERVISOR": need, "CEDANA_OPERATOR_VERSION": "0.10.2"} if need else {}
    why = supervisor_refusal(env, own)
    assert (why is not None) == refused
    if refused:
        assert f"needs a supervisor of {need} or later; this one is {own}" in why and "deploy/Containerfile" in why


def test_operators_ask_for_this_versions_floor():
    assert handshake_env() == {"CEDANA_MIN_SUPERVISOR": SUPERVISOR_FLOOR, "CEDANA_OPERATOR_VERSION": __version__}
    assert supervisor_refusal(handshake_env()) is None  # this version runs its own commands


def test_the_floor_is_the_newest_of_what_the_command_needs():
    assert handshake_env({"CEDANA_MODE": "cooperative"})["CEDANA_MIN_SUPERVISOR"] == max(
        SUPERVISOR_FLOOR, COOPERATIVE_FLOOR, key=lambda v: tuple(map(int, v.split("."))))
    assert handshake_env({"CEDANA_MODE": "cooperative"}, job=True)["CEDANA_MIN_SUPERVISOR"] == JOB_FLOOR
    assert handshake_env({"CEDANA_JOB_PARTS": "2"})["CEDANA_MIN_SUPERVISOR"] == JOB_FLOOR
    assert "needs a supervisor of 0.12.0 or later; this one is 0.11.2" in supervisor_refusal(
        handshake_env(job=True), "0.11.2")


def test_the_cli_refuses_a_newer_operators_command_before_reading_its_flags(tmp_path):
    env = cli_env(tmp_path, "n", "w", CEDANA_MIN_SUPERVISOR="9.0", CEDANA_OPERATOR_VERSION="9.0.2")
    r = cli("run", "--id", "x", "--a-flag-from-9", "--", "true", env=env)
    [line] = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith("ConfigError: this command was written by cedana-airflow 9.0.2")
    assert "unrecognized arguments" not in r.stderr
