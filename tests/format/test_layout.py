"""The store's key layout: spelt only in format/layout.py, documented in full, and stable."""

from __future__ import annotations

import ast
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

import cedana_airflow
from cedana_airflow.errors import CheckpointIdError
from cedana_airflow.format import layout
from cedana_airflow.ids import RESERVED_NAMES

REPO = Path(cedana_airflow.__file__).parent.parent
LAYOUT = REPO / "cedana_airflow" / "format" / "layout.py"
SOURCES = ("cedana_airflow", "operators", "sensors")
#: What starts a spelt key: every top-level prefix of the layout, taken from it so a new one is covered.
KEY_START = tuple(layout.PREFIXES)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of docstring nodes: prose may show a key, code may not."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def spelt_keys(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant or f-string part that starts a store key."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose
            and n.value.startswith(KEY_START)]


def test_only_the_layout_spells_a_store_key():
    found = [f"{p.relative_to(REPO)}:{line}: {text!r}"
             for top in SOURCES for p in sorted((REPO / top).rglob("*.py")) if p != LAYOUT
             for line, text in spelt_keys(p.read_text())]
    assert not found, "store keys spelt outside cedana_airflow/format/layout.py (call it instead):\n" + "\n".join(found)


@pytest.mark.parametrize("source", ['k = "chunks/ab"', 'k = f"locks/writer-{pid}"', 'k = f"{x}" + "drills/a"',
                                    'def f():\n    return f"leases/{cid}.json"'])
def test_a_new_spelling_is_caught(source):
    assert spelt_keys(source)


@pytest.mark.parametrize("source", ['"""chunks/ab in a docstring"""', 'k = "chunks"', 'k = "/api/v1/drills"'])
def test_prose_and_bare_names_are_not_keys(source):
    assert not spelt_keys(source)


def test_the_documented_tree_names_every_top_level_prefix():
    doc = (REPO / "docs" / "store-format.md").read_text()
    tree = re.search(r"## Layout\n.*?```\n(.*?)```", doc, re.S)
    assert tree, "docs/store-format.md has no layout tree under '## Layout'"
    named = set(re.findall(r"[├└]── ([^\s/]+/?)", tree.group(1)))
    assert set(layout.PREFIXES) | {layout.STORE_CONFIG_KEY} <= named
    assert "format/layout.py" in doc


def test_top_level_names_are_the_reserved_checkpoint_ids():
    # a new prefix must also be refused as a checkpoint ID, or an ID could shadow it (ids.py)
    assert layout.TOP_LEVEL_NAMES == RESERVED_NAMES


@pytest.mark.parametrize(("cid", "seq"), [("job", 1), ("train_llm.finetune.3.manual__x-db99e3daf1", 9_999_999_999)])
def test_manifest_key_round_trip(cid, seq):
    key = layout.manifest_key(cid, seq)
    assert key == f"{cid}/{seq:010d}/manifest.json"
    assert layout.parse_manifest_key(key) == (cid, seq)


@pytest.mark.parametrize("key", ["job/0000000001/.tmp-k3j9x2a1", "job/1/manifest.json", "job/restores/x.json",
                                 "chunks/ab/ab12", "0000000001/manifest.json"])
def test_other_keys_are_no_manifest(key):
    assert layout.parse_manifest_key(key) is None


def test_keys_as_documented():
    digest = "81b2eadadf8195303d1d5d12a10bfb2b97c5f3ae7cbd7c9223362948efffa0d0"
    assert layout.chunk_key(digest) == f"chunks/81/{digest}"
    assert layout.chunk_digest(layout.chunk_key(digest)) == digest
    assert layout.quarantine_key(digest) == f"quarantine/{digest}.json"
    assert layout.quarantine_digest(layout.quarantine_key(digest)) == digest
    assert layout.lease_key("job") == "leases/job.json"
    assert layout.drill_report_key("20261130T000000Z-verify-abc123") == "drills/20261130T000000Z-verify-abc123.json"
    assert layout.golden_digest_key("0123456789abcdef") == "drills/golden-0123456789abcdef.txt"
    assert layout.GC_LOCK_KEY == "locks/gc"
    assert layout.writer_lock_key("node-1", 812, "9f2c") == "locks/writer-node-1-812-9f2c"
    at = datetime(2025, 6, 1, 2, 10, 44, 5, tzinfo=timezone.utc)
    assert layout.restore_record_key("job", at, 2, "abcd1234") == "job/restores/20250601T021044.000005Z-2-abcd1234.json"
    assert layout.restore_record_key("job", at, 2, "x").startswith(layout.restores_prefix("job"))


def test_index_shards():
    keys = layout.index_shard_keys()
    assert keys == [f"index/{d}.json" for d in "0123456789abcdef"]
    assert layout.index_shard_key("job") in keys
    assert layout.cas_lock_key("index/5.json") == "index/.lock-5.json"


def test_temp_files():
    assert layout.is_temp("chunks/81/.tmp-k3j9x2a1") and layout.is_temp("job/0000000004/.tmp-x")
    assert not layout.is_temp(layout.manifest_key("job", 4))


def test_keys_refuse_unsafe_checkpoint_ids():
    with pytest.raises(CheckpointIdError, match="reserved"):
        layout.lease_key("chunks")
    with pytest.raises(CheckpointIdError, match="'/'"):
        layout.restores_prefix("a/../etc")
