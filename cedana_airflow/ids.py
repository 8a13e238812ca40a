"""Checkpoint IDs: the label a workload's checkpoints are saved under.

An ID becomes part of a file path and an S3 key, so it is held to a safe character set and a bounded
length; nothing else is ever interpolated into a path. A new DAG run starts fresh (new ID) while a
retry or a Clear of the same run resumes (same ID): see :func:`derive_checkpoint_id`.
"""

from __future__ import annotations

import hashlib
import re

from .errors import CheckpointIdError

__all__ = ["MAX_ID_LENGTH", "RESERVED_NAMES", "validate_checkpoint_id", "derive_checkpoint_id"]

MAX_ID_LENGTH = 200
#: Top-level names of the store layout (docs/store-format.md) that no checkpoint ID may take.
RESERVED_NAMES = frozenset({"chunks", "drills", "index", "leases", "locks", "quarantine", "store.json"})
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+@-]*")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._=+@-]")


def validate_checkpoint_id(checkpoint_id: str) -> str:
    """Return the ID unchanged when it is safe to use in a path or key, else raise CheckpointIdError."""
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise CheckpointIdError("checkpoint ID is empty. Pass --id NAME (letters, digits and . _ = + @ -).")
    if len(checkpoint_id) > MAX_ID_LENGTH:
        raise CheckpointIdError(
            f"checkpoint ID {checkpoint_id[:40]!r}... is {len(checkpoint_id)} characters long. "
            f"Use at most {MAX_ID_LENGTH}."
        )
    if not _SAFE.fullmatch(checkpoint_id) or ".." in checkpoint_id:
        bad = _UNSAFE_CHAR.search(checkpoint_id)
        why = f"character {bad.group()!r}" if bad else "a leading symbol or '..'"
        raise CheckpointIdError(
            f"checkpoint ID {checkpoint_id!r} contains {why}. "
            "Use letters, digits and . _ = + @ -, starting with a letter or digit, without '..'."
        )
    if checkpoint_id in RESERVED_NAMES:
        raise CheckpointIdError(f"checkpoint ID {checkpoint_id!r} is reserved by the store layout. Choose another name.")
    return checkpoint_id


def derive_checkpoint_id(dag_id: str, task_id: str, run_id: str, map_index: int | None = -1) -> str:
    """The default ID of an Airflow task: stable across retries and Clear of one run, new for each run.

    Unsafe characters (``:`` in run IDs, ``/``) become ``_``; a short digest of the exact inputs keeps
    two runs whose names differ only in such characters apart. ``map_index`` -1 or None: not mapped.
    """
    parts = [dag_id, task_id] + ([str(map_index)] if map_index is not None and map_index >= 0 else []) + [run_id]
    exact = "\x1f".join(parts).encode()
    digest = hashlib.sha256(exact).hexdigest()[:10]
    readable = ".".join(_UNSAFE_CHAR.sub("_", p) for p in parts).strip("._-=+@")
    readable = readable.replace("..", "._")[: MAX_ID_LENGTH - len(digest) - 1]
    return validate_checkpoint_id(f"{readable or 'task'}-{digest}")
