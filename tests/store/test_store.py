"""The file store and transfer layer, without CRIU: what a restore may and may not use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from cedana_airflow.errors import CheckpointNotFound, CorruptCheckpoint, StoreUnavailable
from cedana_airflow.format.manifest import CapturedFile, ProcessInfo
from cedana_airflow.store import FileStore, open_store
from cedana_airflow.store.base import chunk_key
from cedana_airflow.store.transfer import (
    CapturedSource,
    CheckpointMeta,
    fetch_checkpoint,
    load_manifests,
    require_latest,
    save_checkpoint,
)

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


def _meta(cid="job", try_number=0):
    return CheckpointMeta(checkpoint_id=cid, node="n1", engine_version="4.1.1", process=PROC, try_number=try_number)


@pytest.fixture
def store(tmp_path):
    s = FileStore(tmp_path / "store")
    return s, s.open(create=True, chunk_avg_bytes=64 << 10)


def _images(d: Path, seed: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(seed * (1 << 20))
    (d / "core-1.img").write_bytes(os.urandom(5000))
    (d / "empty.img").write_bytes(b"")
    return d


def test_save_then_fetch_gives_back_identical_files(store, tmp_path):
    s, cfg = store
    src = _images(tmp_path / "img", os.urandom(3))
    cap = tmp_path / "cap0"
    cap.write_bytes(b"log line\n" * 100)
    m = save_checkpoint(s, cfg, _meta(), src, [CapturedSource("/var/log/job.log", cap, 0o640)])
    assert m.seq == 1 and m.image_bytes == sum(p.stat().st_size for p in src.iterdir()) + cap.stat().st_size
    fetch_checkpoint(s, m, tmp_path / "out")
    for p in src.iterdir():
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()
    assert (tmp_path / "out" / "captured" / "0").read_bytes() == cap.read_bytes()
    assert m.captured[0].path == "/var/log/job.log" and m.captured[0].mode == 0o640


def test_identical_chunks_are_stored_once(store, tmp_path):
    s, cfg = store
    src = _images(tmp_path / "img", os.urandom(7))
    m1 = save_checkpoint(s, cfg, _meta(), src)
    m2 = save_checkpoint(s, cfg, _meta(), src)
    assert m1.stored_bytes > 0 and m2.stored_bytes == 0 and m2.new_chunks == 0
    assert [m.seq for m in load_manifests(s, "job")] == [2, 1]


def test_chunks_without_a_manifest_are_not_a_checkpoint(store, tmp_path, monkeypatch):
    s, cfg = store
    save_checkpoint(s, cfg, _meta(), _images(tmp_path / "a", b"a"))
    monkeypatch.setattr(s, "put_manifest", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        save_checkpoint(s, cfg, _meta(), _images(tmp_path / "b", b"b"))
    assert [m.seq for m in load_manifests(s, "job")] == [1]  # the interrupted one does not exist


def test_a_taken_sequence_number_is_never_overwritten(store, tmp_path):
    s, cfg = store
    m1 = save_checkpoint(s, cfg, _meta(), _images(tmp_path / "a", b"a"))
    assert s.put_manifest("job", 1, b"{}") is False
    assert load_manifests(s, "job")[0] == m1


def test_missing_and_flipped_chunks_are_refused(store, tmp_path):
    s, cfg = store
    m = save_checkpoint(s, cfg, _meta(), _images(tmp_path / "img", os.urandom(11)))
    victim = s.root / chunk_key(m.files[-1].chunks[0].digest)
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 1
    victim.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpoint, match="seq=1"):
        fetch_checkpoint(s, m, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-verified is left to use
    assert not victim.exists()  # set aside, so that a writer uploads it again (store/quarantine.py)
    assert (s.root / "quarantine" / f"{victim.name}.json").exists()
    with pytest.raises(CorruptCheckpoint, match="missing"):
        fetch_checkpoint(s, m, tmp_path / "out")


def test_unreadable_manifest_is_skipped_not_restored(store, tmp_path):
    s, cfg = store
    save_checkpoint(s, cfg, _meta(), _images(tmp_path / "a", b"a"))
    assert s.put_manifest("job", 2, b'{"format_version": 1, "truncated')
    assert [m.seq for m in load_manifests(s, "job")] == [1]


def test_newer_try_outranks_a_stale_writer(store, tmp_path):
    s, cfg = store
    save_checkpoint(s, cfg, _meta(try_number=2), _images(tmp_path / "a", b"a"))
    save_checkpoint(s, cfg, _meta(try_number=1), _images(tmp_path / "b", b"b"))  # old try, written later
    assert [(m.try_number, m.seq) for m in load_manifests(s, "job")] == [(2, 1), (1, 2)]


def test_no_checkpoint_is_a_clear_error(store):
    s, _ = store
    with pytest.raises(CheckpointNotFound, match="no complete checkpoint under checkpoint ID 'nothing'"):
        require_latest(s, "nothing")


def test_unknown_store_format_version_stops_the_client(tmp_path):
    root = tmp_path / "future"
    root.mkdir()
    (root / "store.json").write_text('{"format_version": 99, "chunker": "fastcdc-2020", "digest": "blake3"}')
    with pytest.raises(StoreUnavailable, match="format_version=99.*Upgrade cedana-airflow"):
        FileStore(root).open(create=True, chunk_avg_bytes=1 << 20)


def test_listing_ignores_reserved_names_and_partial_folders(store, tmp_path):
    s, cfg = store
    save_checkpoint(s, cfg, _meta("a"), _images(tmp_path / "a", b"a"))
    (s.root / "b" / "0000000001").mkdir(parents=True)  # a writer died before its manifest
    assert "chunks" not in s.list_ids()
    assert s.list_seqs("b") == []


def test_relative_file_url_is_resolved_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_store("file://rel/store").url == f"file://{tmp_path}/rel/store"


def test_a_manifest_whose_chunks_do_not_cover_a_file_is_refused(store, tmp_path):
    s, cfg = store
    m = save_checkpoint(s, cfg, _meta(), _images(tmp_path / "a", b"a"))
    doc = m.model_dump(mode="json")
    doc["files"][0]["size"] += 4096  # a gap the restore would zero-fill
    assert s.put_manifest("job", 2, json.dumps(doc).encode())
    assert [x.seq for x in load_manifests(s, "job")] == [1]


@pytest.mark.parametrize("path,mode", [("relative/log", 0o644), ("/var/../etc/passwd", 0o644), ("/tmp/x", 0o4755)])
def test_captured_files_must_be_absolute_normalised_and_without_special_bits(path, mode):
    with pytest.raises(ValidationError):
        CapturedFile(path=path, size=0, mode=mode, chunks=())


def test_a_manifest_naming_a_good_chunk_with_a_wrong_size_is_refused_and_the_chunk_kept(store, tmp_path):
    """Whoever can write the store writes a manifest that names another checkpoint's chunk with a wrong
    size: the reader refuses that manifest, and must not take the chunk for bad. Issue 48's design review
    saw every reader (restore, drill verify, check --repair) delete it, breaking the good checkpoint."""
    s, cfg = store
    good = save_checkpoint(s, cfg, _meta(), _images(tmp_path / "img", os.urandom(11)))
    victim = good.files[0].chunks[0]
    first = good.files[0]
    lying = type(good).model_validate({**good.model_dump(), "files": [  # a manifest that validates
        {**first.model_dump(), "size": first.size - 1,
         "chunks": [{"digest": victim.digest, "size": victim.size - 1}, *[c.model_dump() for c in first.chunks[1:]]]},
        *[f.model_dump() for f in good.files[1:]]]})
    with pytest.raises(CorruptCheckpoint):
        fetch_checkpoint(s, lying, tmp_path / "forged")
    assert (s.root / chunk_key(victim.digest)).exists()
    assert not (s.root / "quarantine" / f"{victim.digest}.json").exists()
    fetch_checkpoint(s, good, tmp_path / "out")  # the good checkpoint still restores
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == (tmp_path / "img" / "pages-1.img").read_bytes()


def test_links_in_the_store_are_never_followed_by_a_writer(store, tmp_path):
    """Whoever can write the store turns a chunk folder and a lock file into symbolic links to places of
    the node: a writer running as root created a file at the lock link's target and wrote chunks through
    the folder link (issue 48). Each write now fails in one line, and nothing appears at the targets."""
    s, cfg = store
    outside = tmp_path / "outside"
    outside.mkdir()
    blob = b"\x00" + b"x" * 100  # a raw chunk
    from cedana_airflow.format.chunking import digest as chunk_digest
    d = chunk_digest(b"x" * 100)
    folder = s.root / chunk_key(d)
    folder.parent.parent.mkdir(parents=True, exist_ok=True)
    folder.parent.symlink_to(outside)
    with pytest.raises(StoreUnavailable, match="is a link or not a folder: the store never follows one"):
        s.put_chunk(d, blob)
    assert list(outside.iterdir()) == []
    lock_target = tmp_path / "root-owned"
    key = "index/ids.json"
    from cedana_airflow.format import layout
    lock = s.root / layout.cas_lock_key(key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.symlink_to(lock_target)
    with pytest.raises(StoreUnavailable, match="locking index/ids.json failed"):
        s.put_if_version(key, b"{}", "")
    assert not lock_target.exists()
    with pytest.raises(StoreUnavailable, match="is a link or not a folder"):  # a read does not follow either
        s.get(chunk_key(d))
