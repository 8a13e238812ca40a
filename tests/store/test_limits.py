"""Issue 48: a manifest over format/limits.py's caps is refused before anything large is read or fetched,
and a restore falls back to the older checkpoint as for any refused one."""

from __future__ import annotations

import json
import logging
import os
import tracemalloc
from pathlib import Path

import boto3
import pytest

from cedana_airflow.config import Settings, load_settings
from cedana_airflow.errors import CorruptCheckpoint, StoreError
from cedana_airflow.format import limits
from cedana_airflow.format.layout import manifest_key
from cedana_airflow.format.manifest import ChunkRef, FileEntry, Manifest, ProcessInfo
from cedana_airflow.store import FileStore, open_store
from cedana_airflow.store.transfer import CheckpointMeta, fetch_checkpoint, load_manifests, save_checkpoint

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
META = CheckpointMeta(checkpoint_id="job", node="n1", engine_version="4.1.1", process=PROC)


@pytest.fixture
def store(tmp_path):
    s = FileStore(tmp_path / "store")
    return s, s.open(create=True, chunk_avg_bytes=64 << 10)


def _saved(s, cfg, tmp_path: Path) -> Manifest:
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(200 << 10))
    return save_checkpoint(s, cfg, META, d)


def _forge(m: Manifest, seq: int, files: tuple[FileEntry, ...]) -> Manifest:
    return m.model_copy(update={"seq": seq, "files": files})


def _repeated(m: Manifest, times: int) -> FileEntry:
    """One image file naming the checkpoint's first chunk ``times`` times: a few bytes stored, many written."""
    ref = m.files[0].chunks[0]
    return FileEntry(name="pages-1.img", size=ref.size * times, chunks=(ref,) * times)


def _count_gets(s, monkeypatch) -> list[str]:
    gets: list[str] = []
    real = s.get_chunk
    monkeypatch.setattr(s, "get_chunk", lambda d: gets.append(d) or real(d))
    return gets


def test_an_oversized_manifest_is_refused_from_its_size_never_read_whole(store, tmp_path, caplog):
    s, cfg = store
    _saved(s, cfg, tmp_path)
    big = s.root / manifest_key("job", 2)
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:  # sparse: 300 MiB on no disk at all
        f.truncate(300 << 20)
    caplog.set_level(logging.WARNING)
    tracemalloc.start()
    try:
        found = load_manifests(s, "job")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [m.seq for m in found] == [1]  # the restore takes the older one
    assert peak < 8 << 20, f"{peak} bytes held reading the manifests"
    assert f"seq=2 is refused unread: its manifest is {300 << 20} bytes, more than the {limits.MAX_MANIFEST_BYTES}" \
        in caplog.text


