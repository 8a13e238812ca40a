"""Which running tasks a live drill may fail (drill/live.py: choose), its limits from the opt-in list's
[drills] section, and its time windows (scope/windows.py). A real file store holds the checkpoints the
choice reads; the running tasks are what Airflow's API lists (the test under a real scheduler is
tests/integration/test_live_drill.py)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.drill.facts import StoreFacts
from cedana_airflow.drill.fleet import RunningTask
from cedana_airflow.drill.live import choose
from cedana_airflow.errors import ConfigError
from cedana_airflow.format.manifest import AirflowTask, ProcessInfo
from cedana_airflow.scope.optin import Drills, load_optin
from cedana_airflow.scope.windows import in_any_window, parse_window
from cedana_airflow.store import index, open_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint

PROC = ProcessInfo(pid=42, command=("python", "train.py"), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


def _task(dag: str, task: str, *, try_number: int = 1, retries: int = 1, pool: str = "default_pool") -> RunningTask:
    return RunningTask(dag_id=dag, task_id=task, run_id="r1", try_number=try_number, max_tries=retries, pool=pool)


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)

    def checkpoint(dag: str, task: str) -> None:
        d = tmp_path / f"img-{dag}-{task}"
        d.mkdir()
        (d / "pages-1.img").write_bytes(os.urandom(10_000))
        m = save_checkpoint(s, cfg, CheckpointMeta(f"{dag}.{task}", "gpu-1", "4.1.1", PROC, try_number=1,
                                                   airflow=AirflowTask(dag_id=dag, task_id=task, run_id="r1")), d)
        index.record_checkpoint(s, m)

    s.checkpoint = checkpoint  # type: ignore[attr-defined]
    return s


def _verdicts(store, tasks, limits: Drills, at: datetime | None = None) -> dict[str, tuple[bool, str]]:
    at = at or datetime.now(timezone.utc)
    return {f"{t.dag_id}.{t.task_id}": (v.chosen, v.reason) for t, v in choose(tasks, StoreFacts(store, None), limits, at, seed=1)}


def test_only_checkpointed_tasks_with_a_retry_left_and_a_fresh_checkpoint_are_chosen(store):
    for dag, task in [("a", "train"), ("a", "no_retries"), ("a", "last_try")]:
        store.checkpoint(dag, task)
    tasks = [_task("a", "train"), _task("a", "no_retries", retries=0), _task("a", "last_try", try_number=2),
             _task("a", "plain")]
    v = _verdicts(store, tasks, Drills(live=True, max_per_dag=5))
    assert v["a.train"][0] and v["a.train"][1].startswith("eligible: try 1 of 2")
    assert v["a.no_retries"] == (False, "no retries (retries=0): a live drill never fails a task that cannot retry")
    assert v["a.last_try"] == (False, "no retry left: this is try 2 of 2")
    assert v["a.plain"] == (False, "not checkpointed: no checkpoint in the store names this task instance")

    later = datetime.now(timezone.utc) + timedelta(hours=1)  # the same checkpoint, an hour older
    v = _verdicts(store, tasks, Drills(live=True, max_checkpoint_age_seconds=600), at=later)
    assert not v["a.train"][0] and "above max_checkpoint_age_seconds 600: too much work would be lost" in v["a.train"][1]


def test_a_task_is_failed_only_on_a_checkpoint_this_nodes_key_vouches_for(store):
    """The listing is the store's word: one unsigned manifest naming a running task made 0.7.0's drill fail
    that task's try, and its retry started fresh (issue 48)."""
    from conftest import node_key_bytes

    from cedana_airflow.format.trust import Trust

    store.checkpoint("a", "train")  # written by a store writer without the key: unsigned
    v = {f"{t.dag_id}.{t.task_id}": (c.chosen, c.reason) for t, c in choose(
        [_task("a", "train")], StoreFacts(store, Trust(node_key_bytes())), Drills(live=True), datetime.now(timezone.utc),
        seed=1)}
    assert v["a.train"] == (False, "its latest checkpoint (seq 1) is not one this node would restore: it is not "
                                   "signed, and this node refuses unsigned manifests (allow_unsigned = false)")


def test_blast_radius_limits_per_run_per_dag_and_per_pool(store):
    for dag, task in [("a", "t1"), ("a", "t2"), ("b", "t1"), ("c", "t1")]:
        store.checkpoint(dag, task)
    tasks = [_task("a", "t1"), _task("a", "t2"), _task("b", "t1", pool="gpu"), _task("c", "t1", pool="gpu")]

    v = _verdicts(store, tasks, Drills(live=True, max_per_run=10, max_per_dag=1, max_per_pool=10))
    assert [v["a.t1"][0], v["a.t2"][0]].count(True) == 1 and v["b.t1"][0] and v["c.t1"][0]
    assert "eligible, but limit reached: max_per_dag = 1" in {v["a.t1"][1], v["a.t2"][1]}

    v = _verdicts(store, tasks, Drills(live=True, max_per_run=10, max_per_dag=10, max_per_pool=1))
    assert [v["b.t1"][0], v["c.t1"][0]].count(True) == 1  # one per pool: gpu
    assert [v["a.t1"][0], v["a.t2"][0]].count(True) == 1  # and one in default_pool

    v = _verdicts(store, tasks, Drills(live=True))  # the defaults: one task per drill
    assert sum(chosen for chosen, _ in v.values()) == 1
    assert sum("max_per_run = 1" in why for _, why in v.values()) == 3


def test_windows_say_when_a_live_drill_may_act():
    sat_3am = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)  # a Saturday
    assert parse_window("Sat 02:00-06:00").contains(sat_3am)
    assert not parse_window("Sat 02:00-06:00").contains(sat_3am.replace(hour=6))  # the end is excluded
    assert not parse_window("Mon-Fri 02:00-06:00").contains(sat_3am)
    assert parse_window("Fri 22:00-04:00").contains(sat_3am)  # past midnight: Friday's window
    assert not parse_window("Sat 22:00-04:00").contains(sat_3am)
    assert parse_window("Sat,Sun 00:00-24:00").contains(sat_3am) and parse_window("02:30-03:30").contains(sat_3am)
    assert in_any_window((), sat_3am)  # no windows: any time
    assert not in_any_window((parse_window("Sun 02:00-06:00"), parse_window("Sat 04:00-05:00")), sat_3am)


@pytest.mark.parametrize("bad, says", [("Sat 2am-6am", "is not 'HH:MM-HH:MM'"), ("Caturday 02:00-06:00", "is not a day"),
                                       ("25:00-26:00", "out of range"), ("Sat 02:00-02:00", "is empty")])
def test_a_bad_window_in_the_opt_in_list_is_one_line_naming_it(tmp_path, bad, says):
    p = tmp_path / "optin.toml"
    p.write_text(f'[drills]\nlive = true\nwindows = ["{bad}"]\n')
    with pytest.raises(ConfigError, match=rf"opt-in file .*drills\.windows: .*{says}.*Fix the file"):
        load_optin(p)


def test_live_drills_are_off_unless_the_list_says_so(tmp_path):
    p = tmp_path / "optin.toml"
    p.write_text('[node]\nhostnames = ["*"]\n')
    assert load_optin(p).drills.live is False
    p.write_text('[drills]\nlive = true\nmax_per_dag = 2\n')
    assert (load_optin(p).drills.live, load_optin(p).drills.max_per_dag, load_optin(p).drills.max_per_run) == (True, 2, 1)
