"""The checkpoint browser's pages, rendered without a server: whatever came from the store or the
request is escaped (a hostile checkpoint ID, DAG, task or run ID, node name, reason, drill report or
filter becomes text, never markup), and every page template renders for a fleet with nothing in it.

The pages behind Airflow's auth, in a real api-server and a real browser, are test_browser.py's.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("jinja2")

from cedana_airflow.airflow.browser import views  # noqa: E402
from cedana_airflow.airflow.browser.data import Fleet, IdDetail  # noqa: E402
from cedana_airflow.drill.report import DrillReport  # noqa: E402
from cedana_airflow.drill.trends import trends  # noqa: E402
from cedana_airflow.format.manifest import (AirflowTask, CooperativeState, GpuProcess, GpuState, Manifest,  # noqa: E402
                                            ProcessInfo, StateFile)
from cedana_airflow.store.index import HeartbeatRow, IndexRow  # noqa: E402
from cedana_airflow.store.listing import IdListing  # noqa: E402
from cedana_airflow.store.restores import RestoreRecord  # noqa: E402

#: Markup, an attribute break-out (both quotes) and an entity, in one value.
EVIL = "<script>alert('x')</script>\"'&amp;<img src=x onerror=alert(1)>"
NOW = datetime.now(timezone.utc)
PROC = ProcessInfo(pid=42, command=("python", "train.py"), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
TEMPLATES = Path(views.__file__).parent / "templates"
#: The only script on any page: the static file, inlined as it is (it reads values from data-* only).
SCRIPT = (TEMPLATES.parent / "static" / "browser.js").read_text()


class _Page(HTMLParser):
    """What a browser would build from a page: its elements, their attributes, and its text."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str]] = []  # (tag, name, value)
        self.text: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        (self.scripts if self._in_script else self.text).append(data)


def _safe(html: str) -> _Page:
    """No element or handler came from a value: only the tags our templates write, and no script."""
    page = _Page(html)
    ours = {"html", "head", "meta", "title", "style", "script", "body", "h1", "h2", "p", "a", "b", "span", "table",
            "thead", "tbody", "tr", "th", "td", "form", "input", "select", "option", "button", "div", "br", "ul", "li",
            "pre", "code"} | CHART_TAGS
    assert set(page.tags) <= ours, set(page.tags) - ours
    assert page.tags.count("script") == 1 and "".join(page.scripts).strip() == SCRIPT.strip()  # ours, whole
    assert [(t, k) for t, k, v in page.attrs if k.startswith("on")] == []  # no inline handler anywhere
    return page


#: What chart.py draws with (its own tests check its text is escaped).
CHART_TAGS = {"svg", "g", "rect", "line", "path", "polyline", "circle", "text", "title"}
#: Every attribute a template or the chart writes; a value that broke out of its quotes would add another.
ATTRIBUTES = {"charset", "class", "href", "name", "placeholder", "value", "method", "selected", "id", "type", "lang",
              "content", "title", "role", "aria-label", "aria-sort", "data-tz", "data-top", "data-confirm",
              "data-delete", "xmlns", "viewbox", "width", "height", "preserveaspectratio", "font-family", "font-size",
              "fill", "stroke", "stroke-width", "stroke-dasharray", "x", "y", "x1", "x2", "y1", "y2", "d", "points",
              "cx", "cy", "r", "text-anchor", "opacity", "fill-opacity", "dominant-baseline", "transform"}


def _listing(cid: str, airflow: AirflowTask | None, n: int = 2, **kw: object) -> IdListing:
    rows = tuple(IndexRow(seq=i + 1, try_number=i + 1, node=f"node-{i}{EVIL}", created_at=NOW - timedelta(hours=i),
                          image_bytes=2_000_000, stored_bytes=1_000_000, freeze_seconds=0.25) for i in range(n))
    return IdListing(cid, rows, airflow=airflow, **kw)


