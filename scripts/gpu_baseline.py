"""The bare baseline for GPU checkpoints: NVIDIA's driver checkpoint API plus plain CRIU.

scripts/gpu-validate.sh compares cedana-airflow's checkpoint and restore of a GPU workload with this.
It starts a fresh scripts/gpu_workload.py the way cedana-airflow does (``unshare --pid --fork setsid``,
stdout and stderr on pipes), then times, on that one process tree:

- lock + checkpoint of every CUDA process (GPU memory copied into host memory), through its own
  ctypes binding of libcuda.so.1's ``cuCheckpointProcess*`` calls (only /proc and CRIU's stats
  are read with cedana-airflow's helpers);
- ``criu dump --leave-running`` with the flags our engine passes (cedana_airflow/engine/criu.py: no CRIU
  plugin loaded, so CRIU's CUDA plugin does not drive the driver too) less
  our own additions (the open-file capture script, the parent-death guard): its wall time and the
  time CRIU kept the tree frozen (its stats-dump);
- restore + unlock on the still-running tree (what a heartbeat pays to let it run on);
- after killing the tree: ``criu restore -d`` from the local images, then restore + unlock of each
  CUDA process, and the first step the restored workload prints.

Prints one JSON object on stdout; progress goes to stderr. Root only. Exit 3 (one line) when this
machine has no NVIDIA driver with the checkpoint API, 1 (one line) when a step fails.

    python scripts/gpu_baseline.py [--gib 4] [--criu PATH] [--python PY] [--work-dir DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# /proc and CRIU's stats are read as our engine reads them; the driver calls and the criu command
# lines below are this script's own (that is the bare baseline).
from cedana_airflow.engine.cuda import ns_pid, nvidia_files
from cedana_airflow.engine.images import read_dump_stats
from cedana_airflow.engine.procfs import tree_pids

HERE = Path(__file__).resolve().parent
_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
MIN_API_VERSION = 12080  # cuDriverGetVersion of CUDA 12.8: the first with cuCheckpointProcess*


class Failed(Exception):
    """One line: what failed, why, and the fix."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def say(msg: str) -> None:
    print(f"gpu_baseline: {msg}", file=sys.stderr, flush=True)


# -- the driver's checkpoint API, through ctypes --------------------------------------------------
class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs in cuda.h: 64 bytes, reserved fields zeroed.
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class Driver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise Failed(f"no NVIDIA driver on this machine ({e}): run this on the GPU machine", 3) from None
        self.lib = lib
        v = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(v))
        self.api_version = v.value
        if not hasattr(lib, "cuCheckpointProcessLock") or self.api_version < MIN_API_VERSION:
            raise Failed(f"the NVIDIA driver here (CUDA API {self.api_version}) has no checkpoint API "
                         "(cuCheckpointProcess*, CUDA 12.8 / driver 570 and later): upgrade the driver", 3)
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                     "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"):
            getattr(lib, name).argtypes = [ctypes.c_int, ctypes.c_void_p]
        rc = lib.cuInit(0)  # also what lets a restore work without persistence mode (driver API docs)
        if rc != 0:
            raise Failed(f"the NVIDIA driver is installed but cuInit failed ({self._name(rc)}): no usable GPU "
                         "here; check nvidia-smi and the device permissions", 3)

    def _name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(s))
        return f"{(s.value or b'CUDA error').decode()} ({rc})"

    def _call(self, fn: str, pid: int, arg: object = None) -> None:
        rc = getattr(self.lib, fn)(pid, arg)
        if rc != 0:
            raise Failed(f"{fn} of pid {pid} failed: {self._name(rc)}")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(_LockArgs(timeoutMs=timeout_ms)))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", pid)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid)

    def state(self, pid: int) -> str:
        s = ctypes.c_int()
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(s))
        return _STATES.get(s.value, f"unknown ({s.value})")


# -- /proc ----------------------------------------------------------------------------------------
def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            os.waitpid(-1, os.WNOHANG)  # we are a subreaper: reap what we adopted
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return not os.path.exists(f"/proc/{pid}")


def frozen_seconds(image_dir: Path) -> float | None:
    return read_dump_stats(image_dir).get("frozen")


