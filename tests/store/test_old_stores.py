"""A store left by every earlier release (0.1, 0.2, 0.3: tests/fixtures/stores/) opens, lists, checks clean,
is garbage-collected and restores under this version: the restored workload continues to the output of an
uninterrupted run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import cli, cli_env

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("old_stores")]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"
#: Where the earlier releases ran the workload: a restore maps the very same file there again.
WORKLOAD_DIR = Path("/tmp/cedana-old-store-fixture")


@pytest.fixture(scope="module")
def workload() -> str:
    WORKLOAD_DIR.mkdir(exist_ok=True)
    shutil.copy2(FIXTURES / "counter", WORKLOAD_DIR / "counter")
    out = subprocess.run([str(WORKLOAD_DIR / "counter")], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.splitlines()[-1]  # the uninterrupted run's digest


@pytest.mark.parametrize("release", ["0.1", "0.2", "0.3"])
def test_a_store_of_an_earlier_release_lists_checks_gcs_and_restores(release, workload, tmp_path):
    shutil.copytree(FIXTURES / release, tmp_path / "store")
    cid = f"old-{release.replace('.', '-')}"
    env = cli_env(tmp_path, "node-new", "work")
    listed = cli("checkpoints", "--json", "--exact", env=env)
    assert listed.returncode == 0, listed.stderr
    [entry] = json.loads(listed.stdout)
    assert entry["id"] == cid and len(entry["checkpoints"]) == 3
    checked = cli("check", "--read-data", env=env)
    assert checked.returncode == 0 and checked.stdout.rstrip().endswith("clean"), checked.stdout + checked.stderr
    collected = cli("gc", "--grace", "0", "--json", env=env)  # everything old enough: only what no checkpoint names goes
    assert collected.returncode == 0 and json.loads(collected.stdout)["chunks_kept"] > 0, collected.stderr
    # those releases' CLI signed nothing: 0.8.0 refuses that by default, and restores it where the node's
    # operator said allow_unsigned (each restore logged)
    refused = cli("restore", "--id", cid, env=env)
    assert refused.returncode == 1 and "it is not signed, and this node refuses unsigned manifests" in refused.stderr
    restored = cli("restore", "--id", cid, env={**env, "CEDANA_ALLOW_UNSIGNED": "true"})
    assert restored.returncode == 0, restored.stderr[-2000:]
    assert "restoring unsigned checkpoint" in restored.stderr
    out = restored.stdout.splitlines()
    assert out[0].startswith("step ") and int(out[0].split()[1]) > 1  # it continued, it did not start over
    assert out[-1] == workload
