"""Bad input gets one clear line naming the cause and the fix, and a distinct exit code."""

from __future__ import annotations

import json
import stat
import sys

import pytest

from conftest import cli, cli_env, no_nvidia_driver


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_unknown_checkpoint_id_is_one_line_and_exit_1(tmp_path):
    r = cli("restore", "--id", "never-saved", env=cli_env(tmp_path, "n", "w"))
    assert r.returncode == 1
    line = _one_line(r)
    assert line.startswith("CheckpointNotFound: no complete checkpoint under checkpoint ID 'never-saved'")
    assert "Check --id and --store" in line


@pytest.mark.parametrize("bad", ["../etc", "a/b", "chunks", "", "x" * 201])
def test_unsafe_checkpoint_id_is_refused_before_any_io(tmp_path, bad):
    r = cli("restore", "--id", bad, env=cli_env(tmp_path, "n", "w"))
    assert r.returncode == 2
    assert _one_line(r).startswith("CheckpointIdError: checkpoint ID")
    assert not (tmp_path / "etc").exists()


def test_store_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = cli_env(tmp_path, "n", "w", CEDANA_STORE=f"file://{blocker}/store")
    r = cli("run", "--id", "x", "--", "true", env=env)
    assert r.returncode == 1
    line = _one_line(r)
    assert line.startswith(f"StoreUnavailable: store file://{blocker}/store is not usable")
    assert "choose another --store" in line


def test_criu_absent_is_one_line_with_the_fix(tmp_path):
    env = cli_env(tmp_path, "n", "w", CEDANA_CRIU=str(tmp_path / "no-criu-here"))
    r = cli("run", "--id", "x", "--", "true", env=env)
    assert r.returncode == 1
    line = _one_line(r)
    assert line.startswith("EngineUnavailable: CRIU not found at")
    assert "make setup" in line


def test_criu_too_old_is_one_line_with_the_fix_fake_binary(tmp_path):
    # A stand-in that answers like Debian 12's CRIU 3.17 (which cannot run on this kernel at all).
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    r = cli("run", "--id", "x", "--", "true", env=cli_env(tmp_path, "n", "w", CEDANA_CRIU=str(fake)))
    assert r.returncode == 1
    line = _one_line(r)
    assert "CRIU 3.17.1" in line and "need >= 4" in line and "make setup" in line


def test_malformed_setting_is_one_line_and_exit_2(tmp_path):
    r = cli("run", "--id", "x", "--", "true", env=cli_env(tmp_path, "n", "w", CEDANA_STOP_GRACE_SECONDS="soon"))
    assert r.returncode == 2
    line = _one_line(r)
    assert line.startswith("ConfigError: setting stop_grace_seconds = 'soon' (from CEDANA_STOP_GRACE_SECONDS)")


# doctor's `criu check` probes the whole machine (it once failed beside CRIU tests; 60 of 60 passed beside
# the suite's dumps since): alone, where it costs least, at the end of a run
@pytest.mark.serial
def test_doctor_passes_here_and_fails_with_a_fix_without_criu(tmp_path):
    ok = cli("doctor", env=cli_env(tmp_path, "n", "w"))
    assert ok.returncode == 0, ok.stdout
    assert "OK    criu check: Looks good." in ok.stdout
    bad = cli("doctor", "--json", env=cli_env(tmp_path, "n", "w", CEDANA_CRIU="/nonexistent/criu"))
    assert bad.returncode == 1
    checks = {c["name"]: c for c in json.loads(bad.stdout)}
    assert checks["criu"]["status"] == "fail" and "make setup" in checks["criu"]["fix"]
    assert checks["store"]["status"] == "ok"
    assert "gpu" not in checks["criu"]  # the object belongs to the gpu check only


@no_nvidia_driver
# as above: doctor's `criu check`, alone
@pytest.mark.serial
def test_doctor_says_what_happens_to_a_gpu_task_on_a_node_without_a_driver(tmp_path):
    ok = cli("doctor", "--json", env=cli_env(tmp_path, "n", "w"))
    gpu = {c["name"]: c for c in json.loads(ok.stdout)}["gpu"]
    # said, not a failure unless gpu = require
    assert gpu["status"] == "skip" and gpu["gpu"]["checkpoint_api"] is False and gpu["gpu"]["libcuda"] is False
    assert gpu["gpu"]["problem"].startswith("no NVIDIA driver on this node") and gpu["gpu"]["gpus"] == []
    assert gpu["gpu"]["gpu_count"] == 0 and gpu["gpu"]["criu_cuda_plugin"] is None
    assert gpu["gpu"]["what_happens"].startswith("a task holding GPU devices is not checkpointed here")
    req = cli("doctor", "--json", env=cli_env(tmp_path, "n", "w", CEDANA_GPU="require"))
    assert req.returncode == 1 and {c["name"]: c for c in json.loads(req.stdout)}["gpu"]["status"] == "fail"


def test_run_returns_the_workloads_own_exit_code(tmp_path):
    r = cli("run", "--id", "rc", "--", sys.executable, "-c", "import sys; print('hi'); sys.exit(7)",
            env=cli_env(tmp_path, "n", "w"))
    assert r.returncode == 7
    assert r.stdout == "hi\n"


