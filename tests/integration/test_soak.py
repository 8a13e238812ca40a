"""A slice of the soak (scripts/soak.py) inside the suite, among the other end-to-end tests: two rounds, two
Python shapes once each (a 64 MB numpy process, 1 GB in `make soak`; a process writing files it holds open),
checkpointed, killed at a random point and restored lazily on another node, one round on each store and each
lazy-pages daemon (ours, and CRIU's fed by page files: soak.plan turns the pairs under the shapes), each
compared with an uninterrupted run. The other shapes and full restores have their own tests; `make soak` runs
the long ones, with the shapes in other languages that churn their mappings too. The seed is random and
printed: a failing round is replayed with ``--seed``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration


def test_a_slice_of_the_soak_ends_every_round_as_an_uninterrupted_run(tmp_path):
    # Two shapes: the script itself is what this slice keeps working (every shape has its own test elsewhere:
    # test_workload_shapes, the torch ones in test_airflow_torch); torch and pool rounds took 80 of its 160 s.
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--rounds", "2", "--big-mb", "64",
                        "--s3-mb", "64", "--shapes", "numpy,files", "--keep", str(tmp_path)],
                       capture_output=True, text=True, timeout=1500)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert "soak: 2 passed, 0 failed" in r.stdout
