"""The checkpoint browser: a FastAPI app the ``cedana`` plugin mounts at ``/cedana`` in the api-server.

A mounted plugin app inherits no auth from Airflow's core API, so every route here depends on
Airflow's own ``get_user`` (a Bearer token or the UI's cookie: 401 without one) and asks the auth
manager about each DAG (browser_data.py filters by it; a route for one ID answers 403 when its DAG is
not readable, and deleting needs edit permission on it). No route shows a credential: pages show
the store's URL (credentials in URLs are masked) and what manifests and restore records hold.

Routes (the JSON API is a contract, README "Checkpoint browser")::

    GET    /cedana/                                  fleet page (the nav item)
    GET    /cedana/ids/{checkpoint_id}               one ID: checkpoints, restores, manifests
    GET    /cedana/ti?dag_id=&run_id=&task_id=&map_index=   the task-instance tab
    GET    /cedana/api/v1/checkpoints                the same shape as `checkpoints --json`
    GET    /cedana/api/v1/checkpoints/{checkpoint_id}   one ID, with its restores
    GET    /cedana/drills, /cedana/api/v1/drills    drill reports and trends (users who may read every DAG)
    DELETE /cedana/api/v1/checkpoints/{checkpoint_id}   its manifests (chunks go at the next gc)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse

from ..config import redact
from ..drill.report import DrillReport, list_reports
from ..drill.run import drills_json
from ..drill.trends import trends
from ..errors import CedanaError, CheckpointIdError
from ..ids import derive_checkpoint_id, validate_checkpoint_id
from ..store.base import Store
from ..store.gc import delete_checkpoint_id
from ..store.listing import IdListing, as_json
from . import browser_html as html
from .browser_data import IdDetail, MayRead, StoreCache, dag_of, fleet, id_detail, visible

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


def _may_read(user: Any) -> MayRead:
    return lambda dag_id: _allowed(user, dag_id)


#: Opened stores by (URL, connection): building an S3 client (its service model, a connection lookup)
#: costs more than a page; kept for a few minutes, so a rotated connection is picked up.
_STORE_SECONDS = 300.0
_stores: dict[tuple[str, str | None], tuple[float, Store]] = {}


def _store() -> Store:
    from .config import task_settings
    from .store import task_store

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


def _one(store: Store, checkpoint_id: str, user: Any) -> IdListing:
    """One ID the user may read: 404 when the store has none, 403 when its DAG is not theirs."""
    try:
        validate_checkpoint_id(checkpoint_id)
    except CheckpointIdError as e:
        raise HTTPException(400, str(e)) from None
    found = next((x for x in _listing(store) if x.checkpoint_id == checkpoint_id), None)
    if found is None:
        store_cache.clear()  # maybe newer than the cached listing
        found = next((x for x in _listing(store) if x.checkpoint_id == checkpoint_id), None)
    if found is None:
        raise HTTPException(404, f"no checkpoints under checkpoint ID {checkpoint_id!r}")
    if not _allowed(user, dag_of(found)):
        raise HTTPException(403, f"you may not read the DAG of checkpoint ID {checkpoint_id!r}")
    return found


def _store_problem(e: CedanaError) -> str:
    return str(redact(str(e)))


# -- JSON API -----------------------------------------------------------------------------------
@app.get("/api/v1/checkpoints")
def api_checkpoints(user: User) -> JSONResponse:
    try:
        listed = visible(_listing(_store()), _may_read(user))
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)
    return JSONResponse([as_json(x) for x in listed])


def _detail(checkpoint_id: str, user: Any) -> IdDetail:
    store = _store()
    return id_detail(store, _one(store, checkpoint_id, user))


@app.get("/api/v1/checkpoints/{checkpoint_id}")
def api_checkpoint(checkpoint_id: str, user: User) -> JSONResponse:
    try:
        detail = _detail(checkpoint_id, user)
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)
    x = detail.listing
    return JSONResponse({**as_json(x), "restores": [r.model_dump(mode="json") for r in detail.restores],
                         "restore_count": x.restores,
                         "manifests": [m.model_dump(mode="json", exclude=m.absent_blocks()) for m in detail.manifests]})


@app.delete("/api/v1/checkpoints/{checkpoint_id}")
def api_delete(checkpoint_id: str, user: User) -> JSONResponse:
    try:
        store = _store()
        x = _one(store, checkpoint_id, user)
        if not _allowed(user, dag_of(x), "PUT"):
            raise HTTPException(403, f"deleting checkpoint ID {checkpoint_id!r} needs edit permission on its DAG")
        removed = delete_checkpoint_id(store, checkpoint_id)
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)
    store_cache.clear()
    who = getattr(user, "get_name", lambda: "?")()
    log.warning("cedana: checkpoint ID %s (DAG %s) deleted by %s: %d checkpoint(s)", checkpoint_id, dag_of(x), who, removed)
    _audit(who, x, removed)
    return JSONResponse({"id": checkpoint_id, "deleted_checkpoints": removed})


def _audit(who: str, x: IdListing, removed: int) -> None:
    """Airflow's audit log (Browse > Audit Log) records who deleted what."""
    try:
        from airflow.models.log import Log
        from airflow.utils.session import create_session

        with create_session() as session:
            session.add(Log(event="cedana.delete_checkpoint_id", owner=who, dag_id=dag_of(x),
                            extra=f"checkpoint_id={x.checkpoint_id} checkpoints={removed}"))
    except Exception as e:  # the deletion happened; a missing audit row is logged, not hidden
        log.warning("cedana: audit log not written for the deletion of %s: %s", x.checkpoint_id, e)


