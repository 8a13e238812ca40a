"""The fault matrix's slice in the suite: every step of a heartbeat and of a restore, and every kind of
fault, at least once (fault_matrix.SLICE). `make faults` runs the whole matrix and writes docs/faults.md.

Each case asserts what a user relies on: the last try's output equals an uninterrupted run's, the store
checks clean with every chunk read (no "latest" that points at a partial checkpoint), no process or mount
of the case is left, the next try was not held up by a lease, and a fault that disturbed the run was said
in a line."""

from __future__ import annotations

import pytest

import fault_matrix as fm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")  # per worker: its cases run on every worker, among other modules' tests
def bench(tmp_path_factory):
    with fm.bench_in(tmp_path_factory.mktemp("faults")) as b:
        yield b


def test_the_slice_covers_every_step_and_every_fault():
    assert {s for s, _ in fm.SLICE} == set(fm.STEPS) and {f for _, f in fm.SLICE} == set(fm.FAULTS)
    assert all(fm.applies(s, f) is None for s, f in fm.SLICE)


@pytest.mark.parametrize("step, fault", fm.SLICE, ids=[f"{s}-{f}" for s, f in fm.SLICE])
def test_fault(bench, step, fault):
    o = fm.run_case(bench, step, fault)
    assert not o.error, o.error
    assert o.output_equal, o
    assert o.store_clean, o
    assert not o.strays, o.strays
    assert not o.next_try_held, o  # no writer lease left behind held it up
    if o.tries != [0]:  # the fault disturbed the run: somebody said so
        assert o.line, o
    if fault.startswith("s3-"):
        assert o.faults_injected > 0, o  # the proxy did answer with the fault
