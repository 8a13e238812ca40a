"""The checkpoint browser's pages: server-rendered HTML, every value escaped, a little JS for delete.

Pages open inside Airflow's UI (an iframe), so links to Airflow's own pages target the top window,
and links between our pages are relative (a deployment under a path prefix keeps working). Light
and dark follow the browser's preference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from html import escape
from urllib.parse import quote, urlencode

from ..drill.report import DrillReport
from ..format.manifest import AirflowTask
from ..store.listing import IdListing
from .browser_data import Fleet, IdDetail

__all__ = ["drills_page", "fleet_page", "id_page", "problem", "task_instance_page"]

PAGE_SIZE = 50

_STYLE = """
:root { color-scheme: light dark; --fg: #1a202c; --bg: #fff; --muted: #718096; --line: #e2e8f0; --accent: #017cee; }
@media (prefers-color-scheme: dark) { :root { --fg: #e2e8f0; --bg: #1a202c; --muted: #a0aec0; --line: #2d3748; } }
body { font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg); margin: 1.2rem; }
h1 { font-size: 1.3rem; margin: 0 0 .6rem; } h2 { font-size: 1.05rem; margin: 1.4rem 0 .5rem; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .3rem .6rem;
border-bottom: 1px solid var(--line); white-space: nowrap; } th { color: var(--muted); font-weight: 600; }
td.n, th.n { text-align: right; } a { color: var(--accent); text-decoration: none; } .muted { color: var(--muted); }
.totals span { margin-right: 1.6rem; } .problem { border-left: 4px solid #e53e3e; padding: .6rem 1rem; }
pre { background: rgba(127,127,127,.1); padding: .8rem; overflow: auto; max-height: 24rem; }
button.danger { color: #fff; background: #e53e3e; border: 0; padding: .4rem .8rem; border-radius: 4px; cursor: pointer; }
svg { background: rgba(127,127,127,.06); }
"""


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")


def problem(line: str) -> str:
    """A store that cannot be read (or a refused request): one line, never a stack trace."""
    return _page("cedana: problem", f"<h1>Checkpoints</h1><p class='problem'>{escape(line)}</p>")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _age(t: datetime) -> str:
    s = max(0.0, (datetime.now(timezone.utc) - t).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def _link_id(cid: str, prefix: str = "") -> str:
    return f"<a href='{prefix}ids/{quote(cid, safe='')}'>{escape(cid)}</a>"


def _sorted(ids: Sequence[IdListing], sort: str) -> list[IdListing]:
    keys = {
        "id": lambda x: x.checkpoint_id,
        "dag": lambda x: (x.airflow.dag_id if x.airflow else "", x.checkpoint_id),
        "latest": lambda x: -(x.checkpoints[-1].created_at.timestamp() if x.checkpoints else 0),
        "stored": lambda x: -sum(r.stored_bytes for r in x.checkpoints),
    }
    return sorted(ids, key=keys.get(sort, keys["id"]))


def fleet_page(f: Fleet, *, store_url: str, q: str, dag: str, sort: str, page: int) -> str:
    ids = [x for x in f.ids if (not dag or (x.airflow and x.airflow.dag_id == dag))
           and (not q or q.lower() in (x.checkpoint_id + " " + (x.airflow.task_id if x.airflow else "")).lower())]
    ids = _sorted(ids, sort)
    pages = max(1, -(-len(ids) // PAGE_SIZE))
    shown = ids[(page - 1) * PAGE_SIZE: page * PAGE_SIZE]
    rows = []
    for x in shown:
        a, last = x.airflow, (x.checkpoints[-1] if x.checkpoints else None)
        rows.append(
            "<tr>" + f"<td>{_link_id(x.checkpoint_id)}</td>"
            + "".join(f"<td>{escape(v)}</td>" for v in ((a.dag_id, a.task_id, a.run_id) if a else ("", "", "")))
            + f"<td class=n>{a.map_index if a and a.map_index >= 0 else ''}</td>"
            + (f"<td class=n>{last.seq}</td><td>{_age(last.created_at)}</td><td class=n>{_mb(last.image_bytes)}</td>"
               if last else "<td></td><td></td><td></td>")
            + f"<td class=n>{_mb(sum(r.stored_bytes for r in x.checkpoints))}</td>"
            + f"<td class=n>{x.skipped_heartbeats or ''}</td><td class=n>{x.restores or ''}</td></tr>")
    dags = sorted({x.airflow.dag_id for x in f.ids if x.airflow})
    options = "".join(f"<option{' selected' if d == dag else ''}>{escape(d)}</option>" for d in dags)

    def nav(p: int, by: str = sort) -> str:
        return "?" + urlencode({"q": q, "dag": dag, "sort": by, "page": p})

    sort_links = " ".join(f"<a href='{escape(nav(1, k))}'>{k}</a>" for k in ("id", "dag", "latest", "stored"))
    body = (
        "<h1>Checkpoints</h1>"
        f"<p class='muted'>store {escape(store_url)} &middot; <a href='drills'>fleet drills</a></p>"
        f"<p class='totals'><span><b>{len(f.ids)}</b> checkpoint IDs</span><span><b>{_mb(f.stored_bytes)}</b> stored</span>"
        f"<span><b>{f.checkpoints_last_hour}</b> checkpoints in the last hour</span><span><b>{f.restores_last_day}</b> restores in the last day ({f.restores} in all)</span></p>"
        "<form method='get'><input name='q' placeholder='filter: ID or task' value='" + escape(q) + "'> "
        f"<select name='dag'><option value=''>all DAGs</option>{options}</select> <button>Filter</button>"
        f" <span class='muted'>sort: {sort_links}</span></form>"
        + ("<p class='muted'>No checkpoints you may see in this store.</p>" if not f.ids else
           "<table><tr><th>checkpoint ID</th><th>DAG</th><th>task</th><th>run</th><th class=n>map</th>"
           "<th class=n>latest seq</th><th>age</th><th class=n>image</th><th class=n>stored</th>"
           "<th class=n>skipped</th><th class=n>restores</th></tr>" + "".join(rows) + "</table>")
        + (f"<p>page {page} of {pages} " + (f"<a href='{escape(nav(page - 1))}'>previous</a> " if page > 1 else "")
           + (f"<a href='{escape(nav(page + 1))}'>next</a>" if page < pages else "") + "</p>" if pages > 1 else "")
    )
    return _page("Checkpoints", body)


def _chart(values: Sequence[float], label: str) -> str:
    """A small bar chart, no library: one bar per checkpoint."""
    if not values:
        return ""
    top, w, h = max(values) or 1.0, 360, 60
    bw = w / len(values)
    bars = "".join(f"<rect x='{i * bw:.1f}' y='{h - v / top * h:.1f}' width='{max(bw - 1, 1):.1f}' "
                   f"height='{v / top * h:.1f}' fill='#017cee'><title>{v:g}</title></rect>" for i, v in enumerate(values))
    return f"<div><span class='muted'>{escape(label)} (max {top:g})</span><br><svg width='{w}' height='{h}'>{bars}</svg></div>"


def _airflow_links(a: AirflowTask | None, prefix: str) -> str:
    if a is None:
        return "<span class='muted'>taken outside Airflow (no DAG)</span>"
    run = f"{prefix}dags/{quote(a.dag_id, safe='')}/runs/{quote(a.run_id, safe='')}"
    return (f"DAG <a target='_top' href='{escape(prefix)}dags/{quote(a.dag_id, safe='')}'>{escape(a.dag_id)}</a>, "
            f"run <a target='_top' href='{escape(run)}'>{escape(a.run_id)}</a>, "
            f"task <a target='_top' href='{escape(run)}/tasks/{quote(a.task_id, safe='')}'>{escape(a.task_id)}</a>"
            + (f" [{a.map_index}]" if a.map_index >= 0 else ""))


def _restores_table(d: IdDetail) -> str:
    if not d.restores:
        return "<p class='muted'>Never resumed.</p>"
    rows = "".join(
        f"<tr><td>{escape(r.at.isoformat()[:19])}</td><td class=n>{r.try_number}</td><td>{escape(r.outcome)}</td>"
        f"<td class=n>{r.seq if r.seq is not None else ''}</td><td>{escape(r.from_node)}</td><td>{escape(r.node)}</td>"
        f"<td class=n>{r.gap_seconds:.1f} s</td><td class=n>{r.restore_seconds:.2f} s</td>"
        f"<td>{escape(r.reason or '; '.join(r.refused))}</td></tr>" for r in d.restores)
    return ("<table><tr><th>when</th><th class=n>try</th><th>outcome</th><th class=n>seq</th><th>from node</th>"
            "<th>onto node</th><th class=n>gap</th><th class=n>restore</th><th>why / refused</th></tr>" + rows + "</table>")


def _checkpoints_table(d: IdDetail) -> str:
    rows = "".join(
        f"<tr><td class=n>{m.seq}</td><td class=n>{m.try_number}</td><td>{escape(m.node)}</td>"
        f"<td>{escape(m.created_at.isoformat()[:19])}</td><td class=n>{_mb(m.image_bytes)}</td>"
        f"<td class=n>{_mb(m.stored_bytes)}</td><td class=n>{m.new_chunks}</td><td class=n>{m.freeze_seconds:.3f} s</td>"
        f"<td>{escape(f'{len(m.gpu.processes)} process(es), {m.gpu.checkpoint_seconds:.2f} s copy-out on ' + ', '.join(m.gpu.gpus)) if m.gpu else ''}</td></tr>"
        for m in d.manifests)
    return ("<table><tr><th class=n>seq</th><th class=n>try</th><th>node</th><th>created</th><th class=n>image</th>"
            "<th class=n>stored</th><th class=n>new chunks</th><th class=n>freeze</th><th>GPU</th></tr>" + rows + "</table>")


def id_page(d: IdDetail, *, may_delete: bool) -> str:
    x = d.listing
    newest = d.manifests[-1] if d.manifests else None
    manifest_json = json.dumps(newest.model_dump(mode="json", exclude=newest.absent_blocks()), indent=1) if newest else ""
    delete = ("<p><button class='danger' onclick=\"if (confirm('Delete every checkpoint of " + escape(x.checkpoint_id)
              + "? A retry will then start fresh.')) fetch('../api/v1/checkpoints/" + quote(x.checkpoint_id, safe='')
              + "', {method: 'DELETE'}).then(r => r.json()).then(j => { document.getElementById('deleted').textContent = "
              "j.detail || ('deleted ' + j.deleted_checkpoints + ' checkpoint(s)'); })\">Delete this checkpoint ID</button> "
              "<span id='deleted' class='muted'></span></p>") if may_delete else ""
    body = (
        f"<p><a href='../'>all checkpoints</a></p><h1>{escape(x.checkpoint_id)}</h1>"
        f"<p>{_airflow_links(x.airflow, '../../')}</p>"
        f"<h2>Checkpoints</h2>{_checkpoints_table(d)}"
        + _chart([m.stored_bytes / 1e6 for m in d.manifests], "stored MB per checkpoint")
        + _chart([m.freeze_seconds for m in d.manifests], "freeze seconds per checkpoint")
        + f"<h2>Restores</h2>{_restores_table(d)}"
        + (f"<h2>Newest manifest (seq {newest.seq})</h2><pre>{escape(manifest_json)}</pre>" if newest else "")
        + delete
    )
    return _page(x.checkpoint_id, body)


def task_instance_page(dag_id: str, run_id: str, task_id: str, map_index: int, default_id: str,
                       details: Sequence[IdDetail]) -> str:
    title = f"{dag_id}.{task_id}" + (f"[{map_index}]" if map_index >= 0 else "")
    if not details:
        return _page(title, (
            f"<h1>Checkpoints of {escape(title)}</h1><p>This task instance has no checkpoints in the store. Either it is "
            "not checkpointed (not a checkpointed operator, or out of the opt-in list's scope: the task log says which), "
            f"or it has not reached its first heartbeat yet, or its checkpoints were deleted after it succeeded.</p>"
            f"<p class='muted'>Its default checkpoint ID would be {escape(default_id)}.</p>"))
    parts = [f"<h1>Checkpoints of {escape(title)}</h1><p class='muted'>run {escape(run_id)}</p>"]
    for d in details:
        by_try: dict[int, list[int]] = {}
        for m in d.manifests:
            by_try.setdefault(m.try_number, []).append(m.seq)
        tries = "".join(f"<li>try {t}: seq {', '.join(map(str, seqs))}</li>" for t, seqs in sorted(by_try.items()))
        parts.append(f"<h2>{_link_id(d.listing.checkpoint_id)}</h2><ul>{tries}</ul>"
                     f"<h2>What each try resumed</h2>{_restores_table(d)}")
    return _page(title, "".join(parts))


def _secs(v: float | None) -> str:
    return "" if v is None else f"{v:.2f} s"


def _drill_result(r: DrillReport) -> str:
    """Dry runs and drills that did nothing are neither a pass nor a failure (trends leave them out)."""
    if r.dry_run:
        return "dry run"
    if r.stopped:
        return "did nothing"
    return "pass" if r.ok else "<b>FAIL</b>"


def drills_page(reports: Sequence[DrillReport], figures: dict[str, dict[str, object]]) -> str:
    """Every drill report, newest first, with the trend per mode on top."""
    def pct(t: dict[str, object], name: str) -> str:
        p = t[name]
        assert isinstance(p, dict)
        return f"{_secs(p['p50'])} / {_secs(p['p95'])}"

    trend_rows = "".join(
        f"<tr><td>{escape(mode)}</td><td class=n>{t['passed']} of {t['drills']}</td><td class=n>{pct(t, 'rto_seconds')}</td>"
        f"<td class=n>{pct(t, 'restore_seconds')}</td><td class=n>{pct(t, 'lost_work_seconds')}</td></tr>"
        for mode, t in figures.items())
    rows = "".join(
        f"<tr><td>{escape(r.drill_id)}</td><td>{escape(r.mode)}</td><td>{_drill_result(r)}</td>"
        f"<td>{escape(r.node)}</td><td class=n>{_secs(r.rto_seconds)}</td><td class=n>{_secs(r.restore_seconds)}</td>"
        f"<td class=n>{_secs(r.lost_work_seconds)}</td><td>{'' if r.digest_match is None else ('yes' if r.digest_match else 'NO')}</td>"
        f"<td>{escape('; '.join([*r.problems, *([r.stopped] if r.stopped else [])]))}</td></tr>" for r in reversed(reports))
    body = (
        "<p><a href='./'>all checkpoints</a></p><h1>Fleet drills</h1>"
        + ("<p class='muted'>No drill has run against this store yet: <code>cedana-airflow drill verify</code> or "
           "<code>drill canary</code>.</p>" if not reports else
           "<table><tr><th>mode</th><th class=n>passed</th><th class=n>RTO p50 / p95</th>"
           "<th class=n>restore p50 / p95</th><th class=n>lost work p50 / p95</th></tr>" + trend_rows + "</table>"
           "<h2>Reports</h2><table><tr><th>drill</th><th>mode</th><th>result</th><th>node</th><th class=n>RTO</th>"
           "<th class=n>restore</th><th class=n>lost work</th><th>output matches</th><th>problems</th></tr>"
           + rows + "</table>")
    )
    return _page("Fleet drills", body)
