"""The checkpoint browser behind Airflow's auth, in a real `airflow api-server` (SQLite home in a temp
dir): 401 without a login or with a bad token, IDs filtered by DAG permission, 404 alike for another
DAG's ID and a missing one, delete only with edit permission (and in Airflow's audit log), the views
in /api/v2/plugins, the JSON API in the same shape as `cedana-airflow checkpoints --json` (less on
request, with ETags), and every page in Debian's Chromium at 1440 x 900 inside Airflow's UI.

Per-DAG permissions come from a stand-in auth manager (tests/airflow/stand_in_auth.py: Airflow's
SimpleAuthManager with users scoped to named DAGs), because no auth manager with per-DAG roles is
installed here; logins and tokens are SimpleAuthManager's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.drill.report import DrillReport, save_report
from cedana_airflow.format.manifest import AirflowTask, ProcessInfo
from cedana_airflow.ids import derive_checkpoint_id
from cedana_airflow.store import index, open_store
from cedana_airflow.store.restores import RestoreRecord, record_restore
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint
from conftest import AIRFLOW, ARTIFACTS, REPO, _free_port, browser_page, cli, cli_env

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("browser")]

PROC = ProcessInfo(pid=42, command=("python", "train.py"), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
B_ID = derive_checkpoint_id("dag_b", "fit", "manual__2")
#: As long as real IDs get (a scheduled run of a long-named task): the fleet page must still fit 1440 px.
LONG_OWNER = AirflowTask(dag_id="dag_b", task_id="fine_tune_the_sentiment_classifier_on_reviews",
                         run_id="scheduled__2026-11-30T00:00:00+00:00")
LONG_ID = derive_checkpoint_id(LONG_OWNER.dag_id, LONG_OWNER.task_id, LONG_OWNER.run_id)
USERS = {"admin": "admin", "alice@dag_a": "viewer", "bob": "viewer"}
A_ID = ""  # dag_a's checkpoint ID: its run ID comes from a real run (set by the server fixture)
A_RUN = ""
#: Named as dag_a's task "spoof" would name it in that run, but written by dag_b's task (an author may
#: set any ID): its own DAG decides who sees it, not the URL that finds it.
SPOOF_ID = ""


def _fill(store_dir: Path, tmp: Path) -> None:
    s = open_store(f"file://{store_dir}", load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    owners = {A_ID: AirflowTask(dag_id="dag_a", task_id="train", run_id=A_RUN),
              B_ID: AirflowTask(dag_id="dag_b", task_id="fit", run_id="manual__2"), "cli-job": None,
              LONG_ID: LONG_OWNER, SPOOF_ID: AirflowTask(dag_id="dag_b", task_id="fit", run_id="manual__3")}
    for cid, owner in owners.items():
        for n in range(2):
            d = tmp / f"img-{cid}-{n}"
            d.mkdir(parents=True)
            (d / "pages-1.img").write_bytes(os.urandom(50_000))
            m = save_checkpoint(s, cfg, CheckpointMeta(cid, f"node-{n}", "4.1.1", PROC, try_number=n + 1, airflow=owner), d)
            index.record_checkpoint(s, m)
    record_restore(s, RestoreRecord(checkpoint_id=A_ID, outcome="restored", seq=1, try_number=2, from_node="node-0",
                                    node="node-1", at=datetime.now(timezone.utc), gap_seconds=4.2, restore_seconds=1.1,
                                    airflow=owners[A_ID]))
    index.count_restore(s, A_ID, datetime.now(timezone.utc))
    now = datetime.now(timezone.utc)
    save_report(s, DrillReport(drill_id="20261130T000000Z-canary-abc123", mode="canary", ok=True, node="gpu-7",
                               started_at=now, finished_at=now, rto_seconds=0.4, restore_seconds=0.1,
                               lost_work_seconds=0.2, digest_match=True))
    save_report(s, DrillReport(drill_id="20261130T010000Z-live-def456", mode="live", ok=True, node="gpu-7",
                               started_at=now, finished_at=now, stopped="kill switch: the cedana_fleet_drill DAG is paused"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, airflow_db):
    tmp = tmp_path_factory.mktemp("browser")
    home = tmp / "airflow"
    home.mkdir()
    (home / "airflow.db").write_bytes(airflow_db.read_bytes())
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "tests" / "dags_browser"))
    # one real run of dag_a: a task instance page in Airflow's UI for the Checkpoints tab
    subprocess.run([*AIRFLOW, "dags", "test", "dag_a"], env=env, check=True, capture_output=True, timeout=180)
    import sqlite3

    global A_ID, A_RUN, SPOOF_ID
    with contextlib.closing(sqlite3.connect(home / "airflow.db")) as db:
        [(A_RUN,)] = db.execute("select run_id from dag_run where dag_id = 'dag_a'").fetchall()
    A_ID = derive_checkpoint_id("dag_a", "train", A_RUN)
    SPOOF_ID = derive_checkpoint_id("dag_a", "spoof", A_RUN)
    _fill(tmp / "store", tmp)
    passwords = tmp / "passwords.json"
    passwords.write_text(json.dumps({u: f"pw-{i}" for i, u in enumerate(USERS)}))
    env.update(AIRFLOW__API__PORT=str(port),
               AIRFLOW__CORE__AUTH_MANAGER="stand_in_auth.DagScopedAuthManager",
               AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=",".join(f"{u}:{r}" for u, r in USERS.items()),
               AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(passwords),
               AIRFLOW__API_AUTH__JWT_SECRET=os.urandom(16).hex(),
               AIRFLOW__CEDANA__STORE=f"file://{tmp / 'store'}",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "airflow"), env.get("PYTHONPATH", "")]))
    log = open(tmp / "api-server.log", "wb")
    proc = subprocess.Popen([*AIRFLOW, "api-server", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(base + "/api/v2/monitor/health", timeout=5)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "api-server.log").read_text()[-4000:]
            time.sleep(0.5)
    tokens = {u: _call(base, "POST", "/auth/token", body={"username": u, "password": f"pw-{i}"})[1]["access_token"]
              for i, u in enumerate(USERS)}
    yield base, tokens, tmp
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def _call(base: str, method: str, path: str, token: str | None = None, body: dict | None = None) -> tuple[int, object]:
    req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode()


def test_every_route_needs_a_login(server):
    base, _, _ = server
    for method, path in (("GET", "/cedana/api/v1/checkpoints"), ("GET", f"/cedana/api/v1/checkpoints/{A_ID}"),
                         ("DELETE", f"/cedana/api/v1/checkpoints/{A_ID}"), ("GET", "/cedana/"),
                         ("GET", f"/cedana/ids/{A_ID}"), ("GET", "/cedana/ti?dag_id=dag_a&run_id=x&task_id=train")):
        status, _ = _call(base, method, path)
        assert status == 401, (method, path, status)
    for path in ("/cedana/api/v1/checkpoints", "/cedana/"):  # a token that is not valid: log in again
        status, body = _call(base, "GET", path, token="not-a-jwt")
        assert status == 401 and "invalid token: log in again" in str(body), (path, status, body)


def test_the_json_api_has_the_cli_shape_and_is_filtered_by_dag_permission_stand_in_auth_manager(server):
    base, tokens, tmp = server
    status, everything = _call(base, "GET", "/cedana/api/v1/checkpoints", tokens["admin"])
    assert status == 200
    env = cli_env(tmp, "n", "w", CEDANA_STORE=f"file://{tmp / 'store'}")
    assert everything == json.loads(cli("checkpoints", "--json", env=env).stdout)  # one contract for both
    assert {x["id"] for x in everything} == {A_ID, B_ID, "cli-job", LONG_ID, SPOOF_ID}
    a = next(x for x in everything if x["id"] == A_ID)
    assert a["airflow"]["dag_id"] == "dag_a" and a["restores"] == 1 and [c["seq"] for c in a["checkpoints"]] == [1, 2]

    status, alices = _call(base, "GET", "/cedana/api/v1/checkpoints", tokens["alice@dag_a"])
    assert status == 200 and [x["id"] for x in alices] == [A_ID]  # not dag_b's, not the CLI's (no DAG)
    # another DAG's ID answers as a missing one does: no telling which unreadable DAGs have checkpoints
    missing = _call(base, "GET", f"/cedana/api/v1/checkpoints/{B_ID[:-1]}x", tokens["alice@dag_a"])
    assert missing[0] == 404
    for other in (B_ID, "cli-job"):
        status, body = _call(base, "GET", f"/cedana/api/v1/checkpoints/{other}", tokens["alice@dag_a"])
        assert (status, body["detail"].replace(other, "ID")) == (404, missing[1]["detail"].replace(B_ID[:-1] + "x", "ID"))
        assert _call(base, "GET", f"/cedana/ids/{other}", tokens["alice@dag_a"])[0] == 404
    status, one = _call(base, "GET", f"/cedana/api/v1/checkpoints/{A_ID}", tokens["alice@dag_a"])
    assert status == 200 and one["restores"][0]["outcome"] == "restored" and one["restores"][0]["gap_seconds"] == 4.2
    assert [m["seq"] for m in one["manifests"]] == [1, 2] and one["manifests"][0]["airflow"]["task_id"] == "train"
    assert _call(base, "GET", "/cedana/api/v1/checkpoints/no-such-id", tokens["admin"])[0] == 404
    assert _call(base, "GET", "/cedana/api/v1/checkpoints/..%2Fetc", tokens["admin"])[0] in (400, 404)


def test_pages_render_the_fleet_an_id_and_a_task_instance_tab_stand_in_auth_manager(server):
    base, tokens, _ = server
    status, page = _call(base, "GET", "/cedana/", tokens["alice@dag_a"])
    assert status == 200 and A_ID in page and B_ID not in page and "1</b> checkpoint IDs" in page
    assert "<b>1</b> restores in the last day (1 in all)" in page
    assert "fleet drills" not in page  # the drills are for users who may read every DAG: no link that answers 403
    assert "<a href='drills'>fleet drills</a>" in _call(base, "GET", "/cedana/", tokens["admin"])[1]
    status, page = _call(base, "GET", f"/cedana/ids/{A_ID}", tokens["admin"])
    assert status == 200 and "node-0" in page and "Restores" in page and "4.2 s" in page and "<svg" in page
    status, tab = _call(base, "GET", f"/cedana/ti?{urlencode({'dag_id': 'dag_a', 'run_id': A_RUN, 'task_id': 'train'})}"
                                     "&map_index=-1", tokens["admin"])
    assert status == 200 and "fresh: the first try: nothing to resume yet" in tab
    assert "restored seq 1 from node-0: gap 4.2 s, restore 1.10 s" in tab
    assert "<td>success</td>" in tab  # try 1's state, from Airflow's own table
    status, empty = _call(base, "GET", "/cedana/ti?dag_id=dag_a&run_id=manual__9&task_id=other", tokens["admin"])
    assert status == 200 and "has no checkpoints in the store" in empty
    assert _call(base, "GET", "/cedana/ti?dag_id=dag_b&run_id=manual__2&task_id=fit", tokens["alice@dag_a"])[0] == 403
    spoof = f"/cedana/ti?{urlencode({'dag_id': 'dag_a', 'run_id': A_RUN, 'task_id': 'spoof'})}"
    assert "has no checkpoints in the store" in _call(base, "GET", spoof, tokens["alice@dag_a"])[1]  # dag_b's ID
    assert SPOOF_ID in _call(base, "GET", spoof, tokens["admin"])[1]
    # a malformed query is one line on a page, not FastAPI's validation JSON
    status, bad = _call(base, "GET", "/cedana/?page=abc", tokens["admin"])
    assert status == 400 and "<p class='problem'>bad request: page: " in bad and "(got &#39;abc&#39;)" in bad, bad
    assert _call(base, "GET", "/cedana/?page=0", tokens["admin"])[0] == 400


def test_the_views_are_registered_with_airflow(server):
    base, tokens, _ = server
    status, plugins = _call(base, "GET", "/api/v2/plugins", tokens["admin"])
    [cedana] = [p for p in plugins["plugins"] if p["name"] == "cedana"]
    views = {v["destination"]: v for v in cedana["external_views"]}
    assert views["nav"]["href"] == "cedana/" and views["nav"]["category"] == "browse"
    assert views["task_instance"]["href"].startswith("cedana/ti?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}")
    assert [a["url_prefix"] for a in cedana["fastapi_apps"]] == ["/cedana"]


def test_delete_needs_edit_permission_and_is_in_the_audit_log_stand_in_auth_manager(server):
    base, tokens, tmp = server
    assert _call(base, "DELETE", f"/cedana/api/v1/checkpoints/{B_ID}", tokens["bob"])[0] == 403  # a viewer
    assert _call(base, "DELETE", f"/cedana/api/v1/checkpoints/{B_ID}", tokens["alice@dag_a"])[0] == 404  # unreadable
    status, done = _call(base, "DELETE", f"/cedana/api/v1/checkpoints/{B_ID}", tokens["admin"])
    assert status == 200 and done == {"id": B_ID, "deleted_checkpoints": 2}
    assert not list((tmp / "store").glob(f"{B_ID}/*/manifest.json"))
    assert B_ID not in {x["id"] for x in _call(base, "GET", "/cedana/api/v1/checkpoints", tokens["admin"])[1]}
    # Airflow's audit log (its REST API lists rows of DAGs it knows; dag_b exists only in this store)
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp / "airflow" / "airflow.db")) as db:
        rows = db.execute("select owner, dag_id, extra from log where event = 'cedana.delete_checkpoint_id'").fetchall()
    assert rows == [("admin", "dag_b", f"checkpoint_id={B_ID} checkpoints=2")]


def test_an_unusable_store_is_one_line_on_the_page_not_a_stack_trace_stand_in_store(monkeypatch):
    from cedana_airflow.airflow.browser import app as browser_app
    from cedana_airflow.errors import StoreUnavailable

    def down() -> None:
        raise StoreUnavailable("store s3://ckpt/x/: endpoint http://***@minio:9000 is unreachable. Check AWS_ENDPOINT_URL.")

    from starlette.requests import Request

    monkeypatch.setattr(browser_app, "_store", down)
    request = Request({"type": "http", "method": "GET", "path": "/cedana/", "headers": [], "query_string": b""})
    r = browser_app.page_fleet(request, user=object(), q="", dag="", sort="id", page=1)
    body = bytes(r.body).decode()
    assert r.status_code == 503 and "endpoint http://***@minio:9000 is unreachable" in body and "Traceback" not in body
    api = browser_app.api_checkpoints(request, user=object())
    assert api.status_code == 503 and json.loads(bytes(api.body))["detail"].startswith("store s3://ckpt/x/")


def test_the_json_api_leaves_out_what_a_caller_asks_and_answers_304_to_its_etag(server):
    base, tokens, _ = server
    path = f"/cedana/api/v1/checkpoints/{A_ID}"
    full = _call(base, "GET", path, tokens["admin"])[1]
    lean = _call(base, "GET", path + "?files=false", tokens["admin"])[1]
    assert all("files" in m for m in full["manifests"]) and not any("files" in m for m in lean["manifests"])
    assert lean == {**full, "manifests": [{k: v for k, v in m.items() if k != "files"} for m in full["manifests"]]}
    assert _call(base, "GET", path + "?manifests=false", tokens["admin"])[1] == \
        {k: v for k, v in full.items() if k != "manifests"}
    for route in (path, "/cedana/api/v1/checkpoints"):
        status, headers, body = _raw(base, route, tokens["admin"])
        assert status == 200 and headers["ETag"].startswith('"') and headers["Cache-Control"] == "private, no-cache"
        again = _raw(base, route, tokens["admin"], {"If-None-Match": headers["ETag"]})
        assert (again[0], again[2], again[1]["ETag"]) == (304, b"", headers["ETag"])  # unchanged: no body
        assert _raw(base, route, tokens["admin"], {"If-None-Match": '"stale"'})[0] == 200
    # alice's answer is hers: a different body, a different tag
    assert _raw(base, "/cedana/api/v1/checkpoints", tokens["alice@dag_a"])[1]["ETag"] != \
        _raw(base, "/cedana/api/v1/checkpoints", tokens["admin"])[1]["ETag"]


def _raw(base: str, path: str, token: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    """(status, headers: looked up by any case, body)."""
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _shot(page, name: str, docs: str | None = None, **kw) -> None:
    """A screenshot for people to look at, not an assertion; with CEDANA_DOCS_SCREENSHOTS=1 it also
    replaces docs/img/<docs> (the README's and docs' pictures come from these tests). Under load headless
    Chromium sometimes answers "Unable to capture screenshot" (CI saw it on the login page): try again,
    then go on."""
    import warnings

    for attempt in range(3):
        try:
            page.screenshot(path=ARTIFACTS / name, **kw)
            break
        except Exception as e:  # playwright's Error
            if attempt == 2:
                warnings.warn(f"screenshot {name} not taken: {e}", stacklevel=2)
                return
            page.wait_for_timeout(1000)
    if docs and os.environ.get("CEDANA_DOCS_SCREENSHOTS") == "1":
        import shutil

        shutil.copyfile(ARTIFACTS / name, REPO / "docs" / "img" / docs)


@pytest.fixture(scope="module")
def airflow_ui(server):
    """Debian's Chromium at 1440 x 900, logged in to Airflow as admin through its own login page."""
    base, _, _ = server
    with browser_page() as page:
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(base + "/")
        _shot(page, "0-login.png")
        page.locator("input[name=username]").fill("admin")
        page.locator("input[name=password]").fill("pw-0")
        page.locator("button[type=submit]").click()
        page.wait_for_url(lambda url: "login" not in url, timeout=30_000)
        yield page, base, errors