def _drill_reports(user: Any) -> list[DrillReport]:
    """Drill reports span the fleet (and name IDs of many DAGs): for users who may read every DAG."""
    if not _allowed(user, None):
        raise HTTPException(403, "drill reports are for users who may read every DAG")
    return list_reports(_store())


@app.get("/api/v1/drills")
def api_drills(user: User) -> JSONResponse:
    try:
        return JSONResponse(drills_json(_drill_reports(user)))
    except CedanaError as e:
        return JSONResponse({"detail": _store_problem(e)}, status_code=503)


# -- pages --------------------------------------------------------------------------------------
@app.get("/drills", response_class=HTMLResponse)
def page_drills(user: User) -> HTMLResponse:
    try:
        reports = _drill_reports(user)
    except CedanaError as e:
        return HTMLResponse(html.problem(_store_problem(e)), status_code=503)
    return HTMLResponse(html.drills_page(reports, trends(reports)))


@app.get("/", response_class=HTMLResponse)
def page_fleet(user: User, q: str = "", dag: str = "", sort: str = "id", page: Annotated[int, Query(ge=1)] = 1) -> HTMLResponse:
    try:
        store = _store()
        f = fleet(_listing(store), _may_read(user))
    except CedanaError as e:
        return HTMLResponse(html.problem(_store_problem(e)), status_code=503)
    return HTMLResponse(html.fleet_page(f, store_url=str(redact(store.url)), q=q, dag=dag, sort=sort, page=page))


@app.get("/ids/{checkpoint_id}", response_class=HTMLResponse)
def page_id(checkpoint_id: str, user: User) -> HTMLResponse:
    try:
        detail = _detail(checkpoint_id, user)
    except CedanaError as e:
        return HTMLResponse(html.problem(_store_problem(e)), status_code=503)
    return HTMLResponse(html.id_page(detail, may_delete=_allowed(user, dag_of(detail.listing), "PUT")))


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
        mine = [x for x in _listing(store) if x.checkpoint_id == default or (
            x.airflow is not None and (x.airflow.dag_id, x.airflow.task_id, x.airflow.run_id, x.airflow.map_index)
            == (dag_id, task_id, run_id, index))]
        details = [id_detail(store, x) for x in mine]
    except CedanaError as e:
        return HTMLResponse(html.problem(_store_problem(e)), status_code=503)
    return HTMLResponse(html.task_instance_page(dag_id, run_id, task_id, index, default, details))


@app.exception_handler(HTTPException)
def _http_error(request: Request, e: HTTPException) -> JSONResponse | HTMLResponse:
    if "/api/v1/" in request.url.path:  # the JSON API answers JSON; pages answer a page
        return JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)
    return HTMLResponse(html.problem(str(e.detail)), status_code=e.status_code, headers=e.headers)
