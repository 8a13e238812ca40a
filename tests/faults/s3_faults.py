"""An HTTP proxy in front of moto's S3 server that answers chosen requests with a fault: what an S3
endpoint does on a bad day, over a real socket, to the real boto3 client of the supervisor.

    proxy.arm(Rule("PUT", r"/chunks/", "503", times=6))   # the next 6 chunk uploads get SlowDown

``drop_headers`` makes it a gateway that drops request headers (``{"if-none-match", "if-match"}``: one that
ignores conditional writes). Kinds: ``500`` (InternalError), ``503`` (SlowDown), ``reset`` (the connection is reset, no answer),
``timeout`` (no answer for ``hang`` seconds, then closed), ``short`` (the answer's body is cut in half
under its full Content-Length), ``lost`` (the request reaches the server, which applies it; its answer is
lost on the way back, the connection reset), ``409`` (ConditionalRequestConflict: AWS's answer while
another conditional write to the key is in flight). Kinds joined by ``+`` are taken in turn, the last
one for the rest of ``times``. ``times``: how many matching requests in a row (boto3 retries 5
times: 6 makes one operation fail; a large number is an outage).
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("500", "503", "reset", "timeout", "short", "lost", "409")
_ERROR = {"500": ("InternalError", "We encountered an internal error. Please try again."),
          "503": ("SlowDown", "Please reduce your request rate."),
          "409": ("ConditionalRequestConflict", "A conflicting operation occurred. If using PutObject you can retry "
                  "the request.")}


@dataclass
class Rule:
    method: str
    path: str  # a regex searched in the request's path
    kind: str
    times: int = 6
    hang: float = 5.0
    hits: int = field(default=0)

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and re.search(self.path, path) is not None and self.hits < self.times


class FaultProxy:
    """Forwards to ``upstream``; the armed rule (one at a time) decides which requests fail."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rule: Rule | None = None
        self.faults = 0  # answered with a fault, since the proxy started
        #: Request headers it drops (lower case): a gateway that does not pass conditional writes on.
        self.drop_headers: set[str] = set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._take(self.command, self.path)
                if fault in ("reset", "timeout"):
                    if fault == "timeout":
                        time.sleep(proxy.rule.hang if proxy.rule else 5.0)
                    # RST, not FIN: what a dropped connection looks like to the client
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault in _ERROR:
                    code, msg = _ERROR[fault]
                    xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{msg}</Message>"
                           "</Error>").encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "keep-alive", "expect", *proxy.drop_headers)}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                if fault == "lost":  # applied upstream; the client never hears of it
                    conn.close()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                self.send_response(r.status, r.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "short" and data:
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                else:
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up on a hung answer, or a reset we made: not news

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self, method: str, path: str) -> str | None:
        with self._lock:
            rule = self.rule
            if rule is None or not rule.matches(method, path):
                return None
            rule.hits += 1
            self.faults += 1
            kinds = rule.kind.split("+")  # "lost+409": the first match lost, the next ones 409
            return kinds[min(rule.hits, len(kinds)) - 1]

    def arm(self, rule: Rule | None) -> None:
        with self._lock:
            self.rule = rule

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
