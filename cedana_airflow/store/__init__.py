"""Stores: where checkpoints live, and everything that reads or writes them.

``file://DIR`` is built in; ``s3://bucket/prefix`` needs boto3 (the s3 extra).

- backends: ``base`` (the Store protocol, store.json, keys), ``file``, ``s3`` (with its one client config);
- ``transfer``: save a checkpoint (chunks first, manifest last) and fetch one (every chunk verified);
- ``locks`` (writers and gc), ``index`` and ``listing`` (what ``checkpoints`` shows), ``gc`` (retention
  and garbage collection), ``progress`` (the display of long transfers).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..config import STORE_URL_HINT, Settings, redact
from ..errors import ConfigError
from .base import Store, StoreConfig
from .file import FileStore

__all__ = ["Store", "StoreConfig", "FileStore", "open_store"]

_S3_URL = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?")


def open_store(url: str, settings: Settings | None = None, *, s3_client: Any = None) -> Store:
    """Build the backend for a store URL (no I/O yet).

    ``s3_client``: a boto3 S3 client to use instead of one from the standard chain (Airflow passes
    one built from a connection).
    """
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/"):
            path = str(Path.cwd() / path)
        return FileStore(Path(path))
    if url.startswith("s3://"):
        m = _S3_URL.fullmatch(url)
        if not m or "@" in url or ".." in (m.group(2) or ""):
            raise ConfigError(
                f"store {redact(url)!r} is not a valid S3 URL. Write it as s3://bucket/prefix "
                "(credentials never go in the URL: use the AWS credential chain)."
            )
        from .s3 import S3Store, make_s3_client

        s = settings or Settings()
        return S3Store(m.group(1), m.group(2) or "", s3_client or make_s3_client(s), s)
    raise ConfigError(f"store {redact(url)!r} has no known scheme. {STORE_URL_HINT.capitalize()}.")
