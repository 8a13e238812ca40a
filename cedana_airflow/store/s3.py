"""``s3://bucket/prefix``: checkpoints on AWS S3 or any S3-compatible server (MinIO, Ceph RGW, R2...).

boto3 with its standard credential chain; ``AWS_ENDPOINT_URL`` or ``s3_endpoint_url`` for
S3-compatible endpoints. Inside Airflow the operator passes a client built from a connection; this
module never imports Airflow. botocore errors become one-line :class:`StoreError` s here, at the
boundary, and never carry credentials.

Manifests are written with ``If-None-Match: *`` (a create-only PUT), so an existing manifest is
never replaced, as in the file store. Chunks are plain PUTs: two writers of one digest write the
same raw bytes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..config import Settings, redact
from ..errors import ConditionalWritesIgnored, StoreUnavailable
from ..format import layout
from ..format.limits import TooLarge
from .base import RequiredReads, StoreConfig, StoredObject, parse_store_config

__all__ = ["S3Store", "client_config", "make_s3_client"]

log = logging.getLogger(__name__)

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
           "AllAccessDisabled", "403"}
_MISSING = {"NoSuchKey", "404", "NotFound"}
# A conditional PUT that lost: the key exists (If-None-Match) or moved on (If-Match).
_LOST_RACE = {"PreconditionFailed", "412"}
# A concurrent conditional write to the key was in flight (AWS): its outcome is not known yet, so the
# PUT is tried again, a few times, before it counts as lost.
_IN_FLIGHT = {"ConditionalRequestConflict", "409"}
_IN_FLIGHT_TRIES = 4
_HEAD_BUCKET = "checking the bucket"
#: Where the conditional-write probe writes its scratch key, under the store's prefix: locks/, whose
#: readers skip what is not a lock (older versions too; a filer-backed server keeps emptied folders).
_PROBE_PREFIX = f"{layout.LOCKS}probe-"
#: Writers the probe races for one new key.
_RACERS = 4
#: What a server that does not take conditional writes at all answers (instead of ignoring the header).
_NO_CONDITIONS = {"NotImplemented", "501", "InvalidArgument", "InvalidRequest"}
#: Servers (endpoint, bucket, the client's proxies) this process has probed: when, and whether the server
#: keeps the folders a delete empties. A writer opens its store at every heartbeat: one probe, not one per
#: heartbeat. A long-lived process (the node agent) probes again after _PROBE_EVERY: the server behind an
#: endpoint may be replaced (an upgrade, a failover to another cluster).
_PROBED: dict[tuple[str, str, str], tuple[float, bool]] = {}
_PROBED_LOCK = threading.Lock()
_PROBING: dict[tuple[str, str, str], threading.Lock] = {}  # one probe at a time per server: the others wait for it
_PROBE_EVERY = 3600.0
#: A re-probe that failed on the way (a 503 storm, a timeout) keeps the last verdict this long, then tries again.
_PROBE_RETRY = 300.0
_clock = time.monotonic  # (a test moves it on)


def _where(store: S3Store) -> tuple[str, str, str]:
    meta = getattr(store.client, "meta", None)
    proxies = getattr(getattr(meta, "config", None), "proxies", None)
    return str(getattr(meta, "endpoint_url", "")), store.bucket, repr(sorted((proxies or {}).items()))


def _probe_once(store: S3Store) -> None:
    where = _where(store)
    with _PROBED_LOCK:
        probing = _PROBING.setdefault(where, threading.Lock())
    with probing:
        with _PROBED_LOCK:
            at, keeps = _PROBED.get(where, (None, False))
        if at is not None and _clock() - at < _PROBE_EVERY:
            store.keeps_folders = keeps
            return
        try:
            store.probe_conditional_writes()  # raises where the server ignores them: probed again next time
        except ConditionalWritesIgnored:
            raise
        except StoreUnavailable as e:
            if at is None:
                raise
            # A re-probe that could not finish says nothing new about the server: the last verdict stands (a
            # write that would have succeeded is not failed by the probe's bad luck), and it is tried again soon.
            log.warning("re-checking conditional writes failed (%s); the last check's answer stands", e)
            with _PROBED_LOCK:
                _PROBED[where] = (_clock() - _PROBE_EVERY + _PROBE_RETRY, keeps)
            store.keeps_folders = keeps
            return
        with _PROBED_LOCK:
            _PROBED[where] = (_clock(), store.keeps_folders)


def _folders_of(key: str) -> list[str]:
    """The folders under which a manifest or a restore record lies, innermost first (seq or restores/, then
    the ID's); none for any other key."""
    if found := layout.parse_manifest_key(key):
        return [layout.manifest_key(*found).rsplit("/", 1)[0] + "/", layout.checkpoint_prefix(found[0])]
    if len(parts := key.split("/")) == 3 and f"{parts[1]}/" == layout.RESTORES:
        return [f"{parts[0]}/{layout.RESTORES}", f"{parts[0]}/"]
    return []


def client_config(settings: Settings) -> Any:
    """botocore's client Config for a store: bounded retries, timeouts, a connection per request in
    flight. One place, so the CLI's client and the one from an Airflow connection behave alike."""
    from botocore.config import Config

    # A connection per request in flight: a lazy restore runs two pools of s3_parallelism (faults and
    # prefetch), with an index update and a lease renewal beside them; fewer, and urllib3 drops
    # connections ("Connection pool is full") and makes new ones (issue 52).
    return Config(retries={"mode": "standard", "max_attempts": 5},
                  max_pool_connections=2 * settings.s3_parallelism + 8,
                  s3={"addressing_style": settings.s3_addressing_style},
                  connect_timeout=settings.s3_connect_timeout_seconds, read_timeout=settings.s3_read_timeout_seconds)


def make_s3_client(settings: Settings) -> Any:
    """An S3 client with the standard credential chain, for the endpoint and addressing ``settings`` name.

    Built on botocore's session, which is what boto3's wraps (same credential chain, same
    AWS_ENDPOINT_URL handling): importing boto3 would also load s3transfer, a quarter of a second
    that every short command (``checkpoints``) would pay for a transfer manager it never uses.
    """
    try:
        import botocore.session
    except ImportError:
        raise StoreUnavailable(
            "store s3://: boto3 is not installed. Install it with pip install 'cedana-airflow[s3]'."
        ) from None
    found = _credentials_dir(settings.store_credentials_dir) if settings.store_credentials_dir else {}
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=settings.s3_endpoint_url or found.get("AWS_ENDPOINT_URL") or None,
        region_name=found.get("AWS_REGION") or found.get("AWS_DEFAULT_REGION") or None,
        aws_access_key_id=found.get("AWS_ACCESS_KEY_ID"), aws_secret_access_key=found.get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=found.get("AWS_SESSION_TOKEN"), config=client_config(settings))


