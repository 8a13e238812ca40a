"""GPU modes with real CRIU and the CLI, on a machine without a GPU: a tree that holds a /dev/nvidia*
file (a stand-in device node with /dev/null's numbers: no NVIDIA device exists here) is never handed
to CRIU; it runs on, and the run says why once."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import cli, cli_env, manifests

pytestmark = pytest.mark.integration


@pytest.fixture
def nvidia_stand_in():
    dev = f"/dev/nvidia-cedana-test-{os.getpid()}"
    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))
    yield dev
    os.unlink(dev)


HOLDS = "import sys, time; f = open(sys.argv[1], 'rb'); time.sleep(3.5); print('finished')"


@pytest.mark.parametrize("mode, why", [
    ("off", "and gpu = off, so it is not checkpointed"),
    ("auto", "but no NVIDIA driver on this node"),
])
def test_a_tree_holding_a_stand_in_nvidia_device_is_not_checkpointed_and_says_why_once_no_gpu_here(
        tmp_path, nvidia_stand_in, mode, why):
    r = cli("run", "--id", f"gpu-{mode}", "--heartbeat", "0.5", "--gpu", mode, "--", sys.executable, "-c", HOLDS,
            nvidia_stand_in, env=cli_env(tmp_path, "node-a", "work"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "finished"  # it ran on to its end, never frozen
    said = [ln for ln in r.stderr.splitlines() if "heartbeat skipped" in ln]
    assert len(said) == 1, r.stderr  # about six heartbeats, one line
    assert "holds CUDA state (pid " in said[0] and f"{nvidia_stand_in})" in said[0] and why in said[0]
    assert manifests(tmp_path / "store", f"gpu-{mode}") == []


def test_gpu_require_refuses_to_start_on_a_node_without_a_driver_exit_2_no_gpu_here(tmp_path):
    marker = tmp_path / "started"
    r = cli("run", "--id", "gpu-req", "--gpu", "require", "--", "touch", str(marker),
            env=cli_env(tmp_path, "node-a", "work"))
    assert r.returncode == 2 and not marker.exists()
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("ConfigError: gpu = require, but this node cannot checkpoint GPU state: no NVIDIA driver")