# -- the workload ---------------------------------------------------------------------------------
class Lines(threading.Thread):
    """Reads a pipe into a list of lines, so the workload never blocks on a full pipe."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.lines, self.cond = fd, [], threading.Condition()

    def run(self) -> None:
        with os.fdopen(self.fd, "rb", buffering=0) as f:
            buf = b""
            while chunk := f.read(65536):
                buf += chunk
                *done, buf = buf.split(b"\n")
                with self.cond:
                    self.lines += [d.decode(errors="replace") for d in done]
                    self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> str | None:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines[after:]:
                    if rx.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.5))


def _step(line: str | None) -> int | None:
    m = re.match(r"step (\d+)/", line or "")
    return int(m.group(1)) if m else None


def last_step(lines: Lines) -> int | None:
    with lines.cond:
        return next((s for s in map(_step, reversed(lines.lines)) if s is not None), None)


def _pipe_name(fd: int) -> str:
    return f"pipe:[{os.fstat(fd).st_ino}]"


def _run(cmd: list[str], what: str, log: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = ""
        if log.exists():
            errs = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
            tail = errs[0] if errs else ""
        raise Failed(f"{what} failed (exit {proc.returncode}): {tail or proc.stderr.strip()[-300:]}; log: {log}")
    return seconds


def find_criu(given: str | None) -> str:
    for c in [given] if given else [shutil.which("criu"), "/opt/cedana-airflow/criu/bin/criu"]:
        if c and os.path.exists(c):
            return c
    raise Failed("criu not found (looked on PATH and in /opt/cedana-airflow/criu): pass --criu PATH "
                 "(scripts/gpu-validate.sh provisions one from .gpu-bundle/)")


def measure(a: argparse.Namespace, drv: Driver, criu: str, work: Path) -> dict[str, object]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: `criu restore -d` leaves the restored root to us
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    names = {"stdout": _pipe_name(out_w), "stderr": _pipe_name(err_w)}
    cmd = ["unshare", "--pid", "--fork", "setsid", a.python, str(a.workload), "--gib", str(a.gib),
           "--steps", "1000000", "--step-seconds", str(a.step_seconds), "--seed", str(a.seed)]
    launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, start_new_session=True)
    os.close(out_w)
    os.close(err_w)
    out, err = Lines(out_r), Lines(err_r)
    out.start()
    err.start()
    init = None
    restored_root = None
    try:
        deadline = time.monotonic() + 10
        while init is None and time.monotonic() < deadline:
            kids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split() \
                if os.path.exists(f"/proc/{launcher.pid}") else []
            init = int(kids[0]) if kids else None
            time.sleep(0.01)
        if init is None:
            raise Failed("the workload did not start under 'unshare --pid --fork' (needs util-linux and root)")
        say(f"workload started (namespace init pid {init}); waiting for its third step")
        if out.wait_for(r"^step 3/", a.start_timeout) is None:
            why = (err.lines or ["no output"])[-1]
            raise Failed(f"the workload did not reach step 3 within {a.start_timeout:.0f} s: {why}")
        pids = tree_pids(init)
        cuda = [p for p in pids if nvidia_files(p)]
        if not cuda:
            raise Failed(f"no process of the workload tree {pids} holds /dev/nvidia*: it is not using the GPU")
        cuda_ns = [ns_pid(p) for p in cuda]
        r: dict[str, object] = {"cuda_processes": len(cuda), "api_version": drv.api_version}

        # Checkpoint: lock all, then copy out all (as our engine does), then CRIU, then put back.
        t0 = time.perf_counter()
        for p in cuda:
            drv.lock(p, a.lock_timeout_ms)
        t1 = time.perf_counter()
        for p in cuda:
            drv.checkpoint(p)
        t2 = time.perf_counter()
        left = {p: sorted(nvidia_files(p)) for p in cuda if nvidia_files(p)}
        if left:
            p = next(iter(left))
            raise Failed(f"pid {p} still maps {', '.join(left[p])} after its CUDA checkpoint (UVM/managed or IPC memory?)")
        steps_before = last_step(out)  # it cannot print another while locked
        images = work / "images"
        images.mkdir()
        # CRIU loads none of its plugins (its CUDA plugin would drive the driver API too): as our engine
        no_plugins = work / "no-criu-plugins"
        no_plugins.mkdir()
        dump_log = work / "dump.log"
        dump_wall = _run([criu, "dump", "-t", str(init), "-D", str(images), "-o", str(dump_log), "--file-locks",
                          "--leave-running", "-L", str(no_plugins)], "criu dump", dump_log)
        t3 = time.perf_counter()
        for p in cuda:
            drv.restore(p)
            drv.unlock(p)
        t4 = time.perf_counter()
        states = {p: drv.state(p) for p in cuda}
        if set(states.values()) != {"running"}:
            raise Failed(f"after restore + unlock the workload's CUDA state is {states}, not running")
        frozen = frozen_seconds(images)
        r.update(lock_seconds=t1 - t0, checkpoint_seconds=t2 - t1, criu_dump_seconds=dump_wall,
                 criu_frozen_seconds=frozen, resume_seconds=t4 - t3,
                 image_bytes=sum(f.stat().st_size for f in images.iterdir()),
                 steps_before_dump=steps_before)
        # What the workload was stopped for: GPU copy-out, CRIU's freeze, GPU copy-back.
        r["freeze_seconds"] = (t2 - t0) + (frozen if frozen is not None else dump_wall) + (t4 - t3)
        say(f"checkpoint: lock {t1 - t0:.3f} s, copy-out {t2 - t1:.3f} s, criu dump {dump_wall:.3f} s "
            f"(frozen {frozen if frozen is not None else float('nan'):.3f} s), copy-back {t4 - t3:.3f} s")

        # Lose the tree, then restore it from the local images.
        os.kill(init, signal.SIGKILL)
        launcher.wait(timeout=30)
        if not gone(init, 30):
            raise Failed(f"the workload's init {init} did not go away after SIGKILL")
        init = None
        new_out_r, new_out_w = os.pipe()
        new_err_r, new_err_w = os.pipe()
        out2, err2 = Lines(new_out_r), Lines(new_err_r)
        out2.start()
        err2.start()
        pidfile, restore_log = work / "restore.pid", work / "restore.log"
        t5 = time.perf_counter()
        proc = subprocess.run([criu, "restore", "-D", str(images), "-d", "--pidfile", str(pidfile), "-o",
                               str(restore_log), "--file-locks", "-L", str(no_plugins),
                               "--inherit-fd", f"fd[{new_out_w}]:{names['stdout']}",
                               "--inherit-fd", f"fd[{new_err_w}]:{names['stderr']}"],
                              capture_output=True, text=True, pass_fds=(new_out_w, new_err_w))
        t6 = time.perf_counter()
        os.close(new_out_w)
        os.close(new_err_w)
        if proc.returncode != 0:
            errs = [ln.strip() for ln in restore_log.read_text(errors="replace").splitlines() if "Error" in ln] \
                if restore_log.exists() else []
            raise Failed(f"criu restore failed (exit {proc.returncode}): {(errs or [proc.stderr.strip()[-300:]])[0]}; "
                         f"log: {restore_log}")
        restored_root = int(pidfile.read_text().strip())
        by_ns = {ns_pid(p): p for p in tree_pids(restored_root)}
        missing = [n for n in cuda_ns if n not in by_ns]
        if missing:
            raise Failed(f"the restored tree has no process {missing[0]} in its namespace")
        t7 = time.perf_counter()
        for n in cuda_ns:
            drv.restore(by_ns[n])
            drv.unlock(by_ns[n])
        t8 = time.perf_counter()
        first = out2.wait_for(r"^step ", a.start_timeout)
        if first is None:
            raise Failed(f"the restored workload printed no step within {a.start_timeout:.0f} s: "
                         f"{(err2.lines or ['no output'])[-1]}")
        r.update(criu_restore_seconds=t6 - t5, gpu_restore_seconds=t8 - t7, restore_seconds=(t6 - t5) + (t8 - t7),
                 first_step_after_restore=_step(first))
        say(f"restore: criu restore {t6 - t5:.3f} s, GPU copy-in + unlock {t8 - t7:.3f} s; "
            f"it printed '{first}' (last step seen before the dump: {steps_before})")
        return r
    finally:
        # Everything still below us goes: the workload, a restored tree (adopted: we are its subreaper),
        # a criu cut short by a signal. A GPU process left behind would hold GPU memory for the next run.
        left_over = [p for p in (init, restored_root) if p is not None] + tree_pids(os.getpid())[1:]
        for pid in left_over:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in left_over:
            gone(pid, 30)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--step-seconds", type=float, default=0.05)
    ap.add_argument("--criu", help="criu binary (default: PATH, then /opt/cedana-airflow/criu/bin/criu)")
    ap.add_argument("--python", default=sys.executable, help="the Python with torch that runs the workload")
    ap.add_argument("--workload", type=Path, default=HERE / "gpu_workload.py")
    ap.add_argument("--work-dir", type=Path, help="where the images go (default: a temp dir, removed)")
    ap.add_argument("--lock-timeout-ms", type=int, default=10_000, help="as cedana-airflow's gpu_lock_timeout_seconds")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for the workload's steps")
    ap.add_argument("--dry-run", action="store_true", help="stop before the driver: this interpreter imports "
                    "what the baseline needs and finds criu (scripts/gpu-validate.sh --dry-run)")
    a = ap.parse_args(argv)
    if a.dry_run:
        try:
            criu = find_criu(a.criu)
        except Failed as e:
            print(f"gpu_baseline: {e}", file=sys.stderr)
            return e.code
        print(json.dumps({"dry_run": True, "criu": criu, "python": sys.executable}))
        return 0

    def stopped(signum: int, _frame: object) -> None:  # `timeout` sends SIGTERM: clean up the workload first
        raise Failed(f"stopped by signal {signum} before it finished")

    signal.signal(signal.SIGTERM, stopped)
    try:
        drv = Driver()  # first: a machine without a driver is told so before anything starts
        if os.geteuid() != 0:
            raise Failed("gpu_baseline needs root (CRIU and the driver's checkpoint API act on another process): rerun as root")
        criu = find_criu(a.criu)
        base = a.work_dir or Path(tempfile.mkdtemp(prefix="gpu-baseline-"))
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
        try:
            result = measure(a, drv, criu, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if a.work_dir is None:
                shutil.rmtree(base, ignore_errors=True)
    except Failed as e:
        print(f"gpu_baseline: {e}", file=sys.stderr)
        return e.code
    result.update(gib=a.gib, criu=criu)
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
