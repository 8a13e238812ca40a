"""A task's store and its trust: the store URL from settings, for s3:// an S3 client built from an Airflow
connection, and the signing key: a connection's password, the worker's own key, or by default an Airflow
Variable created on first use."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from ..config import Settings
from ..errors import ConfigError
from ..format.signing import key_id
from ..store import Store, open_store
from ..store.s3 import client_config

__all__ = ["named_connection", "task_store", "s3_client_for", "with_signing_key"]

log = logging.getLogger(__name__)


def s3_client_for(aws_conn_id: str, settings: Settings) -> Any:
    """The amazon provider's S3Hook client for ``aws_conn_id`` (its credentials, region and endpoint_url)."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    # Looked up first: S3Hook on its own logs a warning for a missing connection and carries on with
    # boto3's default chain, which could write checkpoints somewhere nobody configured.
    named_connection(aws_conn_id, "aws_conn_id", "to use boto3's credential chain")
    return S3Hook(aws_conn_id=aws_conn_id, config=client_config(settings)).get_conn()


def named_connection(conn_id: str, option: str, without: str) -> Any:
    """The Airflow connection an option names; a missing one is one line naming the option and the fix."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        raise ConfigError(
            f"Airflow connection {conn_id!r} ({option}) is not defined. Create it (Admin > Connections, "
            f"'airflow connections add', or AIRFLOW_CONN_{conn_id.upper()}) or drop {option} {without}."
        ) from None


def with_signing_key(settings: Settings, signing_conn_id: str | None, signing_variable: str = "") -> Settings:
    """``settings`` with the deployment's signing key, looked up when the task runs, never when the DAG
    is parsed (no secrets backend calls at parse time). In order: the connection ``signing_conn_id``
    names (its password); a key the worker's own settings give (signing_key_file, CEDANA_SIGNING_KEY);
    the Airflow Variable ``signing_variable``, created with a random key on first use. Says once per
    task which key signs (its public key_id) and where it lives."""
    if signing_conn_id:
        password = named_connection(signing_conn_id, "signing_conn_id", "to use a key file or CEDANA_SIGNING_KEY").password
        if not password:
            raise ConfigError(f"Airflow connection {signing_conn_id!r} (signing_conn_id) has no password. Put the "
                              "signing key in its password field.")
        settings = settings.model_copy(update={"signing_key": SecretStr(password), "signing_key_file": None})
        return _said(settings, f"Airflow connection {signing_conn_id!r} (signing_conn_id)")
    if settings.signing_key is not None or settings.signing_key_file is not None:
        return _said(settings, f"{settings.signing_key_file} (signing_key_file)" if settings.signing_key_file
                     else "CEDANA_SIGNING_KEY / [cedana] signing_key")
    if not signing_variable:
        log.warning("cedana: manifests are not signed (signing_variable is empty and no key is configured): a "
                    "restore puts captured files back only under restore_roots and the working directory")
        return settings
    try:
        key, created = _variable_key(signing_variable)
    except Exception as e:  # no task runtime, or the API server refused: unsigned, said, never a failed task
        log.warning("cedana: manifests are not signed: the Airflow Variable %r could not be read or created (%s: %s)",
                    signing_variable, type(e).__name__, e)
        return settings
    settings = settings.model_copy(update={"signing_key": SecretStr(key)})
    return _said(settings, f"Airflow Variable {signing_variable!r} (signing_variable)" + (", created now" if created else ""))


#: A Variable this task created is signed with only once it has held this long (see _variable_key).
SETTLE_SECONDS = 2.0

#: First tasks on one node create the Variable one at a time (see _variable_key).
NODE_LOCK = Path(tempfile.gettempdir()) / "cedana-airflow-signing-variable.lock"


def _variable_key(name: str, *, variables: Any = None, lock: Path = NODE_LOCK,
                  settle: float = SETTLE_SECONDS) -> tuple[str, bool]:
    """The key in Airflow Variable ``name``, created with 32 random bytes when it is missing. Every worker
    reaches Variables through the API server (Airflow 3: workers need no database, fernet key or JWT
    secret of their own), and the metadata database keeps them fernet-encrypted; a secrets backend
    (AIRFLOW_VAR_*, Vault, ...) that holds it wins, as for any Variable.

    The first tasks of a deployment race to create it, and the execution API only upserts: the last
    write stays, and a task that signed with an earlier one made checkpoints no retry can verify (a
    DAG's parallel tasks on its first run did). So tasks on one node create it under a node lock, and
    a task that created it goes on only with a value that has held for ``settle`` seconds: a racer on
    another node writes within its read-and-write, two API calls, far sooner."""
    if variables is None:
        from airflow.sdk import Variable

        variables = Variable

    with _node_lock(lock):
        value = variables.get(name, default=None)
        if value:
            return str(value), False
        variables.set(name, secrets.token_hex(32), description="cedana-airflow: the key that signs checkpoint "
                      "manifests (created on first use). Changing it makes every existing checkpoint unrestorable.")
    seen = variables.get(name)
    for _ in range(5):
        time.sleep(settle)
        again = variables.get(name)
        if again == seen:
            break
        seen = again
    return str(seen), True


@contextlib.contextmanager
def _node_lock(path: Path, wait: float = 10.0) -> Iterator[None]:
    """An exclusive lock on ``path``, waited for ``wait`` seconds at most; none where it cannot be had
    (the settle still covers that case). Never through a symlink, and never on a file another user
    owns: in a shared /tmp, whoever made it first could otherwise hold every first task forever."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.debug("signing variable lock %s not taken: %s", path, e)
        yield
        return
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.debug("signing variable lock %s still held after %.0f s; going on without it", path, wait)
                        break
                    time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _said(settings: Settings, where: str) -> Settings:
    key = settings.resolved_signing_key()
    if key is not None:
        log.info("cedana: manifests are signed and verified with key %s from %s", key_id(key), where)
    return settings


def task_store(settings: Settings, aws_conn_id: str | None) -> Store:
    url = settings.resolved_store()
    if url.startswith("s3://") and aws_conn_id:
        return open_store(url, settings, s3_client=s3_client_for(aws_conn_id, settings))
    return open_store(url, settings)
