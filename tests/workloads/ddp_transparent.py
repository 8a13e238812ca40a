"""Data-parallel training with no checkpoint code at all, as people write it for torchrun: two ranks
(gloo), DistributedDataParallel, SGD with momentum, each rank's batches drawn from the step number.
Rank 0 prints ``step i/N`` and, at the end, ``done digest=<sha256 of the parameters>``; an
uninterrupted run and a checkpointed, killed and restored one must print the same."""

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--step-seconds", type=float, default=0.1)
a = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same initial parameters on every rank
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(1, a.steps + 1):
    g = torch.Generator().manual_seed(step * 2 + rank)
    x = torch.randn(8, 16, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :4].sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step}/{a.steps}", flush=True)
    time.sleep(a.step_seconds)
if rank == 0:
    params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print(f"done digest={hashlib.sha256(params).hexdigest()[:16]}", flush=True)
dist.destroy_process_group()
