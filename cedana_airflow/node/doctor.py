"""``cedana-airflow doctor``: can checkpointing work on this node? One line per check, with the fix."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from ..engine.criu import CriuEngine, find_criu
from ..errors import CedanaError
from ..store import open_store

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "fail" (checkpointing cannot work), "warn", "skip"
    detail: str
    fix: str = ""

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
           Check("criu version", "ok", binary.version)]
    if os.geteuid() == 0:
        ok, last = CriuEngine(binary).check()
        out.append(Check("criu check", "ok" if ok else "fail", last,
                         "" if ok else "use CRIU >= 4 on a kernel it supports; see 'criu check --all'"))
    else:
        out.append(Check("criu check", "skip", "needs root"))
    return out


def _store(settings: Settings) -> Check:
    url = settings.resolved_store()
    try:
        store = open_store(url, settings)
        store.open(create=True, chunk_avg_bytes=settings.chunk_avg_bytes)
        if url.startswith("file://"):
            root = Path(url[len("file://"):])
            with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
                pass
    except (CedanaError, OSError) as e:
        return Check("store", "fail", *_cause_and_fix(str(e)))
    if url.startswith("file://"):
        return Check("store", "ok", f"{url} reachable and writable")
    return Check("store", "ok", f"{url} reachable, bucket present, store.json readable")


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
    out.append(Check("cuda-checkpoint", "ok" if cc else "warn", cc or "not on PATH",
                     "" if cc else "install NVIDIA's cuda-checkpoint (driver >= 550) to checkpoint GPU state"))
    return out


def run_checks(settings: Settings) -> list[Check]:
    checks = _criu(settings)
    root = os.geteuid() == 0
    checks.append(Check("root", "ok" if root else "fail", f"euid {os.geteuid()}",
                        "" if root else "run as root: CRIU needs CAP_SYS_ADMIN and ptrace"))
    for tool in ("unshare", "setsid"):
        path = shutil.which(tool)
        checks.append(Check(tool, "ok" if path else "fail", path or "not found",
                            "" if path else "apt-get install util-linux"))
    checks.append(_store(settings))
    checks.extend(_gpu())
    return checks
