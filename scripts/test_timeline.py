"""Where a test run's time went, worker by worker: `python scripts/test_timeline.py [.artifacts/timeline.json]`.

A parallel run ends when its last worker ends; this says when each worker ran out of work, what it ran
last, and which long tests overlapped, so that the tail of a run can be seen and shortened
(docs/testing.md). The timeline is written by tests/conftest.py at the end of every full run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent.parent / ".artifacts" / "timeline.json"
WIDTH = 100


def main(path: Path = DEFAULT, long: float = 30.0) -> None:
    rows = [r[:5] for r in json.loads(path.read_text())]  # [nodeid, worker, started, ended, cpu, left]
    end = max(r[3] for r in rows)
    by_worker: dict[str, list[list]] = defaultdict(list)
    for r in rows:
        by_worker[r[1]].append(r)
    print(f"{len(rows)} tests, {end:.0f} s from the run's start to its last test's end; one column = {end / WIDTH:.1f} s")
    for worker, tests in sorted(by_worker.items()):
        line = [" "] * WIDTH
        for _, _, a, b, _ in tests:
            for col in range(int(a / end * (WIDTH - 1)), int(b / end * (WIDTH - 1)) + 1):
                line[col] = "=" if b - a >= long else "-"
        busy = sum(b - a for _, _, a, b, _ in tests)
        last = max(tests, key=lambda r: r[3])
        print(f"{worker:>5} |{''.join(line)}| busy {busy:.0f} s, done at {last[3]:.0f} s ({last[0].split('::')[-1][:50]})")
    print(f"'=': a test of {long:.0f} s or more; those, by start:")
    for nodeid, worker, a, b, cpu in sorted((r for r in rows if r[3] - r[2] >= long), key=lambda r: r[2]):
        print(f"  {a:6.0f}-{b:<6.0f} {worker:>5} {b - a:5.0f} s {cpu:6.1f} cpu-s  {nodeid}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
