"""The canary drill's workload: deterministic, memory-holding, and cheap to compare.

It fills ``--mb`` MiB from a seed, then each step rewrites one slice of that memory from a hash chain
and prints ``step i/N``; at the end it prints ``digest <hex>`` of all of it. Stopped and restored
anywhere along the way, it must print the digest an uninterrupted run prints. Standard library only:
it runs with the package's Python and nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cedana_airflow.drill.canary_workload")
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-seconds", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    size = a.mb << 20
    block = hashlib.sha512(str(a.seed).encode()).digest()
    memory = bytearray(block * (size // len(block)) + block[: size % len(block)])
    state = hashlib.blake2b(str(a.seed).encode()).digest()
    slice_len = max(1, size // max(a.steps, 1))
    for i in range(a.steps):
        state = hashlib.blake2b(state + i.to_bytes(8, "little")).digest()
        off = (i * slice_len) % max(size - 64, 1)
        memory[off : off + 64] = state
        print(f"step {i + 1}/{a.steps}", flush=True)
        time.sleep(a.step_seconds)
    print(f"digest {hashlib.blake2b(memory).hexdigest()[:32]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