def test_an_oversized_manifest_in_s3_is_refused_from_its_content_length(bucket, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(limits, "MAX_MANIFEST_BYTES", 64 << 10)  # the real cap would mean a 256 MiB upload
    s = open_store(f"s3://{bucket}/ckpt", load_settings({}, environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    _saved(s, cfg, tmp_path)
    boto3.client("s3").put_object(Bucket=bucket, Key="ckpt/" + manifest_key("job", 2), Body=b" " * (100 << 10))
    read: list[int] = []
    real = s.client.get_object

    def get_object(**kw):
        r = real(**kw)
        body_read = r["Body"].read
        r["Body"].read = lambda n=None: read.append(n) or body_read(n)
        return r

    monkeypatch.setattr(s.client, "get_object", get_object)
    caplog.set_level(logging.WARNING)
    assert [m.seq for m in load_manifests(s, "job")] == [1]
    assert f"seq=2 is refused unread: its manifest is {100 << 10} bytes" in caplog.text
    assert len(read) == 1  # seq 1's body only: seq 2's was closed unread


def test_a_manifest_listing_too_many_files_is_refused_in_one_line(store, tmp_path, monkeypatch, caplog):
    s, cfg = store
    m = _saved(s, cfg, tmp_path)
    monkeypatch.setattr(limits, "MAX_FILES", 1000)  # the real 100k: the same, 0.8 s slower
    doc = json.loads(m.to_json())
    doc["seq"] = 2
    doc["files"] += [{"name": f"f{i}.img", "size": 0, "chunks": []} for i in range(limits.MAX_FILES)]
    s.put_manifest("job", 2, json.dumps(doc).encode())
    caplog.set_level(logging.WARNING)
    assert [x.seq for x in load_manifests(s, "job")] == [1]
    assert (f"checkpoint job seq=2 is refused: its manifest lists {limits.MAX_FILES + 1} files, more than the "
            f"{limits.MAX_FILES} a restore accepts") in caplog.text


def test_a_chunk_named_over_and_over_is_refused_before_any_chunk_is_fetched(store, tmp_path, monkeypatch, caplog):
    s, cfg = store
    m = _saved(s, cfg, tmp_path)
    gets = _count_gets(s, monkeypatch)
    # Over the count of chunk references: refused when read, so nothing ever fetches it.
    monkeypatch.setattr(limits, "MAX_CHUNK_REFS", 1000)
    s.put_manifest("job", 2, _forge(m, 2, (_repeated(m, 1001),)).to_json())
    caplog.set_level(logging.WARNING)
    assert [x.seq for x in load_manifests(s, "job")] == [1]
    assert "seq=2 is refused: its manifest lists 1001 chunk references, more than the 1000" in caplog.text
    # Over the declared total: one ref of 5 TiB (sparse files would take it), refused before dest is made.
    huge = _forge(m, 3, (FileEntry(name="pages-1.img", size=5 << 40,
                                   chunks=(ChunkRef(digest=m.files[0].chunks[0].digest, size=5 << 40),)),))
    with pytest.raises(CorruptCheckpoint, match=f"declares {5 << 40} bytes of files, more than the "
                                                f"{limits.MAX_DECLARED_BYTES} a restore accepts"):
        fetch_checkpoint(s, huge, tmp_path / "out")
    assert gets == [] and not (tmp_path / "out").exists()


def test_a_declared_total_over_this_nodes_max_checkpoint_bytes_is_refused_before_any_chunk_get(
        store, tmp_path, monkeypatch):
    s, cfg = store
    m = _saved(s, cfg, tmp_path)
    settings = Settings(max_checkpoint_bytes=1 << 20, max_captured_bytes=0)  # a restore takes up to 2 MiB
    forged = _forge(m, 2, (_repeated(m, (3 << 20) // m.files[0].chunks[0].size),))
    assert limits.restore_refusal(m, settings) is None
    line = limits.restore_refusal(forged, settings)
    assert line and line.startswith("checkpoint job seq=2 is refused: its manifest declares") and \
        "more than the 2097152 this node restores (2 x max_checkpoint_bytes + max_captured_bytes)" in line
    gets = _count_gets(s, monkeypatch)
    with pytest.raises(CorruptCheckpoint, match="more than the 2097152"):
        fetch_checkpoint(s, forged, tmp_path / "out", max_total_bytes=limits.restore_limit(forged, settings))
    assert gets == [] and not (tmp_path / "out").exists()
    # No max_checkpoint_bytes (0 = unlimited): the hard ceiling.
    assert limits.restore_limit(forged, Settings(max_checkpoint_bytes=0)) == limits.MAX_DECLARED_BYTES


def test_a_writer_never_commits_a_manifest_readers_would_refuse(store, tmp_path, monkeypatch):
    s, cfg = store
    monkeypatch.setattr(limits, "MAX_FILES", 0)
    with pytest.raises(StoreError, match="lists 1 files, more than the 0 a restore accepts; not stored"):
        _saved(s, cfg, tmp_path)
    assert s.list_seqs("job") == []


def test_a_stored_chunk_is_judged_by_its_header_and_its_kind_before_anything_is_allocated_or_waited_on(store, tmp_path):
    """Review of issue 48: a 512 KB zstd frame whose header states 16 GiB made decode and intact allocate
    that; a chunk object made a FIFO hung the file store's reader; a nesting bomb escaped every handler
    as RecursionError; a later version's unknown block was parsed at ~20x its size."""
    import zstandard

    from cedana_airflow.format import chunking
    from cedana_airflow.format.manifest import parse_manifest

    s, cfg = store
    huge = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # states 64 MiB in its header
    tracemalloc.start()
    with pytest.raises(CorruptCheckpoint, match="its frame declares 67108864 bytes, more than the 4096"):
        chunking.decode(b"\x01" + huge, "0" * 64, 4096)
    assert tracemalloc.get_traced_memory()[1] < 8 << 20  # never allocated what the header says
    tracemalloc.stop()
    m = _saved(s, cfg, tmp_path)
    digest = m.files[0].chunks[0].digest
    chunk = tmp_path / "store" / "chunks" / digest[:2] / digest
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(CorruptCheckpoint, match="is not a regular file"):
        s.get_chunk(digest)  # at once: a FIFO is never waited on
    with pytest.raises(ValueError, match="nests deeper than a reader parses"):
        parse_manifest("[" * 200_000 + "]" * 200_000)
    doc = json.loads(m.to_json())
    doc.update(format_version=4, required=[], later={"x": ["y" * 1000] * 2000})
    with pytest.raises(CorruptCheckpoint, match="blocks this reader does not know take more than 1048576 bytes"):
        parse_manifest(json.dumps(doc))
