"""The live drill under a real scheduler (LocalExecutor, SQLite), api-server and dag processor (the test run's
shared stack; the drill's DAG and its targets are this test's own: tests/stack_dags/dags_live.py): it chooses
only an eligible running task, a dry run and the kill switch change nothing, and a real drill fails the chosen
try through Airflow's API, clears it, and measures the retry that restores it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import AIRFLOW, OPTIN_ALL, REPO, airflow_env, cli, cli_env, uninterrupted_digest
from shared_stack import DRILL_NODE, SharedStack

pytestmark = pytest.mark.integration

#: 80 s of steps: train must still be on its first try when the third drill run acts, on a busy scheduler too;
#: its retry goes on without the sleeps (the drill waits for the retry's end, and only its digest is checked)
ARGS = ["--mb", "20", "--steps", "800", "--step-seconds", "0.1", "--fast-after-restores", "1"]


def _drill(stack: SharedStack, dag_id: str, dry_run: bool) -> dict:
    """Trigger the drill DAG and return its report (the task's XCom) once the run ends."""
    run_id = stack.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None,
                                                                   "conf": {"live_dry_run": dry_run}})["dag_run_id"]
    base = f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}"
    deadline = time.monotonic() + 400
    while (state := stack.call("GET", base)["state"]) not in ("success", "failed"):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(1)
    log = stack.task_log(dag_id, run_id, "live", 1)
    assert state == "success", log[-4000:]
    value = stack.xcom(dag_id, run_id, "live", "return_value")
    return json.loads(value) if isinstance(value, str) else value


def _tries(stack: SharedStack, dag_id: str, run_id: str) -> dict[str, tuple[str, int]]:
    tis = stack.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances")["task_instances"]
    return {t["task_id"]: (t["state"], t["try_number"]) for t in tis}