def test_run_json_summarises_a_fresh_run_and_an_error_the_same_way(tmp_path):
    r = cli("run", "--id", "rc", "--json", "--", sys.executable, "-c", "import sys; print('hi'); sys.exit(7)",
            env=cli_env(tmp_path, "n", "w"))
    out, last = r.stdout.splitlines()
    summary = json.loads(last)
    assert (r.returncode, out) == (7, "hi")
    assert {k: summary[k] for k in ("version", "checkpoint_id", "node", "exit_code", "outcome", "restored_from",
                                     "checkpoints", "stopped_by", "killed_by", "error")} == {
        "version": 1, "checkpoint_id": "rc", "node": "n", "exit_code": 7, "outcome": "fresh", "restored_from": None,
        "checkpoints": 0, "stopped_by": None, "killed_by": None, "error": None}
    # An error (here a malformed setting, before anything ran) is the same object, with the one line.
    bad = cli("run", "--id", "rc", "--json-file", str(tmp_path / "s.json"), "--node", "n", "--", "true",
              env=cli_env(tmp_path, "n", "w", CEDANA_STOP_GRACE_SECONDS="soon"))
    summary = json.loads((tmp_path / "s.json").read_text())
    assert bad.returncode == summary["exit_code"] == 2 and summary["outcome"] == "error" and summary["node"] == "n"
    assert summary["error"] == _one_line(bad)


def test_checkpoints_json_lists_the_contract_fields(tmp_path):
    env = cli_env(tmp_path, "node-x", "w", CEDANA_KEEP_CHECKPOINTS="100")
    r = cli("run", "--id", "listed", "--heartbeat", "0.5", "--dag-id", "d", "--task-id", "t", "--run-id", "manual__1",
            "--", sys.executable, "-c", "import time; time.sleep(2.5)", env=env)
    assert r.returncode == 0, r.stderr
    listed = json.loads(cli("checkpoints", "--json", env=env).stdout)
    assert [x["id"] for x in listed] == ["listed"] and listed[0]["source"] == "index"
    assert listed[0]["airflow"] == {"dag_id": "d", "task_id": "t", "run_id": "manual__1", "map_index": -1}
    assert listed[0]["restores"] == 0
    rows = listed[0]["checkpoints"]
    assert rows and {"seq", "try_number", "node", "created_at", "image_bytes", "stored_bytes", "freeze_seconds"} <= rows[0].keys()
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["node"] == "node-x" for r in rows)
    one = json.loads(cli("checkpoints", "listed", "--json", env=env).stdout)  # exact: read from the manifests
    assert one[0]["source"] == "manifests" and one[0]["checkpoints"] == rows


def test_resume_with_only_corrupt_checkpoints_starts_fresh_and_says_so(tmp_path):
    env = cli_env(tmp_path, "n", "w")
    cmd = [sys.executable, "-c", "import time; print('fresh start', flush=True); time.sleep(1.5)"]
    assert cli("run", "--id", "bad", "--heartbeat", "0.5", "--", *cmd, env=env).returncode == 0
    for chunk in (tmp_path / "store" / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(b"\x00garbage")
    r = cli("run", "--id", "bad", "--resume", "--", *cmd, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "fresh start\n"
    assert "no checkpoint could be restored checkpoint_id=bad; starting fresh" in r.stderr
    # the restore history says why this try started fresh, and the listing counts it
    [hist] = [json.loads(p.read_text()) for p in (tmp_path / "store" / "bad" / "restores").glob("*.json")]
    assert hist["outcome"] == "fresh" and hist["reason"] == "every checkpoint was refused" and hist["refused"]
    assert json.loads(cli("checkpoints", "--json", env=env).stdout)[0]["restores"] == 1
    only_restore = cli("restore", "--id", "bad", env=env)
    assert only_restore.returncode == 1
    assert "seq=1: " in only_restore.stderr and "no older checkpoint left" in only_restore.stderr
    assert only_restore.stderr.strip().splitlines()[-1].startswith("CorruptCheckpoint: no checkpoint under checkpoint ID 'bad' could be restored")


def test_short_commands_return_their_own_exit_code_and_a_missing_one_is_127(tmp_path):
    env = cli_env(tmp_path, "n", "w")
    assert cli("run", "--id", "quick", "--", "true", env=env).returncode == 0
    r = cli("run", "--id", "quick", "--", "sh", "-c", "echo said; exit 3", env=env)
    assert r.returncode == 3 and r.stdout == "said\n", r.stderr
    missing = cli("run", "--id", "quick", "--", "no-such-command-here", "--flag", env=env)
    assert missing.returncode == 127
    assert _one_line(missing).startswith("CommandNotFound: command not found: 'no-such-command-here' is not an "
                                         "executable file on PATH")
    relative = cli("run", "--id", "quick", "--", "./not-here.sh", env=env, cwd=tmp_path)
    assert relative.returncode == 127 and f"at {tmp_path}/not-here.sh." in _one_line(relative)


def test_non_finite_numbers_and_an_unusable_work_dir_are_one_line(tmp_path):
    env = cli_env(tmp_path, "n", "w")
    grace = cli("gc", "--grace", "nan", env=env)
    assert grace.returncode == 2 and "argument --grace: 'nan' is not a duration" in _one_line(grace)
    beat = cli("run", "--id", "x", "--heartbeat", "inf", "--", "true", env=env)
    assert beat.returncode == 2 and "argument --heartbeat: 'inf' is neither a duration" in _one_line(beat)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    work = cli("run", "--id", "x", "--work-dir", str(blocker / "work"), "--", "true", env=env)
    assert work.returncode == 2
    assert _one_line(work).startswith(f"ConfigError: work dir {blocker / 'work'} cannot be used: Not a directory.")


def test_a_live_drill_from_the_cli_says_where_it_runs_and_exits_2(tmp_path):
    r = cli("drill", "live", env=cli_env(tmp_path, "n", "w"))
    assert r.returncode == 2
    assert _one_line(r).startswith("ConfigError: live drills run inside Airflow, where they can fail and clear task "
                                   "instances: enable them with live = true under [drills] in the opt-in list")
    assert not (tmp_path / "store").exists()  # nothing was opened or created
