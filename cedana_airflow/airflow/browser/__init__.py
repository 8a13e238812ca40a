"""The checkpoint browser: read-only pages and a small JSON API over the store, inside Airflow's UI.

The ``cedana`` plugin (plugin.py) mounts its FastAPI app at ``/cedana`` in the api-server, with a nav
item (Browse > Checkpoints) and a Checkpoints tab on every task instance. Every route asks Airflow's
auth manager first, and a user sees only the checkpoints and restore records of DAGs they may read,
each judged by the DAG it names itself (an ID may hold several DAGs'). One concept a file:

- app.py: the routes, their auth checks and status codes (the URLs and the JSON are a contract:
  docs/browser.md);
- data.py: what a user may see (filtered by DAG permission, item by item) and the cached store listing; no
  FastAPI, no HTML;
- views.py: what each page is given, rendered through Jinja2 with autoescaping;
- templates/: the pages, each extending base.html; static/browser.css: their stylesheet, which
  base.html inlines (the pages run in Airflow's iframe and need no second request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["fastapi_app"]


def fastapi_app() -> FastAPI:
    """The browser's FastAPI app, for the plugin's ``fastapi_apps``. Imported on the first call, because
    its routes depend on Airflow's API server, which importing this package must not load."""
    from .app import app

    return app