def test_the_shipped_drill_dag_has_its_live_task_once_the_opt_in_list_enables_live_drills(tmp_path, airflow_db):
    env = airflow_env(tmp_path, airflow_db)
    (tmp_path / "optin.toml").write_text(OPTIN_ALL + "[drills]\nlive = true\n")  # the list airflow_env names
    code = ("from airflow.dag_processing.dagbag import DagBag\n"
            f"bag = DagBag(dag_folder={str(REPO / 'dags' / 'cedana_fleet_drill.py')!r})\n"
            "assert not bag.import_errors, bag.import_errors\n"
            "print(sorted(bag.get_dag('cedana_fleet_drill').task_ids))")
    r = subprocess.run([*AIRFLOW[:2], "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'live'" in r.stdout.splitlines()[-1], r.stdout


def test_a_live_drill_fails_only_an_eligible_task_and_measures_the_retry_that_restores_it(tmp_path, airflow_stack):
    """Everything as nobody, with the default ``agent = auto``: the target tasks checkpoint through the stack's
    drill agent, and the drill task, holding neither the store nor the key, reads their facts through it (nobody's
    group is among its agent_drillers) and has it keep the report."""
    stack = airflow_stack
    store = stack.drill_store  # the drill agent's: only this test writes there
    # Its own kill switch: a Variable no other test's drill reads.
    stop = f"cedana_drills_stop_{tmp_path.name}"
    optin = stack.user_dir("drill") / "optin.toml"  # nobody's task reads it
    optin.write_text(OPTIN_ALL + f'[drills]\nlive = true\nfollow_seconds = 300\nkill_switch_variable = "{stop}"\n')
    optin.chmod(0o644)
    agent = stack.agent(DRILL_NODE)
    target = stack.add_dag("live_target", "dags_live:target_dag", store=f"file://{tmp_path / 'unused'}",
                           work_dir=str(stack.user_dir("live-work")), train_args=ARGS, agent=agent)
    drill = stack.add_dag("live_drill", "dags_live:drill_dag", settings={"optin_file": str(optin)}, agent=agent)
    run_id = stack.trigger(target)
    try:
        _drills(stack, tmp_path, store, target, drill, stop, run_id)
    finally:  # what is still running (no_retries, plain) stops with the test, not minutes after it
        stack.call("PATCH", f"/api/v2/dags/{target}/dagRuns/{quote(run_id)}", {"state": "failed"})


def _drills(stack: SharedStack, tmp_path: Path, store: Path, target: str, drill: str, stop: str, run_id: str) -> None:
    deadline = time.monotonic() + 180
    while not (all(list(store.glob(f"{target}.{t}.*/*/manifest.json")) for t in ("train", "no_retries"))
               and _tries(stack, target, run_id).get("plain", ("",))[0] == "running"):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.5)

    # A dry run: says what it would fail, and why the others are passed over; touches nothing.
    dry = _drill(stack, drill, dry_run=True)
    assert dry["dry_run"] is True and dry["ok"] is True and dry["ran_as_uid"] == 65534  # nobody
    verdicts = {t["task_id"]: t for t in dry["targets"] if t["dag_id"] == target}
    assert verdicts["train"]["chosen"] and verdicts["train"]["reason"].startswith("eligible"), verdicts
    assert not verdicts["no_retries"]["chosen"] and "no retries" in verdicts["no_retries"]["reason"]
    assert not verdicts["plain"]["chosen"] and "not checkpointed" in verdicts["plain"]["reason"]
    assert _tries(stack, target, run_id) == {t: ("running", 1) for t in ("train", "no_retries", "plain")}

    # The kill switch: a Variable set by an operator stops the drill before it acts.
    stack.call("POST", "/api/v2/variables", {"key": stop, "value": "maintenance window"})
    stopped = _drill(stack, drill, dry_run=False)
    assert f"kill switch: Airflow Variable {stop} is set" in stopped["stopped"], stopped
    assert stopped["targets"] == [] and stopped["ok"] is True
    assert _tries(stack, target, run_id) == {t: ("running", 1) for t in ("train", "no_retries", "plain")}
    stack.call("DELETE", f"/api/v2/variables/{stop}")

    # The real thing: try 1 of train is failed through Airflow, cleared, and try 2 restores.
    report = _drill(stack, drill, dry_run=False)
    assert report["ok"] is True and not report["stopped"], report
    [acted] = [t for t in report["targets"] if t["ok"] is not None]
    assert (acted["task_id"], acted["retry_try_number"], acted["retry_state"]) == ("train", 2, "success")
    tries = _tries(stack, target, run_id)
    assert tries["train"] == ("success", 2) and tries["no_retries"][1] == 1 and tries["plain"][1] == 1  # untouched

    base = f"/api/v2/dags/{target}/dagRuns/{quote(run_id)}/taskInstances/train"
    log2 = stack.task_log(target, run_id, "train", 2)
    restored = re.search(r"cedana \(node agent\): restored seq (\d+) of try 1 \(node (\S+)\) on node ([^:\s]+): "
                         r".*checkpoint_id=([^\s,]+), mode ", log2)
    assert restored, log2[-3000:]
    assert "start-up: allocating" not in log2  # try 2 did not start over
    assert re.findall(r"done digest=\w+", log2) == [uninterrupted_digest(*ARGS)]
    # The report's figures are this retry's
    assert (report["checkpoint_id"], report["restored_seq"], report["from_node"], report["to_node"]) == (
        restored[4], int(restored[1]), restored[2], restored[3])
    assert 0 <= report["detect_seconds"] < report["retry_seconds"] < report["rto_seconds"], report
    assert report["restore_seconds"] > 0 and report["lost_work_seconds"] >= 0 and report["bytes_fetched"] > 0
    # The failed try carries the drill's note, so a person looking at it sees why it failed
    assert stack.call("GET", base)["note"].startswith(f"cedana live drill {report['drill_id']}: try 1 failed on purpose")

    # Every drill is kept; only the one that acted counts in the trends.
    drills = json.loads(cli("drills", "--json", env=cli_env(tmp_path, "n", "w", CEDANA_STORE=f"file://{store}")).stdout)
    assert sorted((r["mode"], r["dry_run"], bool(r["stopped"])) for r in drills["reports"]) == [
        ("live", False, False), ("live", False, True), ("live", True, False)]
    assert drills["trends"]["live"]["drills"] == 1 and drills["trends"]["live"]["passed"] == 1