def _manifest(seq: int, gpu: bool = False) -> Manifest:
    # a manifest's checkpoint ID is validated when it is read; its other fields are the writer's
    return Manifest(format_version=3, checkpoint_id="train-1", seq=seq, try_number=seq, node=f"n{EVIL}", created_at=NOW,
                    engine_version="4.1.1", process=PROC, files=(), image_bytes=seq * 10**6, stored_bytes=seq * 10**5,
                    new_chunks=seq, freeze_seconds=0.1 * seq,
                    airflow=AirflowTask(dag_id=f"d{EVIL}", task_id=f"t{EVIL}", run_id=f"r{EVIL}"),
                    gpu=GpuState(driver_version="580", cuda_api_version=13000, gpus=(f"H200{EVIL}",),
                                 processes=(GpuProcess(ns_pid=1),), checkpoint_seconds=1.5) if gpu else None)


OWNER = AirflowTask(dag_id=f"dag{EVIL}", task_id=f"task{EVIL}", run_id=f"run{EVIL}", map_index=3)
RESTORES = (
    RestoreRecord(checkpoint_id="train-1", outcome="restored", seq=1, try_number=2, from_node=f"a{EVIL}",
                  node=f"b{EVIL}", at=NOW, gap_seconds=4.2, restore_seconds=1.1),
    RestoreRecord(checkpoint_id="train-1", outcome="fresh", refused=(f"refused{EVIL}",), at=NOW),
    RestoreRecord(checkpoint_id="train-1", outcome="fresh", reason=f"why{EVIL}", at=NOW),
)
#: An ID the listing index names (the store's folder names are not validated on the way in).
def _cooperative(seq: int) -> Manifest:
    """A checkpoint the workload wrote itself (docs/cooperative.md): format 4, its block required."""
    state = CooperativeState(files=(StateFile(path=f"rank-0/{EVIL}.pt", size=0, mode=0o600, chunks=()),), request=1,
                             ranks=2, verify_command=("check", EVIL))
    return _manifest(seq).model_copy(update={"format_version": 4, "writer": "cedana-airflow 0.6.0", "gpu": None,
                                             "required": ("cooperative",), "engine": "cooperative",
                                             "cooperative": state})


BEAT = HeartbeatRow(interval_seconds=432, auto=True, cost_seconds=3.1, commit_seconds=9.0, mtbf_seconds=33840,
                    expected_loss_seconds=225, reason=f"heartbeat 7m12s: {EVIL}")
DETAIL = IdDetail(_listing(f"id{EVIL}", OWNER, heartbeat=BEAT), (_manifest(1), _manifest(2, gpu=True), _cooperative(3)), RESTORES)
REPORTS = [
    DrillReport(drill_id=f"d1{EVIL}", mode="canary", ok=False, node=f"g{EVIL}", started_at=NOW, finished_at=NOW,
                problems=(f"p{EVIL}",), rto_seconds=0.4, digest_match=False),
    DrillReport(drill_id="d2", mode="live", ok=True, node="g", started_at=NOW, finished_at=NOW, stopped=f"kill{EVIL}"),
]


def _hostile_pages() -> dict[str, str]:
    fleet = Fleet((DETAIL.listing, _listing("plain", None, restores=1)), 3_000_000, 2, 1, 1)
    return {
        "fleet": views.fleet_page(fleet, store_url=f"s3://b/{EVIL}", q=EVIL, dag=OWNER.dag_id, sort=EVIL, page=1, tz=EVIL),
        "id": views.id_page(DETAIL, may_delete=True),
        "task_instance": views.task_instance_page(OWNER.dag_id, OWNER.run_id, OWNER.task_id, 3, f"def{EVIL}", [DETAIL]),
        "task_instance, none": views.task_instance_page(OWNER.dag_id, OWNER.run_id, OWNER.task_id, -1, f"def{EVIL}", []),
        "drills": views.drills_page(REPORTS, trends(REPORTS)),
        "problem": views.problem(f"no checkpoints under checkpoint ID {EVIL}"),
    }


