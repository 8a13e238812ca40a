"""Whatever a fetched checkpoint makes fail refuses that checkpoint with one line (issue 11, item 5).

Crafted but schema-valid manifests are written straight into a file:// store, as a store writer
could, and restored with the real Checkpointer: no traceback, no huge allocation, one reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import CheckpointNotFound, CorruptCheckpoint
from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint


def _one_checkpoint(tmp_path: Path):
    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    images = tmp_path / "img"
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(5000))
    proc = ProcessInfo(pid=1, command=("x",), cwd=str(tmp_path), stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    m = save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.1.1", proc), images)
    return store, cfg, tmp_path / "store" / "job" / f"{m.seq:010d}" / "manifest.json"


def _checkpointer(tmp_path: Path, store, cfg) -> Checkpointer:
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    # a node that accepts unsigned manifests: what these store-side limits guard (a signing node refuses first)
    return Checkpointer(engine, store, cfg, "job", Settings(node="node-b", allow_unsigned=True), work_dir=tmp_path / "work")


def test_a_chunk_declaring_a_huge_size_is_refused_before_anything_is_allocated(tmp_path):
    store, cfg, path = _one_checkpoint(tmp_path)
    doc = json.loads(path.read_text())
    doc["files"][0]["chunks"][0]["size"] = 1 << 36  # 64 GiB: decompressing it would allocate that much
    doc["files"][0]["size"] = sum(c["size"] for c in doc["files"][0]["chunks"])
    doc["image_bytes"] = doc["files"][0]["size"]
    Manifest.model_validate(doc)  # schema-valid: only the store's own limit can tell
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpoint, match=r"declares 68719476736 bytes, more than any chunk of this store \(262144\)"):
        _checkpointer(tmp_path, store, cfg).restore(cwd=str(tmp_path))


def test_an_image_file_named_like_the_captured_folder_is_never_fetched(tmp_path):
    store, cfg, path = _one_checkpoint(tmp_path)
    doc = json.loads(path.read_text())
    doc["files"][0]["name"] = "captured"
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointNotFound):  # the manifest is refused when read: no complete checkpoint
        _checkpointer(tmp_path, store, cfg).restore(cwd=str(tmp_path))
    assert not (tmp_path / "work").exists() or not list((tmp_path / "work").rglob("captured"))


def test_a_checkpoint_criu_refuses_keeps_the_log_its_message_names(tmp_path):
    import re

    store, cfg, _ = _one_checkpoint(tmp_path)  # random bytes: real CRIU refuses them
    with pytest.raises(CorruptCheckpoint) as e:
        _checkpointer(tmp_path, store, cfg).restore(cwd=str(tmp_path))
    log = re.search(r"log: (\S+\.log)\.", str(e.value))
    assert log, str(e.value)
    assert Path(log.group(1)).is_file()  # the log the message points to is there to read
    assert not list((tmp_path / "work").rglob("pages-1.img"))  # the images are not


def test_a_work_dir_without_room_for_the_fetch_ends_the_try_naming_both_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    """Review of issue 48: nothing checked free disk before a fetch; a full disk failed every candidate
    the same way mid-fetch, and the run started fresh, burying the checkpoint. Sizes only a signature
    vouches for end the try: an unsigned manifest's (allow_unsigned) are refused like a corrupt one."""
    import types

    from conftest import node_key_bytes

    from cedana_airflow.errors import NodeInTheWay
    from cedana_airflow.run import checkpointer

    store, cfg, _ = _one_checkpoint(tmp_path)  # seq 1, unsigned
    images = tmp_path / "img"
    proc = ProcessInfo(pid=1, command=("x",), cwd=str(tmp_path), stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.1.1", proc), images, signing_key=node_key_bytes())
    full = types.SimpleNamespace(f_bavail=10, f_frsize=4096)  # 40 KB free
    monkeypatch.setattr(checkpointer.os, "statvfs", lambda path: full)
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    with pytest.raises(NodeInTheWay, match=r"checkpoint job seq=2 needs \d+ bytes in .*restore-\d+-[0-9a-f]+-2-\w+, whose file "
                       r"system has 40960 free: free space there \(work_dir\), or let the retry run on another node"):
        Checkpointer(engine, store, cfg, "job", Settings(node="node-b"), work_dir=tmp_path / "work").restore(
            cwd=str(tmp_path))
    assert not list((tmp_path / "work").glob("restore-*/images"))  # nothing was fetched
    store.delete("job/0000000002/manifest.json")  # left: the unsigned one, on a node that accepts such
    with pytest.raises(CorruptCheckpoint, match=r"seq=1 needs \d+ bytes .* by what its unsigned manifest declares"):
        _checkpointer(tmp_path, store, cfg).restore(cwd=str(tmp_path))
