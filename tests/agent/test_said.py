"""The agent's lines about a run, kept for its caller (agent/said.py): only its own ID's, at INFO and above,
numbered, printable, and bounded."""

from __future__ import annotations

import json
import logging

from cedana_airflow.agent.said import KEPT, REPLY_BYTES, Said


def test_a_run_keeps_the_lines_that_name_its_id_and_no_other_id_s():
    log = logging.getLogger("cedana_airflow.run.runner")
    log.setLevel(logging.DEBUG)
    with Said("job.a") as said, Said("job.a.b") as other:
        log.info("checkpoint saved checkpoint_id=job.a seq=1 chunks=3")
        log.info("checkpoint saved checkpoint_id=job.a.b seq=1")  # another ID that starts with it
        log.info("checkpoint saved checkpoint_id=job.ab seq=1")
        log.debug("freeze checkpoint_id=job.a seq=2")  # below INFO: the agent's debug is not the caller's
        log.warning("heartbeat skipped checkpoint_id=job.a: too large\x1b[31m; the workload keeps running")
        log.info("restored checkpoint_id=job.a")  # at the end of the line
        log.info("checkpoint saved checkpoint_id=job.a+00_00 seq=1")  # an Airflow ID goes on past a "+"
        # a line that quotes a caller's text naming another ID: neither run's
        log.warning("checkpoint refused checkpoint_id=job.a.b seq=2: cannot open /tmp/checkpoint_id=job.a x")
        logging.getLogger("cedana_airflow.agent.server").warning("agent refused start: checkpoint_id=job.a")
    log.info("checkpoint saved checkpoint_id=job.a seq=3")  # detached: not kept
    lines, more = said.since(0)
    assert [n for n, _ in lines] == [1, 2, 3] and not more
    assert lines[0][1] == "checkpoint saved checkpoint_id=job.a seq=1 chunks=3"
    assert "\x1b" not in lines[1][1] and lines[1][1].startswith("heartbeat skipped checkpoint_id=job.a: too large")
    assert said.since(2) == ([lines[2]], False)
    assert other.since(0) == ([[1, "checkpoint saved checkpoint_id=job.a.b seq=1"]], False)


def test_a_line_that_leaves_its_id_to_the_record_is_its_run_s_alone():
    """A heartbeat's line names no ID (said once, where the run starts: 0.11.0); the record carries it."""
    log = logging.getLogger("cedana_airflow.run.checkpointer")
    log.setLevel(logging.INFO)
    with Said("job.a") as said, Said("job.b") as other:
        log.info("checkpoint seq=1: froze 0.010 s", extra={"checkpoint_id": "job.a"})
        log.info("checkpoint seq=1: froze 0.020 s", extra={"checkpoint_id": "job.b"})
        log.info("quoting checkpoint_id=job.b", extra={"checkpoint_id": "job.a"})  # names another run: neither's
        log.info("checkpoint seq=2: froze 0.030 s")  # no ID at all: nobody's
    assert said.since(0) == ([[1, "checkpoint seq=1: froze 0.010 s"]], False)
    assert other.since(0) == ([[1, "checkpoint seq=1: froze 0.020 s"]], False)


def test_a_caller_that_never_asks_loses_only_the_oldest_lines_and_long_ones_come_a_reply_at_a_time():
    log = logging.getLogger("cedana_airflow.run.checkpointer")
    with Said("many") as said:
        for i in range(KEPT + 5):
            log.warning("heartbeat %d checkpoint_id=many", i)
    lines, more = said.since(0)
    assert len(lines) == KEPT and not more
    assert lines[0][0] == 6 and lines[-1] == [KEPT + 5, f"heartbeat {KEPT + 4} checkpoint_id=many"]
    with Said("long") as said:  # lines cut at 2,000 characters: 200 of them would not fit one reply
        for i in range(KEPT):  # nor would fewer of them, each character a 12-byte JSON escape
            log.warning("checkpoint_id=long %s", ("x" if i % 2 else "\U0001f600") * 5000)
    got, last = [], 0
    while True:
        lines, more = said.since(last)
        assert len(json.dumps(lines)) <= 2 * REPLY_BYTES < 64 << 10  # within the protocol's message
        got += lines
        last = lines[-1][0]
        if not more:
            break
    # the newest that fit the run's budget (KEPT_BYTES), in order, over more than one reply
    assert len(got) > 1 and [n for n, _ in got] == list(range(KEPT - len(got) + 1, KEPT + 1))
    assert all(len(str(x)) <= 2000 for _, x in got) and len(json.dumps(got)) > REPLY_BYTES


