"""CheckpointSensor (poke, reschedule, deferrable through its trigger) against a real store, and
GpuSensor: the real no-driver path here, and its conditions against a fake NVML (no GPU on this machine)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint
from conftest import AIRFLOW, airflow_env, cli_env, no_nvidia_driver

pytest.importorskip("airflow")
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException  # noqa: E402

from cedana_airflow.sensors import CheckpointSensor, CheckpointTrigger, GpuSensor  # noqa: E402

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


def _checkpoint(url: str, tmp_path, cid: str = "sensed") -> None:
    s = open_store(url, load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    d = tmp_path / f"img-{time.monotonic_ns()}"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(5000))
    save_checkpoint(s, cfg, CheckpointMeta(cid, "gpu-7", "4.1.1", PROC), d)


def test_poke_waits_for_a_complete_checkpoint_and_its_age(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    sensor = CheckpointSensor(task_id="s", checkpoint_id="sensed", max_age=timedelta(seconds=1), store=url)
    assert not sensor.poke({}).is_done
    _checkpoint(url, tmp_path)
    found = sensor.poke({})
    assert found.is_done and found.xcom_value["seq"] == 1 and found.xcom_value["node"] == "gpu-7"
    time.sleep(1.2)
    assert not sensor.poke({}).is_done  # older than max_age now


def test_an_unsafe_checkpoint_id_fails_the_sensor_without_retrying(tmp_path):
    sensor = CheckpointSensor(task_id="s", checkpoint_id="../etc", store=f"file://{tmp_path}")
    with pytest.raises(AirflowFailException, match="checkpoint ID '../etc'"):
        sensor.poke({})


def test_the_trigger_fires_when_the_checkpoint_lands_and_survives_serialization(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    classpath, kwargs = CheckpointTrigger("sensed", 60.0, url, None, poll_seconds=0.1).serialize()
    assert classpath == "cedana_airflow.sensors.checkpoint.CheckpointTrigger"
    trigger = CheckpointTrigger(**kwargs)  # as the triggerer rebuilds it
    threading.Timer(0.5, _checkpoint, (url, tmp_path)).start()

    async def first_event():
        return await asyncio.wait_for(trigger.run().__anext__(), timeout=20)

    event = asyncio.run(first_event())
    assert event.payload["status"] == "found" and event.payload["checkpoint"]["seq"] == 1


@pytest.mark.integration
def test_dags_test_runs_the_sensor_in_all_three_modes_until_a_workload_checkpoints(tmp_path, airflow_db):  # noqa: F811
    env = airflow_env(tmp_path, airflow_db)
    log = tmp_path / "dags-test.log"
    producers: dict[str, subprocess.Popen[bytes]] = {}
    with open(log, "wb") as out:
        dag = subprocess.Popen([*AIRFLOW, "dags", "test", "cedana_sensors"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while dag.poll() is None:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                text = log.read_text()
                # Each sensor's workload starts once that sensor is seen waiting (it found nothing yet, or
                # its trigger runs), so every mode really waits, and the deferrable one really defers,
                # before its checkpoint lands.
                running = re.findall(r"starting task_id=wait_(\w+)", text)[:text.count("Task started")]
                for mode in running:
                    waiting = ("[DAG TEST] running trigger in line" if mode == "deferred"
                               else f"no complete checkpoint of sensed-{mode} yet")
                    if mode not in producers and waiting in text:
                        producers[mode] = subprocess.Popen(
                            [sys.executable, "-m", "cedana_airflow", "run", "--id", f"sensed-{mode}", "--heartbeat", "1",
                             "--", "sleep", "60"], env=cli_env(tmp_path, "node-p", f"work-{mode}"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.2)
        finally:
            for p in [dag, *producers.values()]:
                p.kill()
                p.wait()
    text = log.read_text()
    assert dag.returncode == 0, text[-4000:]
    assert sorted(producers) == ["deferred", "poke", "reschedule"]
    assert "no complete checkpoint of sensed-poke yet" in text and "no complete checkpoint of sensed-reschedule yet" in text
    assert "[DAG TEST] running trigger in line" in text  # the deferrable one waited in its trigger
    assert re.search(r"DagRun Finished: dag_id=cedana_sensors, .* state=success", text)


@no_nvidia_driver
def test_gpu_sensor_without_a_driver_fails_with_one_line_or_skips():
    with pytest.raises(AirflowFailException, match=r"cedana: no NVIDIA driver on node \S+ \(NVML: .*\)\. Run this on a GPU worker"):
        GpuSensor(task_id="g").poke({})
    with pytest.raises(AirflowSkipException, match="no NVIDIA driver"):
        GpuSensor(task_id="g", soft_fail=True).poke({})
    # the checkpoint API is asked first, with the detection gpu = require uses
    with pytest.raises(AirflowFailException, match=r"cedana: no NVIDIA driver on this node \(.*\)\. Checkpointing GPU state"):
        GpuSensor(task_id="g", require_checkpoint_api=True).poke({})


class _Device(ctypes.Structure):
    _fields_ = [("index", ctypes.c_int)]


class _FakeNvml(types.ModuleType):
    """Stands in for NVML: there is no GPU on this machine. Two GPUs, settable free memory and Xids.

    Handles are ctypes pointers, as real pynvml's are: an event's ``device`` is a new pointer object
    to the same device, so it compares unequal (by identity) to the handle it was registered with.
    """

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    nvmlEventTypeXidCriticalError = 8

    def __init__(self, free: list[int], util: list[int], xids: list[tuple[int, int]]) -> None:
        super().__init__("pynvml")
        self.free, self.util, self.xids = free, util, list(xids)
        self.devices = [_Device(i) for i in range(len(free))]

    def _handle(self, i):  # a fresh pointer object each time, like the driver's answers
        return ctypes.cast(ctypes.addressof(self.devices[i]), ctypes.POINTER(_Device))

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return len(self.free)
    def nvmlDeviceGetHandleByIndex(self, i): return self._handle(i)
    def nvmlDeviceGetName(self, h): return "NVIDIA H200"
    def nvmlDeviceGetMemoryInfo(self, h): return types.SimpleNamespace(total=141 << 30, free=self.free[h.contents.index])
    def nvmlDeviceGetUtilizationRates(self, h): return types.SimpleNamespace(gpu=self.util[h.contents.index])
    def nvmlEventSetCreate(self): return object()
    def nvmlEventSetFree(self, s): pass
    def nvmlDeviceRegisterEvents(self, h, kind, s): pass

    def nvmlEventSetWait_v2(self, s, timeout_ms):
        if not self.xids:
            raise self.NVMLError_Timeout()
        i, xid = self.xids.pop(0)
        return types.SimpleNamespace(device=self._handle(i), eventData=xid)


def test_gpu_sensor_conditions_against_a_fake_nvml_no_gpu_here(monkeypatch):
    sensor = GpuSensor(task_id="g", min_free_memory_bytes=40 << 30, max_utilization_percent=50, xid_listen_seconds=0.1)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml([80 << 30, 10 << 30], [5, 5], []))
    assert sensor.poke({}) is False  # GPU 1 has too little free memory
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml([80 << 30, 60 << 30], [5, 90], []))
    assert sensor.poke({}) is False  # GPU 1 is busy
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml([80 << 30, 60 << 30], [5, 5], []))
    assert sensor.poke({}) is True
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml([80 << 30, 60 << 30], [5, 5], [(1, 79)]))
    with pytest.raises(AirflowFailException, match="GPU 1 reported Xid 79. Drain this node"):
        sensor.poke({})
    assert GpuSensor(task_id="g", gpu_indices=[0], min_free_memory_bytes=40 << 30).poke({}) is True
