"""GPU modes with real CRIU and the CLI, on a machine without a GPU: a tree that holds a /dev/nvidia*
file (a stand-in device node with /dev/null's numbers: no NVIDIA device exists here) is never handed
to CRIU; it runs on, and the run says why once."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import cli, cli_env, kill_node, manifests, no_nvidia_driver, start_cli, wait_for_checkpoints

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
    pytest.param("auto", "but no NVIDIA driver on this node", marks=no_nvidia_driver),
])
def test_a_tree_holding_a_stand_in_nvidia_device_is_not_checkpointed_and_says_why_once_no_gpu_here(
        tmp_path, nvidia_stand_in, mode, why):
    r = cli("run", "--id", f"gpu-{mode}", "--heartbeat", "0.5", "--gpu", mode, "--", sys.executable, "-c", HOLDS,
            nvidia_stand_in, env=cli_env(tmp_path, "node-a", "work"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "finished"  # it ran on to its end, never frozen
    said = [ln for ln in r.stderr.splitlines() if "heartbeat skipped" in ln]
    assert len(said) == 1, r.stderr  # about six heartbeats, one line
    assert "holds GPU devices (pid " in said[0] and f"{nvidia_stand_in})" in said[0] and why in said[0]
    assert manifests(tmp_path / "store", f"gpu-{mode}") == []


@no_nvidia_driver
def test_gpu_require_refuses_to_start_on_a_node_without_a_driver_exit_2_no_gpu_here(tmp_path):
    marker = tmp_path / "started"
    r = cli("run", "--id", "gpu-req", "--gpu", "require", "--", "touch", str(marker),
            env=cli_env(tmp_path, "node-a", "work"))
    assert r.returncode == 2 and not marker.exists()
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("ConfigError: gpu = require, but this node cannot checkpoint GPU state: no NVIDIA driver")


COUNTER = ("import time\nfor i in range(1, 41):\n    print(f'step {i}', flush=True)\n    time.sleep(0.1)\n"
           "print('finished', flush=True)")


def test_crius_own_cuda_plugin_is_never_loaded_at_dump_or_restore(tmp_path):
    """CRIU's CUDA plugin, where a CRIU build ships it, would drive the same CUDA processes as our
    engine and collide with it (docs/gpu.md). CRIU loads every .so of its plugin directory; here that
    directory (CRIU_LIBS_DIR) holds a cuda_plugin.so that cannot load, which fails any CRIU that
    reads it: checkpoint and restore must not."""
    plugins = tmp_path / "criu-plugins"
    plugins.mkdir()
    (plugins / "cuda_plugin.so").write_bytes(b"not an ELF file")
    env = cli_env(tmp_path, "node-a", "work-a", CRIU_LIBS_DIR=str(plugins))
    proc = start_cli("run", "--id", "plugins", "--heartbeat", "0.5", "--", sys.executable, "-c", COUNTER,
                     env=env, out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "plugins", 1, proc, timeout=60)
    kill_node(proc, ms[0]["process"]["pid"])
    r = cli("restore", "--id", "plugins", "--heartbeat", "60",
            env=cli_env(tmp_path, "node-b", "work-b", CRIU_LIBS_DIR=str(plugins)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("step ") and lines[0] != "step 1" and lines[-1] == "finished", lines  # resumed
