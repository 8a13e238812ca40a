"""What every workload shape shares: its arguments, its step lines and its closing digest.

A shape prints ``start-up ...`` once, ``step i/N`` after each step, and ``done digest=...`` at the
end; the digest depends only on the arguments, so a restored run must print the one an
uninterrupted run prints.
"""

from __future__ import annotations

import argparse
import os
import time


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-seconds", type=float, default=0.1)
    return ap


def start(what: str) -> None:
    print(f"start-up: {what} (pid {os.getpid()})", flush=True)


def step(i: int, n: int, seconds: float) -> None:
    print(f"step {i}/{n}", flush=True)
    time.sleep(seconds)


def done(digest: str) -> None:
    print(f"done digest={digest}", flush=True)
