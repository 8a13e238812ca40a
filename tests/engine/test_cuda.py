"""GPU state (engine/cuda.py, run/gpu_state.py) without a GPU: no NVIDIA driver exists on this machine.

The lock/checkpoint/restore/unlock sequence and its rollback run against a stand-in driver (the
test names say so); what the driver would do to a real process cannot be exercised here (docs/gpu.md,
scripts/gpu-validate.sh). The inventory is read from a stand-in /proc/driver/nvidia tree.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.engine import cuda
from cedana_airflow.errors import ConfigError, GpuCheckpointFailed, GpuUnavailable
from cedana_airflow.format.manifest import GpuProcess, GpuState, Manifest, ProcessInfo
from cedana_airflow.format.signing import sign, signature_problem
from cedana_airflow.run.gpu_state import GpuGate

from conftest import no_nvidia_driver

STEPS = ["lock", "checkpoint", "restore", "unlock"]
PIDS = [os.getpid(), os.getppid()]  # real pids without /dev/nvidia* mappings: the check after checkpoint passes


class StandInDriver:
    """The driver's view of ``cuda`` (pids with CUDA state; default PIDS): records every call and the
    state it leaves each pid in; fails the n-th call of one kind when told, before acting, or after
    acting with ``half_way`` (the driver got as far as changing the state, then reported an error)."""

    def __init__(self, fail: tuple[str, int] | None = None, cuda: Sequence[int] | None = None, *,
                 half_way: bool = False, states: dict[int, str] | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.states: dict[int, str] = {p: "running" for p in (PIDS if cuda is None else cuda)} | (states or {})
        self.fail, self.half_way = fail, half_way

    def _do(self, what: str, pid: int, before: str, after: str) -> None:
        self.calls.append((what, pid))
        failing = self.fail and self.fail[0] == what and sum(1 for c in self.calls if c[0] == what) == self.fail[1]
        if failing and not self.half_way:
            raise GpuCheckpointFailed(f"cuCheckpointProcess{what.title()} of pid {pid} failed: CUDA_ERROR_TIMEOUT (909)")
        if self.states.get(pid, cuda.NO_CUDA) != before:  # as the driver: CUDA_ERROR_ILLEGAL_STATE
            raise GpuCheckpointFailed(f"cuCheckpointProcess{what.title()} of pid {pid} failed: "
                                      f"CUDA_ERROR_ILLEGAL_STATE (401): it is {self.states.get(pid, cuda.NO_CUDA)}")
        self.states[pid] = after
        if failing:
            raise GpuCheckpointFailed(f"cuCheckpointProcess{what.title()} of pid {pid} failed: CUDA_ERROR_UNKNOWN (999)")

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
        return self.states.get(pid, cuda.NO_CUDA)


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
    assert "every process was brought back to running and runs on" in str(e.value) and "\n" not in str(e.value)
    if fail[0] == "checkpoint":  # the usual cause is the workload's memory, which the line names (not a mapping left)
        assert "UVM/managed memory, CUDA IPC memory, MIG or MPS make the driver's checkpoint fail" in str(e.value)


@pytest.mark.parametrize("fail", [("lock", 2), ("checkpoint", 1), ("checkpoint", 2)])
def test_stand_in_driver_a_call_that_fails_half_way_is_still_brought_back_to_running_no_gpu_here(fail):
    """The driver changed the state, then reported an error: the old rollback guessed from return codes
    that nothing had happened to that process, and left it locked or checkpointed."""
    drv = StandInDriver(fail, half_way=True)
    with pytest.raises(GpuCheckpointFailed, match="every process was brought back to running") as e:
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            pass
    assert drv.states == {p: "running" for p in PIDS}, drv.states
    assert "CUDA_ERROR_UNKNOWN (999)" in str(e.value)


def test_stand_in_driver_a_process_already_locked_or_checkpointed_is_taken_as_it_is_and_ends_running_no_gpu_here():
    """CRIU's plugin or another tool got there first: no second lock (CUDA_ERROR_ILLEGAL_STATE)."""
    a, b = PIDS
    drv = StandInDriver(states={a: "locked", b: "checkpointed"})
    with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
        assert drv.states == {a: "checkpointed", b: "checkpointed"}
    assert drv.calls == [("checkpoint", a), ("restore", b), ("restore", a), ("unlock", b), ("unlock", a)]
    assert drv.states == {a: "running", b: "running"}


