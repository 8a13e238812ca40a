"""The checkpoint browser behind Airflow's auth, in a real `airflow api-server` (SQLite home in a temp
dir): 401 without a login, IDs filtered by DAG permission, 403 on another DAG's ID, delete only with
edit permission (and in Airflow's audit log), the views in /api/v2/plugins, and the JSON API in the
same shape as `cedana-airflow checkpoints --json`.

Per-DAG permissions come from a stand-in auth manager (tests/airflow/stand_in_auth.py: Airflow's
SimpleAuthManager with users scoped to named DAGs), because no auth manager with per-DAG roles is
installed here; logins and tokens are SimpleAuthManager's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
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

pytestmark = pytest.mark.integration

PROC = ProcessInfo(pid=42, command=("python", "train.py"), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
B_ID = derive_checkpoint_id("dag_b", "fit", "manual__2")
USERS = {"admin": "admin", "alice@dag_a": "viewer", "bob": "viewer"}
A_ID = ""  # dag_a's checkpoint ID: its run ID comes from a real run (set by the server fixture)
A_RUN = ""


def _fill(store_dir: Path, tmp: Path) -> None:
    s = open_store(f"file://{store_dir}", load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    owners = {A_ID: AirflowTask(dag_id="dag_a", task_id="train", run_id=A_RUN),
              B_ID: AirflowTask(dag_id="dag_b", task_id="fit", run_id="manual__2"), "cli-job": None}
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

    global A_ID, A_RUN
    with contextlib.closing(sqlite3.connect(home / "airflow.db")) as db:
        [(A_RUN,)] = db.execute("select run_id from dag_run where dag_id = 'dag_a'").fetchall()
    A_ID = derive_checkpoint_id("dag_a", "train", A_RUN)
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
    status, _ = _call(base, "GET", "/cedana/api/v1/checkpoints", token="not-a-jwt")
    assert status in (401, 403)


def test_the_json_api_has_the_cli_shape_and_is_filtered_by_dag_permission_stand_in_auth_manager(server):
    base, tokens, tmp = server
    status, everything = _call(base, "GET", "/cedana/api/v1/checkpoints", tokens["admin"])
    assert status == 200
    env = cli_env(tmp, "n", "w", CEDANA_STORE=f"file://{tmp / 'store'}")
    assert everything == json.loads(cli("checkpoints", "--json", env=env).stdout)  # one contract for both
    assert {x["id"] for x in everything} == {A_ID, B_ID, "cli-job"}
    a = next(x for x in everything if x["id"] == A_ID)
    assert a["airflow"]["dag_id"] == "dag_a" and a["restores"] == 1 and [c["seq"] for c in a["checkpoints"]] == [1, 2]

    status, alices = _call(base, "GET", "/cedana/api/v1/checkpoints", tokens["alice@dag_a"])
    assert status == 200 and [x["id"] for x in alices] == [A_ID]  # not dag_b's, not the CLI's (no DAG)
    assert _call(base, "GET", f"/cedana/api/v1/checkpoints/{B_ID}", tokens["alice@dag_a"])[0] == 403
    assert _call(base, "GET", "/cedana/api/v1/checkpoints/cli-job", tokens["alice@dag_a"])[0] == 403
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
    status, page = _call(base, "GET", f"/cedana/ids/{A_ID}", tokens["admin"])
    assert status == 200 and "node-0" in page and "Restores" in page and "4.2 s" in page and "<svg" in page
    status, tab = _call(base, "GET", f"/cedana/ti?{urlencode({'dag_id': 'dag_a', 'run_id': A_RUN, 'task_id': 'train'})}"
                                     "&map_index=-1", tokens["admin"])
    assert status == 200 and "try 1: seq 1" in tab and "try 2: seq 2" in tab and "restored" in tab
    status, empty = _call(base, "GET", "/cedana/ti?dag_id=dag_a&run_id=manual__9&task_id=other", tokens["admin"])
    assert status == 200 and "has no checkpoints in the store" in empty
    assert _call(base, "GET", "/cedana/ti?dag_id=dag_b&run_id=manual__2&task_id=fit", tokens["alice@dag_a"])[0] == 403


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
    assert _call(base, "DELETE", f"/cedana/api/v1/checkpoints/{B_ID}", tokens["alice@dag_a"])[0] == 403
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
    from cedana_airflow.airflow import browser_app
    from cedana_airflow.errors import StoreUnavailable

    def down() -> None:
        raise StoreUnavailable("store s3://ckpt/x/: endpoint http://***@minio:9000 is unreachable. Check AWS_ENDPOINT_URL.")

    monkeypatch.setattr(browser_app, "_store", down)
    r = browser_app.page_fleet(user=object(), q="", dag="", sort="id", page=1)
    body = bytes(r.body).decode()
    assert r.status_code == 503 and "endpoint http://***@minio:9000 is unreachable" in body and "Traceback" not in body
    api = browser_app.api_checkpoints(user=object())
    assert api.status_code == 503 and json.loads(bytes(api.body))["detail"].startswith("store s3://ckpt/x/")


def _shot(page, name: str, **kw) -> None:
    """A screenshot for people to look at, not an assertion. Under load headless Chromium sometimes
    answers "Unable to capture screenshot" (CI saw it on the login page): try again, then go on."""
    import warnings

    for attempt in range(3):
        try:
            page.screenshot(path=ARTIFACTS / name, **kw)
            return
        except Exception as e:  # playwright's Error
            if attempt == 2:
                warnings.warn(f"screenshot {name} not taken: {e}", stacklevel=2)
            else:
                page.wait_for_timeout(1000)


def test_in_a_real_browser_log_in_open_browse_checkpoints_then_an_id(server):
    """Debian's Chromium driven by Playwright: Airflow's own login, the nav item, an ID's page."""
    from playwright.sync_api import expect

    base, _, _ = server
    with browser_page() as page:
        page.goto(base + "/")
        _shot(page, "0-login.png")
        page.locator("input[name=username]").fill("admin")
        page.locator("input[name=password]").fill("pw-0")
        page.locator("button[type=submit]").click()
        page.wait_for_url(lambda url: "login" not in url, timeout=30_000)
        page.goto(base + "/plugin/cedana-checkpoints")
        frame = page.frame_locator("iframe")
        expect(frame.get_by_role("link", name=A_ID)).to_be_visible(timeout=30_000)
        _shot(page, "1-fleet.png")
        frame.get_by_role("link", name=A_ID).click()
        expect(frame.get_by_role("heading", name="Restores")).to_be_visible(timeout=30_000)
        expect(frame.get_by_text("node-0").first).to_be_visible()
        _shot(page, "2-checkpoint-id.png", full_page=True)
        # the task instance of the real run, and its Checkpoints tab
        page.goto(f"{base}/dags/dag_a/runs/{quote(A_RUN, safe='')}/tasks/train")
        page.locator("a[href$='/plugin/cedana-task-checkpoints']").click()  # the tab, next to Logs and Details
        tab = page.frame_locator("iframe")
        expect(tab.get_by_text("try 1: seq 1")).to_be_visible(timeout=30_000)
        expect(tab.get_by_text("try 2: seq 2")).to_be_visible()
        _shot(page, "3-task-instance-tab.png")


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
