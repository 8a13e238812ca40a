"""Failover across real workers: Airflow's CeleryExecutor with two Celery workers (PostgreSQL, Redis and
moto's S3 started by scripts/fleet_stack.py), one killed with everything under it while it runs a
checkpointed task; the retry runs on the other and resumes from the dead one's checkpoint. The workers
run as uid nobody from the worker environment, each beside its node's agent (root), as issue 49 deploys
them: the agent is the only part of ours that is root and the only one with the store and the key."""

from __future__ import annotations

import json
import os
import pwd
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))

from demo_fleet import OPTIN, TRAIN_ARGS, failover, summary, uninterrupted  # noqa: E402
from fleet_stack import FleetError, FleetStack, descendants  # noqa: E402

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("fleet")]


def test_a_part_that_does_not_come_up_is_one_line_naming_it_and_nothing_is_left_running(tmp_path):
    stack = FleetStack(tmp_path / "broken", REPO / "scripts" / "fleet_dags", OPTIN,
                       extra_env={"AIRFLOW__CORE__EXECUTOR": "no_such_module.NoSuchExecutor"})
    with pytest.raises(FleetError) as e:
        with stack:
            pass
    line = str(e.value)
    assert "\n" not in line and re.match(r"(scheduler|api-server) exited 1 while starting: .*NoSuchExecutor.*\(log: \S+\.log\)$",
                                         line), line
    assert stack.procs == {} and stack.pg_dir is None  # every part stopped, PostgreSQL's data dir removed
    assert [p for p in descendants(os.getpid())[1:] if "redis" in open(f"/proc/{p}/cmdline").read()] == []


def audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with FleetStack(tmp_path_factory.mktemp("fleet"), REPO / "scripts" / "fleet_dags", OPTIN,
                    # the retry's steps go on without their sleeps: what is checked is its digest, not its pace
                    extra_env={"CEDANA_FLEET_TRAIN_ARGS": " ".join([*TRAIN_ARGS, "--fast-after-restores", "1"])},
                    worker_user="nobody") as f:
        yield f


def test_the_retry_of_a_task_whose_node_died_resumes_on_the_other_worker(fleet):
    expect = uninterrupted(TRAIN_ARGS)
    out = failover(fleet, checkpoints_before_kill=3)
    print(summary(out, expect))
    a = out["node_a"]
    b = ({"worker-a", "worker-b"} - {a}).pop()
    assert not out["problem"], summary(out, expect)
    # try 1 ran on A and died there; try 2 ran on B and restored what A took
    assert (out["retry_try_number"], out["retry_host"], out["from_node"], out["to_node"]) == (2, b, a, b)
    assert re.search(rf"cedana[^:]*: restored seq \d+ of try 1 \(node {a}\) on node {b}: .*checkpoint_id="
                     rf"{re.escape(out['checkpoint_id'])}", out["log_2"]), out["log_2"][-3000:]
    assert out["restored_seq"] >= out["last_checkpoint_seq"] >= 3
    assert "start-up: allocating" not in out["log_2"]  # it did not start over
    assert re.findall(r"done digest=\w+", out["log_2"]) == [expect]
    # the figures are this run's, in the order they happened
    assert 0 < out["detect_seconds"] <= out["retry_seconds"] <= out["restore_done_seconds"] <= out["rto_seconds"]
    assert out["lost_work_seconds"] >= 0
    text = summary(out, expect)
    assert f"taken on node {a}" in text and f"restored on node {b}" in text and f"final output: {expect} == uninterrupted run" in text
    # both tries were the agents' callers, as nobody; the workers had no store and ran as nobody
    nobody = pwd.getpwnam("nobody").pw_uid
    assert "store=the node agent's (" in out["log_1"] and "cedana (node agent): restored seq " in out["log_2"], \
        out["log_2"][-3000:]
    for node in (a, b):
        starts = [r for r in audit(fleet.root / f"agent-{node}.audit") if r.get("op") == "start"]
        assert starts and all(r["uid"] == nobody and r["decision"] == "allowed" for r in starts), starts
    status = Path(f"/proc/{fleet.procs[b].pid}/status").read_text()
    assert f"Uid:\t{nobody}\t{nobody}\t{nobody}\t{nobody}" in status, status
    assert not any(k.startswith(("AWS_", "AIRFLOW_CONN_")) or k.endswith("__STORE")
                   for k in Path(f"/proc/{fleet.procs[b].pid}/environ").read_text().split("\0"))
    fleet.start_worker(a)  # the node comes back for the next case


def test_a_node_lost_before_any_checkpoint_makes_the_retry_start_fresh_and_say_why(fleet):
    out = failover(fleet, dag_id="cedana_failover_late", checkpoints_before_kill=0)
    a = out["node_a"]
    assert out["last_checkpoint_seq"] is None and out["retry_host"] != a
    assert out["problem"].startswith("try 2 started fresh instead of restoring: "), out["problem"]
    assert re.search(r"no checkpoint to resume checkpoint_id=\S+; starting fresh", out["log_2"]), out["log_2"][-3000:]
    assert out["state"] == "success" and out["log_2"].count("start-up: allocating") == 1 and re.findall(r"done digest=\w+", out["log_2"]) == [
        uninterrupted(TRAIN_ARGS)]
    fleet.start_worker(a)

