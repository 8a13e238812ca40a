"""Every torchrun job, transparently (issue 47): a two-rank gloo DDP job with no checkpoint code, under
``cedana-airflow run`` with default settings, is checkpointed on its heartbeat (its launcher's io_uring
refused, its store and gloo connections carried), killed with its node, resumed by ``run --resume`` on
node-b, and ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, cli, cli_env, descendants, kill_node, manifests, start_cli, wait_for_checkpoint_after

pytestmark = pytest.mark.integration

DDP = REPO / "tests" / "workloads" / "ddp_transparent.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def test_a_torchrun_ddp_job_resumes_on_another_node_with_an_uninterrupted_runs_parameters(tmp_path):
    pytest.importorskip("torch")
    job = [*TORCHRUN, str(DDP), "--steps", "200"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = subprocess.run([*job, "--step-seconds", "0"], capture_output=True, text=True, env=env, timeout=300,
                               check=True).stdout.splitlines()[-1]
    assert reference.startswith("done digest=")
    a = start_cli("run", "--id", "ddp", "--heartbeat", "2", "--", *job, env=cli_env(tmp_path, "node-a", "work-a"),
                  out=tmp_path / "a")
    try:
        wait_for_checkpoint_after(tmp_path / "store", "ddp", tmp_path / "a.out", "step 2/", a)
        tree = descendants(a.pid)[1:]
        held = [p for p in tree for fd in _fds(p) if "io_uring" in fd]
        assert held == [], f"pids {held} hold an io_uring"  # the launcher's libuv stores, refused
        last = manifests(tmp_path / "store", "ddp")[-1]
        kill_node(a, last["process"]["pid"])
    finally:
        if a.poll() is None:
            a.kill()
    err = (tmp_path / "a.err").read_text()
    assert "heartbeat failed" not in err, err[-3000:]
    assert "done digest" not in (tmp_path / "a.out").read_text(), "the job ended before the node was lost"
    r = cli("run", "--resume", "--id", "ddp", "--heartbeat", "0", "--", *job, env=cli_env(tmp_path, "node-b", "work-b"),
            timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restored checkpoint_id=ddp seq=" in r.stderr and "from_node=node-a node=node-b" in r.stderr, r.stderr[-3000:]
    out = r.stdout.splitlines()
    printed_on_a = [ln for ln in (tmp_path / "a.out").read_text().splitlines() if ln.startswith("step ")]
    first, last_on_a = (int(ln.split()[1].split("/")[0]) for ln in (out[0], printed_on_a[-1]))
    assert 2 < first <= last_on_a + 1, (out[:2], printed_on_a[-2:])  # went on from where it was, not from step 1
    assert out[-1] == reference, (out[-2:], reference)


def _fds(pid: int) -> list[str]:
    try:
        return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []
