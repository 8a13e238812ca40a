"""The demo as a newcomer sees it: its DAG run by Airflow's own components (api-server, scheduler,
dag-processor, triggerer; LocalExecutor), started from the repo's root as `make demo` starts them, so
both tries have task logs; try 2's log, read through the REST API and in Airflow's UI (Debian's
Chromium driven by Playwright), shows the restore; Airflow's header has no plugin import error and
no red component, and the DAG run has ended when the demo stops the stack."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ARTIFACTS, REPO, browser_page

sys.path.insert(0, str(REPO / "scripts"))

from airflow_stack import AirflowStack, StackError  # noqa: E402
from demo import DAG_ID, TASK_ID, Demo, lose_the_node, summarize, uninterrupted  # noqa: E402

from cedana_airflow.ids import derive_checkpoint_id  # noqa: E402
from cedana_airflow.units import binary_size  # noqa: E402

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("demo")]

#: Smaller than the demo's own (300 MB, 90 steps of 0.5 s); the DAG's 5 s heartbeat is kept. 25 s of steps: the
#: node is lost after two heartbeats and 1.5 s more, which a busy machine must not find past the workload's end.
STEPS = 100
ARGS = ("--mb", "60", "--steps", str(STEPS), "--step-seconds", "0.25", "--change-fraction", "0.01")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, airflow_db):
    root = tmp_path_factory.mktemp("demo")
    demo = Demo(home=root / "airflow", root=root / "demo", train_args=ARGS)
    demo.prepare(airflow_db)
    # from the repo's root, as `make demo` and `make ui` run (a pip install -e leaves its egg-info there)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        stack = AirflowStack(demo.env(), demo.home, DAG_ID)
        stack.__enter__()
    try:
        out = lose_the_node(stack, demo, checkpoints=2, echo=lambda line: None)
        yield stack, out
    finally:
        stack.__exit__(None, None, None)


def test_try_2s_log_through_the_rest_api_names_the_checkpoint_it_restored(demo_run):
    stack, out = demo_run
    expect = uninterrupted(ARGS)
    text, ok = summarize(out, expect, steps=STEPS)
    print(text)
    assert out["state"] == "success" and out["tries"] == 2, text
    cid = derive_checkpoint_id(DAG_ID, TASK_ID, out["run_id"])
    restore = out["restore"]  # the XCom cedana_restore, as the UI's XCom tab shows it
    assert restore["checkpoint_id"] == cid and restore["from_try"] == 1
    log2 = out["logs"][2]
    line = next((x for x in log2.splitlines() if x.startswith("cedana: restored ")), "")
    assert re.match(rf"cedana: restored seq {restore['seq']} of try 1 \(node \S+\) on node \S+: gap [\d.]+ s, restore "
                    rf"[\d.]+ s, checkpoint_id={re.escape(cid)}, mode \w+$", line), log2[-3000:]
    # what a reader looks for is seen first, even where a log viewer cuts a long line
    assert f"seq {restore['seq']}" in line[:100] and "gap" in line[:100], line
    # logged when the restore happened: every step try 2 ran comes after it, not before
    step = rf"step \d+/{STEPS}"
    assert re.search(step, log2[log2.index(line):]) and not re.search(step, log2[:log2.index(line)])
    assert "start-up: allocating" in out["logs"][1] and "start-up: allocating" not in log2  # try 2 did not start over
    assert re.findall(r"done digest=\w+", log2) == [expect] and ok
    saved = re.search(rf"steps saved: +(\d+) of {STEPS} not redone", text)
    assert saved and int(saved.group(1)) >= 5, text  # two 5 s heartbeats of 0.25 s steps before the kill
    sizes = next(x for x in text.splitlines() if x.startswith("checkpoints taken:"))
    assert all(binary_size(m["image_bytes"]) in sizes for m in out["manifests"]), (sizes, out["manifests"])


def test_try_1s_log_says_its_workload_was_killed_by_sigkill_and_nothing_of_unshare(demo_run):
    _, out = demo_run
    log1 = out["logs"][1]
    assert re.search(r"cedana: the workload was killed by SIGKILL; \d+ checkpoint\(s\) taken this try", log1), log1[-3000:]
    assert "sigprocmask" not in log1 and "unshare:" not in log1, log1[-3000:]


def test_the_dag_run_has_ended_in_success_when_the_demo_stops_airflow(demo_run):
    stack, out = demo_run
    assert out["run_state"] == "success"  # read through the REST API when lose_the_node returned
    assert stack.dag_run(DAG_ID, out["run_id"])["state"] == "success"


def test_airflows_header_shows_no_plugin_import_error_and_no_red_component(demo_run):
    stack, _ = demo_run
    errors = stack.call("GET", "/api/v2/plugins/importErrors")
    assert errors["total_entries"] == 0 and errors["import_errors"] == [], errors
    assert "cedana" in [p["name"] for p in stack.call("GET", "/api/v2/plugins")["plugins"]]  # loaded, once
    health = stack.call("GET", "/api/v2/monitor/health")
    assert {part: v["status"] for part, v in health.items()} == dict.fromkeys(
        ("metadatabase", "scheduler", "triggerer", "dag_processor"), "healthy"), health


def test_in_airflows_ui_try_2s_logs_tab_shows_the_restore_line(demo_run):
    from playwright.sync_api import expect

    stack, out = demo_run
    with browser_page() as page:
        page.goto(stack.ti_url(DAG_ID, out["run_id"], TASK_ID))  # the task instance page, no login (a local demo)
        expect(page.get_by_role("button", name=re.compile(r"^1"))).to_be_visible(timeout=60_000)
        page.get_by_role("button", name=re.compile(r"^2")).first.click()  # Task Tries: 2
        page.get_by_placeholder("Search logs...").fill("restored")
        line = page.get_by_text(re.compile(r"cedana: restored seq \d+ of try 1 \(node \S+\) on node \S+: gap "))
        expect(line.first).to_be_visible(timeout=60_000)
        page.screenshot(path=ARTIFACTS / "demo-try-2-log.png")


def test_in_airflows_ui_the_checkpoints_tab_tells_each_try_how_it_started_and_what_it_lost(demo_run):
    """The demo's real run in the task instance's Checkpoints tab and its ID's page, at 1440 x 900: try
    1 started fresh (the first try) and lost the work after its newest checkpoint (Airflow's own end
    time), try 2 restored that checkpoint; the chart holds every checkpoint. The docs' pictures."""
    from playwright.sync_api import expect

    stack, out = demo_run
    cid = derive_checkpoint_id(DAG_ID, TASK_ID, out["run_id"])
    seq = out["restore"]["seq"]
    with browser_page() as page:
        page.goto(stack.ti_url(DAG_ID, out["run_id"], TASK_ID))
        page.locator("a[href$='/plugin/cedana-task-checkpoints']").click()  # the tab, next to Logs and Details
        page.wait_for_selector("iframe", timeout=60_000)
        tab = page.frame_locator("iframe")
        rows = tab.locator("table.tries tbody tr")
        expect(rows).to_have_count(2, timeout=60_000)
        expect(rows.nth(0)).to_contain_text(re.compile("failed|up_for_retry"))  # as Airflow's history keeps it
        expect(rows.nth(0)).to_contain_text("fresh: the first try: nothing to resume yet")
        expect(rows.nth(0).locator("td").last).to_have_text(re.compile(r"^\d+\.\d (s|min)$"))  # the work it lost
        expect(rows.nth(1)).to_contain_text(re.compile(rf"success\s*restored seq {seq} from \S+: gap [\d.]+ s"))
        expect(rows.nth(1).locator("td").last).to_have_text("none")
        _shot(page, "demo-checkpoints-tab.png", "checkpoint-tab.png")
        tab.get_by_role("link", name=cid).first.click()  # our page, in the tab's frame
        chart = tab.get_by_role("img", name=re.compile(rf"^{len(out['manifests'])} checkpoints, .* 1 restore"))
        expect(chart).to_be_visible(timeout=60_000)
        _shot(page, "demo-checkpoint-id.png", "checkpoint-id.png", full_page=True)