def test_stand_in_driver_a_process_in_a_state_the_driver_cannot_checkpoint_is_refused_untouched_no_gpu_here():
    drv = StandInDriver(states={PIDS[1]: "failed"})
    with pytest.raises(GpuCheckpointFailed, match=rf"pid {PIDS[1]}'s CUDA state is failed"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            pass
    assert drv.states[PIDS[0]] == "running"


def test_stand_in_driver_a_failed_dump_puts_gpu_state_back_and_the_error_goes_up_no_gpu_here():
    drv = StandInDriver()
    with pytest.raises(RuntimeError, match="criu dump failed"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            raise RuntimeError("criu dump failed")
    assert all(drv.states[p] == "running" for p in PIDS)


def test_stand_in_driver_a_failure_putting_state_back_is_reported_and_the_rest_still_unlocked_no_gpu_here():
    drv = StandInDriver(("restore", 1))
    with pytest.raises(GpuCheckpointFailed, match="putting GPU state back failed: .*CUDA_ERROR_TIMEOUT"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            pass
    # the other process was restored and unlocked; the failed one is named in the error
    assert sorted(drv.states.values()) == ["checkpointed", "running"]


def test_stand_in_driver_a_rollback_that_fails_says_the_workload_may_be_stuck_no_gpu_here():
    class Stuck(StandInDriver):
        def restore(self, pid: int) -> None:
            raise GpuCheckpointFailed(f"cuCheckpointProcessRestore of pid {pid} failed: CUDA_ERROR_ILLEGAL_STATE (401)")

    drv = Stuck(("checkpoint", 2), half_way=True)
    with pytest.raises(GpuCheckpointFailed, match="bringing the processes back also failed .*the workload may be stuck"):
        with cuda.suspended(drv, PIDS, lock_timeout_ms=1000):
            pass


def test_stand_in_driver_a_device_mapping_left_after_checkpoint_refuses_the_dump_and_rolls_back_no_gpu_here(tmp_path):
    dev = Path(f"/dev/nvidia-cedana-test-{os.getpid()}")
    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))  # /dev/null under a /dev/nvidia* name
    try:
        with open(dev, "rb"):  # this process now "holds" a device file, as UVM or IPC memory would
            assert cuda.device_holders([os.getpid(), os.getppid()]) == [os.getpid()]
            drv = StandInDriver()
            with pytest.raises(GpuCheckpointFailed, match=f"pid {os.getpid()} still maps {dev}"):
                with cuda.suspended(drv, [os.getpid()], lock_timeout_ms=1000):
                    pass
            assert drv.states[os.getpid()] == "running"
    finally:
        dev.unlink()


@no_nvidia_driver
def test_no_driver_here_is_one_line():
    with pytest.raises(GpuUnavailable, match=r"^no NVIDIA driver on this node \(.*\)\. .*set gpu = off$"):
        cuda.load_driver()


def _no_driver() -> cuda.CudaDriver:
    raise GpuUnavailable("no NVIDIA driver on this node (libcuda.so.1: cannot open shared object file). Checkpointing "
                         "GPU state needs driver 570 or later: run GPU tasks on GPU nodes, or set gpu = off")


def test_a_node_without_the_driver_makes_require_a_config_error_and_auto_starts():
    with pytest.raises(ConfigError, match="gpu = require, but this node cannot checkpoint GPU state: no NVIDIA driver"):
        GpuGate(load_settings({"gpu": "require"}, environ={}), load=_no_driver).require()
    GpuGate(load_settings({"gpu": "auto"}, environ={}), load=_no_driver).require()  # auto never refuses to start


def _holding_a_stand_in_device():
    """This process holds a /dev/nvidia* file (/dev/null's numbers under that name), as NVML does."""
    dev = Path(f"/dev/nvidia-cedana-test-{os.getpid()}")
    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))
    return dev