@pytest.mark.parametrize("name", ["fleet", "id", "task_instance", "task_instance, none", "drills", "problem"])
def test_values_from_the_store_and_the_request_are_text_never_markup(name):
    html = _hostile_pages()[name]
    page = _safe(html)
    assert html.count("<script") == 1 and "<img" not in html  # base.html's own, and no other
    text = "".join(page.text)
    assert EVIL in text  # escaped once: the browser shows the value as it was (not "&amp;lt;...")
    for tag, key, value in page.attrs:  # no value broke out of its attribute into a new one
        assert key in ATTRIBUTES, (tag, key)


def test_hostile_values_in_links_and_attributes_stay_inside_them():
    pages = _hostile_pages()
    fleet, one = _Page(pages["fleet"]), _Page(pages["id"])
    assert ("input", "value", EVIL) in fleet.attrs  # the filter comes back as typed
    assert [v for t, k, v in fleet.attrs if t == "option" and k == "selected"] == [""]  # the DAG filter, once
    id_links = [v for t, k, v in fleet.attrs if k == "href" and v.startswith("ids/")]
    assert id_links == ["ids/id%3Cscript%3Ealert%28%27x%27%29%3C%2Fscript%3E%22%27%26amp%3B%3Cimg%20src=x%20"
                        "onerror=alert%281%29%3E"]  # one path segment, percent-encoded (the DAG filter left one)
    airflow_links = [v for t, k, v in one.attrs if t == "a" and k == "href" and v.startswith("../../dags/")]
    assert len(airflow_links) == 3 and all("<" not in v and "'" not in v and "/" not in v[len("../../dags/"):]
                                           .replace("/runs/", "").replace("/tasks/", "").replace("/mapped/", "")
                                           for v in airflow_links)
    assert airflow_links[2].endswith("/mapped/3")  # the mapped task instance's own page
    assert sum(1 for t, k, v in one.attrs if t == "a" and k == "data-top") == 3  # each opens in Airflow's window
    button = dict((k, v) for t, k, v in one.attrs if t == "button")
    assert button["data-confirm"] == f"Delete every checkpoint of id{EVIL}? A retry will then start fresh."
    assert button["data-delete"].startswith("../api/v1/checkpoints/id%3Cscript%3E") and "'" not in button["data-delete"]


def test_the_pages_keep_what_they_show():
    pages = _hostile_pages()
    assert "<b>2</b> checkpoint IDs" in pages["fleet"] and "restores in the last day (1 in all)" in pages["fleet"]
    assert "<svg" in pages["id"] and "4.2 s" in pages["id"] and "1 process(es), 1.50 s copy-out on H200" in pages["id"]
    assert "written by the workload: 1 file(s), 2 rank(s), verify command</td>" in pages["id"]
    tab = pages["task_instance"]
    assert "fresh: the first try: nothing to resume yet</td>" in tab and "<td class=n title='the newest at " in tab
    assert "restored seq 1 from a&lt;script&gt;" in tab and ": gap 4.2 s, restore 1.10 s</td>" in tab
    assert "<b>FAIL</b>" in pages["drills"] and "did nothing</td>" in pages["drills"]


def _empty_pages() -> dict[str, str]:
    """Each page template, for a store with nothing in it (or nothing the user may see)."""
    nothing = IdDetail(IdListing("cli-job", ()), (), ())
    return {
        "fleet.html": views.fleet_page(Fleet((), 0, 0, 0, 0), store_url="file:///s", q="", dag="", sort="id", page=1),
        "id.html": views.id_page(nothing, may_delete=False),
        "task_instance.html": views.task_instance_page("dag_a", "manual__1", "train", -1, "dag_a.train.x", []),
        "drills.html": views.drills_page([], {}),
        "problem.html": views.problem("store file:///s: not found."),
    }


