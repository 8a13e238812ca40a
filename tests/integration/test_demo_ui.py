"""The demo as a newcomer sees it: its DAG run by Airflow's own components (api-server, scheduler,
dag-processor; LocalExecutor), so both tries have task logs; try 2's log, read through the REST API
and in Airflow's UI (Debian's Chromium driven by Playwright), shows the restore."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ARTIFACTS, REPO, browser_page

sys.path.insert(0, str(REPO / "scripts"))

from airflow_stack import AirflowStack, StackError  # noqa: E402
from demo import DAG_ID, TASK_ID, Demo, lose_the_node, summarize, uninterrupted  # noqa: E402

from cedana_airflow.ids import derive_checkpoint_id  # noqa: E402

pytestmark = pytest.mark.integration

#: Smaller than the demo's own (300 MB, 90 steps of 0.5 s); the DAG's 5 s heartbeat is kept.
ARGS = ("--mb", "60", "--steps", "60", "--step-seconds", "0.25", "--change-fraction", "0.01")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, airflow_db):
    root = tmp_path_factory.mktemp("demo")
    demo = Demo(home=root / "airflow", root=root / "demo", train_args=ARGS)
    demo.prepare(airflow_db)
    with AirflowStack(demo.env(), demo.home, DAG_ID) as stack:
        out = lose_the_node(stack, demo, checkpoints=2, echo=lambda line: None)
        yield stack, out


def test_try_2s_log_through_the_rest_api_names_the_checkpoint_it_restored(demo_run):
    stack, out = demo_run
    expect = uninterrupted(ARGS)
    text, ok = summarize(out, expect, steps=60)
    print(text)
    assert out["state"] == "success" and out["tries"] == 2, text
    cid = derive_checkpoint_id(DAG_ID, TASK_ID, out["run_id"])
    restore = out["restore"]  # the XCom cedana_restore, as the UI's XCom tab shows it
    assert restore["checkpoint_id"] == cid and restore["from_try"] == 1
    log2 = out["logs"][2]
    assert re.search(rf"cedana: restored checkpoint_id={re.escape(cid)} seq={restore['seq']} \(taken by try 1 on node ",
                     log2), log2[-3000:]
    assert "start-up: allocating" in out["logs"][1] and "start-up: allocating" not in log2  # try 2 did not start over
    assert re.findall(r"done digest=\w+", log2) == [expect] and ok
    saved = re.search(r"steps saved: +(\d+) of 60 not redone", text)
    assert saved and int(saved.group(1)) >= 5, text  # two 5 s heartbeats of 0.25 s steps before the kill


def test_in_airflows_ui_try_2s_logs_tab_shows_the_restore_line(demo_run):
    from playwright.sync_api import expect

    stack, out = demo_run
    with browser_page() as page:
        page.goto(stack.ti_url(DAG_ID, out["run_id"], TASK_ID))  # the task instance page, no login (a local demo)
        expect(page.get_by_role("button", name=re.compile(r"^1"))).to_be_visible(timeout=60_000)
        page.get_by_role("button", name=re.compile(r"^2")).first.click()  # Task Tries: 2
        page.get_by_placeholder("Search logs...").fill("restored")
        line = page.get_by_text(re.compile(r"cedana: restored checkpoint_id=\S+ seq=\d+ \(taken by try 1"))
        expect(line.first).to_be_visible(timeout=60_000)
        page.screenshot(path=ARTIFACTS / "demo-try-2-log.png")


def test_a_part_that_does_not_come_up_is_one_line_naming_it(tmp_path, airflow_db):
    demo = Demo(home=tmp_path / "airflow", root=tmp_path / "demo", train_args=ARGS)
    demo.prepare(airflow_db)
    env = {**demo.env(), "AIRFLOW__CORE__EXECUTOR": "no_such_module.NoSuchExecutor"}
    stack = AirflowStack(env, demo.home, DAG_ID, start_timeout=120)
    stack.env["AIRFLOW__CORE__EXECUTOR"] = "no_such_module.NoSuchExecutor"  # over the stack's LocalExecutor
    with pytest.raises(StackError) as e:
        with stack:
            pass
    line = str(e.value)
    assert "\n" not in line and re.match(r"airflow (scheduler|api-server) exited \d+ while starting: .*\(log: \S+\.log\)$",
                                         line), line
    assert stack.procs == {}  # every part stopped
