"""Stores: where checkpoints live. ``file://DIR`` is built in; ``s3://`` arrives with the s3 extra."""

from __future__ import annotations

from pathlib import Path

from ..config import STORE_URL_HINT, redact
from ..errors import ConfigError
from .base import Store, StoreConfig
from .file import FileStore

__all__ = ["Store", "StoreConfig", "FileStore", "open_store"]


def open_store(url: str) -> Store:
    """Build the backend for a store URL (no I/O yet)."""
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/"):
            path = str(Path.cwd() / path)
        return FileStore(Path(path))
    if url.startswith("s3://"):
        raise ConfigError(f"store {redact(url)}: the s3:// backend is not available in this version. Use file:///DIR.")
    raise ConfigError(f"store {redact(url)!r} has no known scheme. {STORE_URL_HINT.capitalize()}.")
