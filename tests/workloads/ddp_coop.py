"""Data-parallel training as people write it, run by torchrun: two ranks (gloo), DistributedDataParallel, SGD
with momentum and a step LR schedule, a random dropout mask per step. Checkpoints are cooperative
(cedana_airflow.coop.torch): written when the supervisor asks, resumed from CEDANA_RESTORE_DIR.
Rank 0 prints ``step N`` and, at the end, ``done digest=<sha256 of the parameters>``.
"""

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cedana_airflow.coop.torch import Resumable

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--step-seconds", type=float, default=0.1)
a = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same initial parameters on every rank
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
torch.manual_seed(1 + rank)  # each rank's own dropout stream: its state is part of the checkpoint

ckpt = Resumable(model, opt, sched)
start = ckpt.resume()
if start and rank == 0:
    print(f"resumed at step {start}", flush=True)
for step in range(start, a.steps):
    g = torch.Generator().manual_seed(step * 2 + rank)  # the data position is the step
    x = torch.randn(8, 16, generator=g)
    y = x[:, :4].sum(1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if rank == 0:
        print(f"step {step + 1} loss {loss.item():.5f}", flush=True)
    time.sleep(a.step_seconds)
    ckpt.save_if_requested(step + 1)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
if rank == 0:
    print(f"done digest={digest}", flush=True)
dist.destroy_process_group()
