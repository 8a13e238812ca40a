"""Forward compatibility: a manifest from a later version, read by this one. From format 4 on, a block
this reader does not know is skipped unless the manifest marks it required; then the checkpoint is
refused in one line naming the block and the version that wrote it (docs/store-format.md)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from cedana_airflow.config import load_settings
from cedana_airflow.errors import UnknownRequiredBlock
from cedana_airflow.format.layout import manifest_key
from cedana_airflow.format.manifest import ProcessInfo, parse_manifest
from cedana_airflow.format.signing import sign, signature_problem
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, load_manifests, save_checkpoint

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
KEY = b"k" * 32


def _doc(tmp_path: Path) -> dict:
    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    d = tmp_path / "img"
    d.mkdir(exist_ok=True)
    (d / "pages-1.img").write_bytes(os.urandom(10_000))
    return json.loads(save_checkpoint(store, cfg, CheckpointMeta("job", "n1", "4.1.1", PROC), d).to_json())


def _future(doc: dict, **blocks) -> dict:
    return {**doc, "format_version": 7, "writer": "cedana-airflow 0.9.0", "required": [], **blocks}


def test_an_unknown_optional_block_of_a_later_version_is_skipped_and_kept(tmp_path):
    doc = _future(_doc(tmp_path), telemetry={"gpu_watts": [300, 310]})
    m = parse_manifest(json.dumps(doc))
    assert (m.format_version, m.writer, m.seq) == (7, "cedana-airflow 0.9.0", doc["seq"])
    assert m.unknown_blocks == {"telemetry": {"gpu_watts": [300, 310]}}
    assert json.loads(m.to_json())["telemetry"] == {"gpu_watts": [300, 310]}  # written back as it was


def test_a_signature_covers_the_blocks_this_reader_does_not_know(tmp_path):
    doc = _future(_doc(tmp_path), telemetry={"gpu_watts": 300})
    # The later writer signs its whole document; this reader must verify it without knowing `telemetry`.
    signed = json.loads(sign(parse_manifest(json.dumps(doc)), KEY).to_json())
    assert signed["telemetry"] == {"gpu_watts": 300}
    assert signature_problem(parse_manifest(json.dumps(signed)), KEY) is None
    tampered = {**signed, "telemetry": {"gpu_watts": 9000}}
    assert "does not match" in (signature_problem(parse_manifest(json.dumps(tampered)), KEY) or "")


def test_an_unknown_required_block_refuses_the_checkpoint_in_one_line_naming_it_and_its_writer(tmp_path, caplog):
    doc = _future(_doc(tmp_path), required=["airflow", "zstd_dictionary"], zstd_dictionary={"id": 3})
    with pytest.raises(UnknownRequiredBlock) as e:
        parse_manifest(json.dumps(doc))
    line = str(e.value)
    assert "\n" not in line and "'zstd_dictionary'" in line and "cedana-airflow 0.9.0" in line
    assert "manifest format 7" in line and "upgrade cedana-airflow" in line
    # In a store: the reader skips it, says that line, and the older checkpoint stays the latest usable one.
    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    newer = {**doc, "seq": doc["seq"] + 1}
    assert store.put_manifest("job", newer["seq"], json.dumps(newer).encode())
    with caplog.at_level(logging.WARNING):
        assert [m.seq for m in load_manifests(store, "job")] == [doc["seq"]]
    assert any("needs block 'zstd_dictionary'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("change, why", [
    ({"format_version": 4, "writer": None}, "names its writer"),
    ({"format_version": 3, "writer": "x"}, "go with format_version 4"),
    ({"format_version": "4"}, "valid integer"),
    ({"format_version": 0}, "greater than or equal to 1"),
    ({"format_version": 5, "writer": "x", "required": "gpu"}, "required is a list"),
])
def test_what_a_later_version_may_not_do_either(tmp_path, change, why):
    doc = {k: v for k, v in {**_doc(tmp_path), **change}.items() if v is not None}
    with pytest.raises((ValidationError, ValueError), match=why):
        parse_manifest(json.dumps(doc))


def test_versions_1_to_3_still_forbid_unknown_fields(tmp_path):
    doc = {**_doc(tmp_path), "telemetry": {}}
    with pytest.raises(ValidationError, match="telemetry"):
        parse_manifest(json.dumps(doc))
    assert manifest_key("job", 1).endswith("manifest.json")