def _plugin_frame(page):
    """Our page inside Airflow's: the iframe's frame (the only child frame)."""
    page.wait_for_selector("iframe", timeout=30_000)
    for _ in range(100):
        frames = [f for f in page.frames if f.parent_frame is not None and "/cedana/" in f.url]
        if frames:
            # the page's script reloads it once when it was rendered in another timezone: wait for the one that stays
            frames[0].wait_for_selector("html[data-ready]", state="attached", timeout=30_000)
            return frames[0]
        page.wait_for_timeout(100)
    raise AssertionError(f"no plugin frame in {[f.url for f in page.frames]}")


def _fits(frame) -> None:
    """Nothing on the page reaches past the frame's right edge, and nothing scrolls sideways."""
    from playwright.sync_api import Error

    for attempt in range(5):
        frame.wait_for_selector("html[data-ready]", state="attached", timeout=30_000)
        try:
            width, scroll, widest = frame.evaluate("""() => {
                const right = Math.max(...[...document.querySelectorAll('body *')].map(e => e.getBoundingClientRect().right));
                return [document.documentElement.clientWidth, document.documentElement.scrollWidth, right];
            }""")
            break
        except Error as e:
            # the page went away under us (seen on CI right after data-ready: Airflow's router navigating
            # the frame again from a %2B path, now avoided): measure the page that stays
            if "Execution context was destroyed" not in str(e) or attempt == 4:
                raise
            frame.wait_for_load_state("load", timeout=30_000)
    assert scroll <= width and widest <= width + 1, (frame.url, width, scroll, widest)


def test_in_a_real_browser_every_plugin_page_fits_a_1440_px_laptop(airflow_ui):
    """Debian's Chromium driven by Playwright: the nav item, the fleet page and an ID's page in
    Airflow's frame, the task instance tab and the drills, none wider than the frame."""
    from playwright.sync_api import expect

    page, base, _ = airflow_ui
    page.goto(base + "/plugin/cedana-checkpoints")
    frame = _plugin_frame(page)
    expect(frame.get_by_role("link", name=LONG_ID)).to_be_visible(timeout=30_000)
    expect(frame.get_by_role("columnheader", name="restores")).to_be_in_viewport()  # the columns a user came for
    _fits(frame)
    _shot(page, "1-fleet.png", docs="checkpoint-browser.png")
    for cid in (A_ID, LONG_ID, "cli-job"):
        frame.goto(f"{base}/cedana/ids/{quote(cid, safe='=+@')}")  # as the pages link it: Airflow's
        # router would navigate the frame again from a %2B path, cutting short the next goto
        expect(frame.get_by_role("heading", name="Restores")).to_be_visible(timeout=30_000)
        expect(frame.get_by_role("img", name=re.compile(r"^2 checkpoints, "))).to_be_visible()  # the chart
        _fits(frame)
    page.goto(base + "/plugin/cedana-checkpoints")
    frame = _plugin_frame(page)
    landed: list[str] = []
    page.on("framenavigated", lambda f: landed.append(f.url) if f.parent_frame and "/cedana/ids/" in f.url else None)
    frame.get_by_role("link", name=A_ID).click()
    expect(frame.get_by_role("heading", name="Restores")).to_be_visible(timeout=30_000)
    frame.wait_for_selector("html[data-ready]", state="attached", timeout=30_000)
    assert len(set(landed)) == 1, landed  # one page load, not Airflow's router loading it again (%2B vs +)
    assert page.url.endswith(f"/plugin/cedana-checkpoints/cedana/ids/{quote(A_ID, safe='+')}") or \
        A_ID.replace("+", "%2B") in page.url, page.url  # Airflow keeps a link to this page in its address bar
    _shot(page, "2-checkpoint-id.png", full_page=True)  # the docs' picture is the demo's (test_demo_ui.py)
    frame.goto(base + "/cedana/drills")
    expect(frame.get_by_role("heading", name="Fleet drills")).to_be_visible(timeout=30_000)
    _fits(frame)
    # the task instance of the real run, and its Checkpoints tab (narrower: Airflow's grid is beside it)
    page.goto(f"{base}/dags/dag_a/runs/{quote(A_RUN, safe='')}/tasks/train")
    page.locator("a[href$='/plugin/cedana-task-checkpoints']").click()  # the tab, next to Logs and Details
    tab = _plugin_frame(page)
    expect(tab.get_by_text("fresh: the first try: nothing to resume yet")).to_be_visible(timeout=30_000)
    expect(tab.get_by_text("restored seq 1 from node-0: gap 4.2 s, restore 1.10 s")).to_be_visible()
    expect(tab.get_by_role("columnheader", name="work lost")).to_be_in_viewport()
    _fits(tab)
    _shot(page, "3-task-instance-tab.png")