def _shot(page, name: str, docs: str, **kw: object) -> None:
    """A screenshot in the test artifacts; with CEDANA_DOCS_SCREENSHOTS=1 it also replaces docs/img/<docs>."""
    import os
    import shutil

    page.screenshot(path=ARTIFACTS / name, **kw)
    if os.environ.get("CEDANA_DOCS_SCREENSHOTS") == "1":
        shutil.copyfile(ARTIFACTS / name, REPO / "docs" / "img" / docs)


def test_a_part_that_does_not_come_up_is_one_line_naming_it(tmp_path, airflow_db):
    # A database `airflow db migrate` never made (a first hour's skipped step): every part refuses it at once.
    # (A bad executor failed only the scheduler, after the other three had spent 40 CPU-s starting; CI run 68.)
    demo = Demo(home=tmp_path / "airflow", root=tmp_path / "demo", train_args=ARGS)
    demo.prepare(airflow_db)
    (demo.home / "airflow.db").unlink()
    stack = AirflowStack(demo.env(), demo.home, DAG_ID, start_timeout=120)
    with pytest.raises(StackError) as e:
        with stack:
            pass
    line = str(e.value)
    assert "\n" not in line and re.match(r"airflow (api-server|scheduler|dag-processor|triggerer) exited 1 while starting: "
                                         r".*Database migration required.*\(log: \S+\.log\)$", line), line
    assert stack.procs == {}  # every part stopped
