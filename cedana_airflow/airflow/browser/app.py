"""The checkpoint browser's routes: the FastAPI app the ``cedana`` plugin mounts at ``/cedana`` in the api-server.

A mounted plugin app inherits no auth from Airflow's core API, so every route here depends on
Airflow's own ``get_user`` (a Bearer token or the UI's cookie: 401 without one, or with one that is
not valid) and asks the auth manager about the DAG of each manifest, restore record and index row
(data.py filters by it: an ID is no one DAG's). A route for one ID answers 404 alike when the store
has none and when none of it is the user's: IDs derive from DAG, task and run, so a 403 would tell
who may not read a DAG that it has checkpoints. Deleting an ID needs edit permission on every DAG
named under it. No route shows a credential: pages show the store's URL (credentials
in URLs are masked) and what manifests and restore records hold.

The JSON API answers with an ETag (a hash of the body; ``If-None-Match`` gets 304) and
``Cache-Control: private, no-cache``: the answer is per user, and a poller pays for a body only
when it changed.

Routes (the JSON API is a contract, README "Checkpoint browser")::

    GET    /cedana/                                  fleet page (the nav item)
    GET    /cedana/ids/{checkpoint_id}               one ID: checkpoints, restores, manifests
    GET    /cedana/ti?dag_id=&run_id=&task_id=&map_index=   the task-instance tab
    GET    /cedana/api/v1/checkpoints                the same shape as `checkpoints --json`
    GET    /cedana/api/v1/checkpoints/{checkpoint_id}   one ID, with its restores (?files=false, ?manifests=false)
    GET    /cedana/drills, /cedana/api/v1/drills    drill reports and trends (users who may read every DAG)
    DELETE /cedana/api/v1/checkpoints/{checkpoint_id}   its manifests (chunks go at the next gc)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Set
from functools import cache
from typing import Annotated, Any
from urllib.parse import unquote

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder as jsonable
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ...config import redact
from ...drill.report import DrillReport, list_reports
from ...drill.run import drills_json
from ...drill.trends import trends
from ...errors import CedanaError, CheckpointIdError
from ...ids import derive_checkpoint_id, validate_checkpoint_id
from ...store.base import Store
from ...store.gc import delete_checkpoint_id
from ...store.listing import IdListing, as_json, list_store
from . import views
from .data import AirflowTry, IdDetail, MayRead, StoreCache, fleet, id_detail, scoped, visible

__all__ = ["app", "store_cache"]

log = logging.getLogger(__name__)

app = FastAPI(title="cedana-airflow checkpoint browser", docs_url=None, redoc_url=None, openapi_url=None)
store_cache = StoreCache()


def _get_user() -> Callable[..., Any]:
    from airflow.api_fastapi.core_api.security import get_user

    return get_user


User = Annotated[Any, Depends(_get_user())]


def _team(dag_id: str) -> str | None:
    try:
        from airflow.models.dag import DagModel

        return DagModel.get_team_name(dag_id)
    except Exception:  # teams are optional; a lookup failure must not open or close access by itself
        return None


def _allowed(user: Any, dag_id: str | None, method: str = "GET") -> bool:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    details = DagDetails(id=dag_id, team_name=_team(dag_id)) if dag_id else None  # None: every DAG
    return bool(get_auth_manager().is_authorized_dag(method=method, details=details, user=user))  # type: ignore[arg-type]


def _may_read(user: Any, method: str = "GET") -> MayRead:
    return cache(lambda dag_id: _allowed(user, dag_id, method))  # one question per DAG a request


#: Opened stores by (URL, connection): building an S3 client (its service model, a connection lookup)
#: costs more than a page; kept for a few minutes, so a rotated connection is picked up.
_STORE_SECONDS = 300.0
_stores: dict[tuple[str, str | None], tuple[float, Store]] = {}


def _store() -> Store:
    from ..config import task_settings
    from ...hooks.store import task_store

    settings, options = task_settings()
    key = (settings.resolved_store(), options.aws_conn_id)
    hit = _stores.get(key)
    if hit is not None and time.monotonic() - hit[0] < _STORE_SECONDS:
        return hit[1]
    store = task_store(settings, options.aws_conn_id)
    _stores[key] = (time.monotonic(), store)
    return store


def _listing(store: Store) -> list[IdListing]:
    return store_cache.listing(store)


def _one(store: Store, checkpoint_id: str, may_read: MayRead) -> IdListing:
    """One ID the user may read some of, as listed (id_detail scopes it): 404 when the store has none,
    and the same 404 when none of it is theirs (a 403 would confirm that a DAG they may not read has
    checkpoints)."""
    try:
        validate_checkpoint_id(checkpoint_id)
    except CheckpointIdError as e:
        raise HTTPException(400, str(e)) from None
    found = next((x for x in _listing(store) if x.checkpoint_id == checkpoint_id), None)
    if found is None or scoped(found, may_read) is None:
        # Not in the cached listing (maybe newer than it) or not the user's: read this one ID from the
        # store either way (a handful of reads, never the whole store), so that a forbidden ID costs the
        # time a missing one does and the answer's timing tells nothing either.
        fresh = list_store(store, checkpoint_id)
        found = fresh[0] if fresh else None
    if found is None or scoped(found, may_read) is None:
        raise HTTPException(404, f"no checkpoints under checkpoint ID {checkpoint_id!r} that you may read")
    return found


def _store_problem(e: CedanaError) -> str:
    return str(redact(str(e)))


# -- JSON API -----------------------------------------------------------------------------------
def _json(request: Request, payload: Any) -> Response:
    """``payload`` with a strong ETag of its bytes; 304 and no body when the caller has them already."""
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    tag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {"ETag": tag, "Cache-Control": "private, no-cache", "Vary": "Authorization, Cookie"}
    asked = {t.strip().removeprefix("W/") for t in request.headers.get("if-none-match", "").split(",")}
    if tag in asked or "*" in asked:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


@app.get("/api/v1/checkpoints")
def api_checkpoints(request: Request, user: User) -> Response:
    try:
        listed = visible(_listing(_store()), _may_read(user))
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)
    return _json(request, [as_json(x) for x in listed])


def _detail(store: Store, checkpoint_id: str, user: Any) -> IdDetail:
    may_read = _may_read(user)
    return id_detail(store, _one(store, checkpoint_id, may_read), may_read)


@app.get("/api/v1/checkpoints/{checkpoint_id}")
def api_checkpoint(request: Request, checkpoint_id: str, user: User, files: bool = True,
                   manifests: bool = True) -> Response:
    """The ID, its restores and its manifests. Most of a manifest's bytes are its ``files`` (every
    image file with its chunk list: about 8 KB per checkpoint of a 77 MiB job): ``files=false``
    leaves those lists out, ``manifests=false`` every manifest (the ``checkpoints`` rows remain)."""
    try:
        detail = _detail(_store(), checkpoint_id, user)
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)
    x = detail.listing
    out: dict[str, Any] = {**as_json(x), "restores": [r.model_dump(mode="json") for r in detail.restores],
                           "restore_count": x.restores, "partial": detail.partial}
    if manifests:
        out["manifests"] = [m.model_dump(mode="json", exclude=m.absent_blocks() | (set() if files else {"files"}))
                            for m in detail.manifests]
    return _json(request, out)


@app.delete("/api/v1/checkpoints/{checkpoint_id}")
def api_delete(checkpoint_id: str, user: User) -> JSONResponse:
    try:
        store = _store()
        detail = _detail(store, checkpoint_id, user)  # its manifests and records read now, not the index's word
        refused = _may_not_delete(checkpoint_id, detail.dags, user)
        if refused:
            raise HTTPException(403, refused)
        # only what was judged: a checkpoint written since (another DAG's, maybe) is not this user's to take
        removed = delete_checkpoint_id(store, checkpoint_id, detail.seqs)
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)
    store_cache.clear()
    who = getattr(user, "get_name", lambda: "?")()
    dags = sorted(detail.dags, key=lambda d: (d is None, d or ""))
    log.warning("cedana: checkpoint ID %s (DAG %s) deleted by %s: %d checkpoint(s)", checkpoint_id,
                ", ".join(map(str, dags)), who, removed)
    _audit(who, checkpoint_id, dags, removed)
    return JSONResponse({"id": checkpoint_id, "deleted_checkpoints": removed})


def _may_not_delete(checkpoint_id: str, dags: Set[str | None], user: Any) -> str:
    """Why the user may not delete an ID ("" when they may): deleting takes every item under it, so it
    needs edit permission on each DAG they name (an item no DAG owns: on every DAG). The line names
    only DAGs the user may read: no other answer tells which DAGs have checkpoints."""
    may_edit, may_read = _may_read(user, "PUT"), _may_read(user)
    missing = [d for d in dags if not may_edit(d)]
    if not missing:
        return ""
    named = sorted(f"{d!r}" for d in missing if d is not None and may_read(d))
    unread = sum(1 for d in missing if d is not None and not may_read(d))
    parts = named + ([f"{unread} DAG(s) you may not read"] if unread else []) + \
        (["every DAG (some of it was taken outside Airflow)"] if None in missing else [])
    return (f"deleting checkpoint ID {checkpoint_id!r} needs edit permission on every DAG that has checkpoints "
            f"or restores under it; missing: {', '.join(parts)}")


def _audit(who: str, checkpoint_id: str, dags: list[str | None], removed: int) -> None:
    """Airflow's audit log (Browse > Audit Log) records who deleted what: a row for each DAG involved."""
    extra = f"checkpoint_id={checkpoint_id} checkpoints={removed}"
    if len(dags) > 1:
        extra += " dags=" + ",".join(d or "-" for d in dags)
    try:
        from airflow.models.log import Log
        from airflow.utils.session import create_session

        with create_session() as session:
            for dag in dags:
                session.add(Log(event="cedana.delete_checkpoint_id", owner=who, dag_id=dag, extra=extra))
    except Exception as e:  # the deletion happened; a missing audit row is logged, not hidden
        log.warning("cedana: audit log not written for the deletion of %s: %s", checkpoint_id, e)


