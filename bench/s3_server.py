"""The S3 endpoint of the S3 benchmarks, and counting what goes over the wire: moto's server, a protocol
test double (one Python process; see report.MOTO_NOTE), or SeaweedFS, a real S3 server (`weed mini`,
issue 52; report.SEAWEEDFS_NOTE). ``KIND`` chooses (bench/run.py sets it per part); ``server()`` starts it.
(This module is not named moto.py: bench/ is first on sys.path, and the real moto package must stay
importable.)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import boto3
from harness import say

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import local_parts  # noqa: E402  (its SeaweedFS, and http_answers)

BUCKET = "bench"
#: The server the S3 parts run against: "moto" or "seaweedfs".
KIND = "moto"


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


class Endpoint:
    """An S3 server as a subprocess on a free loopback port, with a bucket; sets the AWS_* variables of this
    process for boto3 (restored on exit). ``mark()`` and ``since()`` count the requests of any window of a
    run by operation, whoever sent them, and the server's CPU."""

    name = ""
    proc: subprocess.Popen[bytes]
    url = ""

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}

    def _use(self) -> None:
        """This process's boto3 (and its children's) at this server, with a bucket."""
        aws = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        for k in [*aws, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"]:
            self._saved[k] = os.environ.pop(k, None)
        os.environ.update(aws)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        say(f"{self.name} {self.version()} S3 server at {self.url} (pid {self.proc.pid}), bucket {BUCKET}")

    def _wait_until_up(self, log: Path) -> None:
        deadline = time.monotonic() + 60
        while not local_parts.http_answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"{self.name}'s S3 server did not start; see {log}")
            time.sleep(0.1)

    def __enter__(self) -> Endpoint:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def version(self) -> str:
        return "?"

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def mark(self) -> tuple[Any, float]:
        """A point in the run: (the server's request count so far, its CPU seconds)."""
        raise NotImplementedError

    def since(self, mark: tuple[Any, float]) -> dict[str, Any]:
        """Requests (by operation, and as 'op status' pairs) and server CPU since ``mark``."""
        raise NotImplementedError


def _counted(ops: dict[str, int], by_status: dict[str, int], cpu: float) -> dict[str, Any]:
    return {"requests": sum(ops.values()), "ops": dict(sorted(ops.items())),
            "ops_by_status": dict(sorted(by_status.items())), "server_cpu_seconds": cpu}


class Moto(Endpoint):
    """moto's S3 server. Its access log (one line per request) is kept and counted."""

    name = "moto"

    def __init__(self, work: Path, name: str) -> None:
        super().__init__()
        self.log_path = work / f"moto-{name}.log"

    def __enter__(self) -> Moto:
        port = _free_port()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (the server's, closed on exit)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self._wait_until_up(self.log_path)
        self._use()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._log.close()

    def version(self) -> str:
        return moto_version()

    def mark(self) -> tuple[int, float]:
        return os.path.getsize(self.log_path), self.cpu_seconds()

    def since(self, mark: tuple[Any, float]) -> dict[str, Any]:
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
        return _counted(ops, by_status, self.cpu_seconds() - mark[1])


_S3_REQUESTS = re.compile(r'^SeaweedFS_s3_request_total\{bucket="[^"]*",code="(\d+)",type="(\w+)"\} (\S+)$', re.M)


class Seaweed(Endpoint):
    """SeaweedFS's `weed mini` (master, volume server, filer and S3 gateway in one process), started as the tests
    start it (scripts/local_parts.py), its data in a temp dir. Requests are counted from its Prometheus metrics,
    by the gateway's request type (GET, PUT, LIST, DELETE; a HEAD is a GET there) and status."""

    name = "SeaweedFS"

    def __init__(self, work: Path, name: str) -> None:
        super().__init__()
        port = _free_port()
        self.metrics = f"http://127.0.0.1:{port}/metrics"
        self.server = local_parts.Seaweed(extra=(f"-metricsPort={port}",))

    def __enter__(self) -> Seaweed:
        try:
            self.url = self.server.start()
        except RuntimeError as e:
            raise SystemExit(f"SeaweedFS's S3 server did not start: {e}") from None
        assert self.server.proc is not None
        self.proc = self.server.proc
        self._use()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.server.stop()  # its data and log

    def version(self) -> str:
        return seaweed_version()

    def _counts(self) -> dict[tuple[str, str], float]:
        with urllib.request.urlopen(self.metrics, timeout=10) as r:
            text = r.read().decode()
        counts: dict[tuple[str, str], float] = {}
        for m in _S3_REQUESTS.finditer(text):  # one series per bucket: summed
            counts[(m.group(2), m.group(1))] = counts.get((m.group(2), m.group(1)), 0.0) + float(m.group(3))
        return counts

    def mark(self) -> tuple[dict[tuple[str, str], float], float]:
        return self._counts(), self.cpu_seconds()

    def since(self, mark: tuple[Any, float]) -> dict[str, Any]:
        now, before = self._counts(), mark[0]
        ops: dict[str, int] = {}
        by_status: dict[str, int] = {}
        for (op, code), n in now.items():
            d = int(n - before.get((op, code), 0))
            if d:
                ops[op] = ops.get(op, 0) + d
                by_status[f"{op} {code}"] = d
        return _counted(ops, by_status, self.cpu_seconds() - mark[1])


def server(work: Path, name: str) -> Endpoint:
    """The S3 server ``KIND`` names, to be entered: ``with server(work, "transfer") as s3:``."""
    return Seaweed(work, name) if KIND == "seaweedfs" else Moto(work, name)


def server_name() -> str:
    return "SeaweedFS" if KIND == "seaweedfs" else "moto"


def seaweed_version() -> str:
    try:
        out = subprocess.run([str(local_parts.WEED), "version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "?"
    m = re.search(r"(\d+\.\d+(?:\.\d+)?) ", out)  # "version 8000GB 4.48 pypi linux amd64"
    return m.group(1) if m else "?"


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
