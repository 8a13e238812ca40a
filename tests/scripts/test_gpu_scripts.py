"""The GPU validation scripts, checked where there is no GPU: they parse, and a machine without an
NVIDIA driver is told so in one line, before anything heavy (no venv, no bundle, no workload).
The run itself needs the GPU machine: bash scripts/gpu-validate.sh (docs/gpu.md)."""

from __future__ import annotations

import ctypes
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _has_driver() -> bool:
    if os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


no_driver = pytest.mark.skipif(_has_driver(), reason="this machine has an NVIDIA driver; run scripts/gpu-validate.sh")


@pytest.mark.parametrize("script", ["gpu-validate.sh", "gpu-bundle.sh"])
def test_shell_script_parses_no_gpu_here(script):
    r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", ["gpu_baseline.py", "gpu_workload.py"])
def test_python_script_compiles_no_gpu_here(script, tmp_path):
    py_compile.compile(str(SCRIPTS / script), cfile=str(tmp_path / "out.pyc"), doraise=True)


@no_driver
def test_gpu_validate_without_a_driver_exits_3_with_one_line_before_any_work_no_gpu_here(tmp_path):
    # A copy in a folder with no .gpu-bundle/: the refusal must not need the bundle, nor write anything.
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPTS / "gpu-validate.sh", tmp_path / "scripts")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path)}
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu-validate.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr
    assert r.stdout == ""
    [line] = r.stderr.splitlines()
    assert line.startswith("gpu-validate: no NVIDIA driver on this machine (") and line.endswith(
        "run this on the GPU machine"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "scripts"]  # no work dir, no report
    assert list(out.iterdir()) == []


def test_gpu_validate_rejects_an_unknown_argument_with_usage_no_gpu_here():
    r = subprocess.run(["bash", str(SCRIPTS / "gpu-validate.sh"), "--bogus"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2
    assert "unknown argument '--bogus'" in r.stderr and "usage:" in r.stderr


@no_driver
def test_gpu_baseline_without_a_driver_exits_3_with_one_line_no_gpu_here():
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_baseline.py")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr
    assert r.stdout == ""
    [line] = r.stderr.splitlines()
    assert line.startswith("gpu_baseline: no NVIDIA driver on this machine (") and "GPU machine" in line, line


def test_gpu_workload_without_torch_says_so_in_one_line_no_gpu_here():
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, timeout=60)
    if probe.returncode == 0:
        pytest.skip("torch is importable here; this checks the message where it is not")
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_workload.py"), "--device", "cpu", "--steps", "1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3
    [line] = r.stderr.splitlines()
    assert line.startswith("gpu_workload: PyTorch is not importable"), line
