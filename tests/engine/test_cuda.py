"""GPU state (engine/cuda.py, run/gpu_state.py) without a GPU: no NVIDIA driver exists on this machine.

The lock/checkpoint/restore/unlock sequence and its rollback run against a stand-in driver (the
test names say so); what the driver would do to a real process cannot be exercised here (docs/gpu.md,
scripts/gpu-validate.sh). The inventory is read from a stand-in /proc/driver/nvidia tree.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.engine import cuda
from cedana_airflow.errors import ConfigError, GpuCheckpointFailed, GpuUnavailable
from cedana_airflow.format.manifest import GpuProcess, GpuState, Manifest, ProcessInfo
from cedana_airflow.format.signing import sign, signature_problem
from cedana_airflow.run.gpu_state import GpuGate

STEPS = ["lock", "checkpoint", "restore", "unlock"]


class StandInDriver:
    """Records every call and the state it leaves each pid in; fails the n-th call of one kind when told."""

    def __init__(self, fail: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.states: dict[int, str] = {}
        self.fail = fail

    def _do(self, what: str, pid: int, before: str, after: str) -> None:
        self.calls.append((what, pid))
        if self.fail and self.fail[0] == what and sum(1 for c in self.calls if c[0] == what) == self.fail[1]:
            raise GpuCheckpointFailed(f"cuCheckpointProcess{what.title()} of pid {pid} failed: CUDA_ERROR_TIMEOUT (909)")
        assert self.states.get(pid, "running") == before, (what, pid, self.states)
        self.states[pid] = after

    def version(self) -> int:
        return 13000

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._do("lock", pid, "running", "locked")

    def checkpoint(self, pid: int) -> None:
        self._do("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid: int) -> None:
        self._do("restore", pid, "checkpointed", "locked")

    def unlock(self, pid: int) -> None:
        self._do("unlock", pid, "locked", "running")

    def state(self, pid: int) -> str:
        return self.states.get(pid, "running")


PIDS = [os.getpid(), os.getppid()]  # real pids without /dev/nvidia* mappings: the check after checkpoint passes


def test_stand_in_driver_every_process_is_locked_before_any_is_checkpointed_and_all_run_on_no_gpu_here():
    drv = StandInDriver()
    with cuda.suspended(drv, PIDS, lock_timeout_ms=1000) as s:
        assert all(drv.states[p] == "checkpointed" for p in PIDS)  # what CRIU dumps: no GPU memory held
    assert [c[0] for c in drv.calls] == ["lock", "lock", "checkpoint", "checkpoint", "restore", "restore",
                                         "unlock", "unlock"]
    assert all(drv.states[p] == "running" for p in PIDS) and s.checkpoint_seconds >= 0 and s.resume_seconds >= 0


@pytest.mark.parametrize("fail", [(w, n) for w in ("lock", "checkpoint") for n in (1, 2)])
def test_stand_in_driver_a_failure_before_the_dump_rolls_every_process_back_no_gpu_here(fail):
    drv = StandInDriver(fail)
    dumped = []
    with pytest.raises(GpuCheckpointFailed) as e:
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            dumped.append(True)
    assert not dumped  # CRIU never ran
    assert all(drv.states.get(p, "running") == "running" for p in PIDS), drv.states
    assert "every process was put back as it was and runs on" in str(e.value) and "\n" not in str(e.value)


def test_stand_in_driver_a_failed_dump_puts_gpu_state_back_and_the_error_goes_up_no_gpu_here():
    drv = StandInDriver()
    with pytest.raises(RuntimeError, match="criu dump failed"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            raise RuntimeError("criu dump failed")
    assert all(drv.states[p] == "running" for p in PIDS)


def test_stand_in_driver_a_failure_putting_state_back_is_reported_and_the_rest_still_unlocked_no_gpu_here():
    drv = StandInDriver(("restore", 1))
    with pytest.raises(GpuCheckpointFailed, match="putting GPU state back failed"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            pass
    # the other process was restored and unlocked; the failed one is named in the error
    assert sorted(drv.states.values()) == ["checkpointed", "running"]


def test_stand_in_driver_a_rollback_that_fails_says_the_workload_may_be_stuck_no_gpu_here():
    class Stuck(StandInDriver):
        def restore(self, pid: int) -> None:
            raise GpuCheckpointFailed(f"cuCheckpointProcessRestore of pid {pid} failed: CUDA_ERROR_ILLEGAL_STATE (401)")

    drv = Stuck(("checkpoint", 2))
    with pytest.raises(GpuCheckpointFailed, match="rolling back also failed .*the workload may be stuck"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            pass


def test_stand_in_driver_a_device_mapping_left_after_checkpoint_refuses_the_dump_and_rolls_back_no_gpu_here(tmp_path):
    dev = Path(f"/dev/nvidia-cedana-test-{os.getpid()}")
    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))  # /dev/null under a /dev/nvidia* name
    try:
        with open(dev, "rb"):  # this process now "holds" a device file, as UVM or IPC memory would
            assert cuda.cuda_pids([os.getpid(), os.getppid()]) == [os.getpid()]
            drv = StandInDriver()
            with pytest.raises(GpuCheckpointFailed, match=f"pid {os.getpid()} still maps {dev}"):
                with cuda.suspended(drv, [os.getpid()], lock_timeout_ms=1000):
                    pass
            assert drv.states[os.getpid()] == "running"
    finally:
        dev.unlink()


def test_no_driver_here_is_one_line_and_require_is_a_config_error():
    with pytest.raises(GpuUnavailable, match=r"^no NVIDIA driver on this node \(.*\)\. .*set gpu = off$"):
        cuda.load_driver()
    with pytest.raises(ConfigError, match="gpu = require, but this node cannot checkpoint GPU state"):
        GpuGate(load_settings({"gpu": "require"}, environ={})).require()
    GpuGate(load_settings({"gpu": "auto"}, environ={})).require()  # auto never refuses to start


def test_inventory_from_the_kernel_modules_proc_files(tmp_path):
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release "
                                      "Build  (dvs-builder@U16)  Sun Jul 27 06:54:38 UTC 2025\nGCC version: 12\n")
    for bus, model in (("0000:3b:00.0", "NVIDIA H200"), ("0000:19:00.0", "NVIDIA H100 80GB HBM3")):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
        (tmp_path / "gpus" / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 156\n")
    assert cuda.gpu_inventory(tmp_path) == cuda.GpuInventory("580.65.06", ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    assert cuda.gpu_inventory(tmp_path / "absent") == cuda.GpuInventory("", ())


def _gpu_manifest(models: tuple[str, ...]) -> Manifest:
    gpu = GpuState(driver_version="580.65.06", cuda_api_version=13000, gpus=models,
                   processes=(GpuProcess(ns_pid=1, memory_bytes=4 << 30),), checkpoint_seconds=1.5)
    return Manifest(format_version=3, gpu=gpu, checkpoint_id="g", seq=4, node="gpu-1",
                    created_at=datetime.now(timezone.utc), engine_version="4.1.1",
                    process=ProcessInfo(pid=9, command=("python",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]"),
                    files=(), image_bytes=0, stored_bytes=0)


def test_stand_in_driver_a_gpu_checkpoint_restores_only_onto_the_same_gpu_models_and_count_no_gpu_here():
    m = _gpu_manifest(("NVIDIA H200", "NVIDIA H200"))
    s = load_settings(environ={})

    def gate(models: tuple[str, ...], **kw) -> GpuGate:
        return GpuGate(kw.pop("settings", s), load=lambda: StandInDriver(), inventory=lambda: cuda.GpuInventory("580.65.06", models))

    assert gate(("NVIDIA H200", "NVIDIA H200")).restore_refusal(m) is None
    assert "this node has 1 x NVIDIA H200" in gate(("NVIDIA H200",)).restore_refusal(m)
    assert "this node has 2 x NVIDIA H100" in gate(("NVIDIA H100", "NVIDIA H100")).restore_refusal(m)
    assert "gpu = off" in gate(("NVIDIA H200", "NVIDIA H200"), settings=load_settings({"gpu": "off"}, environ={})).restore_refusal(m)
    no_driver = GpuGate(s).restore_refusal(m)  # the real loader: no driver on this machine
    assert no_driver.startswith("seq 4 holds GPU state (2 x NVIDIA H200), but no NVIDIA driver on this node")
    assert GpuGate(s).restore_refusal(_gpu_manifest(("x",)).model_copy(update={"gpu": None, "format_version": 1})) is None


def test_a_gpu_manifest_is_version_3_signed_or_not_and_its_gpu_block_is_signed():
    m = _gpu_manifest(("NVIDIA H200",))
    assert Manifest.model_validate_json(m.to_json()) == m
    signed = sign(m, b"k" * 32)
    assert signed.format_version == 3 and signature_problem(signed, b"k" * 32) is None
    forged = signed.model_copy(update={"gpu": signed.gpu.model_copy(update={"gpus": ("NVIDIA H100",)})})
    assert "changed after it was signed" in signature_problem(forged, b"k" * 32)
    with pytest.raises(ValueError, match="gpu or airflow block goes with format_version 3"):
        Manifest.model_validate({**m.model_dump(mode="json"), "format_version": 1})