def _drill_reports(user: Any) -> list[DrillReport]:
    """Drill reports span the fleet (and name IDs of many DAGs): for users who may read every DAG."""
    if not _allowed(user, None):
        raise HTTPException(403, "drill reports are for users who may read every DAG")
    return list_reports(_store())


@app.get("/api/v1/drills")
def api_drills(request: Request, user: User) -> Response:
    try:
        return _json(request, drills_json(_drill_reports(user)))
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)


# -- pages --------------------------------------------------------------------------------------
def _tz(request: Request) -> str:
    """The timezone to show times in: ``?tz=``, else the cookie the page's script sets from the user's
    Airflow setting; views.zone() falls back to UTC for a name it does not know."""
    return unquote(request.query_params.get("tz") or request.cookies.get("cedana_tz") or "UTC")[:64]


def _problem(request: Request, line: str, status: int, headers: dict[str, str] | None = None) -> HTMLResponse:
    return HTMLResponse(views.problem(line, tz=_tz(request)), status_code=status, headers=headers)


@app.get("/drills", response_class=HTMLResponse)
def page_drills(request: Request, user: User) -> HTMLResponse:
    try:
        reports = _drill_reports(user)
    except CedanaError as e:
        return _problem(request, _store_problem(e), 503)
    return HTMLResponse(views.drills_page(reports, trends(reports), tz=_tz(request)))