def test_in_a_real_browser_links_on_an_id_page_open_airflows_own_pages(airflow_ui):
    """The sandboxed frame may not navigate Airflow's window (target=_top is blocked there): each link
    to the DAG, the run and the task instance lands on that page of Airflow's UI."""
    from playwright.sync_api import expect

    page, base, errors = airflow_ui
    run_path = f"/dags/dag_a/runs/{quote(A_RUN, safe='')}"
    for name, path, shows in (("dag_a", "/dags/dag_a", "dag_a"), (A_RUN, run_path, A_RUN),
                              ("train", run_path + "/tasks/train", "train")):
        page.goto(f"{base}/plugin/cedana-checkpoints/cedana/ids/{quote(A_ID, safe='')}")
        frame = _plugin_frame(page)
        expect(frame.get_by_role("heading", name="Restores")).to_be_visible(timeout=30_000)
        frame.get_by_role("link", name=name, exact=True).click()
        page.wait_for_url(lambda url: url.split("?")[0].endswith(path), timeout=30_000)
        expect(page.get_by_text(shows, exact=True).first).to_be_visible(timeout=30_000)
    assert not [e for e in errors if "sandboxed" in e or "Unsafe attempt" in e], errors


def _brightness(frame) -> float:
    """The page background's mean RGB, 0-255 (Airflow's colours are oklch(): a canvas turns them into RGB)."""
    return frame.evaluate("""() => { const c = document.createElement('canvas'); c.width = c.height = 1;
        const x = c.getContext('2d'); x.fillStyle = getComputedStyle(document.body).backgroundColor;
        x.fillRect(0, 0, 1, 1); const [r, g, b] = x.getImageData(0, 0, 1, 1).data; return (r + g + b) / 3; }""")


