"""cedana-airflow: transparent checkpoint/restore of long Airflow tasks with CRIU.

Public names resolve lazily, so ``import cedana_airflow`` does no I/O and pulls in nothing heavy
(Airflow's provider discovery imports us before its config is ready).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.12.0"

_NAMES = {
    "Settings": "config",
    "load_settings": "config",
    "Manifest": "format.manifest",
    "CedanaError": "errors",
    "ConfigError": "errors",
    "StoreError": "errors",
    "EngineError": "errors",
    "CheckpointNotFound": "errors",
    "CorruptCheckpoint": "errors",
    "validate_checkpoint_id": "ids",
    "derive_checkpoint_id": "ids",
    "open_store": "store",
    "run_workload": "run.runner",
    "RunResult": "run.runner",
}

__all__ = ["__version__", *sorted(_NAMES)]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'cedana_airflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
