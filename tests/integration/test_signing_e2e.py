"""Signed checkpoints end to end with real CRIU: the node with the key resumes, a node with another
key refuses (issue 11, item 2)."""

from __future__ import annotations

import sys

import pytest

from conftest import TRAIN, cli, cli_env, kill_node, start_cli, uninterrupted_digest, wait_for_checkpoints

pytestmark = pytest.mark.integration


def test_a_signed_checkpoint_resumes_with_the_key_and_is_refused_with_another(tmp_path):
    """No key configured: the node key (/etc/cedana-airflow/node.key, created on first use) signs, as in
    0.8.0's default; 0.7.0 signed nothing and accepted anything (issue 48)."""
    from conftest import forge_unsigned, node_key_bytes

    from cedana_airflow.format.signing import key_id

    args = ["--mb", "10", "--steps", "40", "--step-seconds", "0.1"]
    proc = start_cli("run", "--id", "signed", "--heartbeat", "1", "--", sys.executable, str(TRAIN), *args,
                     env=cli_env(tmp_path, "node-a", "work-a"), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "signed", 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    assert ms[0]["signature"]["key_id"] == key_id(node_key_bytes())

    other = cli("restore", "--id", "signed", env=cli_env(tmp_path, "node-b", "work-b",
                                                          CEDANA_SIGNING_KEY="fedcba9876543210fedcba9876543210"))
    assert other.returncode == 1 and "is signed with key" in other.stderr.strip().splitlines()[-1]
    # the owner: a task restores only its own checkpoints (this one was taken by hand, outside Airflow)
    task = cli("restore", "--id", "signed", "--dag-id", "d", "--task-id", "t", "--run-id", "r",
               env=cli_env(tmp_path, "node-b", "work-b"))
    assert task.returncode == 2 and ") may be neither written nor restored by this task: it " \
        "was written outside Airflow, not by this task (DAG 'd' task 't' (map index -1))" in task.stderr, task.stderr
    # a store writer without the key strips the signatures: refused by default, in one line
    for m in sorted((tmp_path / "store" / "signed").glob("*/manifest.json")):
        forge_unsigned(m)
    refused = cli("restore", "--id", "signed", env=cli_env(tmp_path, "node-b", "work-b"))
    assert refused.returncode == 1 and "is refused: it is not signed, and this node refuses unsigned manifests " \
        "(allow_unsigned = false)" in refused.stderr.strip().splitlines()[-1], refused.stderr
    # a node whose operator accepts unsigned manifests restores it, and says so each time
    r = cli("restore", "--id", "signed", env=cli_env(tmp_path, "node-b", "work-c", CEDANA_ALLOW_UNSIGNED="true"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*args)
    assert "restoring unsigned checkpoint checkpoint_id=signed seq=" in r.stderr and "(allow_unsigned = true)" in r.stderr


def test_a_signed_checkpoint_puts_its_files_back_where_the_workload_had_them_with_default_roots(tmp_path):
    """Signed by our own supervisor: the log outside the working directory goes back without restore_roots."""
    log = tmp_path / "elsewhere" / "steps.log"
    log.parent.mkdir()
    (tmp_path / "node-a-cwd").mkdir()
    args = ["--mb", "10", "--steps", "30", "--step-seconds", "0.1", "--log", str(log)]
    key = {"CEDANA_SIGNING_KEY": "0123456789abcdef0123456789abcdef"}
    proc = start_cli("run", "--id", "signed-files", "--heartbeat", "1", "--", sys.executable, str(TRAIN), *args,
                     env=cli_env(tmp_path, "node-a", "work-a", **key), out=tmp_path / "a", cwd=tmp_path / "node-a-cwd")
    ms = wait_for_checkpoints(tmp_path / "store", "signed-files", 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    assert [c["path"] for c in ms[0]["captured"]] == [str(log)]
    assert "a restore would refuse" not in (tmp_path / "a.err").read_text()  # signed: nothing to warn about
    log.write_text("garbage written after the checkpoint\n")
    cwd = tmp_path / "node-b-cwd"  # another working directory: the log is outside it
    cwd.mkdir()
    r = cli("restore", "--id", "signed-files", env=cli_env(tmp_path, "node-b", "work-b", **key), cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest("--mb", "10", "--steps", "30")
    assert log.read_text().splitlines() == [f"step {i}" for i in range(30)]
