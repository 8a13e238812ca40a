"""The store's own credentials never reach a checkpoint image, and local images are root's alone
(issue 11, items 3 and 4).

The supervisor needs them to write the store; the workload does not, and its memory (environment
included) is what a checkpoint stores. Every chunk of a real checkpoint is decoded and searched.
"""

from __future__ import annotations

import stat
import sys
import uuid
from pathlib import Path

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.format.manifest import Manifest
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import fetch_checkpoint
from conftest import TRAIN, cli_env, kill_node, start_cli, wait_for_checkpoints

pytestmark = pytest.mark.integration


def _image_bytes_of_first_checkpoint(tmp_path: Path, cid: str, **env: str) -> bytes:
    proc = start_cli("run", "--id", cid, "--heartbeat", "1", "--", sys.executable, str(TRAIN), "--mb", "5",
                     "--steps", "200", "--step-seconds", "0.05", env=cli_env(tmp_path, "node-a", f"work-{cid}", **env),
                     out=tmp_path / cid)
    ms = wait_for_checkpoints(tmp_path / "store", cid, 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    store.open(create=False, chunk_avg_bytes=1 << 20)
    images = tmp_path / f"images-{cid}"
    fetch_checkpoint(store, Manifest.model_validate(ms[0]), images)  # every chunk decoded and verified
    return b"".join(p.read_bytes() for p in sorted(images.rglob("*")) if p.is_file())


def test_no_store_credential_is_in_any_chunk_of_a_checkpoint(tmp_path):
    canary = f"canary-{uuid.uuid4().hex}"
    creds = {"AWS_SECRET_ACCESS_KEY": canary, "AWS_SESSION_TOKEN": canary + "-token", "CEDANA_SIGNING_KEY": canary + "-sig"}
    clean = _image_bytes_of_first_checkpoint(tmp_path, "clean", **creds, NOT_A_SECRET=canary + "-plain",
                                             CEDANA_KEEP_LOCAL="true")
    dumps = list((tmp_path / "work-clean").glob("dump-*"))
    assert dumps and all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in dumps)  # local images: root only
    assert canary.encode() not in clean.replace((canary + "-plain").encode(), b"")
    assert (canary + "-plain").encode() in clean  # the search finds what the workload does hold
    # named in keep_env, a credential stays: the workload asked for it, and the search finds it
    kept = _image_bytes_of_first_checkpoint(tmp_path, "kept", **creds, CEDANA_KEEP_ENV="AWS_SECRET_ACCESS_KEY")
    assert canary.encode() in kept and (canary + "-token").encode() not in kept
