"""What the agent remembers of each workload it runs, so that an agent started after it (a restart, a
crash, an upgrade) takes them up again: heartbeats go on, the owner's handle still works, a stop still
takes the final checkpoint. One JSON file per workload in the agent's runs folder (root's, 0700, on
/run: a reboot ends the trees and their files alike), written once the tree runs and removed when its
run ends; beside it the shim's control socket, where the new agent asks the shim for the tree.

The file holds the owner's handle: it is root's alone (0600 in a 0700 folder), like the node's key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Remembered", "forget", "recall", "remember"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Remembered:
    wid: str
    handle: str
    checkpoint_id: str
    started_at: float
    restored_seq: int | None
    try_number: int
    claim: dict[str, Any] | None
    settings: dict[str, Any]  # the request's task settings (workloads.TASK_SETTINGS), not the node's
    peer: dict[str, Any]  # protocol.Peer's fields
    carried: dict[str, Any]  # callers.Caller.carried()
    pid: int
    command: list[str]
    cwd: str
    stdout_pipe: str
    stderr_pipe: str
    own_namespaces: bool
    fresh: str | None = None  # 0.8.2: why its resume started fresh; its restore (status's), once said
    restore: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # fields a newer agent adds: kept, not read


def _path(runs: Path, wid: str) -> Path:
    return runs / f"{wid}.json"


def control_socket(runs: Path, wid: str) -> Path:
    """Where the workload's shim listens for an agent started after ours."""
    return runs / f"{wid}.sock"


def remember(runs: Path, r: Remembered) -> None:
    """Write (or rewrite) ``r``'s file, whole or not at all."""
    tmp = runs / f".{r.wid}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(r), f)
    os.replace(tmp, _path(runs, r.wid))


def forget(runs: Path, wid: str) -> None:
    for path in (_path(runs, wid), control_socket(runs, wid)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def recall(runs: Path) -> list[Remembered]:
    """Every workload a former agent left running, as its files say; a file that cannot be read is said
    and removed (nothing can take that workload up: its shim still ends it with its caller)."""
    out = []
    for path in sorted(runs.glob("w-*.json")):
        try:
            raw = json.loads(path.read_text())
            known = {k: raw.pop(k) for k in list(raw) if k in Remembered.__dataclass_fields__}
            out.append(Remembered(**{**known, "extra": {**known.get("extra", {}), **raw}}))
        except (OSError, ValueError, TypeError) as e:
            log.warning("agent: %s cannot be read (%s); that workload is not taken up again", path, e)
            forget(runs, path.stem)
    return out
