"""A stop requested from a signal handler, even from a second handler running inside the first's."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from cedana_airflow.signal_safe import SignalSafeEvent

# The first SIGTERM's handler requests the stop; a second SIGTERM (sudo's relay of the one its command's
# process group got) is raised at each of the first handler's bytecodes in turn, its handler requesting the
# stop again inside the first's. Whatever the stop's code takes (any lock, anywhere under it), one of those
# places is inside it: a stop that can hang there hangs this script.
_EVERY_BYTECODE = textwrap.dedent("""
    import os, signal, sys, threading
    from cedana_airflow.signal_safe import SignalSafeEvent

    if sys.argv[1] == "operator":
        from cedana_airflow.operators import CheckpointedCommandOperator
        op = CheckpointedCommandOperator(task_id="t", command=["true"])
        def fresh():
            op._stop = type(op._stop)()
            return op.on_kill, op._stop
    else:
        kind = SignalSafeEvent if sys.argv[1] == "signal_safe" else threading.Event
        def fresh():
            ev = kind()
            return ev.set, ev

    at = {"n": 0, "count": 0}
    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            at["count"] += 1
            if at["count"] == at["n"]:
                os.kill(os.getpid(), signal.SIGUSR2)  # the second SIGTERM, now
        return tracer

    def first(n):
        request, ev = fresh()
        signal.signal(signal.SIGUSR2, lambda signum, frame: request())  # the second handler: the same request
        at.update(n=n, count=0)
        sys.settrace(tracer)
        request()
        sys.settrace(None)
        assert ev.is_set()
        return at["count"]

    places = first(0)
    for n in range(1, places + 1):
        first(n)
    print(f"stop requested with a second handler inside the first at each of {places} places", flush=True)
""")


@pytest.mark.parametrize("kind", ["signal_safe", "operator"])
def test_a_second_handler_inside_the_first_at_any_bytecode_requests_the_stop_and_returns(kind):
    out = subprocess.run([sys.executable, "-c", _EVERY_BYTECODE, kind], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("stop requested with a second handler"), out.stderr


def test_threadings_own_event_hangs_there_which_is_why_the_stop_is_not_one():
    # The cause, shown: without it this module would not be needed (and the test above could not fail).
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", _EVERY_BYTECODE, "plain"], capture_output=True, text=True, timeout=5)


def test_wait_times_out_unset_and_returns_once_another_thread_sets_it():
    ev = SignalSafeEvent()
    assert ev.wait(0.1) is False and not ev.is_set()
    threading.Timer(0.2, ev.set).start()
    assert ev.wait(30) is True and ev.is_set()
    ev.clear()
    assert not ev.is_set() and ev.wait(0) is False
