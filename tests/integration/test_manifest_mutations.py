"""Mutation test of the restore against a hostile store writer (issue 11, "done when").

A hundred and fifty manifests (every kind of mutation a dozen times), each the store's newest checkpoint with one field changed at random (paths,
modes, sizes, names, digests, seq, cwd, version), are restored by the real Checkpointer with real
CRIU. Each must end as one of our errors with a one-line message (after falling back to the older
checkpoint), nothing may be written outside the restore roots, and no process may be left behind.
The images are random bytes but for a root tree's pstree and core (so files are placed as for a real
tree), so no mutation can restore: CRIU refuses whatever gets that far.
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import CheckpointNotFound, CorruptCheckpoint
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CapturedSource, CheckpointMeta, save_checkpoint
from conftest import criu_image, own_processes, pb_message

pytestmark = pytest.mark.integration

MUTATIONS = 150


def _checkpoint(store, cfg, tmp_path: Path, root: Path, n: int) -> dict:
    images = tmp_path / f"img{n}"
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(3000))
    # a root tree's pstree and core (what read_creds reads before placing files), the rest random: CRIU
    # refuses whatever gets that far, after the files were placed as root would place them
    (images / "pstree.img").write_bytes(criu_image(pb_message((1, 1), (2, 0), (3, 1), (4, 1), (5, 1))))
    (images / "core-1.img").write_bytes(criu_image(pb_message((1, 1), (5, pb_message((1, 0), (10, pb_message((7, 0), (8, 0))))))))
    copy_ = tmp_path / f"copy{n}"
    copy_.write_bytes(b"step 1\n")
    proc = ProcessInfo(pid=1, command=("python", "train.py"), cwd=str(root), stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    m = save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.1.1", proc), images,
                        [CapturedSource(str(root / "out" / "steps.log"), copy_, 0o644)])
    return json.loads(m.to_json())


def _mutate(doc: dict, rng: random.Random, root: Path, outside: Path) -> tuple[str, dict]:
    d = copy.deepcopy(doc)
    bad_paths = ["/etc/cedana-mutation", str(outside / "x"), str(root / ".." / outside.name / "x"), "relative/x",
                 str(root / "link" / "x"), str(root), str(root / "out"), "/", "/proc/self/mem", str(root / "deep" / "ok")]
    what = rng.choice(["captured.path", "captured.mode", "captured.size", "file.size", "chunk.size", "file.name",
                       "chunk.digest", "seq", "cwd", "format_version", "captured.twice", "checkpoint_id"])
    if what == "captured.path":
        d["captured"][0]["path"] = rng.choice(bad_paths)
    elif what == "captured.mode":
        d["captured"][0]["mode"] = rng.choice([0o4755, 0o2755, 0o1777, 0o7777, -1, 0o777, 0])
    elif what == "captured.size":
        d["captured"][0]["size"] = rng.choice([0, 1, 10**12, -5])
    elif what == "file.size":
        d["files"][0]["size"] = rng.choice([0, 1 << 36, 2999, 3001])
    elif what == "chunk.size":
        d["files"][0]["chunks"][0]["size"] = rng.choice([1 << 36, 0, 1 << 30])
        d["files"][0]["size"] = sum(c["size"] for c in d["files"][0]["chunks"])
    elif what == "file.name":
        d["files"][0]["name"] = rng.choice(["captured", "../escape", ".hidden", "a/b", "", "pages-1.img", "other.img"])
    elif what == "chunk.digest":
        d["files"][0]["chunks"][0]["digest"] = rng.choice(["0" * 64, "zz", "A" * 64, os.urandom(32).hex()])
    elif what == "seq":
        d["seq"] = rng.choice([1, 3, 0, -1, 10**9])
    elif what == "cwd":
        d["process"]["cwd"] = rng.choice(bad_paths)
    elif what == "format_version":
        d["format_version"] = rng.choice([0, 2, 3, "1"])
    elif what == "captured.twice":
        d["captured"].append(copy.deepcopy(d["captured"][0]))
    else:
        d["checkpoint_id"] = rng.choice(["../job", "other", "job/2", ""])
    return what, d


def test_hundreds_of_mutated_manifests_are_each_refused_cleanly(tmp_path):
    root, outside, victim = tmp_path / "root", tmp_path / "outside", tmp_path / "victim"
    for d in (root / "out", outside, victim):
        d.mkdir(parents=True)
    (root / "link").symlink_to(victim)
    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    _checkpoint(store, cfg, tmp_path, root, 1)  # the older one a refusal falls back to
    base = _checkpoint(store, cfg, tmp_path, root, 2)
    newest = tmp_path / "store" / "job" / "0000000002" / "manifest.json"
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    # A node that accepts unsigned manifests (allow_unsigned): a signing node refuses every mutation
    # on its signature (tests/format/test_signing.py); this is the parsing and placing behind it.
    cp = Checkpointer(engine, store, cfg, "job", Settings(node="node-b", allow_unsigned=True), work_dir=tmp_path / "work")
    children_before = own_processes()
    rng = random.Random(20261130)
    seen: dict[str, int] = {}
    for _ in range(MUTATIONS):
        what, doc = _mutate(base, rng, root, outside)
        seen[what] = seen.get(what, 0) + 1
        newest.write_text(json.dumps(doc))
        with pytest.raises((CorruptCheckpoint, CheckpointNotFound)) as e:
            cp.restore(cwd=str(root))
        assert "\n" not in str(e.value), (what, str(e.value))
        assert not os.path.exists("/etc/cedana-mutation") and list(outside.iterdir()) == [], what
        assert list(victim.iterdir()) == [], what
        assert own_processes() <= children_before, f"{what}: a process was left behind"
    assert len(seen) == 12  # every kind of mutation was tried
    # what may be written is written only inside the root: the captured log, and nothing else
    assert {p.relative_to(root).as_posix() for p in root.rglob("*")} <= {"out", "out/steps.log", "link", "deep", "deep/ok"}