def test_stand_in_driver_the_driver_says_which_processes_hold_cuda_state_not_their_device_files_no_gpu_here():
    """A process already checkpointed holds no device file and is found; one that holds a device file
    without CUDA state (NVML only, a forked child) is not locked: the heartbeat is refused, saying why."""
    me, parent = os.getpid(), os.getppid()
    gate = GpuGate(load_settings(environ={}), load=lambda: drv)
    drv = StandInDriver(cuda=[], states={parent: "checkpointed"})
    assert gate.dump_refusal([me, parent]) == ([parent], None)
    dev = _holding_a_stand_in_device()
    try:
        with open(dev, "rb"):
            holding, why = gate.dump_refusal([me, parent])
            assert holding == [parent]
            assert why.startswith(f"pid {me} holds {dev} but has no CUDA state the driver can checkpoint (it reaches "
                                  "the GPU through NVML only"), why
            drv.states[me] = "running"  # now a CUDA process that also holds NVML's files: checkpointed as one
            assert gate.dump_refusal([me, parent]) == ([me, parent], None)
    finally:
        dev.unlink()
    assert drv.calls == []  # asking is all a refusal does


def test_stand_in_driver_a_driver_that_cannot_answer_refuses_the_heartbeat_and_gpu_off_never_asks_no_gpu_here():
    class Broken(StandInDriver):
        def state(self, pid: int) -> str:
            raise GpuCheckpointFailed(f"cuCheckpointProcessGetState of pid {pid} failed: CUDA_ERROR_OPERATING_SYSTEM (304)")

    gate = GpuGate(load_settings(environ={}), load=Broken)
    # processes holding no device file: no CUDA state to lock, whatever the driver's error (a CPU task on a GPU node)
    assert gate.dump_refusal(PIDS) == ([], None)
    dev = _holding_a_stand_in_device()
    try:
        with open(dev, "rb"):  # one that holds the device files, and the driver cannot say: not dumped
            holding, why = gate.dump_refusal(PIDS)
    finally:
        dev.unlink()
    assert holding == [] and why.startswith("the driver could not say which processes hold CUDA state (") and "(304)" in why

    def never() -> cuda.CudaDriver:
        raise AssertionError("gpu = off loaded the driver")

    assert GpuGate(load_settings({"gpu": "off"}, environ={}), load=never).dump_refusal(PIDS) == ([], None)


def test_a_node_without_the_driver_is_asked_once_per_run_not_at_every_heartbeat():
    loads = []

    def load() -> cuda.CudaDriver:
        loads.append(1)
        return _no_driver()

    gate = GpuGate(load_settings(environ={}), load=load)
    for _ in range(3):
        assert gate.dump_refusal(PIDS) == ([], None)
    assert loads == [1]


def test_the_lock_timeout_never_reaches_the_driver_as_0_which_means_no_timeout():
    assert GpuGate(load_settings({"gpu_lock_timeout_seconds": 0.0004}, environ={})).lock_timeout_ms == 1
    assert GpuGate(load_settings({"gpu_lock_timeout_seconds": 10}, environ={})).lock_timeout_ms == 10_000
    assert cuda.lock_timeout_ms(0.0015) == 2


class _FakeLibcuda:
    """libcuda.so.1's checkpoint calls as ctypes sees them: what LibcudaDriver passes, and the codes it gets."""

    def __init__(self, state_rc: int, state: int = 0) -> None:
        self.state_rc, self.state, self.lock_args = state_rc, state, None

    def cuCheckpointProcessGetState(self, pid, ref):
        ref._obj.value = self.state
        return self.state_rc

    def cuCheckpointProcessLock(self, pid, ref):
        self.lock_args = ref._obj  # the struct byref() points at
        return 0

    def cuGetErrorName(self, rc, ref):
        ref._obj.value = {304: b"CUDA_ERROR_OPERATING_SYSTEM", 1: b"CUDA_ERROR_INVALID_VALUE"}.get(rc, b"?")
        return 0