def test_in_a_real_browser_the_pages_follow_airflows_theme_and_timezone(airflow_ui):
    from playwright.sync_api import expect

    page, base, _ = airflow_ui
    page.goto(base + "/")
    page.evaluate("""() => { localStorage.setItem('theme', 'dark');
                             localStorage.setItem('timezone', JSON.stringify('Asia/Kolkata')); }""")
    try:
        page.goto(f"{base}/plugin/cedana-checkpoints/cedana/ids/{quote(A_ID, safe='')}")
        frame = _plugin_frame(page)
        expect(frame.get_by_role("heading", name="Restores")).to_be_visible(timeout=30_000)
        expect(frame.locator("td", has_text=re.compile(r"^2\d{3}-\d\d-\d\d \d\d:\d\d:\d\d IST$")).first).to_be_visible(
            timeout=30_000)  # rendered again in the user's timezone, once
        expect(frame.locator("html")).to_have_attribute("data-theme", "dark")
        assert _brightness(frame) < 60  # Airflow's dark background (its own colour, copied from its page)
        _shot(page, "4-checkpoint-id-dark.png")
        page.evaluate("document.documentElement.classList.replace('dark', 'light')")  # the user switches back
        expect(frame.locator("html")).to_have_attribute("data-theme", "light")
        assert _brightness(frame) > 200
    finally:
        page.evaluate("() => { localStorage.removeItem('theme'); localStorage.removeItem('timezone'); }")


def test_drill_reports_and_trends_for_users_who_may_read_every_dag_stand_in_auth_manager(server):
    base, tokens, _ = server
    status, drills = _call(base, "GET", "/cedana/api/v1/drills", tokens["bob"])
    assert status == 200 and [r["drill_id"] for r in drills["reports"]] == ["20261130T000000Z-canary-abc123",
                                                                            "20261130T010000Z-live-def456"]
    assert drills["trends"]["canary"]["rto_seconds"] == {"p50": 0.4, "p95": 0.4}
    assert "live" not in drills["trends"]  # a drill that did nothing proves nothing
    status, page = _call(base, "GET", "/cedana/drills", tokens["admin"])
    assert status == 200 and "Fleet drills" in page and "1 of 1" in page and "0.40 s / 0.40 s" in page
    assert "did nothing</td>" in page and "kill switch: the cedana_fleet_drill DAG is paused" in page
    assert _call(base, "GET", "/cedana/drills", tokens["alice@dag_a"])[0] == 403  # reports name every DAG's IDs
    assert _call(base, "GET", "/cedana/api/v1/drills")[0] == 401
