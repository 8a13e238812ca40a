"""An unsigned checkpoint whose captured files a restore would refuse is said once, at the first
checkpoint that captured files: a workload that opens its files after the first heartbeat is judged
at the heartbeat that sees them (it was judged at the first one, which had none, and never again)."""

from __future__ import annotations

from pathlib import Path

from cedana_airflow.config import Settings
from cedana_airflow.format.manifest import CapturedFile
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.store import index
from cedana_airflow.store.transfer import load_manifests
from test_fallback import _one_checkpoint


def test_the_warning_comes_at_the_first_checkpoint_that_captured_files_and_once(tmp_path: Path) -> None:
    store, cfg, _ = _one_checkpoint(tmp_path)
    [first] = load_manifests(store, "job")
    index.record_checkpoint(store, first)  # (an ID's entry holds a warning only beside its checkpoints)
    assert first.captured == ()
    cp = Checkpointer(None, store, cfg, "job", Settings(node="node-a"), work_dir=tmp_path / "work")
    cp._check_restorable(first)  # nothing captured yet: nothing to judge
    assert index.read_entry(store, "job").restore_warning == ""

    outside = CapturedFile(path="/var/spool/elsewhere/steps.log", size=0, mode=0o644, chunks=())
    second = first.model_copy(update={"seq": 2, "captured": (outside,)})
    cp._check_restorable(second)
    said = index.read_entry(store, "job").restore_warning
    assert said.startswith("a restore would refuse this checkpoint: captured file /var/spool/elsewhere/steps.log")

    index.record_restore_warning(store, "job", "")
    cp._check_restorable(second.model_copy(update={"seq": 3}))  # once per supervisor
    assert index.read_entry(store, "job").restore_warning == ""


def test_a_stale_warning_is_cleared_by_a_checkpoint_a_restore_would_take(tmp_path: Path) -> None:
    store, cfg, _ = _one_checkpoint(tmp_path)
    [first] = load_manifests(store, "job")
    index.record_checkpoint(store, first)
    index.record_restore_warning(store, "job", "a restore would refuse this checkpoint: (an earlier try's)")
    assert index.read_entry(store, "job").restore_warning
    Checkpointer(None, store, cfg, "job", Settings(node="node-a"), work_dir=tmp_path / "work")._check_restorable(first)
    assert index.read_entry(store, "job").restore_warning == ""

