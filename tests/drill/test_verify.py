"""The verify drill with real CRIU images and the CLI: it passes on a good store, names the chunk of a
corrupted latest checkpoint, catches an image set CRIU would refuse, and keeps every report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cedana_airflow.engine.criu import find_criu
from cedana_airflow.engine.image_check import image_set_problems
from conftest import cli, cli_env, manifests

pytestmark = pytest.mark.integration


def _dump_of_a_sleeping_process(tmp_path: Path, command: tuple[str, ...] = ("sleep", "30"), ready: Path | None = None) -> Path:
    """CRIU's images of ``command`` (once it has made ``ready``, where it says when it is ready)."""
    images = tmp_path / "images"
    images.mkdir()
    p = subprocess.Popen(list(command), start_new_session=True)  # returns once it runs: sleep is in its sleep
    try:
        deadline = time.monotonic() + 30
        while ready is not None and not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, f"{command} never made {ready}"
            time.sleep(0.05)
        subprocess.run([find_criu("", Path("/opt/cedana-airflow/criu")).path, "dump", "-t", str(p.pid), "-D", str(images),
                        "--leave-running", "--shell-job", "-o", str(tmp_path / "dump.log")], check=True, capture_output=True)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return images


def test_an_image_set_with_raw_payloads_after_its_entries_passes(tmp_path):
    # a pipe holding unread data: CRIU writes pipes-data.img as entries each followed by raw bytes
    mark = tmp_path / "written"
    images = _dump_of_a_sleeping_process(tmp_path, ("sh", "-c", f"(echo pending; touch {mark}; sleep 30) | sleep 30"), mark)
    assert (images / "pipes-data.img").exists()
    assert image_set_problems(images) == []


def test_a_real_image_set_passes_and_what_criu_would_refuse_is_named(tmp_path):
    images = _dump_of_a_sleeping_process(tmp_path)
    assert image_set_problems(images) == []
    [pages] = images.glob("pages-*.img")
    with open(pages, "ab") as f:
        f.write(b"\0" * 4096)  # one page more than the pagemap indexes
    [pm] = images.glob("pagemap-*.img")
    with open(images / "pstree.img", "ab") as f:
        f.write(b"\x40\0\0\0")  # an entry claiming 64 bytes the file does not hold
    problems = image_set_problems(images)
    assert any(p.startswith(f"{pages.name} holds") and f"where {pm.name} indexes" in p for p in problems), problems
    assert "pstree.img is not a well-formed CRIU image (an entry runs past its end)" in problems
    (images / "inventory.img").unlink()
    assert image_set_problems(images) == ["inventory.img is missing"]


def test_verify_drill_passes_then_names_a_corrupt_chunk_and_keeps_both_reports(tmp_path):
    env = cli_env(tmp_path, "node-a", "work")
    for cid in ("job-1", "job-2"):
        r = cli("run", "--id", cid, "--heartbeat", "0.5", "--", sys.executable, "-c", "import time; time.sleep(1.8)", env=env)
        assert r.returncode == 0, r.stderr
    good = cli("drill", "verify", "--json", env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    report = json.loads(good.stdout)
    assert report["mode"] == "verify" and report["ok"] is True and report["problems"] == []
    assert [c["checkpoint_id"] for c in report["checked"]] == ["job-1", "job-2"]
    assert all(c["ok"] and c["bytes_fetched"] > 0 and c["seq"] >= 1 for c in report["checked"])
    assert {"mode", "ok", "rto_seconds", "lost_work_seconds", "restore_seconds", "digest_match", "checkpoint_id",
            "restored_seq", "from_node", "to_node", "started_at", "finished_at"} <= report.keys()

    latest = max(manifests(tmp_path / "store", "job-2"), key=lambda m: m["seq"])
    digest = latest["files"][0]["chunks"][0]["digest"]
    chunk = tmp_path / "store" / "chunks" / digest[:2] / digest
    chunk.write_bytes(b"\x00" + b"bit rot" * 10)
    bad = cli("drill", "verify", "--ids", "job-*", env=env)
    assert bad.returncode == 1
    assert "OK   job-1 seq" in bad.stdout and "FAIL job-2 seq" in bad.stdout and digest in bad.stdout, bad.stdout
    assert "FAILED" in bad.stdout.splitlines()[-1]

    listed = json.loads(cli("drills", "--json", env=env).stdout)
    assert [(r["mode"], r["ok"]) for r in listed["reports"]] == [("verify", True), ("verify", False)]
    assert {k: listed["trends"]["verify"][k] for k in ("drills", "passed", "pass_rate", "last_ok")} == {
        "drills": 2, "passed": 1, "pass_rate": 0.5, "last_ok": False}
    assert cli("drill", "verify", "--ids", "nothing-*", env=env).returncode == 1  # nothing verified is no pass
    assert cli("drill", "verify", "--sample", "0", env=env).returncode == 2


def test_trends_use_nearest_rank_percentiles_per_mode():
    from datetime import datetime, timezone

    from cedana_airflow.drill.report import DrillReport
    from cedana_airflow.drill.trends import trends

    now = datetime.now(timezone.utc)
    rs = [DrillReport(drill_id=f"d{i}", mode="canary", ok=i != 3, node="n", started_at=now, finished_at=now,
                      rto_seconds=float(i), lost_work_seconds=None if i == 0 else 0.5) for i in range(1, 21)]
    t = trends(rs)["canary"]
    assert (t["drills"], t["passed"], t["pass_rate"]) == (20, 19, 0.95)
    assert t["rto_seconds"] == {"p50": 10.0, "p95": 19.0} and t["restore_seconds"] == {"p50": None, "p95": None}
    assert trends([]) == {}
