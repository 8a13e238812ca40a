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
one integer: the request number) so that ranks that saw the request at different steps still save the
same step for the same request. With NCCL the integer lives on the rank's current CUDA device.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, listen, request, requested, restore_dir

__all__ = ["Resumable", "rng_states", "set_rng_states"]


def rng_states() -> dict[str, Any]:
    """Every random generator a training step may draw from: Python's, NumPy's (if imported), torch's
    CPU generator and this process's CUDA device's (only the current one: asking for every device's
    would create a CUDA context on each GPU from each rank)."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = (torch.cuda.current_device(), torch.cuda.get_rng_state())
    import sys

    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        device, state = states["cuda"]
        torch.cuda.set_rng_state(state, device=device)
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _local(rank: int, world_size: int) -> tuple[int, int]:
    try:
        local, size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return rank, world_size
    return (local, size) if 0 <= local < size <= world_size else (rank, world_size)


class Resumable:
    """What a training loop saves and resumes cooperatively. ``extra``: anything else picklable (an
    epoch counter, a data loader's state_dict) returned by :meth:`resume` as ``self.extra``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any | None = None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rank, self.world_size = _rank_and_world()
        # Each node's supervisor takes its own ranks' part of a job on several nodes (run/job.py): its ranks
        # mark theirs done to its local rank 0 (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE), every file keeps
        # its global rank's name.
        self.local_rank, self.local_world_size = _local(self.rank, self.world_size)
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

    def agreed_request(self) -> int:
        """The request every rank answers now, 0 for none: one all-reduce (MAX) of each rank's view, so
        ranks that saw the request at different steps still save the same step, for the same request."""
        n = request()
        if self.world_size == 1:
            return n
        # NCCL reduces only CUDA tensors; gloo (and others) CPU ones.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        flag = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def requested(self) -> bool:
        return self.agreed_request() > 0

    def save(self, step: int, n: int | None = None) -> None:
        """Write this rank's part of request ``n`` (default: the open one; rank 0 commits it once every
        rank's is written). The state is taken first on every rank (a sharded model's state_dict is a
        collective), whether or not the request is still open."""
        state = {"step": step, "model": self.model.state_dict(), "rng": rng_states(), "extra": self.extra,
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        n = n or request()
        if not n:
            return  # answered already, or withdrawn: nothing to write
        with checkpoint(self.local_rank, self.local_world_size, n=n) as d:
            torch.save(state, d / f"rank-{self.rank}.pt")

    def save_if_requested(self, step: int) -> bool:
        """:meth:`save` when asked (collectively); whether it did."""
        n = self.agreed_request()
        if not n:
            return False
        self.save(step, n)
        return True
