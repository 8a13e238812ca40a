"""The demo's summary (scripts/demo.py), from a run's logs and manifests: the sizes it prints are each
checkpoint's own, and the restore it reports is read from try 2's restore line."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from demo import image_sizes, summarize  # noqa: E402

from cedana_airflow.units import binary_size  # noqa: E402

MB = 1_000_000


def _manifest(seq: int, image: int) -> dict:
    return {"seq": seq, "image_bytes": image, "stored_bytes": image // 10, "freeze_seconds": 0.5}


def _run(manifests: list[dict]) -> dict:
    log2 = ("cedana: checkpoint_id=cedana_demo_training.train.manual__x node=vm2 try=2\n"
            "cedana: restored seq 3 of try 1 (node vm) on node vm2: gap 4.1 s, restore 0.40 s, "
            "checkpoint_id=cedana_demo_training.train.manual__2026-12-01T10:00:00+00:00-0123456789ab\n"
            "step 12/90 loss=0.1\ndone digest=abc\n")
    return {"tries": 2, "state": "success", "run_state": "success", "logs": {1: "", 2: log2},
            "manifests": manifests}


def test_the_summary_prints_each_checkpoints_image_size_not_the_last_ones_for_all():
    ms = [_manifest(s, 333 * MB) for s in range(1, 8)] + [_manifest(8, 647 * MB)]
    text, ok = summarize(_run(ms), "done digest=abc", steps=90)
    line = next(x for x in text.splitlines() if x.startswith("checkpoints taken:"))
    assert f"{binary_size(333 * MB)} (seq 1-7)" in line and f"{binary_size(647 * MB)} (seq 8)" in line, line
    assert "each" not in line and " MB" not in text, text  # binary units, as the browser prints them
    assert ok


def test_one_size_reads_each_and_many_read_as_a_range():
    assert image_sizes([_manifest(s, 60 * MB) for s in (1, 2, 3)]) == f"{binary_size(60 * MB)} each"
    many = [_manifest(s, (300 + 10 * s) * MB) for s in range(1, 6)]
    assert image_sizes(many) == f"{binary_size(310 * MB)} to {binary_size(350 * MB)}"


def test_the_restore_and_the_steps_saved_come_from_try_2s_restore_line():
    text, ok = summarize(_run([_manifest(1, 60 * MB)]), "done digest=abc", steps=90)
    assert "seq 3 (taken by try 1 on vm) restored on vm2 in 0.40 s; gap since that checkpoint 4.1 s" in text, text
    assert "11 of 90 not redone" in text and ok, text
