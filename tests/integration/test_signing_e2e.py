"""Signed checkpoints end to end with real CRIU: the node with the key resumes, a node with another
key refuses (issue 11, item 2)."""

from __future__ import annotations

import sys

import pytest

from conftest import TRAIN, cli, cli_env, kill_node, start_cli, uninterrupted_digest, wait_for_checkpoints

pytestmark = pytest.mark.integration


def test_a_signed_checkpoint_resumes_with_the_key_and_is_refused_with_another(tmp_path):
    args = ["--mb", "10", "--steps", "40", "--step-seconds", "0.1"]
    key = {"CEDANA_SIGNING_KEY": "0123456789abcdef0123456789abcdef"}
    proc = start_cli("run", "--id", "signed", "--heartbeat", "1", "--", sys.executable, str(TRAIN), *args,
                     env=cli_env(tmp_path, "node-a", "work-a", **key), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "signed", 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    assert ms[0]["signature"]["key_id"]

    other = cli("restore", "--id", "signed", env=cli_env(tmp_path, "node-b", "work-b",
                                                          CEDANA_SIGNING_KEY="fedcba9876543210fedcba9876543210"))
    assert other.returncode == 1 and "is signed with key" in other.stderr.strip().splitlines()[-1]
    r = cli("restore", "--id", "signed", env=cli_env(tmp_path, "node-b", "work-c", **key))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*args)
