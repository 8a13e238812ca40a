"""moto's S3 server, made as safe under concurrent writers as S3 is.

CI saw a compare-and-swap of the listing index lose a row on moto (5.2.6) with 18 writers on one
key. Two races of moto's threaded server, each of which can do that, are closed here:

- A conditional PUT (``If-Match`` / ``If-None-Match: *``) is checked, then stored, in two steps, so two
  writers can both pass the check. S3 (and SeaweedFS, MinIO) decide it atomically: every conditional
  write here runs alone, from the check to the store.
- An object's ETag is computed lazily by reading its buffer without the object's lock, while a
  concurrent GET reads the same buffer under it: the shared file position can hand the GET an empty
  body, or cache a wrong ETag. The ETag is computed under the object's lock here.

Unconditional requests still run in parallel.

Usage: python scripts/moto_s3.py -H HOST -p PORT (the same flags as ``python -m moto.server``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable

_CONDITIONS = ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH")


class AtomicConditionalWrites:
    """WSGI middleware: a PUT or DELETE with a precondition runs alone, from the check to the store."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") in ("PUT", "DELETE") and any(environ.get(h) for h in _CONDITIONS):
            with self.lock:
                return list(self.app(environ, start_response))  # drained inside the lock: the write is done
        return self.app(environ, start_response)


def _lock_etags() -> None:
    from moto.s3.models import FakeKey

    unlocked = FakeKey.etag.fget

    def etag(self: FakeKey) -> str:
        with self.lock:  # value() seeks and reads the same buffer under this lock
            return unlocked(self)

    FakeKey.etag = property(etag)  # type: ignore[method-assign,assignment]


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser()
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto.server does: URLs it hands out name it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _lock_etags()
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, AtomicConditionalWrites(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
