"""The canary drill end to end with real CRIU: a staged node loss, a restore elsewhere, the output
compared with an uninterrupted run; on file:// and on S3 (moto over HTTP); and a restore that fails
is a failed drill that says why."""

from __future__ import annotations

import json

import pytest

from conftest import cli, cli_env

pytestmark = pytest.mark.integration

# 8 s of steps: two heartbeats (to moto too) come well before the end, on a machine busy with other tests
CANARY = ["drill", "canary", "--mb", "24", "--steps", "80", "--step-seconds", "0.1", "--heartbeat", "0.6", "--json"]


@pytest.mark.parametrize("where", ["file", "s3"])
def test_canary_drill_passes_with_a_digest_match_and_plausible_figures(tmp_path, where, request):
    extra = {"CEDANA_STORE": f"s3://{request.getfixturevalue('bucket')}/drills"} if where == "s3" else {}
    env = cli_env(tmp_path, "gpu-7", "work", **extra)
    r = cli(*CANARY, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["mode"] == "canary" and rep["ok"] is True and rep["digest_match"] is True and rep["problems"] == []
    assert (rep["from_node"], rep["to_node"], rep["node"]) == ("gpu-7-drill-a", "gpu-7-drill-b", "gpu-7")
    assert rep["restored_seq"] >= 2 and rep["bytes_fetched"] > 24 << 20
    assert 0 <= rep["lost_work_seconds"] < 5 and 0 < rep["restore_seconds"] < rep["rto_seconds"] < 60
    listed = json.loads(cli("drills", "--json", env=env).stdout)
    assert [x["drill_id"] for x in listed["reports"]] == [rep["drill_id"]]  # the report stays
    assert listed["trends"]["canary"]["rto_seconds"] == {"p50": rep["rto_seconds"], "p95": rep["rto_seconds"]}
    assert json.loads(cli("checkpoints", "--json", env=env).stdout) == []  # the drill's own ID does not


def test_a_canary_whose_restore_fails_is_a_failed_drill_that_says_why(tmp_path):
    # every checkpoint is "too old" for the restoring node: the restore refuses them all and exits 1
    env = cli_env(tmp_path, "n", "work", CEDANA_MAX_RESTORE_GAP_SECONDS="0")
    r = cli(*CANARY, env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] is False and rep["digest_match"] is None
    [why] = rep["problems"]
    assert why.startswith("the restore on n-drill-b exited 1: CorruptCheckpoint: no checkpoint under checkpoint ID")
    assert "beyond max_restore_gap = 0 s" in why
