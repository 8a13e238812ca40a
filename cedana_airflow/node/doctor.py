"""``cedana-airflow doctor``: can checkpointing work on this node? One line per check, with the fix."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Settings
from ..engine import cuda
from ..engine.criu import CriuEngine, find_criu
from ..engine.fds import carries_inet_sockets
from ..engine.net_lock import lock_flags
from ..engine.page_file import fuse_available
from ..errors import CedanaError, GpuUnavailable, StoreUnavailable
from ..store import open_store

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "fail" (checkpointing cannot work), "warn", "skip"
    detail: str
    fix: str = ""
    gpu: dict[str, Any] | None = None  # the "gpu" check only: what --json shows of the node's GPU state support

    @property
    def blocking(self) -> bool:
        return self.status == "fail"


def _cause_and_fix(message: str) -> tuple[str, str]:
    """Split "<what failed>: <cause>. <fix>." into its cause and its fix sentence."""
    head, sep, fix = message.rstrip(".").rpartition(". ")
    return (head + ".", fix) if sep else (message, "")


def _criu(settings: Settings) -> list[Check]:
    try:
        binary = find_criu(settings.criu, settings.criu_prefix)
    except CedanaError as e:
        return [Check("criu", "fail", *_cause_and_fix(str(e)))]
    out = [Check("criu", "ok", f"{binary.path} (from {binary.source})"),
           Check("criu version", "ok", binary.version), _sockets(binary.version), _io_uring(settings)]
    if os.geteuid() == 0:
        out.append(_network_lock(str(binary.path)))
        engine = CriuEngine(binary)
        ok, last = engine.check()
        out.append(Check("criu check", "ok" if ok else "fail", last,
                         "" if ok else "use CRIU >= 4 on a kernel it supports; see 'criu check --all'"))
        out.append(_restore_mode(settings, engine))
    else:
        out.append(Check("criu check", "skip", "needs root"))
    return out


def _sockets(version: str) -> Check:
    """What this CRIU carries of a workload that talks (issue 47): TCP and UDP sockets need 4.2 on Linux 6.16+."""
    if carries_inet_sockets(version):
        return Check("criu sockets", "ok", f"CRIU {version} carries TCP and UDP sockets on Linux {platform.release()}; "
                     "not an io_uring (docs/compatibility.md)")
    return Check("criu sockets", "warn", f"CRIU {version} cannot dump a TCP or UDP socket on Linux {platform.release()} "
                 "(criu#2718): a workload that holds one is not checkpointed",
                 "install CRIU 4.2 or later (scripts/install-criu.sh) or set CEDANA_CRIU to one")


def _network_lock(criu: str) -> Check:
    """While it dumps a TCP connection CRIU holds the connection's packets back: with libnftables, or
    the iptables command (CRIU's default). Without either, a workload that holds a connection fails
    every heartbeat."""
    if lock_flags(criu):
        return Check("network lock", "ok", "nftables (CRIU's libnftables): a workload's TCP connections are held "
                     "still while it is dumped")
    v4, v6 = shutil.which("iptables"), shutil.which("ip6tables")  # CRIU runs one per address family
    if v4 and v6:
        return Check("network lock", "ok", f"iptables ({v4}, {v6}): a workload's TCP connections are held still while "
                     "it is dumped (nftables, faster, needs a CRIU built with libnftables)")
    if v4 or v6:
        missing = "ip6tables" if v4 else "iptables"
        return Check("network lock", "warn", f"{v4 or v6} but no {missing}: a workload that holds an established "
                     f"{'IPv6' if v4 else 'IPv4'} TCP connection is not checkpointed (every heartbeat fails)",
                     f"install {missing} (apt-get install iptables), or a CRIU built with libnftables")
    return Check("network lock", "warn", "neither nftables support in this CRIU nor an iptables command: a workload "
                 "that holds an established TCP connection is not checkpointed (every heartbeat fails)",
                 "install iptables (apt-get install iptables), or a CRIU built with libnftables")


def _io_uring(settings: Settings) -> Check:
    """CRIU cannot dump an io_uring: what this node does about the workloads that would take one."""
    if settings.io_uring == "deny":
        return Check("io_uring", "ok", "io_uring = deny: a workload's io_uring_setup answers ENOSYS, so libuv (torchrun's "
                     "TCPStore, Node.js) falls back to epoll and stays checkpointable (docs/compatibility.md)")
    return Check("io_uring", "warn", "io_uring = allow: a workload that opens an io_uring is not checkpointed (every "
                 "heartbeat fails, named at the first); torchrun jobs do", "set io_uring = deny (the default)")


def _restore_mode(settings: Settings, engine: CriuEngine) -> Check:
    """Which restore this node does: lazy (runs while memory streams in) where the kernel allows."""
    if settings.restore_mode == "full":
        return Check("restore mode", "ok", "full (restore_mode = full)")
    ok, why = engine.lazy_pages
    if ok:
        if settings.lazy_pages_via in ("auto", "ours"):
            via = "our lazy-pages daemon (1 MiB around each fault)"
        elif settings.lazy_pages_via == "socket":
            via = "CRIU's lazy-pages daemon and its page-server protocol"
        else:
            fuse, how = fuse_available()
            via = ("CRIU's lazy-pages daemon and page files over /dev/fuse" if fuse else
                   f"CRIU's lazy-pages daemon and page files, which cannot be mounted here ({how}): a lazy restore "
                   "is retried in full; set lazy_pages_via = ours")
        return Check("restore mode", "ok", f"lazy ({why}); pages via {via}; GPU state is restored in full")
    return Check("restore mode", "warn", f"full: this kernel cannot restore lazily ({why})",
                 "a kernel with userfaultfd (CONFIG_USERFAULTFD, 4.11+ for a process tree) restores lazily; "
                 "set restore_mode = full to silence this")


def _store(settings: Settings, probe: bool) -> Check:
    """Read only, unless ``probe`` (``--probe-store``): then store.json is created where absent and, on a file
    store, a probe file written and removed, and the line says so."""
    url = settings.resolved_store()
    if not probe:
        return _store_read_only(settings, url)
    honoured = ""
    try:
        store = open_store(url, settings)
        store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
        if url.startswith("s3://"):  # what the store's safety rests on (issue 52), asked each time here
            honoured = "; " + (store.probe_conditional_writes()  # type: ignore[attr-defined]
                               if settings.s3_conditional_writes == "probe" else
                               "s3_conditional_writes = trust: conditional writes not probed")
        if url.startswith("file://"):
            root = Path(url[len("file://"):])
            with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
                pass
    except (CedanaError, OSError) as e:
        return Check("store", "fail", *_cause_and_fix(str(e)))
    if url.startswith("file://"):
        return Check("store", "ok", f"{url} reachable and writable (--probe-store: wrote and removed a probe file; "
                                    "store.json created if it was absent)")
    return Check("store", "ok", f"{url} reachable, bucket present, store.json readable (--probe-store: store.json "
                                f"created if it was absent; a scratch key under locks/ written and removed){honoured}")


def _store_read_only(settings: Settings, url: str) -> Check:
    try:
        open_store(url, settings).open(create=False, chunk_avg_bytes=settings.chunk_avg_bytes)
    except StoreUnavailable as e:
        if url.startswith("file://") and "does not exist" in str(e):
            root = Path(url[len("file://"):])
            parent = next(p for p in root.parents if p.exists())
            if os.access(parent, os.W_OK | os.X_OK):
                return Check("store", "ok", f"{url} does not exist yet: the first checkpoint creates it "
                                            f"({parent} is writable; nothing was written)")
        return Check("store", "fail", *_cause_and_fix(str(e)))
    except (CedanaError, OSError) as e:
        return Check("store", "fail", *_cause_and_fix(str(e)))
    return Check("store", "ok", f"{url} reachable and read (nothing was written: --probe-store "
                                "checks that it can be)")


def _gpu() -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return [Check("nvidia", "skip", "pynvml not installed (pip install 'cedana-airflow[gpu]'); CPU only")]
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [Check("nvidia", "skip", f"no NVIDIA driver ({e}); CPU workloads only")]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        n = pynvml.nvmlDeviceGetCount()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
    except Exception as e:  # a driver that loads but cannot answer: report it, do not crash
        return [Check("nvidia", "warn", f"NVML answered with an error: {e}", "check the driver with nvidia-smi")]
    finally:
        pynvml.nvmlShutdown()
    out = [Check("nvidia", "ok", f"driver {driver}, {n} GPU(s): {', '.join(map(str, names))}")]
    cc = shutil.which("cuda-checkpoint")
    out.append(Check("cuda-checkpoint", "ok" if cc else "skip", cc or "not on PATH: not needed, the driver's "
                     "checkpoint API is called directly (see the gpu check)"))
    return out


def _persistence_modes() -> list[bool] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return [bool(pynvml.nvmlDeviceGetPersistenceMode(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


#: What NVIDIA's driver cannot checkpoint, whatever its version (docs/gpu.md).
_UNSUPPORTED = "UVM/managed memory, CUDA IPC memory, MIG, MPS, multi-process NCCL"


def _criu_cuda_plugin(settings: Settings) -> str | None:
    """Where CRIU's own CUDA plugin is installed, if anywhere CRIU looks (its built-in plugin directory,
    CRIU_LIBS_DIR, the usual prefixes). cedana-airflow never lets CRIU load it (engine/criu.py)."""
    dirs = [os.environ.get("CRIU_LIBS_DIR", ""), "/usr/lib/criu", "/usr/local/lib/criu"]
    try:
        binary = find_criu(settings.criu, settings.criu_prefix)
        helptext = subprocess.run([binary.path, "--help"], capture_output=True, text=True, timeout=30).stdout
        if m := re.search(r"--libdir.*\(by default (\S+?)\)", helptext):
            dirs.insert(0, m.group(1))
    except (CedanaError, OSError, subprocess.TimeoutExpired):
        pass
    return next((str(p) for d in dirs if d and (p := Path(d) / "cuda_plugin.so").is_file()), None)


def _what_happens(inv: cuda.GpuInventory, info: dict[str, Any]) -> str:
    """What happens to a CUDA task on this node, in one sentence (doctor --json: gpu.what_happens)."""
    if info["problem"]:
        return ("a task holding GPU devices is not checkpointed here (its heartbeats are skipped, said once; gpu = "
                f"require refuses to start it): {info['problem']}")
    gpus = ", ".join(f"{i}: {m}" for i, m in enumerate(inv.models)) or "none"
    return ("each heartbeat locks every CUDA process of the task, copies its GPU memory into host memory through the "
            "driver's checkpoint API, dumps the tree with CRIU (its CUDA plugin not loaded) and copies the memory "
            f"back; a checkpoint restores only onto GPUs {gpus}, in this order. Managed (UVM) or IPC memory, MIG and "
            "MPS make the driver's checkpoint fail: that heartbeat is skipped and the task runs on")


def _gpu_state(settings: Settings) -> Check:
    """Can this node checkpoint GPU state (engine/cuda.py)? With the facts --json carries as ``gpu``."""
    inv = cuda.gpu_inventory()
    info: dict[str, Any] = {"mode": settings.gpu, "driver_version": inv.driver_version or None,
                            "gpus": list(inv.models), "gpu_count": len(inv.models), "libcuda": False,
                            "cuda_api_version": None, "checkpoint_api": False,
                            "persistence_mode": _persistence_modes(), "warnings": [], "problem": None,
                            "unsupported": _UNSUPPORTED, "criu_cuda_plugin": _criu_cuda_plugin(settings),
                            "uvm_module": os.path.exists("/proc/driver/nvidia-uvm") or os.path.exists("/dev/nvidia-uvm"),
                            "what_happens": ""}
    try:
        driver = cuda.load_driver()
        info.update(libcuda=True, cuda_api_version=driver.version(), checkpoint_api=True)
    except GpuUnavailable as e:
        info["problem"] = str(e)
        info["libcuda"] = cuda.libcuda_loadable()
        info["what_happens"] = _what_happens(inv, info)
        status = "fail" if settings.gpu == "require" else "skip"
        return Check("gpu", status, f"GPU state cannot be checkpointed here: {e}",
                     "run GPU tasks on a node with driver 570 or later" if status == "fail" else "", info)
    major = int(inv.driver_version.split(".")[0]) if inv.driver_version[:1].isdigit() else 0
    warnings = info["warnings"]
    if major and major < 575:
        warnings.append(f"driver {inv.driver_version}: PyTorch is reported to fail to checkpoint below 575")
    if major and major < 580:
        warnings.append(f"driver {inv.driver_version}: restores only onto the same GPU models (580 adds a device map)")
    if info["persistence_mode"] and not all(info["persistence_mode"]):
        warnings.append("persistence mode is off on some GPUs: each checkpoint and restore pays the driver's start-up")
    info["what_happens"] = _what_happens(inv, info)
    plugin = f"; CRIU's CUDA plugin at {info['criu_cuda_plugin']} is not loaded" if info["criu_cuda_plugin"] else ""
    detail = (f"checkpoint API present (CUDA API {info['cuda_api_version']}, driver {inv.driver_version or '?'}, "
              f"{len(inv.models)} GPU(s){plugin})")
    return Check("gpu", "warn" if warnings else "ok", detail, "; ".join(warnings), info)


def _node_key(settings: Settings) -> Check:
    """The key this node signs and verifies with: its ID, never the key; not created here."""
    from ..keys import DEFAULT_KEY_FILE, node_key

    if settings.signing_key_file is None and settings.signing_key is None and not os.path.lexists(DEFAULT_KEY_FILE):
        return Check("node key", "warn", f"{DEFAULT_KEY_FILE} does not exist yet: the first supervisor creates it",
                     "copy the key of this store's other nodes there (root, 0400), or 'cedana-airflow key init' "
                     "on the first node")
    try:
        k = node_key(settings)
    except CedanaError as e:
        return Check("node key", "fail", str(e), "see docs/security.md#the-node-key")
    return Check("node key", "ok", f"{k.where}: key {k.key_id}")


def run_checks(settings: Settings, probe_store: bool = False) -> list[Check]:
    checks = _criu(settings)
    root = os.geteuid() == 0
    checks.append(Check("root", "ok" if root else "fail", f"euid {os.geteuid()}",
                        "" if root else "run as root: CRIU needs CAP_SYS_ADMIN and ptrace"))
    for tool in ("unshare", "setsid"):
        path = shutil.which(tool)
        checks.append(Check(tool, "ok" if path else "fail", path or "not found",
                            "" if path else "apt-get install util-linux"))
    checks.append(_store(settings, probe_store))
    checks.append(_node_key(settings))
    checks.extend(_gpu())
    checks.append(_gpu_state(settings))
    return checks
