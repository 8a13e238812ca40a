"""Airflow's REST API as our tasks reach it (airflow/api.py): through a connection whose host is the API's
address and whose login and password are exchanged at POST /auth/token (simple, FAB and Keycloak auth
managers), or whose extra carries a token (any auth manager). A stand-in api-server on loopback answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

pytest.importorskip("airflow")

from cedana_airflow.airflow.api import AirflowApi, connection_url  # noqa: E402
from conftest import send_json  # noqa: E402


@pytest.mark.parametrize(("conn", "url"), [
    (SimpleNamespace(host="http://airflow.example:8080/", port=None, schema=None), "http://airflow.example:8080"),
    (SimpleNamespace(host="airflow.example", port=8443, schema="https"), "https://airflow.example:8443"),
    (SimpleNamespace(host="airflow.example", port=None, schema=""), "http://airflow.example"),
    (SimpleNamespace(host="", port=8080, schema="http"), None),
])
def test_a_connection_names_the_api_s_address_in_its_host(conn, url):
    assert connection_url(conn) == url


@pytest.fixture
def api_server():
    seen: list[tuple[str, str, str | None, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            seen.append(("POST", self.path, self.headers.get("Authorization"), body))
            if self.path == "/auth/token" and body == {"username": "drills", "password": "s3cret"}:
                return send_json(self, 201, {"access_token": "jwt-for-drills"})  # as FAB answers: 201 Created
            send_json(self, 401, {"detail": "Invalid credentials"})

        def do_GET(self) -> None:  # noqa: N802
            seen.append(("GET", self.path, self.headers.get("Authorization"), {}))
            if self.headers.get("Authorization") in ("Bearer jwt-for-drills", "Bearer minted-elsewhere"):
                return send_json(self, 200, {"version": "3.3.2"})
            send_json(self, 401, {"detail": "Not authenticated"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_login_and_password_of_a_connection_whose_host_is_the_api(api_server, monkeypatch):
    where, seen = api_server
    monkeypatch.setenv("AIRFLOW_CONN_CEDANA_API", json.dumps(
        {"conn_type": "http", "host": where.split(":")[0], "port": int(where.split(":")[1]), "schema": "http",
         "login": "drills", "password": "s3cret"}))
    api = AirflowApi(None, "cedana_api", option="drill_api_conn_id", denied_fix="Give the user edit.")
    assert api.base == f"http://{where}"
    assert api.call("GET", "/api/v2/version") == {"version": "3.3.2"}
    assert [(m, p, a) for m, p, a, _ in seen] == [("POST", "/auth/token", None),
                                                  ("GET", "/api/v2/version", "Bearer jwt-for-drills")]


def test_a_token_in_the_extra_is_sent_as_is_and_the_url_option_wins_over_the_host(api_server, monkeypatch):
    where, seen = api_server
    monkeypatch.setenv("AIRFLOW_CONN_CEDANA_API", json.dumps(
        {"conn_type": "http", "host": "unreachable.invalid", "extra": {"token": "minted-elsewhere"}}))
    api = AirflowApi(f"http://{where}/", "cedana_api", option="history_api_conn_id", denied_fix="")
    assert api.call("GET", "/api/v2/version") == {"version": "3.3.2"}
    assert [(m, a) for m, _, a, _ in seen] == [("GET", "Bearer minted-elsewhere")]  # no login at all


def test_wrong_credentials_are_one_line_naming_the_fix(api_server, monkeypatch):
    from cedana_airflow.errors import CedanaError

    where, _ = api_server
    monkeypatch.setenv("AIRFLOW_CONN_CEDANA_API", json.dumps(
        {"conn_type": "http", "host": f"http://{where}", "login": "drills", "password": "wrong"}))
    with pytest.raises(CedanaError, match=r"POST /auth/token: HTTP 401: .*Invalid credentials.*Give the user edit\."):
        AirflowApi(None, "cedana_api", option="drill_api_conn_id", denied_fix="Give the user edit.")
