"""A failed heartbeat is one line that says the cause, the fix where there is a usual one, and whether
the workload is still running (the fault matrix found both wrong: a full disk logged a traceback, and a
dump that failed because the workload had just ended said it kept running)."""

from __future__ import annotations

import errno
import logging
import threading

from cedana_airflow.run.checkpoint_triggers import Heartbeat, os_error_line


def _beat_once(beat, alive, caplog) -> list[logging.LogRecord]:
    done = threading.Event()

    def once():
        if done.is_set():  # a second beat before stop() reached it (a busy machine): not this test's
            return
        try:
            beat()
        finally:
            done.set()

    hb = Heartbeat(0.01, once, alive=alive)
    with caplog.at_level(logging.WARNING, logger="cedana_airflow"):
        hb.start()
        done.wait(5)
        hb.stop()
    return [r for r in caplog.records if "heartbeat failed" in r.getMessage()]


def test_a_full_work_dir_is_one_line_with_the_fix_not_a_traceback(caplog):
    def beat():
        raise OSError(errno.ENOSPC, "No space left on device", "/var/tmp/cedana/dump-1/images/pages-1.img")

    [rec] = _beat_once(beat, lambda: True, caplog)
    assert rec.getMessage() == ("heartbeat failed; the workload keeps running: No space left on device "
                                "(/var/tmp/cedana/dump-1/images/pages-1.img); free space there or point "
                                "CEDANA_WORK_DIR at a larger disk")
    assert rec.exc_info is None


def test_a_heartbeat_that_fails_because_the_workload_ended_says_so(caplog):
    from cedana_airflow.errors import DumpFailed

    def beat():
        raise DumpFailed("criu dump of pid 7 failed (exit 1): Unable to detach from 7: No such process")

    [rec] = _beat_once(beat, lambda: False, caplog)
    assert rec.getMessage().startswith("heartbeat failed as the workload ended (the previous checkpoint stays")
    assert "keeps running" not in rec.getMessage()


def test_os_errors_without_a_usual_fix_still_name_the_cause_and_the_file():
    assert os_error_line(OSError(errno.EIO, "Input/output error", "/w/x")) == "Input/output error (/w/x)"


def test_the_same_failure_again_is_counted_not_said_and_each_kind_is_said_once(caplog):
    from cedana_airflow.run.checkpoint_triggers import Failures

    recorded: list[str] = []
    f = Failures(record=recorded.append)
    with caplog.at_level(logging.DEBUG, logger="cedana_airflow"):
        for pid in range(100, 112):  # a serving worker: every heartbeat fails on its socket
            f.failed("heartbeat", f"criu dump of pid {pid} failed (exit 1): Can't get 1:16 opt")
        f.failed("heartbeat", "No space left on device (/var/tmp/cedana/dump-3)")
        f.succeeded()
        f.succeeded()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [
        "heartbeat failed; the workload keeps running: criu dump of pid 100 failed (exit 1): Can't get 1:16 opt",
        "heartbeat failed the same way 10 times now (said in full the first time); the workload keeps running: "
        "criu dump of pid 109 failed (exit 1): Can't get 1:16 opt",
        "heartbeat failed; the workload keeps running: No space left on device (/var/tmp/cedana/dump-3)",
        "checkpoint taken after 13 failed heartbeat(s); last failure: No space left on device (/var/tmp/cedana/dump-3)",
    ]
    assert f.total == 13 and len(recorded) == 13
    assert f.as_json() == [{"cause": "criu dump of pid 111 failed (exit 1): Can't get 1:16 opt", "count": 12},
                           {"cause": "No space left on device (/var/tmp/cedana/dump-3)", "count": 1}]


def test_a_store_that_cannot_record_the_count_costs_nothing(caplog):
    from cedana_airflow.run.checkpoint_triggers import Failures

    def unreachable(why: str) -> None:
        raise ConnectionError("the store is down")

    f = Failures(record=unreachable)
    with caplog.at_level(logging.WARNING, logger="cedana_airflow"):
        f.failed("heartbeat", "the store is unreachable")
        f.failed("heartbeat", "the store is unreachable")
    assert [r.getMessage() for r in caplog.records] == ["heartbeat failed; the workload keeps running: the store is unreachable"]
    assert f.total == 2
