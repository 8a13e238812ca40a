"""A PyTorch job's cooperative checkpoints: model, optimizer, scheduler, RNG states and the position in
the data, one file per rank. Imports torch only here (an optional dependency of the workload).

    from cedana_airflow.coop.torch import Resumable

    ckpt = Resumable(model, optimizer, scheduler)      # after torch.distributed.init_process_group, if any
    start = ckpt.resume()                              # the step to go on from: 0 on a fresh start
    for step in range(start, steps):
        batch = batch_at(step)                         # the data position is the step: a seeded sampler
        train_one_step(batch)
        ckpt.save_if_requested(step + 1)               # collective: every rank saves at the same step

Every rank writes ``rank-<r>.pt``; a DDP job's ranks hold equal parameters, an FSDP job's hold their
shards, and both come back as they were. ``save_if_requested`` is a collective call (an all-reduce of
one integer) so that ranks that saw the request at different steps still save the same one.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, listen, request, requested, restore_dir

__all__ = ["Resumable", "rng_states", "set_rng_states"]


def rng_states() -> dict[str, Any]:
    """Every random generator a training step may draw from: Python's, NumPy's (if imported), torch's
    CPU generator and each CUDA device's."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    import sys

    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Resumable:
    """What a training loop saves and resumes cooperatively. ``extra``: anything else picklable (an
    epoch counter, a data loader's state_dict) returned by :meth:`resume` as ``self.extra``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any | None = None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rank, self.world_size = _rank_and_world()
        self.extra: dict[str, Any] = {}
        listen()

    def resume(self) -> int:
        """Load this rank's part of the restored checkpoint, if any; the step to go on from (0: fresh)."""
        d = restore_dir()
        if d is None:
            return 0
        state = torch.load(Path(d) / f"rank-{self.rank}.pt", map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_states(state["rng"])
        self.extra = state.get("extra", {})
        return int(state["step"])

    def requested(self) -> bool:
        """Whether any rank was asked: one all-reduce, so every rank answers the same at the same step."""
        asked = requested()
        if self.world_size == 1:
            return asked
        flag = torch.tensor([1 if asked else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, step: int) -> None:
        """Write this rank's part of the open request (rank 0 commits it once every rank's is written)."""
        if not request():  # withdrawn since this rank was told (its deadline passed): nothing to answer
            return
        state = {"step": step, "model": self.model.state_dict(), "rng": rng_states(), "extra": self.extra,
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        with checkpoint(self.rank, self.world_size) as d:
            torch.save(state, d / f"rank-{self.rank}.pt")

    def save_if_requested(self, step: int) -> bool:
        """:meth:`save` when asked (collectively); whether it did."""
        if not self.requested():
            return False
        self.save(step)
        return True