def test_every_page_template_renders_with_an_empty_fleet():
    pages = _empty_pages()
    templates = {p.name for p in TEMPLATES.glob("*.html")} - {"base.html"} - {p.name for p in TEMPLATES.glob("_*.html")}
    assert set(pages) == templates  # a new page template comes with its line here
    for html in pages.values():
        _safe(html)
        assert html.startswith("<!doctype html>") and "--accent: #017cee" in html  # base.html, with the stylesheet
    assert "<b>0</b> checkpoint IDs" in pages["fleet.html"] and "No checkpoints you may see in this store." in pages["fleet.html"]
    assert "taken outside Airflow (no DAG)" in pages["id.html"] and "Never resumed." in pages["id.html"]
    assert "Delete this checkpoint ID" not in pages["id.html"]  # not without edit permission
    assert "has no checkpoints in the store" in pages["task_instance.html"]
    assert "No drill has run against this store yet" in pages["drills.html"]
    assert "<p class='problem'>store file:///s: not found.</p>" in pages["problem.html"]


def test_the_stylesheet_is_the_static_file_inlined():
    css = (TEMPLATES.parent / "static" / "browser.css").read_text()
    assert f"<style>\n{css.rstrip()}</style>" in views.problem("x")


def test_the_task_instance_tab_tells_each_try_how_it_started_and_what_work_it_lost():
    from cedana_airflow.airflow.browser.data import AirflowTry, tries

    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)

    def m(seq: int, try_number: int, minute: int) -> Manifest:
        return _manifest(seq).model_copy(update={"try_number": try_number, "created_at": t0 + timedelta(minutes=minute)})

    restored = RestoreRecord(checkpoint_id="train-1", outcome="restored", seq=2, try_number=2, from_node="gpu-3",
                             node="gpu-9", at=t0 + timedelta(minutes=25), gap_seconds=900.0, restore_seconds=3.0)
    d = IdDetail(_listing("train-1", OWNER), (m(1, 1, 5), m(2, 1, 10), m(3, 2, 30)), (restored,))
    airflow = [AirflowTry(1, "failed", t0, t0 + timedelta(minutes=14)), AirflowTry(2, "running", t0 + timedelta(minutes=24))]
    one, two = tries(d, airflow)
    assert (one.fresh_reason, [c.seq for c in one.checkpoints], one.lost_seconds) == \
        ("the first try: nothing to resume yet", [1, 2], 240.0)  # died 4 min after its newest checkpoint
    assert two.restore == restored and two.fresh_reason == "" and two.lost_seconds is None  # still running
    # without Airflow's end times, the next try's restore gap bounds the loss (and says so: "≤")
    one, two = tries(d)
    assert (one.lost_seconds, one.lost) == (900.0, "bound")
    assert (two.lost_seconds, two.lost) == (None, "unknown")  # the last try, and no word from Airflow on it
    html = views.task_instance_page("dag", "run", "train", -1, "train-1", [d], airflow)
    assert "fresh: the first try: nothing to resume yet</td>" in html and ">4.0 min</td>" in html
    assert "restored seq 2 from gpu-3: gap 900.0 s, restore 3.00 s</td>" in html and "<td>running</td>" in html
    assert "&le; 15.0 min" in views.task_instance_page("dag", "run", "train", -1, "train-1", [d])


def test_an_id_links_with_its_plus_as_airflows_router_would_write_it():
    """A run's ID holds '+' (its timezone): Airflow decodes the frame's path into its address bar and
    navigates the frame again when the two differ, so a %2B link would load the page twice."""
    cid = "dag_a.train.manual__2026-12-03T03_36_45+00_00-2bdf9c6403=x@y"
    html = views.fleet_page(Fleet((_listing(cid, None),), 0, 0, 0, 0), store_url="file:///s", q="", dag="",
                            sort="id", page=1)
    assert [v for t, k, v in _Page(html).attrs if k == "href" and v.startswith("ids/")] == [f"ids/{cid}"]