@app.get("/", response_class=HTMLResponse)
def page_fleet(request: Request, user: User, q: str = "", dag: str = "", sort: str = "id",
               page: Annotated[int, Query(ge=1)] = 1) -> HTMLResponse:
    try:
        store = _store()
        f = fleet(_listing(store), _may_read(user))
    except CedanaError as e:
        return _problem(request, _store_problem(e), 503)
    return HTMLResponse(views.fleet_page(f, store_url=str(redact(store.url)), q=q, dag=dag, sort=sort, page=page,
                                         may_read_drills=_allowed(user, None), tz=_tz(request)))


@app.get("/ids/{checkpoint_id}", response_class=HTMLResponse)
def page_id(request: Request, checkpoint_id: str, user: User) -> HTMLResponse:
    try:
        detail = _detail(_store(), checkpoint_id, user)
    except CedanaError as e:
        return _problem(request, _store_problem(e), 503)
    return HTMLResponse(views.id_page(detail, may_delete=not _may_not_delete(checkpoint_id, detail.dags, user),
                                      tz=_tz(request)))


def _airflow_tries(dag_id: str, run_id: str, task_id: str, map_index: int) -> list[AirflowTry]:
    """Each try's state and times from Airflow's own tables (its history, and the current try).
    Best effort: without them the tab still shows what the store knows."""
    try:
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.taskinstancehistory import TaskInstanceHistory
        from airflow.utils.session import create_session
        from sqlalchemy import select

        out: dict[int, AirflowTry] = {}
        with create_session() as session:
            for model in (TaskInstanceHistory, TaskInstance):  # the current try last: it wins
                rows = session.execute(select(model.try_number, model.state, model.start_date, model.end_date).where(
                    model.dag_id == dag_id, model.run_id == run_id, model.task_id == task_id,
                    model.map_index == map_index))
                for n, state, start, end in rows:
                    out[n] = AirflowTry(n, str(getattr(state, "value", state)) if state else None, start, end)
        return sorted(out.values(), key=lambda t: t.try_number)
    except Exception as e:  # an older schema, a DB hiccup: the tab loses Airflow's view, not its page
        log.debug("cedana: task instance tries not read for %s.%s: %s", dag_id, task_id, e)
        return []