def test_stand_in_libcuda_no_cuda_state_is_read_from_the_two_codes_other_projects_read_so_and_others_fail_no_gpu_here():
    assert cuda.LibcudaDriver(_FakeLibcuda(3)).state(7) == cuda.NO_CUDA  # CUDA_ERROR_NOT_INITIALIZED
    assert cuda.LibcudaDriver(_FakeLibcuda(1)).state(7) == cuda.NO_CUDA  # CUDA_ERROR_INVALID_VALUE
    assert cuda.LibcudaDriver(_FakeLibcuda(0, 2)).state(7) == "checkpointed"
    assert cuda.LibcudaDriver(_FakeLibcuda(0, 5)).state(7) == "unknown (5)"  # CUDA 13.4's "restoring"
    with pytest.raises(GpuCheckpointFailed, match=r"cuCheckpointProcessGetState of pid 7 failed: CUDA_ERROR_OPERATING_SYSTEM \(304\)"):
        cuda.LibcudaDriver(_FakeLibcuda(304)).state(7)


def test_stand_in_libcuda_the_lock_struct_carries_the_timeout_first_and_never_0_no_gpu_here():
    lib = _FakeLibcuda(0)
    cuda.LibcudaDriver(lib).lock(7, 0)
    assert ctypes.sizeof(cuda._LockArgs) == 64 and cuda._LockArgs.timeoutMs.offset == 0
    assert lib.lock_args.timeoutMs == 1 and list(lib.lock_args.reserved1) == [0] * 7


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
    assert "this node has GPUs 0: NVIDIA H200:" in gate(("NVIDIA H200",)).restore_refusal(m)
    assert "this node has GPUs 0: NVIDIA H100, 1: NVIDIA H100:" in gate(("NVIDIA H100", "NVIDIA H100")).restore_refusal(m)
    assert "gpu = off" in gate(("NVIDIA H200", "NVIDIA H200"), settings=load_settings({"gpu": "off"}, environ={})).restore_refusal(m)
    no_driver = GpuGate(s, load=_no_driver).restore_refusal(m)
    assert no_driver.startswith("seq 4 holds GPU state (GPUs 0: NVIDIA H200, 1: NVIDIA H200), but no NVIDIA driver on this node")
    assert GpuGate(s).restore_refusal(_gpu_manifest(("x",)).model_copy(update={"gpu": None, "format_version": 1})) is None


def test_stand_in_driver_the_same_models_in_another_order_are_refused_the_driver_restores_by_index_no_gpu_here():
    m = _gpu_manifest(("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    gate = GpuGate(load_settings(environ={}), load=StandInDriver,
                   inventory=lambda: cuda.GpuInventory("580.65.06", ("NVIDIA H100 80GB HBM3", "NVIDIA H200")))
    why = gate.restore_refusal(m)
    assert why is not None and "same GPU models in the same order (device index)" in why, why


def test_a_gpu_manifest_is_version_3_signed_or_not_and_its_gpu_block_is_signed():
    m = _gpu_manifest(("NVIDIA H200",))
    assert Manifest.model_validate_json(m.to_json()) == m
    signed = sign(m, b"k" * 32)
    assert signed.format_version == 3 and signature_problem(signed, b"k" * 32) is None
    forged = signed.model_copy(update={"gpu": signed.gpu.model_copy(update={"gpus": ("NVIDIA H100",)})})
    assert "changed after it was signed" in signature_problem(forged, b"k" * 32)
    with pytest.raises(ValueError, match="gpu or airflow block goes with format_version 3"):
        Manifest.model_validate({**m.model_dump(mode="json"), "format_version": 1})
