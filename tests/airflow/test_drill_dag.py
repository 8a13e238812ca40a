"""The cedana_fleet_drill DAG under `airflow dags test` (cluster policy on): it loads, schedules from
[cedana] drill_schedule, runs a canary per queue the opt-in list names, keeps every report, and a
failed drill fails its task and calls the configured notifier."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import AIRFLOW, REPO, airflow_env, cli, cli_env

pytestmark = pytest.mark.integration


def _json_line(stdout: str) -> list:
    """The CLI's JSON output (Airflow logs a few lines before it on stdout)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("[")))


def test_the_drill_dag_runs_verify_and_a_canary_per_queue_and_a_failed_drill_calls_the_notifier(tmp_path, airflow_db):
    notified = tmp_path / "notified.jsonl"
    env = airflow_env(tmp_path, airflow_db, AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
                      AIRFLOW__CEDANA__DRILL_SCHEDULE="0 3 * * *",
                      AIRFLOW__CEDANA__DRILL_NOTIFIER="drill_notifier_probe:notify", CEDANA_TEST_NOTIFIED=str(notified),
                      PYTHONPATH=str(REPO / "tests" / "airflow"))
    (tmp_path / "optin.toml").write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["default", "gpu-*"]\n'
                                         '[workload]\ndags = ["*"]\n')
    parsed = subprocess.run([*AIRFLOW, "dags", "reserialize"], env=env, capture_output=True, text=True, timeout=180)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    listed = subprocess.run([*AIRFLOW, "dags", "details", "cedana_fleet_drill", "--output", "json"], env=env,
                            capture_output=True, text=True, timeout=180)
    assert listed.returncode == 0, listed.stderr[-3000:]
    [details] = _json_line(listed.stdout)
    assert (details["timetable_summary"], details["is_paused"]) == ("0 3 * * *", "True")  # paused on creation
    errors = subprocess.run([*AIRFLOW, "dags", "list-import-errors", "--output", "json"], env=env,
                            capture_output=True, text=True, timeout=180)
    assert _json_line(errors.stdout) == [], errors.stdout  # it loads under the cluster policy

    # An empty store: verify has nothing to verify (a failed drill); the canary stages its node loss.
    run = subprocess.run([*AIRFLOW, "dags", "test", "cedana_fleet_drill"], env=env, capture_output=True, text=True,
                         timeout=600)
    text = run.stdout + run.stderr
    assert "cedana: drill" in text and "(canary) passed" in text, text[-4000:]
    assert "task_id=canary_default" in text and "canary_gpu" not in text  # one per queue the list names
    assert "(verify) FAILED" in text and "nothing was verified" in text, text[-4000:]
    assert [json.loads(line) for line in notified.read_text().splitlines()] == [
        {"dag_id": "cedana_fleet_drill", "task_id": "verify"}]
    reports = json.loads(cli("drills", "--json", env=cli_env(tmp_path, "n", "w")).stdout)["reports"]
    assert sorted((r["mode"], r["ok"]) for r in reports) == [("canary", True), ("verify", False)]
    canary = next(r for r in reports if r["mode"] == "canary")
    assert canary["digest_match"] is True and canary["rto_seconds"] > 0
