"""A real PyTorch job, as people write one, through Airflow's scheduler with retries and DEFAULT settings:
DataLoader(num_workers=2) workers reading a dataset directory, a log and a checkpoint directory outside the
working directory, a progress bar on stderr. Try 1 is killed after a few heartbeats, try 2 runs under another
node name on a /tmp without try 1's multiprocessing directories, and the trained parameters equal an
uninterrupted run's. No restore_roots, no signing key: the defaults must be enough."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, airflow_env, wait_gone

sys.path.insert(0, str(REPO / "scripts"))

from airflow_stack import AirflowStack  # noqa: E402

pytestmark = pytest.mark.integration

SHAPE = REPO / "tests" / "integration" / "shapes" / "torch_loader.py"
ARGS = ["--epochs", "3", "--step-seconds", "0.15"]


def _dataset(root: Path, n: int = 192) -> None:
    rng = np.random.default_rng(7)
    root.mkdir(parents=True)
    for i in range(n):
        x = rng.standard_normal(16).astype(np.float32)
        np.save(root / f"{i:04d}.npy", np.append(x, np.float32(x[:4].sum() - x[4:8].mean())))


def _uninterrupted(root: Path) -> str:
    out = subprocess.run([sys.executable, str(SHAPE), "--data", str(root / "data"), "--log", str(root / "ref.log"),
                          "--ckpt", str(root / "ref-ckpts"), "--epochs", "3", "--step-seconds", "0"],
                         capture_output=True, text=True, check=True, cwd=root).stdout
    return re.findall(r"done digest=\w+", out)[-1]


def test_a_pytorch_dataloader_job_resumes_on_another_node_with_default_settings(tmp_path, airflow_db):
    root = tmp_path / "torch"
    _dataset(root / "data")
    for d in ("job", "logs"):
        (root / d).mkdir(parents=True)
    (root / "node").write_text("node-a\n")
    env = airflow_env(tmp_path, airflow_db, CEDANA_E2E_TORCH_ROOT=str(root), CEDANA_E2E_TORCH_ARGS=" ".join(ARGS))
    pymp_before = set(glob.glob("/tmp/pymp-*"))
    with AirflowStack(env, tmp_path / "airflow", wait_dag="cedana_torch") as stack:
        run_id = stack.trigger("cedana_torch")
        # Killed once a heartbeat has caught it training (its log open): a checkpoint from before the log
        # existed would leave try 1's lines in it (a file created after a checkpoint is not rolled back).
        deadline = time.monotonic() + 240
        while not (ms := [m for p in sorted((tmp_path / "store").glob("cedana_torch.train.*/*/manifest.json"))
                          if (m := json.loads(p.read_text()))["captured"]]):
            assert time.monotonic() < deadline, stack.logs()
            assert stack.task_instance("cedana_torch", run_id, "train")["state"] != "failed", stack.logs()
            time.sleep(0.2)
        pid = ms[0]["process"]["pid"]
        assert [c["path"] for c in ms[0]["captured"]] == [str(root / "logs" / "train.log")]  # outside the cwd
        (root / "node").write_text("node-b\n")  # the retry parses the DAG file again: another node
        os.kill(pid, signal.SIGKILL)  # the node dies under try 1
        assert wait_gone(pid, 10)
        for d in set(glob.glob("/tmp/pymp-*")) - pymp_before:  # the new node's /tmp is fresh
            shutil.rmtree(d, ignore_errors=True)

        deadline = time.monotonic() + 300
        while (ti := stack.task_instance("cedana_torch", run_id, "train"))["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(1)
        log1 = stack.task_log("cedana_torch", run_id, "train", 1)
        log2 = stack.task_log("cedana_torch", run_id, "train", 2)
        assert ti["state"] == "success" and ti["try_number"] == 2, log2[-4000:]

    assert re.search(r"cedana: restored seq \d+ of try 1 \(node node-a\) on node node-b: gap [\d.]+ s, restore [\d.]+ s, "
                     r"checkpoint_id=cedana_torch\.train\.\S+", log2), log2[-4000:]
    assert "start-up" in log1 and "start-up" not in log2  # try 2 did not import torch or build its loader again
    assert "a restore would refuse" not in log1 + log2 and "refused" not in log2
    # The parameters trained across the kill equal an uninterrupted run's, and every step was logged once.
    assert re.findall(r"done digest=\w+", log2) == [_uninterrupted(root)]
    steps = [ln.split(" loss")[0] for ln in (root / "logs" / "train.log").read_text().splitlines()]
    assert steps == [ln.split(" loss")[0] for ln in (root / "ref.log").read_text().splitlines()]
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == ["epoch-0.pt", "epoch-1.pt", "epoch-2.pt"]
