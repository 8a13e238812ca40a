"""The checkpoint browser's pages: what each template is given, and the rendering.

The markup lives in ``templates/`` (every page extends ``base.html``, which inlines
``static/browser.css`` and ``static/browser.js``); this module picks, sorts, pages and measures, and
hands the templates plain values. Jinja2 autoescapes every one of them, so whatever came from the
store (checkpoint IDs, DAG and task IDs, node names, reasons) or from the request (the filter)
reaches the page escaped, and nothing here builds markup (chart.py's SVG escapes its own text).

Pages open inside Airflow's UI (a sandboxed iframe), so links to Airflow's own pages carry
``data-top`` and the page's script moves Airflow's window to them; links between our pages are
relative (a deployment under a path prefix keeps working). Times are shown in the user's Airflow
timezone (the script hands it over in a cookie), sizes in binary units.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode
from zoneinfo import ZoneInfo

from jinja2 import Environment, FileSystemLoader, StrictUndefined, pass_context
from jinja2.runtime import Context

from ...drill.report import DrillReport
from ...store.listing import IdListing
from ...units import duration_text
from ...units import binary_size
from .chart import checkpoint_chart
from .data import AirflowTry, Fleet, IdDetail, tries

__all__ = ["PAGE_SIZE", "SORTS", "drills_page", "fleet_page", "id_page", "problem", "task_instance_page", "zone"]

PAGE_SIZE = 50
#: The package folder: templates/ and static/ are looked up under it, by those names.
_HERE = Path(__file__).parent


@cache
def _env() -> Environment:
    """Made on first use, so importing this module reads no file. The templates ship with the package
    and are read once (no ``auto_reload``: a page costs no stat calls)."""
    env = Environment(loader=FileSystemLoader(_HERE), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True, auto_reload=False)
    env.filters.update(size=binary_size, age=_age, secs=_secs, duration=duration_text, urlpart=_urlpart, idpart=_idpart, when=_when)
    return env


def zone(name: str | None) -> tzinfo:
    """The user's timezone by its IANA name; UTC for none or one this machine does not know."""
    if name and name not in ("UTC", "Etc/UTC"):
        try:
            return ZoneInfo(name)
        except (ValueError, KeyError, OSError):  # unknown or malformed: never a failed page
            pass
    return timezone.utc


def _render(template: str, *, tz: str = "UTC", **context: Any) -> str:
    """``tz``: the name the request asked for (cookie or ?tz=); the script compares it with the user's."""
    return _env().get_template(f"templates/{template}").render(tz=zone(tz), tz_asked=tz, **context)


