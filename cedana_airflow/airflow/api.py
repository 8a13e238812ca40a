"""Airflow's public REST API, as our tasks use it: a token, then JSON calls (the standard library only).

Airflow 3 tasks have no database access: what a task reads of Airflow's history (airflow/history.py)
and what a live drill does (live_fleet.py) go through the API, with the permissions of the user it
logs in as, exactly as a person in the UI would.

The user comes from an Airflow connection, with any auth manager: a token in its extra
(``{"token": ...}``) is sent as is; a login and password are exchanged at ``POST /auth/token``, which the
simple, FAB (database and LDAP users) and Keycloak auth managers answer. The connection's host, when it
has one, is the API's address.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from ..errors import CedanaError, ConfigError
from ..hooks.store import named_connection

__all__ = ["AirflowApi", "PAGE", "api_base_url", "connection_url"]

#: Rows per request of a paged listing.
PAGE = 100


def api_base_url(option: str | None) -> str:
    """``option`` (an [cedana] *_api_url), else the api-server this worker reports to."""
    if option:
        return option.rstrip("/")
    from airflow.configuration import conf

    execution = conf.get("core", "execution_api_server_url", fallback="") or ""
    if execution.rstrip("/").endswith("/execution"):
        return execution.rstrip("/")[: -len("/execution")]
    base = conf.get("api", "base_url", fallback="") or ""
    if not base:
        raise ConfigError("no address for Airflow's API: set [cedana] drill_api_url / history_api_url (or [core] "
                          "execution_api_server_url).")
    return base.rstrip("/")


def connection_url(conn: Any) -> str | None:
    """The API's address a connection names in its host (``http://airflow:8080``, or host, port and
    schema as an HTTP connection keeps them), or None when it names none."""
    host = (getattr(conn, "host", None) or "").strip().rstrip("/")
    if not host:
        return None
    if "://" not in host:
        port = getattr(conn, "port", None)
        host = f"{getattr(conn, 'schema', None) or 'http'}://{host}{f':{port}' if port else ''}"
    return host


class AirflowApi:
    """A logged-in client. ``url``: the [cedana] *_api_url option; unset, the connection's host, else
    the api-server this worker reports to. ``conn_id``: a connection with a login and password or an
    extra {"token": ...}; None: the simple auth manager's all-admins token. ``option``: the [cedana] option
    that names the connection, for error messages; ``denied_fix``: what to do about a 401/403."""

    def __init__(self, url: str | None, conn_id: str | None, *, option: str, denied_fix: str) -> None:
        self.option, self.denied_fix = option, denied_fix
        conn = named_connection(conn_id, f"[cedana] {option}", "to use the all-admins token") if conn_id else None
        self.base = api_base_url(url or (connection_url(conn) if conn is not None else None))
        self.token = self._login(conn)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *, token: str | None = None,
             missing_ok: bool = False) -> Any:
        token = token if token is not None else self.token
        req = urllib.request.Request(self.base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if missing_ok and e.code == 404:
                return None
            detail = e.read().decode(errors="replace")[:300]
            fix = f" {self.denied_fix}" if e.code in (401, 403) else ""
            raise CedanaError(f"Airflow API {method} {path.split('?')[0]}: HTTP {e.code}: {detail}.{fix}") from None
        except OSError as e:
            raise CedanaError(f"Airflow API at {self.base} cannot be reached ({e}). Set [cedana] {self.option.replace('conn_id', 'url')} "
                              "to the api-server's address.") from None

    def pages(self, path: str, key: str, query: Mapping[str, Any], cap: int | None = None) -> list[dict[str, Any]]:
        """Every row of a paged listing (``key``: its list, e.g. "task_instances"), 100 per request; with
        ``cap``, about that many at most."""
        out: list[dict[str, Any]] = []
        while cap is None or len(out) < cap:
            query_text = urlencode({**query, "limit": PAGE, "offset": len(out)}, doseq=True)
            page = self.call("GET", f"{path}?{query_text}") or {}
            rows = page.get(key) or []
            out += rows
            if not rows or len(out) >= page.get("total_entries", 0):
                break
        return out

    def _login(self, c: Any) -> str:
        if c is None:  # the simple auth manager in all-admins mode hands out a token
            got = self.call("GET", "/auth/token", token="")
        else:
            if tok := (c.extra_dejson or {}).get("token"):
                return str(tok)
            got = self.call("POST", "/auth/token", {"username": c.login, "password": c.password}, token="")
        try:
            return str(got["access_token"])
        except (TypeError, KeyError):
            raise ConfigError(f"Airflow API at {self.base} gave no token. Set [cedana] {self.option} to a "
                              "connection with a user's login and password.") from None
