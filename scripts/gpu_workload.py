"""A deterministic PyTorch training workload that holds several GiB of GPU memory (scripts/gpu-validate.sh).

Its whole output depends only on its arguments: an uninterrupted run and one that was checkpointed,
killed and restored must print the same loss for every step and the same final digest. Nothing here
knows about cedana-airflow: it is the unmodified workload a user would run.

    python gpu_workload.py --gib 4 --steps 300 --step-seconds 0.1 --seed 1234 [--device cpu]

Output, one line each: ``start-up: ...``, ``allocated ...``, ``step i/N loss=<float repr>``, and at the end
``digest <sha256 of every parameter's bytes, then the ballast's>``. Exit 3 when CUDA is not usable
and ``--device cpu`` was not given.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main(): a missing torch is one line there, not a traceback here
    import torch

# cuBLAS is deterministic only with a fixed workspace; it must be set before the first cuBLAS handle.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_CHUNK = 64 << 20  # elements per host copy when hashing: bounds the extra host memory to 256 MiB


def _host_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in host memory, without needing numpy."""
    host = t.cpu().contiguous()
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="GPU memory to hold in all, model state included (GiB)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step: time for heartbeats to land")
    ap.add_argument("--pace-file", default=None,
                    help="sleep --step-seconds only while this file exists, and hold before the last step until "
                         "it is gone: the run that is checkpointed and killed is paced and never ends before its "
                         "checkpoints (a busy machine), its restored rest runs at full speed")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--hidden", type=int, default=2048, help="width of the MLP's layers")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="'cuda' (default) or 'cpu' (no GPU state: for trying it out)")
    a = ap.parse_args(argv)
    if a.gib <= 0 or a.steps < 1 or a.step_seconds < 0 or a.hidden < 1 or a.layers < 1 or a.batch < 1:
        ap.error("--gib must be > 0, --steps, --hidden, --layers and --batch >= 1, --step-seconds >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"gpu_workload: PyTorch is not importable ({e}). Run it with the Python that has torch.", file=sys.stderr)
        return 3
    if a.device == "cpu":
        device = torch.device("cpu")
        print("running on CPU (--device cpu): no GPU state is held", flush=True)
    else:
        if not torch.cuda.is_available():
            print(f"gpu_workload: CUDA is not available to PyTorch {torch.__version__} (no driver or no GPU). "
                  "Run on a GPU machine, or pass --device cpu to try it on the CPU.", file=sys.stderr)
            return 3
        device = torch.device(a.device)

    # Deterministic kernels only (an error, not a silent difference, where one has none). fp32 matmuls
    # stay IEEE: PyTorch's default, left as it is.
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a.seed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"start-up: pid {os.getpid()} device {device} ({name}) torch {torch.__version__} gib {a.gib:g} "
          f"steps {a.steps} seed {a.seed}", flush=True)

    gen = torch.Generator(device=device)
    layers: list[torch.nn.Module] = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1]).to(device)
    teacher = torch.nn.Linear(a.hidden, a.hidden).to(device)  # the target the model learns
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    # The ballast fills the rest of --gib: weights, gradients and momentum take about 3x the parameters.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ballast_elems = max(1 << 20, int((a.gib * (1 << 30) - 3 * param_bytes) // 4))
    gen.manual_seed(a.seed)
    ballast = torch.randn(ballast_elems, generator=gen, device=device)
    span = min(ballast_elems, 1 << 18)  # 1 MiB of ballast rewritten per step: live state, mostly unchanged
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
    else:
        held = ballast_elems * 4 + param_bytes
    print(f"allocated {held / (1 << 30):.2f} GiB on {device} ({param_bytes / (1 << 20):.0f} MiB parameters)", flush=True)

    for step in range(1, a.steps + 1):
        gen.manual_seed(a.seed * 1_000_003 + step)  # each step's batch depends on the step only
        x = torch.randn(a.batch, a.hidden, generator=gen, device=device)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        lo = (step * span) % (ballast_elems - span + 1)
        with torch.no_grad():
            ballast[lo:lo + span].mul_(0.5).add_(loss.detach())
        print(f"step {step}/{a.steps} loss={loss.item()!r}", flush=True)
        if a.step_seconds and (a.pace_file is None or os.path.exists(a.pace_file)):
            time.sleep(a.step_seconds)
        while a.pace_file and step == a.steps - 1 and os.path.exists(a.pace_file):
            time.sleep(a.step_seconds or 0.1)  # its checkpoints are still to come: held, not ended

    h = hashlib.sha256()
    with torch.no_grad():
        for t in [*(p.detach() for p in model.parameters()),
                  *(ballast[i:i + _CHUNK] for i in range(0, ballast_elems, _CHUNK))]:
            h.update(_host_bytes(t))
    print(f"digest {h.hexdigest()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
