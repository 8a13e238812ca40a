"""A stop requested from a signal handler, even from a second handler running inside the first's."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from cedana_airflow.signal_safe import SignalSafeEvent

# The first SIGTERM's handler is inside the event's set() (modelled: it holds the event's lock) when a
# second's runs in the same thread, as when sudo relays the SIGTERM its command's group already got.
_NESTED = textwrap.dedent("""
    import os, signal, sys, threading
    from cedana_airflow.signal_safe import SignalSafeEvent
    ev = SignalSafeEvent() if sys.argv[1] == "safe" else threading.Event()

    def first(signum, frame):
        with ev._cond:
            os.kill(os.getpid(), signal.SIGUSR2)  # delivered now: its handler runs before the next bytecode
            pass

    signal.signal(signal.SIGUSR1, first)
    signal.signal(signal.SIGUSR2, lambda signum, frame: ev.set())
    os.kill(os.getpid(), signal.SIGUSR1)
    print("stop requested" if ev.is_set() else "not requested", flush=True)
""")


def test_a_second_handler_inside_the_first_sets_the_stop_and_returns():
    out = subprocess.run([sys.executable, "-c", _NESTED, "safe"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "stop requested\n", out.stderr


def test_threadings_own_event_hangs_there_which_is_why_the_stop_is_not_one():
    # The cause, shown: without it this module would not be needed (and the test above could not fail).
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", _NESTED, "plain"], capture_output=True, text=True, timeout=3)


def test_wait_times_out_unset_and_returns_once_another_thread_sets_it():
    ev = SignalSafeEvent()
    assert ev.wait(0.1) is False and not ev.is_set()
    threading.Timer(0.2, ev.set).start()
    assert ev.wait(30) is True and ev.is_set()
    ev.clear()
    assert not ev.is_set() and ev.wait(0) is False