@app.get("/ti", response_class=HTMLResponse)
def page_task_instance(request: Request, user: User, dag_id: str, run_id: str, task_id: str,
                       map_index: str = "-1") -> HTMLResponse:
    if not _allowed(user, dag_id):
        raise HTTPException(403, f"you may not read DAG {dag_id!r}")
    # Airflow's UI puts the run ID into the tab's href as it is, so the '+' of '+00:00' arrives as a
    # space; run IDs never hold spaces (allowed_run_id_pattern), so this undoes exactly that.
    run_id = run_id.replace(" ", "+")
    # An unmapped task's page leaves the {MAP_INDEX} token unreplaced (seen with Airflow 3.3): not mapped.
    index = int(map_index) if map_index.lstrip("-").isdigit() else -1
    try:
        store = _store()
        default = derive_checkpoint_id(dag_id, task_id, run_id, map_index=index)
        may_read = _may_read(user)
        mine = [x for x in _listing(store) if x.checkpoint_id == default or (
            x.airflow is not None and (x.airflow.dag_id, x.airflow.task_id, x.airflow.run_id, x.airflow.map_index)
            == (dag_id, task_id, run_id, index))]
        # each manifest's and record's own DAG decides what shows, neither the URL's nor the ID's newest
        details = [id_detail(store, x, may_read) for x in mine if scoped(x, may_read) is not None]
    except CedanaError as e:
        return _problem(request, _store_problem(e), 503)
    return HTMLResponse(views.task_instance_page(dag_id, run_id, task_id, index, default, details,
                                                 _airflow_tries(dag_id, run_id, task_id, index) if details else (),
                                                 tz=_tz(request)))


def _is_api(request: Request) -> bool:
    return "/api/v1/" in request.url.path  # the JSON API answers JSON; pages answer a page


@app.exception_handler(HTTPException)
def _http_error(request: Request, e: HTTPException) -> Response:
    status, detail, headers = e.status_code, str(e.detail), dict(e.headers or {})
    if status == 403 and detail == "Invalid JWT token":
        # Airflow's get_user says 403 for a token it cannot verify; for this app (and RFC 6750) a
        # credential that is not valid is 401: log in again
        status, detail, headers = 401, "invalid token: log in again (or ask POST /auth/token for a new one)", \
            {**headers, "WWW-Authenticate": 'Bearer error="invalid_token"'}
    if _is_api(request):
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)
    return _problem(request, detail, status, headers)


@app.exception_handler(RequestValidationError)
def _bad_request(request: Request, e: RequestValidationError) -> Response:
    """A malformed query (``?page=abc``): one line naming the parameter on a page; the JSON API keeps
    FastAPI's 422 body, which callers parse."""
    if _is_api(request):
        return JSONResponse({"detail": jsonable(e.errors())}, status_code=422)
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err.get("loc", ())[1:]) or "the request"
        parts.append(f"{where}: {err.get('msg', 'not valid')} (got {err.get('input')!r})")
    return _problem(request, "bad request: " + "; ".join(parts), 400)
