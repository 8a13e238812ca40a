"""The S3 endpoint of the S3 benchmarks: moto's server on loopback, and counting what goes over the wire.

moto's server is a protocol test double (one Python process), not a storage system: see
report.MOTO_NOTE. (This module is not named moto.py: bench/ is first on sys.path, and the real
moto package must stay importable.)
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import boto3
from harness import say

BUCKET = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LOG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours the lines of 3xx/4xx/5xx answers


def _op_of(method: str, target: str) -> str:
    """The S3 operation of a request line in moto's (werkzeug's) access log; path-style addressing."""
    path, _, query = target.partition("?")
    has_key = path.strip("/").count("/") >= 1
    if method == "GET":
        return "ListObjectsV2" if "list-type" in query else ("GetObject" if has_key else "ListObjects")
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "PUT":
        return "UploadPart" if "partNumber" in query else ("PutObject" if has_key else "CreateBucket")
    if method == "POST":
        if "delete" in query:
            return "DeleteObjects"
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    if method == "DELETE":
        return "DeleteObject"
    return method


class Moto:
    """moto's S3 server as a subprocess on a free loopback port, with a bucket; sets the AWS_* variables
    of this process for boto3 (restored on exit). Its access log (one line per request) is kept so
    that any window of a run can be counted by operation, whoever sent the requests."""

    def __init__(self, work: Path, name: str) -> None:
        self.log_path = work / f"moto-{name}.log"
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> Moto:
        port = _free_port()
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        aws = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        for k in [*aws, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"]:
            self._saved[k] = os.environ.pop(k, None)
        os.environ.update(aws)
        self._wait_until_up()
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        say(f"moto {moto_version()} S3 server at {self.url} (pid {self.proc.pid}), bucket {BUCKET}")
        return self

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1)
                return
            except urllib.error.HTTPError:
                return  # it answered
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise SystemExit(f"moto's S3 server did not start; see {self.log_path}")
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def mark(self) -> tuple[int, float]:
        """A point in the run: (access log offset, server CPU seconds)."""
        return os.path.getsize(self.log_path), self.cpu_seconds()

    def since(self, mark: tuple[int, float]) -> dict[str, Any]:
        """Requests (by operation, and as 'op status' pairs) and server CPU since ``mark``."""
        time.sleep(0.05)  # the server logs a request right after answering it
        with open(self.log_path, "rb") as f:
            f.seek(mark[0])
            text = _ANSI.sub("", f.read().decode(errors="replace"))
        ops: dict[str, int] = {}
        by_status: dict[str, int] = {}
        for m in _LOG_LINE.finditer(text):
            op = _op_of(m.group(1), m.group(2))
            ops[op] = ops.get(op, 0) + 1
            key = f"{op} {m.group(3)}"
            by_status[key] = by_status.get(key, 0) + 1
        return {"requests": sum(ops.values()), "ops": dict(sorted(ops.items())),
                "ops_by_status": dict(sorted(by_status.items())), "server_cpu_seconds": self.cpu_seconds() - mark[1]}


def moto_version() -> str:
    try:
        import moto

        return str(moto.__version__)
    except Exception:  # noqa: BLE001
        return "?"


class WireCounter:
    """Request bodies a boto3 client sends (botocore's before-send event, once per attempt)."""

    def __init__(self, client: Any) -> None:
        self.requests = 0
        self.bytes_sent = 0
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3", self._send)

    def _send(self, request: Any, **_: Any) -> None:
        h = request.headers
        n = h.get("X-Amz-Decoded-Content-Length") or h.get("Content-Length")
        if n is None and isinstance(request.body, (bytes, bytearray)):
            n = len(request.body)
        with self._lock:
            self.requests += 1
            self.bytes_sent += int(n or 0)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.requests, self.bytes_sent


def delete_prefix(prefix: str) -> int:
    """Remove every object under ``prefix`` (untimed housekeeping, so moto's memory stays bounded)."""
    c = boto3.client("s3")
    n = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
            n += len(keys)
    return n
