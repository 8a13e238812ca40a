"""A real PyTorch CPU training job for the soak: DataLoader workers, Adam, a small MLP.

DataLoader(num_workers=2, persistent_workers=True) hands batches over shared memory and passes
their file descriptors over unix sockets: the parts of a training job that a checkpoint taken
while workers run must carry across a restore. Deterministic: the final parameter digest depends
only on the arguments, so a checkpointed, killed and restored run must print the same one as an
uninterrupted run.

    python loader_train.py --seed 7 --epochs 3 --batches 40 --step-seconds 0.05
"""

import argparse
import hashlib
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--batches", type=int, default=40, help="batches per epoch")
ap.add_argument("--batch-size", type=int, default=64)
ap.add_argument("--step-seconds", type=float, default=0.05)
ap.add_argument("--workers", type=int, default=2)
args = ap.parse_args()

print(f"start-up: building the model and loader (pid {os.getpid()})", flush=True)
import torch  # noqa: E402  (after the start-up line: importing takes seconds)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Synthetic(Dataset):
    """Seeded inputs and targets made in the main process before the workers fork: each worker
    reads them from memory it shares copy-on-write with the main process, as a TensorDataset does."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        true = torch.randn(32, 4, generator=g)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.tanh(self.x @ true) + 0.01 * torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


torch.manual_seed(args.seed)
data = Synthetic(args.batches * args.batch_size, args.seed)
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                    persistent_workers=args.workers > 0, generator=torch.Generator().manual_seed(args.seed))
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loss_fn = nn.MSELoss()

step = 0
for epoch in range(args.epochs):
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        print(f"step {step}/{args.epochs * args.batches} loss={loss.item():.6f}", flush=True)
        time.sleep(args.step_seconds)

h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
print(f"done digest={h.hexdigest()[:16]}", flush=True)