def test_fleet_headers_sort_both_ways_and_a_filter_that_matches_nothing_says_so():
    small, big = _listing("a-small", None), _listing("b-big", None)
    big = IdListing(big.checkpoint_id, tuple(r.model_copy(update={"stored_bytes": 10**9}) for r in big.checkpoints))
    fleet = Fleet((small, big), 0, 0, 0, 0)

    def order(sort: str) -> list[str]:
        html = views.fleet_page(fleet, store_url="file:///s", q="", dag="", sort=sort, page=1)
        return [v[len("ids/"):] for t, k, v in _Page(html).attrs if k == "href" and v.startswith("ids/")]

    assert order("stored") == ["b-big", "a-small"] and order("-stored") == ["a-small", "b-big"]  # 0.4's meaning kept
    assert order("id") == ["a-small", "b-big"] and order("-id") == ["b-big", "a-small"]
    html = views.fleet_page(fleet, store_url="file:///s", q="", dag="", sort="stored", page=1)
    # sorted by it now: a second click turns it round
    assert "aria-sort='descending'><a href='?q=&amp;dag=&amp;sort=-stored&amp;page=1'>stored</a><span class='arrow'>▼" in html
    none = views.fleet_page(fleet, store_url="file:///s", q="zzz", dag="", sort="id", page=1)
    assert "No checkpoint ID matches &ldquo;zzz&rdquo;. <a href='?sort=id'>Show all 2</a>." in none
    assert "<table" not in none


def test_times_show_in_the_users_timezone_and_an_unknown_one_is_utc():
    d = IdDetail(_listing("train-1", OWNER), (_manifest(1).model_copy(
        update={"created_at": datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)}),), ())
    assert ">2026-12-01 17:30:00 IST</td>" in views.id_page(d, may_delete=False, tz="Asia/Kolkata")
    assert "data-tz='Asia/Kolkata'" in views.id_page(d, may_delete=False, tz="Asia/Kolkata")
    assert ">2026-12-01 12:00:00 UTC</td>" in views.id_page(d, may_delete=False, tz="No/Such_Zone")
    assert ">2026-12-01 12:00:00 UTC</td>" in views.id_page(d, may_delete=False, tz="../../etc/passwd")


def test_the_id_page_says_the_heartbeat_its_cost_and_the_work_a_failure_loses() -> None:
    page = views.id_page(DETAIL, may_delete=False)
    assert ("Heartbeat <b>7m12s</b> (auto): a checkpoint costs the workload 3.10 s and commits 9.0 s after it starts; "
            "a failure loses ~3m45s of work, failures every ~9.4h.") in page
    fixed = IdDetail(_listing("fixed", None, heartbeat=HeartbeatRow(
        interval_seconds=600, cost_seconds=0.5, expected_loss_seconds=301,
        in_force="every 10m (from the default of heartbeat_seconds)")), (), ())
    page = views.id_page(fixed, may_delete=False)
    assert "Heartbeat <b>10m</b>: a checkpoint costs the workload 0.50 s" in page
    assert "In force: every 10m (from the default of heartbeat_seconds)." in page  # where it came from (0.11.0)
    assert "Heartbeat" not in views.id_page(IdDetail(_listing("none", None), (), ()), may_delete=False)


def test_the_id_page_says_how_many_heartbeats_failed_and_the_latest_line() -> None:
    failing = IdDetail(_listing("serve", None, n=0, failed_heartbeats=20, last_failure="criu dump of pid 7 failed: <sock>"),
                       (), ())
    page = views.id_page(failing, may_delete=False)
    assert ("20 heartbeats failed (the workload kept running); the latest: criu dump of pid 7 failed: &lt;sock&gt;"
            in page)
    assert "heartbeats failed" not in views.id_page(IdDetail(_listing("fine", None), (), ()), may_delete=False)


def test_the_fleet_page_counts_each_id_s_failed_heartbeats_and_sorts_by_them() -> None:
    fleet = Fleet((_listing("fine", None), _listing("serve", None, failed_heartbeats=20, last_failure="criu <sock>")),
                  0, 0, 0, 0)
    html = views.fleet_page(fleet, store_url="file:///s", q="", dag="", sort="-failed", page=1)
    assert "<td class=n title='criu &lt;sock&gt;'>20</td>" in html and ">failed</a>" in html
    assert [v for t, k, v in _Page(html).attrs if k == "href" and v.startswith("ids/")] == ["ids/serve", "ids/fine"]