# -- filters: values to text (the templates escape what they return) -----------------------------
def _age(t: datetime) -> str:
    s = max(0.0, (datetime.now(timezone.utc) - t).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


@pass_context
def _when(ctx: Context, t: datetime) -> str:
    """A time in the user's timezone, with the zone's abbreviation (Airflow shows times this way)."""
    local = t.astimezone(ctx["tz"])
    return local.strftime("%Y-%m-%d %H:%M:%S ") + (local.tzname() or "")


def _secs(v: float | None) -> str:
    return "" if v is None else f"{v:.2f} s"


def _urlpart(s: str) -> str:
    """One path segment of a URL: every character but letters, digits and ``_.-~`` percent-encoded."""
    return quote(s, safe="")


def _idpart(checkpoint_id: str) -> str:
    """A checkpoint ID as a path segment, its ``= + @`` left as they are (all legal in a path).

    Airflow's router decodes the frame's path into its own address bar and, when the frame's path
    differs from what it decoded, navigates the frame again: a ``%2B`` link would load every page
    twice (and cut short whatever the user did in the first).
    """
    return quote(checkpoint_id, safe="=+@")


# -- pages --------------------------------------------------------------------------------------
def problem(line: str, *, tz: str = "UTC") -> str:
    """A store that cannot be read (or a refused request): one line, never a stack trace."""
    return _render("problem.html", tz=tz, line=line)


def _newest(x: IdListing) -> float:
    return x.checkpoints[-1].created_at.timestamp() if x.checkpoints else 0.0


#: The fleet table's columns, by ``?sort=`` key: (header, key function, right-aligned). A key sorts by its
#: function, ``-key`` the other way round. ``latest`` (by age: newest first) and ``stored`` (largest
#: first) keep the meaning they had in 0.4's URLs, so ``stored`` is the one whose plain key descends.
SORTS: dict[str, tuple[str, Callable[[IdListing], Any], bool]] = {
    "id": ("checkpoint ID", lambda x: x.checkpoint_id, False),
    "dag": ("DAG", lambda x: (x.airflow.dag_id if x.airflow else "", x.checkpoint_id), False),
    "task": ("task", lambda x: (x.airflow.task_id if x.airflow else "", x.checkpoint_id), False),
    "run": ("run", lambda x: (x.airflow.run_id if x.airflow else "", x.checkpoint_id), False),
    "seq": ("latest seq", lambda x: x.checkpoints[-1].seq if x.checkpoints else 0, True),
    "latest": ("age", lambda x: -_newest(x), False),
    "image": ("image", lambda x: x.checkpoints[-1].image_bytes if x.checkpoints else 0, True),
    "stored": ("stored", lambda x: -sum(r.stored_bytes for r in x.checkpoints), True),
    "skipped": ("skipped", lambda x: x.skipped_heartbeats, True),
    "failed": ("failed", lambda x: x.failed_heartbeats, True),  # heartbeats that failed (0.11.0)
    "restores": ("restores", lambda x: x.restores, True),
}
_DESCENDING_KEYS = {"stored"}  # their plain key puts the largest first
_FIRST_CLICK = {"id": "id", "dag": "dag", "task": "task", "run": "run", "latest": "latest", "stored": "stored",
                "seq": "-seq", "image": "-image", "skipped": "-skipped", "failed": "-failed",
                "restores": "-restores"}


def _sorted(ids: Sequence[IdListing], sort: str) -> list[IdListing]:
    key = sort.lstrip("-")
    _, fn, _ = SORTS.get(key, SORTS["id"])
    return sorted(ids, key=fn, reverse=sort.startswith("-") and key in SORTS)


@dataclass(frozen=True)
class _Header:
    label: str
    href: str
    arrow: str  # "" when the table is not sorted by it, else which way it reads now (age: youngest first is up)
    numeric: bool


def _headers(sort: str, nav: Callable[[int, str], str]) -> list[_Header]:
    out = []
    for key, (label, _, numeric) in SORTS.items():
        sorted_by = sort.lstrip("-") == key
        nxt = (key if sort.startswith("-") else "-" + key) if sorted_by else _FIRST_CLICK[key]
        down = sort.startswith("-") != (key in _DESCENDING_KEYS)
        out.append(_Header(label, nav(1, nxt), ("▼" if down else "▲") if sorted_by else "", numeric))
    return out


def fleet_page(f: Fleet, *, store_url: str, q: str, dag: str, sort: str, page: int, may_read_drills: bool = True,
               tz: str = "UTC") -> str:
    ids = [x for x in f.ids if (not dag or (x.airflow and x.airflow.dag_id == dag))
           and (not q or q.lower() in (x.checkpoint_id + " " + (x.airflow.task_id if x.airflow else "")).lower())]
    ids = _sorted(ids, sort)
    pages = max(1, -(-len(ids) // PAGE_SIZE))
    page = min(page, pages)

    def nav(p: int, by: str = sort) -> str:
        return "?" + urlencode({"q": q, "dag": dag, "sort": by, "page": p})

    return _render(
        "fleet.html", tz=tz, fleet=f, shown=ids[(page - 1) * PAGE_SIZE: page * PAGE_SIZE], matched=len(ids),
        store_url=store_url, q=q, dag=dag, dags=sorted({x.airflow.dag_id for x in f.ids if x.airflow}),
        headers=_headers(sort, nav), sort_key=sort, clear_href="?" + urlencode({"sort": sort}),
        may_read_drills=may_read_drills, page=page, pages=pages, previous_href=nav(page - 1) if page > 1 else "", next_href=nav(page + 1) if page < pages else "")


def id_page(d: IdDetail, *, may_delete: bool, tz: str = "UTC") -> str:
    newest = d.manifests[-1] if d.manifests else None
    manifest_json = json.dumps(newest.model_dump(mode="json", exclude=newest.absent_blocks()), indent=1) if newest else ""
    chart = checkpoint_chart(d.manifests, d.restores, tz=zone(tz))
    return _render("id.html", tz=tz, d=d, x=d.listing, chart=chart, newest=newest, manifest_json=manifest_json,
                   may_delete=may_delete)


def task_instance_page(dag_id: str, run_id: str, task_id: str, map_index: int, default_id: str,
                       details: Sequence[IdDetail], airflow_tries: Sequence[AirflowTry] = (), *, tz: str = "UTC") -> str:
    title = f"{dag_id}.{task_id}" + (f"[{map_index}]" if map_index >= 0 else "")
    sections = [(d, tries(d, airflow_tries)) for d in details]
    return _render("task_instance.html", tz=tz, title=title, run_id=run_id, default_id=default_id, sections=sections)


def drills_page(reports: Sequence[DrillReport], figures: dict[str, dict[str, object]], *, tz: str = "UTC") -> str:
    """Every drill report, newest first, with the trend per mode on top."""
    return _render("drills.html", tz=tz, reports=list(reversed(reports)), figures=figures)
