"""The GPU validation scripts, checked where there is no GPU: they parse, and a machine without an
NVIDIA driver is told so in one line, before anything heavy (no venv, no bundle, no workload).
The run itself needs the GPU machine: bash scripts/gpu-validate.sh (docs/gpu.md)."""

from __future__ import annotations

import ctypes
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
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


def _code_lines(script: Path) -> list[str]:
    return [ln for ln in script.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_every_step_of_gpu_validate_is_bounded_and_a_step_that_ignores_sigterm_is_killed_no_gpu_here():
    """A hung step must end: every `timeout` carries -k (SIGKILL after its SIGTERM), and no background
    step runs under `timeout`, whose pid is not the step's (killing it leaves the step running)."""
    code = _code_lines(SCRIPTS / "gpu-validate.sh")
    unbounded = [ln for ln in code if re.search(r"(^|[\s;(])timeout\s", ln) and not re.search(r"\btimeout -k \d+", ln)]
    assert not unbounded, unbounded
    backgrounded = [ln for ln in code if ln.rstrip().endswith("&") and re.search(r"\b(timeout|bounded)\b", ln)]
    assert not backgrounded, backgrounded
    # The final checkpoint a stopped step takes is bounded too, inside the 10 s before SIGKILL.
    assert any("CEDANA_STOP_WINDOW_SECONDS=8" in ln for ln in code)


def test_gpu_validate_does_not_warn_past_a_failed_criu_check_no_gpu_here():
    text = (SCRIPTS / "gpu-validate.sh").read_text()
    assert "trying anyway" not in text
    assert re.search(r'if \[ "\$criu_check" != ok \]; then\n(.*\n)*?\s+fail 1 ', text)


def _torch_only_python(tmp_path: Path) -> Path:
    """A GPU machine's Python as the validation meets it: a venv (made from a venv) whose packages hold
    torch but not cedana-airflow. Ours lends it its site-packages, without their .pth files (so not
    the editable install of this checkout)."""
    venv = tmp_path / "torch-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site_dir = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    import site
    Path(site_dir, "lend.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import torch; import cedana_airflow"], capture_output=True, text=True,
                           cwd=tmp_path)  # not the checkout, where `-c` would find the package in the cwd
    assert "No module named 'cedana_airflow'" in probe.stderr, probe.stderr  # torch yes, our package no
    return python


@pytest.mark.integration
def test_gpu_validate_dry_run_passes_every_step_that_needs_no_gpu_no_gpu_here(tmp_path):
    """scripts/gpu-validate.sh --dry-run, as CI runs it: the interpreter choice, the venv that sees the
    torch Python's packages, cedana-airflow imported in every interpreter that needs it (the baseline
    runs in the venv), CRIU, doctor, a small CPU workload checkpointed, killed and restored with equal
    output, the timeouts, and everything brought back in two files."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not importable here (make test installs it)")
    criu = "/opt/cedana-airflow/criu/bin/criu"
    torch_python = _torch_only_python(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
    env.update(OUT=str(out), TMPDIR=str(tmp_path), CEDANA_GPU_PYTHON=str(torch_python))
    if not os.path.exists(criu):  # as `make test` leaves a machine: the private prefix, found with no setting
        env["CEDANA_CRIU"] = criu = shutil.which("criu") or criu
    r = subprocess.run(["bash", str(SCRIPTS / "gpu-validate.sh"), "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.splitlines()[-1].startswith("gpu-validate: OK: dry run passed in "), r.stderr[-2000:]
    # A device call brings back 8 files at most: the figures and one archive of every log.
    assert sorted(p.name for p in out.iterdir()) == ["gpu-validate-logs.tar.gz", "gpu-validate.json"]
    report = json.loads((out / "gpu-validate.json").read_text())
    assert report["ok"] is True and report["dry_run"] is True and report["error"] is None
    assert report["criu"]["path"] == criu  # the CRIU the engine finds
    assert report["compare"]["match"] is True and report["compare"]["first_step_after_restore"] > 1
    assert report["compare"]["loss_mismatches"] == 0 and report["compare"]["restored_ran_start_up"] is False
    interp = report["interpreters"]
    assert interp["workload"] == str(torch_python) and interp["venv"] != interp["workload"]
    assert report["baseline"]["dry_run"] is True and report["baseline"]["python"] == interp["venv"]
    assert report["doctor_gpu"]["what_happens"]
    # read from the restore's log line (0.11.0's shape): a figure the GPU machine's report must not lose
    assert report["restore"]["restore_seconds"] > 0 and report["restore"]["seq"] >= 1, report["restore"]
    with tarfile.open(out / "gpu-validate-logs.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"run.err", "run.out", "restore.err", "restore.out", "reference.out", "baseline.err", "doctor.json"} <= names, names
    assert not any(p.name.startswith("gpu-validate.") for p in tmp_path.iterdir())  # its work dir is gone
