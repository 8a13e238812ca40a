"""The task state record both operators keep: where each try ran, and bookkeeping that never fails a task."""

from __future__ import annotations

import logging

from cedana_airflow.airflow.task_state import STATE_KEY, TaskState


class _Store(dict):
    """Stands in for context["task_state_store"] (the real one talks to the API server of a running task)."""

    def set(self, key, value):
        self[key] = value


def test_tries_and_nodes_survive_into_the_next_try():
    store = _Store()
    TaskState(store, logging.getLogger("t")).add_try(1, "gpu-7", checkpoint_id="cid")
    TaskState(store, logging.getLogger("t")).add_try(2, "gpu-9")
    third = TaskState(store, logging.getLogger("t"))  # what try 3 reads
    assert third.previous_try(3)["node"] == "gpu-9" and third.previous_try(2)["node"] == "gpu-7"
    assert third.earlier_nodes(3) == ("gpu-7", "gpu-9") and third.earlier_nodes(2) == ("gpu-7",)
    assert store[STATE_KEY]["checkpoint_id"] == "cid" and TaskState(_Store(), logging.getLogger("t")).previous_try(1) is None


def test_a_broken_state_store_is_logged_and_never_fails_the_task(caplog):
    class Broken:
        def get(self, key):
            raise ConnectionError("API server gone")

        def set(self, key, value):
            raise ConnectionError("API server gone")

    with caplog.at_level(logging.WARNING):
        state = TaskState(Broken(), logging.getLogger("t"))
        state.add_try(1, "gpu-7")
    assert state.earlier_nodes(2) == ("gpu-7",)  # kept in memory for this try
    assert "could not read the task state store" in caplog.text and "could not write the task state store" in caplog.text