def test_heartbeat_autos_history_goes_only_to_an_agent_that_takes_it():
    """A 0.8.3 caller sends its queue's failure history with its start; to an older agent (no "said" in its
    hello's features), which refuses settings it does not know, the history is left out and the rest sent."""
    from cedana_airflow.agent.route import task_request
    from cedana_airflow.config import load_settings

    history = '{"failures": 1, "exposure_seconds": 18000, "tries": 3, "scope": "queue gpu"}'
    settings = load_settings({"heartbeat_seconds": "auto", "heartbeat_min_seconds": 1, "heartbeat_max_seconds": 6},
                             {"CEDANA_FAILURE_HISTORY": history})
    new = task_request(settings, ["start", "heartbeat", "stop", "restore", "said"])
    old = task_request(settings, ["start", "heartbeat", "stop", "restore"])
    assert new["failure_history"]["failures"] == 1 and new["heartbeat_seconds"] == "auto"
    assert "failure_history" not in old and old == {k: v for k, v in new.items() if k != "failure_history"}


def test_a_failure_history_is_bounded_and_one_printable_line():
    """Through the agent the history is a caller's word, said in root's log: no forged line, no giant one."""
    import pytest

    from cedana_airflow.config import FailureHistory

    h = FailureHistory.model_validate({"scope": "queue gpu\ncedana agent: forged", "note": "\x1b[2Jx"})
    assert h.scope == "queue gpu?cedana agent: forged" and h.note == "?[2Jx"
    for bad in ({"scope": "x" * 301}, {"failures": 10**400}, {"window_days": float("inf")}, {"tries": -1}):
        with pytest.raises(ValueError):
            FailureHistory.model_validate(bad)


def test_a_run_keeps_at_most_its_byte_budget_of_lines_the_newest():
    from cedana_airflow.agent.said import KEPT_BYTES

    log = logging.getLogger("cedana_airflow.run.checkpointer")
    with Said("big") as said:
        for i in range(KEPT):  # each line 2,000 characters outside ASCII: 12 bytes each as JSON
            log.warning("checkpoint_id=big %d %s", i, "\U0001f600" * 3000)
    kept, last = [], 0
    while True:
        lines, more = said.since(last)
        kept += lines
        last = lines[-1][0]
        if not more:
            break
    assert sum(len(json.dumps(x)) + 16 for _, x in kept) <= KEPT_BYTES
    assert kept[-1][0] == KEPT and [n for n, _ in kept] == list(range(KEPT - len(kept) + 1, KEPT + 1))


def test_the_agent_keeps_at_most_its_per_uid_number_of_ended_runs_the_newest():
    """A uid that starts and ends many runs cannot fill root's memory with them (each keeps its lines)."""
    import threading
    import time
    from types import SimpleNamespace

    from cedana_airflow.agent.server import KEEP_ENDED_PER_UID, Agent

    agent = Agent.__new__(Agent)
    agent._lock = threading.Lock()
    now = time.time()
    runs = [SimpleNamespace(wid=f"w-{uid}-{i}", uid=uid, ended_at=now - i) for uid in (1000, 1001)
            for i in range(KEEP_ENDED_PER_UID + 10)]
    running = SimpleNamespace(wid="w-running", uid=1000, ended_at=None)
    old = SimpleNamespace(wid="w-old", uid=1002, ended_at=now - 3600)
    agent._runs = {r.wid: r for r in [*runs, running, old]}
    agent._forget_ended()
    left = set(agent._runs)
    assert "w-running" in left and "w-old" not in left
    for uid in (1000, 1001):
        assert {w for w in left if w.startswith(f"w-{uid}-")} == {f"w-{uid}-{i}" for i in range(KEEP_ENDED_PER_UID)}
