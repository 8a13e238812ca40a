"""A slice of the soak (scripts/soak.py) inside the suite, among the other end-to-end tests: four
rounds, the four Python shapes once each (a 64 MB numpy process on either store, 1 GB in `make soak`; a PyTorch DataLoader
job, a multiprocessing.Pool with shared memory, a process writing files it holds open), checkpointed, killed
at a random point and restored on another node, each lazy/full x file/S3 pair once (soak.plan turns
the pairs under the shapes; the two lazy rounds take our lazy-pages daemon and CRIU's fed by page files),
each compared with an uninterrupted run; `make soak` runs the long ones, with the shapes in other languages
that churn their mappings too. The seed is random and printed: a failing round is replayed with ``--seed``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration


def test_a_slice_of_the_soak_ends_every_round_as_an_uninterrupted_run(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--rounds", "4", "--big-mb", "64",
                        "--s3-mb", "64", "--shapes", "numpy,torch,pool,files", "--keep", str(tmp_path)],
                       capture_output=True, text=True, timeout=1500)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert "soak: 4 passed, 0 failed" in r.stdout