#: Files a credentials directory may hold: a Kubernetes Secret mounted as a volume, one file per key.
_CREDENTIAL_FILES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                     "AWS_REGION", "AWS_DEFAULT_REGION")


def _credentials_dir(folder: Path) -> dict[str, str]:
    """The store's credentials from files (read by the supervisor only: never in the workload's
    environment, so never in a checkpoint image)."""
    found = {}
    for name in _CREDENTIAL_FILES:
        try:
            found[name] = (folder / name).read_text().strip()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreUnavailable(f"store credentials {folder / name} cannot be read: {e.strerror}. "
                                   "Check the mounted Secret (store_credentials_dir).") from None
    missing = [n for n in _CREDENTIAL_FILES[:2] if not found.get(n)]
    if missing:
        raise StoreUnavailable(f"store credentials dir {folder} has no {' or '.join(missing)} file. Give the Secret "
                               "those keys, or unset store_credentials_dir to use the standard credential chain.")
    return found


class S3Store(RequiredReads):
    """``settings`` give the requests in flight and the server-side encryption asked for on every write."""

    def __init__(self, bucket: str, prefix: str, client: Any, settings: Settings) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.client = client
        self.parallelism = settings.s3_parallelism
        self.conditional_writes = settings.s3_conditional_writes
        #: Whether the server keeps (and lists) the folders a delete empties, as SeaweedFS's filer does: the
        #: probe finds out. Unknown (no probe: `trust`) counts as no.
        self.keeps_folders = False
        self._put_args: dict[str, str] = {}
        if settings.s3_sse:
            self._put_args["ServerSideEncryption"] = settings.s3_sse
        if settings.s3_sse_kms_key_id:
            self._put_args["SSEKMSKeyId"] = settings.s3_sse_kms_key_id

    # -- the error boundary ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

        # an endpoint URL may carry user:password@: never into a message
        endpoint = redact(getattr(getattr(self.client, "meta", None), "endpoint_url", "?"))
        try:
            yield
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", "?"))
            # head_bucket answers a bare 404 where other calls say NoSuchBucket
            if code == "NoSuchBucket" or (code in _MISSING and what == _HEAD_BUCKET):
                raise StoreUnavailable(
                    f"store {self.url}: bucket {self.bucket!r} does not exist at {endpoint}. "
                    "Create it, or fix the bucket in --store / CEDANA_STORE."
                ) from None
            if code in _DENIED:
                raise StoreUnavailable(
                    f"store {self.url}: {what} was refused ({code}) at {endpoint}. Check the credentials "
                    "(AWS_ACCESS_KEY_ID / profile / role, or the Airflow connection) and the bucket policy."
                ) from None
            raise StoreUnavailable(f"store {self.url}: {what} failed ({code}) at {endpoint}. Retry, or check the endpoint's logs.") from None
        except NoCredentialsError:
            raise StoreUnavailable(
                f"store {self.url}: no AWS credentials found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "a profile, or an instance role (or an aws_conn_id in Airflow)."
            ) from None
        except EndpointConnectionError:
            raise StoreUnavailable(
                f"store {self.url}: endpoint {endpoint} is unreachable. Check AWS_ENDPOINT_URL / s3_endpoint_url and the network."
            ) from None
        except BotoCoreError as e:
            raise StoreUnavailable(f"store {self.url}: {what} failed: {type(e).__name__}. Check the endpoint and network.") from None

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _get(self, key: str) -> bytes | None:
        return self.get_versioned(key)[0]

    def _put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str = "") -> bool:
        from botocore.exceptions import ClientError

        if (create_only or if_match) and self.conditional_writes == "probe":
            _probe_once(self)  # every writer, not only those that open the store to write (gc, repair, a delete)
        extra = dict(self._put_args)
        if create_only:
            extra["IfNoneMatch"] = "*"
        elif if_match:
            extra["IfMatch"] = if_match
        unsure = False  # whether botocore tried any PUT of this write again: a try it gave up on may have applied
        with self._errors(f"writing {key}"):
            for attempt in range(_IN_FLIGHT_TRIES):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
                    return True
                except ClientError as e:
                    code = str(e.response.get("Error", {}).get("Code"))
                    if not (create_only or if_match) or code not in _LOST_RACE | _IN_FLIGHT:
                        raise
                    unsure = unsure or bool(e.response.get("ResponseMetadata", {}).get("RetryAttempts"))
                    if code in _IN_FLIGHT and attempt + 1 < _IN_FLIGHT_TRIES:
                        time.sleep(0.05 * 2**attempt * random.uniform(0.5, 1.5))  # racers out of step
                        continue
                    # botocore tried again after the server had applied a try whose answer was lost on the way
                    # back (a reset, a timeout), and the retry met that write (412, or 409 while it was in flight
                    # and then 412 here): our own write, not another writer's. Bytes equal to ours are ours:
                    # manifests, leases and locks carry their writer and time, index shards a nonce.
                    return unsure and self._get(key) == data
        return False

    def _pages(self, prefix: str, delimiter: str = "", limit: int = 0) -> Iterator[dict[str, Any]]:
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix)}
        if delimiter:
            args["Delimiter"] = delimiter
        if limit:
            args["PaginationConfig"] = {"MaxItems": limit, "PageSize": min(limit, 1000)}
        with self._errors(f"listing {prefix or '/'}"):
            yield from self.client.get_paginator("list_objects_v2").paginate(**args)

    def _keys(self, prefix: str, delimiter: str = "") -> Iterator[str]:
        for page in self._pages(prefix, delimiter):
            for p in page.get("CommonPrefixes", []):
                yield p["Prefix"][len(self.prefix):]
            for o in page.get("Contents", []):
                yield o["Key"][len(self.prefix):]

    # -- conditional writes ---------------------------------------------------------------------
    def probe_conditional_writes(self) -> str:
        """Whether this server honours what the store's safety rests on (manifests, records and leases are
        create-only; the index and the leases compare-and-swap), tried as writers use it on a scratch key
        under locks/ (which every reader skips), removed after. Returns what it found, in words; raises
        StoreUnavailable, one line, where it does not."""
        folder = f"{_PROBE_PREFIX}{secrets.token_hex(8)}/"
        key = f"{folder}scratch"
        endpoint = str(redact(getattr(getattr(self.client, "meta", None), "endpoint_url", "?")))
        problems: list[str] = []
        try:
            # writers racing for one new key (two supervisors at one seq): exactly one may win, and the key
            # must hold what it wrote
            bodies = [f"racer-{i}".encode() for i in range(_RACERS)]
            with ThreadPoolExecutor(_RACERS, thread_name_prefix="cedana-probe") as pool:
                raced = list(pool.map(lambda body: self._probe_put(key, body, endpoint, IfNoneMatch="*"), bodies))
            server = next((srv for _, srv in raced if srv), "") or "an unnamed server"
            held, etag = self.get_versioned(key)
            winners = [body for body, (won, _) in zip(bodies, raced) if won]
            if not winners and held in bodies:  # its own retried PUT lost to its first attempt, which had won
                winners = [held]
            if len(winners) != 1 or held != winners[0]:
                problems.append(f"{len(winners)} of {_RACERS} concurrent create-only PUTs (If-None-Match: *) of one "
                                "new key succeeded")
            # compare-and-swap: a stale ETag loses and leaves the object as it was; the current one wins
            if self._probe_put(key, b"stale", endpoint, IfMatch='"' + "0" * 32 + '"')[0] or self.get(key) != held:
                problems.append("a PUT with a stale If-Match succeeded")
            elif not self._probe_put(key, b"swapped", endpoint, IfMatch=etag)[0]:
                problems.append("a PUT with the current If-Match was refused")
        finally:
            with contextlib.suppress(StoreUnavailable):
                self.delete(key)
                self.keeps_folders = self._kept(folder)
        if problems:
            raise ConditionalWritesIgnored(
                f"store {self.url}: the S3 server at {endpoint} ({server}) does not honour conditional writes: "
                f"{'; '.join(problems)}, so two writers could both commit one checkpoint, or the index and the "
                "leases could not be updated. Use a server that honours If-None-Match and If-Match on PUT under "
                "concurrent writers (AWS S3; SeaweedFS 4.17 or later; a recent MinIO), or set "
                "s3_conditional_writes = trust for one writer per checkpoint ID at your own risk "
                "(docs/store-format.md, Conditional writes)")
        return f"{server} at {endpoint} honours create-only and compare-and-swap PUTs, {_RACERS} writers racing"

    def _kept(self, folder: str) -> bool:
        """Whether the server still lists ``folder`` (the probe's, emptied): a filer-backed server keeps it,
        and then it goes too (a DELETE of a folder key that holds nothing)."""
        with self._errors("probing conditional writes"):
            # SeaweedFS 4.48 lists an emptied folder as a key of its own under its name (a prefix that is the
            # folder's name without the slash finds nothing there); S3 lists nothing
            r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(folder), Delimiter="/")
            kept = any(o["Key"] == self._key(folder) for o in r.get("Contents", [])) or any(
                p["Prefix"] == self._key(folder) for p in r.get("CommonPrefixes", []))
            if kept:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(folder))
        return kept

    def _probe_put(self, key: str, body: bytes, endpoint: str, **condition: str) -> tuple[bool, str]:
        """(whether a conditional PUT was taken, the answer's Server header): a real write's arguments."""
        from botocore.exceptions import ClientError

        def server(meta: dict[str, Any]) -> str:
            return "".join(c for c in str(meta.get("HTTPHeaders", {}).get("server") or "") if c.isprintable())[:80]

        with self._errors("probing conditional writes"):
            try:
                r = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body, **self._put_args,
                                           **condition)
            except ClientError as e:
                code = str(e.response.get("Error", {}).get("Code"))
                if code in _LOST_RACE | _IN_FLIGHT:  # a racer that met another's write in flight lost to it
                    return False, server(e.response.get("ResponseMetadata", {}))
                if code in _NO_CONDITIONS:  # it refuses the header itself: as good as ignoring it, and said so
                    raise ConditionalWritesIgnored(
                        f"store {self.url}: the S3 server at {endpoint} refuses conditional writes ({code} to "
                        f"{', '.join(condition)} on PUT), which the store's safety rests on. Use a server that "
                        "honours them, or set s3_conditional_writes = trust at your own risk (docs/store-format.md, "
                        "Conditional writes)") from None
                raise
        return True, server(r.get("ResponseMetadata", {}))

    # -- Store ----------------------------------------------------------------------------------
    def open(self, *, create: bool, chunk_avg_bytes: int) -> StoreConfig:
        with self._errors(_HEAD_BUCKET):
            self.client.head_bucket(Bucket=self.bucket)
        if create and self.conditional_writes == "probe":
            _probe_once(self)
        raw = self._get(layout.STORE_CONFIG_KEY)
        if raw is None:
            if not create:
                return StoreConfig(chunk_avg_bytes=chunk_avg_bytes)
            cfg = StoreConfig(chunk_avg_bytes=chunk_avg_bytes)
            self._put(layout.STORE_CONFIG_KEY, cfg.model_dump_json(indent=2).encode(), create_only=True)
            raw = self._get(layout.STORE_CONFIG_KEY)  # a concurrent creator may have won
            if raw is None:
                raise StoreUnavailable(f"store {self.url}: store.json vanished right after it was written. Check the bucket's lifecycle rules.")
        return parse_store_config(raw, self.url)

    def has_chunk(self, digest: str) -> bool:
        from botocore.exceptions import ClientError

        with self._errors(f"checking chunk {digest}"):
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._key(layout.chunk_key(digest)))
                return True
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in _MISSING:
                    return False
                raise

    def put_chunk(self, digest: str, blob: bytes) -> None:
        self._put(layout.chunk_key(digest), blob)

    def put_manifest(self, checkpoint_id: str, seq: int, data: bytes) -> bool:
        return self._put(layout.manifest_key(checkpoint_id, seq), data, create_only=True)

    def list_ids(self) -> list[str]:
        return sorted(p.rstrip("/") for p in self._keys("", "/") if p.endswith("/") and p.rstrip("/") not in layout.TOP_LEVEL_NAMES)

    def list_seqs(self, checkpoint_id: str) -> list[int]:
        out = []
        for key in self._keys(layout.checkpoint_prefix(checkpoint_id)):
            found = layout.parse_manifest_key(key)
            if found and found[0] == checkpoint_id:
                out.append(found[1])
        return sorted(out)

    def get(self, key: str) -> bytes | None:
        return self._get(key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._put(key, data, create_only=True)

    def delete(self, key: str) -> None:
        folders = _folders_of(key)
        if folders and self.conditional_writes == "probe":
            _probe_once(self)  # whether the server keeps emptied folders (a process may delete before it writes)
        with self._errors(f"deleting {key}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        if folders and self.keeps_folders:
            self._drop_emptied_folders(folders)

    def _drop_emptied_folders(self, folders: list[str]) -> None:
        """The folders a deleted manifest or restore record leaves empty, on a server that keeps and lists
        them (SeaweedFS: a deleted ID stayed among the store's IDs, for gc, check and the agent to walk for
        ever), as the file store drops its own. A folder that still holds objects is left (SeaweedFS 4.48).
        Only where the probe saw folders kept: on AWS a DELETE in a versioned bucket writes a delete marker
        even for a key that is not there. Best effort: the delete itself is done."""
        from botocore.exceptions import BotoCoreError, ClientError

        for folder in folders:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(folder))
            except (BotoCoreError, ClientError) as e:
                log.debug("store %s: removing the emptied folder %s failed (%s)", self.url, folder, e)
                return

    def get_versioned(self, key: str) -> tuple[bytes | None, str]:
        from botocore.exceptions import ClientError

        with self._errors(f"reading {key}"):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
                return bytes(r["Body"].read()), str(r["ETag"])
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in _MISSING:
                    return None, ""
                raise

    def get_bounded(self, key: str, limit: int) -> bytes | None:
        """One GET, judged by its Content-Length: the body of an object over ``limit`` is closed unread."""
        from botocore.exceptions import ClientError

        with self._errors(f"reading {key}"):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in _MISSING:
                    return None
                raise
            body, size = r["Body"], int(r.get("ContentLength", limit))
            try:
                if size > limit:
                    raise TooLarge(size, limit)
                data = bytes(body.read(size + 1))  # read(n) allocates n first: never the cap for a small object
            finally:
                body.close()
            if len(data) > limit:
                raise TooLarge(len(data), limit)
            return data

    def get_if_changed(self, key: str, token: str) -> tuple[bytes | None, str] | None:
        from botocore.exceptions import ClientError

        if not token:
            return self.get_versioned(key)
        with self._errors(f"reading {key}"):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(key), IfNoneMatch=token)
                return bytes(r["Body"].read()), str(r["ETag"])
            except ClientError as e:
                code = str(e.response.get("Error", {}).get("Code"))
                if code in ("304", "NotModified"):
                    return None
                if code in _MISSING:
                    return None, ""
                raise

    def put_if_version(self, key: str, data: bytes, token: str) -> bool:
        return self._put(key, data, create_only=not token, if_match=token)

    def list_objects(self, prefix: str, limit: int = 0) -> Iterator[StoredObject]:
        for page in self._pages(prefix, limit=limit):
            for o in page.get("Contents", []):
                yield StoredObject(o["Key"][len(self.prefix):], int(o["Size"]), o["LastModified"].timestamp())
