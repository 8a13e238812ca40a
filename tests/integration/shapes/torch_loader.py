"""PyTorch CPU training as people write it: a dataset directory read by DataLoader(num_workers=2)
workers, a log file and a checkpoint directory outside the working directory, a progress bar on
stderr. tqdm is not installed in this environment, so the bar is a minimal one of the same kind
(``\\r``-rewritten line on stderr). Seeded: the final parameters depend only on the arguments.

    python torch_loader.py --data DIR --log FILE --ckpt DIR [--epochs 2]

DIR holds one .npy file per sample: 16 inputs, then 1 target.
"""

import hashlib
import sys
from pathlib import Path

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--data", required=True)
ap.add_argument("--log", required=True)
ap.add_argument("--ckpt", required=True)
ap.add_argument("--epochs", type=int, default=3)
args = ap.parse_args()

_shape.start("importing torch, building the loader")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Samples(Dataset):
    """One .npy file per sample, read by the workers."""

    def __init__(self, root: str) -> None:
        self.files = sorted(Path(root).glob("*.npy"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        row = torch.from_numpy(np.load(self.files[i]))
        return row[:16], row[16:]


def bar(done: int, total: int) -> None:
    filled = 30 * done // total
    sys.stderr.write(f"\rtrain |{'#' * filled}{' ' * (30 - filled)}| {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


torch.manual_seed(1234)
loader = DataLoader(Samples(args.data), batch_size=16, shuffle=True, num_workers=2,
                    generator=torch.Generator().manual_seed(1234))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
Path(args.ckpt).mkdir(parents=True, exist_ok=True)
log = open(args.log, "a", buffering=1)
total, n = args.epochs * len(loader), 0
for epoch in range(args.epochs):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        n += 1
        log.write(f"epoch {epoch} step {n} loss {loss.item():.6f}\n")
        bar(n, total)
        _shape.step(n, total, args.step_seconds)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, Path(args.ckpt) / f"epoch-{epoch}.pt")
log.close()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
_shape.done(h.hexdigest()[:16])
