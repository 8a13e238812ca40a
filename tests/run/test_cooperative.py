"""Cooperative checkpoints (issue 35), with the real CLI and real processes: the workload writes its own
state when asked (cedana_airflow.coop), the supervisor stores it as a checkpoint of the same ID, and a
retry on another node resumes from it. What a user would notice: the resumed run ends as an uninterrupted
one, a workload that never answers keeps running and leaves no checkpoint, a rank that dies mid-write
leaves none either, a node without CRIU protects a cooperative workload in mode auto."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cedana_airflow.config import Settings
from cedana_airflow.errors import CorruptCheckpoint
from cedana_airflow.format.manifest import Manifest, ProcessInfo, StateFile, parse_manifest
from cedana_airflow.run.cooperative import _listing, catches
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, StateSource, fetch_checkpoint, save_checkpoint
from conftest import REPO, cli, cli_env, kill_node, manifests, start_cli, wait_for_checkpoints

COUNTER = str(REPO / "tests" / "workloads" / "coop_counter.py")
NO_CRIU = "/nonexistent/criu"


def _total(*args: str) -> str:
    out = subprocess.run([sys.executable, COUNTER, *args, "--step-seconds", "0"], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"done total=\d+", out)[-1]


def _summary(r: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_killed_cooperative_run_resumes_on_another_node_and_ends_as_an_uninterrupted_one(tmp_path):
    env_a = cli_env(tmp_path, "node-a", "work-a")
    proc = start_cli("run", "--id", "coop", "--mode", "cooperative", "--heartbeat", "0.3", "--", sys.executable,
                     COUNTER, "--steps", "60", "--step-seconds", "0.05", "--mb", "1", env=env_a, out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "coop", 2, proc)
    kill_node(proc, ms[-1]["process"]["pid"])
    m = parse_manifest(json.dumps(ms[-1]))
    assert (m.format_version, m.engine, m.required, m.files) == (4, "cooperative", ("cooperative",), ())
    assert m.cooperative is not None and [f.path for f in m.cooperative.files] == ["rank-0/blob", "rank-0/counter"]
    # nothing of an answered request is left to mistake for one: its state dir went when it was taken (the
    # node can die while the next request is open, or while the taken state is being stored: those may stay)
    answered = [p for p in (tmp_path / "work-a").rglob("COMPLETE")
                if p.parent.name.startswith("state-") and int(p.parent.name[6:]) <= m.cooperative.request]
    assert answered == []

    r = cli("run", "--id", "coop", "--resume", "--mode", "cooperative", "--heartbeat", "0.3", "--json", "--",
            sys.executable, COUNTER, "--steps", "60", "--step-seconds", "0.05", "--mb", "1",
            env=cli_env(tmp_path, "node-b", "work-b"))
    assert r.returncode == 0, r.stderr
    s = _summary(r)
    assert s["outcome"] == "restored" and s["restored_from"]["engine"] == "cooperative"
    assert s["restored_from"]["node"] == "node-a" and s["restored_from"]["seq"] == m.seq
    assert re.search(r"rank 0 resumed at step [1-9]", r.stdout)
    assert re.findall(r"done total=\d+", r.stdout) == [_total("--steps", "60")]
    # The 1 MiB blob did not change between requests: each later checkpoint stored next to nothing of it.
    later = [x for x in manifests(tmp_path / "store", "coop") if x["seq"] > m.seq]
    assert later and all(x["stored_bytes"] < 64 << 10 for x in later)


def test_a_workload_that_never_creates_complete_is_skipped_and_runs_on(tmp_path):
    r = cli("run", "--id", "never", "--mode", "cooperative", "--heartbeat", "0.2", "--json", "--", sys.executable,
            COUNTER, "--steps", "30", "--step-seconds", "0.05", "--never-complete",
            env=cli_env(tmp_path, "n", "w", CEDANA_COOPERATIVE_TIMEOUT_SECONDS="0.3"))
    assert r.returncode == 0, r.stderr
    s = _summary(r)
    assert s["checkpoints"] == 0 and s["skipped_heartbeats"] >= 1
    assert "did not create COMPLETE in 0.3 s (cooperative_timeout_seconds; told by SIGUSR1" in r.stderr
    assert manifests(tmp_path / "store", "never") == []
    assert re.findall(r"done total=\d+", r.stdout) == [_total("--steps", "30")]


def test_a_request_never_kills_a_workload_without_a_handler(tmp_path):
    """SIGUSR1's default action ends a process: only processes that handle it are sent it."""
    r = cli("run", "--id", "deaf", "--mode", "cooperative", "--heartbeat", "0.1", "--json", "--", sys.executable, "-c",
            "import time; time.sleep(1.2); print('slept')",
            env=cli_env(tmp_path, "n", "w", CEDANA_COOPERATIVE_TIMEOUT_SECONDS="0.2"))
    assert r.returncode == 0 and r.stdout.startswith("slept"), r.stderr
    assert _summary(r)["skipped_heartbeats"] >= 1 and "told by" not in r.stderr


def test_a_rank_that_dies_mid_write_leaves_no_checkpoint_and_no_half_of_one(tmp_path):
    r = cli("run", "--id", "ranks", "--mode", "cooperative", "--heartbeat", "0.4", "--json", "--", sys.executable,
            COUNTER, "--ranks", "2", "--die-rank", "1", "--steps", "40", "--step-seconds", "0.05",
            env=cli_env(tmp_path, "n", "w", CEDANA_COOPERATIVE_TIMEOUT_SECONDS="0.5"))
    assert r.returncode == 1, r.stderr  # the workload's own verdict: one of its ranks died
    ms = [parse_manifest(json.dumps(m)) for m in manifests(tmp_path / "store", "ranks")]
    assert [m.cooperative.request for m in ms if m.cooperative] == [1], r.stderr  # request 2 was never committed
    assert ms[0].cooperative is not None and ms[0].cooperative.ranks == 2
    assert [f.path for f in ms[0].cooperative.files] == ["rank-0/counter", "rank-1/counter"]
    assert "cooperative checkpoint 2 dropped: the workload did not create COMPLETE" in r.stderr


def test_mode_auto_without_criu_checkpoints_cooperatively_stops_with_a_final_one_and_resumes(tmp_path):
    env = cli_env(tmp_path, "node-a", "work-a", CEDANA_CRIU=NO_CRIU)
    proc = start_cli("run", "--id", "auto", "--mode", "auto", "--heartbeat", "0.3", "--", sys.executable, COUNTER,
                     "--steps", "60", "--step-seconds", "0.05", env=env, out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "auto", 1, proc)
    proc.send_signal(signal.SIGTERM)  # a drain: the final checkpoint is cooperative too
    assert proc.wait(60) == 128 + signal.SIGTERM
    err = (tmp_path / "a.err").read_text()
    assert f"CRIU cannot run here (CRIU not found at {NO_CRIU}" in err, err
    final = manifests(tmp_path / "store", "auto")[-1]
    assert final["seq"] > ms[0]["seq"] and final["engine"] == "cooperative"
    assert re.search(rf"final checkpoint seq {final['seq']} in", err), err

    r = cli("run", "--id", "auto", "--resume", "--mode", "auto", "--json", "--", sys.executable, COUNTER, "--steps",
            "60", "--step-seconds", "0.01", env=cli_env(tmp_path, "node-b", "work-b", CEDANA_CRIU=NO_CRIU))
    assert r.returncode == 0 and _summary(r)["restored_from"]["seq"] == final["seq"], r.stderr
    assert re.findall(r"done total=\d+", r.stdout) == [_total("--steps", "60")]


def test_mode_auto_without_criu_and_an_undeclared_workload_says_once_it_is_unprotected(tmp_path):
    r = cli("run", "--id", "bare", "--mode", "auto", "--heartbeat", "0.1", "--json", "--", sys.executable, COUNTER,
            "--steps", "20", "--step-seconds", "0.05", "--no-listen",
            env=cli_env(tmp_path, "n", "w", CEDANA_CRIU=NO_CRIU))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("this task is unprotected: CRIU cannot run here (CRIU not found at") == 1, r.stderr
    assert manifests(tmp_path / "store", "bare") == [] and _summary(r)["checkpoints"] == 0


def test_restore_as_today_resumes_a_cooperative_checkpoint_with_its_recorded_command(tmp_path):
    """`restore` needs no --mode: the manifest says what wrote it; the recorded command starts in its recorded
    directory with CEDANA_RESTORE_DIR, and the run's heartbeats go on cooperatively."""
    env = cli_env(tmp_path, "node-a", "w")
    proc = start_cli("run", "--id", "kind", "--mode", "cooperative", "--heartbeat", "0.3", "--", sys.executable,
                     COUNTER, "--steps", "60", "--step-seconds", "0.05", env=env, out=tmp_path / "a", cwd=tmp_path)
    ms = wait_for_checkpoints(tmp_path / "store", "kind", 2, proc)
    kill_node(proc, ms[-1]["process"]["pid"])
    r = cli("restore", "--id", "kind", "--heartbeat", "0.3", "--json", env=cli_env(tmp_path, "node-b", "w2"))
    assert r.returncode == 0, r.stderr
    s = _summary(r)
    assert s["outcome"] == "restored" and s["restored_from"]["engine"] == "cooperative"
    assert "was taken cooperatively: this run's heartbeats are cooperative too (mode was transparent)" in r.stderr
    assert s["checkpoints"] >= 1 and manifests(tmp_path / "store", "kind")[-1]["engine"] == "cooperative"
    assert re.findall(r"done total=\d+", r.stdout) == [_total("--steps", "60")]


# -- the pieces, with real files -------------------------------------------------------------------------------

def _store(tmp_path: Path):
    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    return store, store.open(create=True, chunk_avg_bytes=64 << 10)


def _state(tmp_path: Path) -> StateSource:
    top = tmp_path / "state"
    (top / "opt" / "deep").mkdir(parents=True)
    (top / "model.pt").write_bytes(os.urandom(200_000))
    (top / "opt" / "deep" / "adam state.bin").write_bytes(b"x" * 10)
    os.chmod(top / "model.pt", 0o640)
    (top / "COMPLETE").touch()
    (top / ".done-0").write_text("1")
    files, ranks = _listing(top)
    return StateSource(files, request=1, ranks=ranks, write_seconds=0.5)


def _saved(tmp_path: Path) -> tuple[object, Manifest]:
    store, cfg = _store(tmp_path)
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="", stderr_pipe="")
    return store, save_checkpoint(store, cfg, CheckpointMeta("c", "n", "0.6.0", proc), None, state=_state(tmp_path))


def test_a_state_directory_comes_back_file_for_file_with_its_modes_and_no_markers(tmp_path):
    store, m = _saved(tmp_path)
    assert m.cooperative is not None and [f.path for f in m.cooperative.files] == [
        "model.pt", "opt/deep/adam state.bin"]  # COMPLETE and the rank markers are the protocol's, not state
    dest = tmp_path / "back"
    fetch_checkpoint(store, m, dest)
    assert (dest / "model.pt").read_bytes() == (tmp_path / "state" / "model.pt").read_bytes()
    assert (dest / "opt" / "deep" / "adam state.bin").read_bytes() == b"x" * 10
    assert (dest / "model.pt").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in dest.iterdir()) == ["model.pt", "opt"]


def test_a_corrupt_state_chunk_is_refused(tmp_path):
    store, m = _saved(tmp_path)
    digest = m.cooperative.files[0].chunks[0].digest
    chunk = next((tmp_path / "store").rglob(digest))
    chunk.write_bytes(b"not the chunk")
    with pytest.raises(CorruptCheckpoint, match=digest[:12]):
        fetch_checkpoint(store, m, tmp_path / "back")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a//b", "a/./b", "a/../../b", "", "a/\x01"])
def test_a_manifest_cannot_name_a_state_file_outside_its_directory(path):
    with pytest.raises(ValueError):
        StateFile(path=path, size=0, mode=0o600, chunks=())


def test_a_symlink_in_the_state_directory_refuses_the_whole_state(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "ok").write_text("1")
    (tmp_path / "s" / "link").symlink_to("/etc/passwd")
    with pytest.raises(ValueError, match="holds a symlink, 'link'"):
        _listing(tmp_path / "s")


def test_a_reader_that_does_not_know_the_block_refuses_in_one_line(tmp_path):
    """The rule 0.5.1 and 0.5.2 apply to "cooperative" (a required block they do not know), shown here with
    a block this version does not know."""
    _, m = _saved(tmp_path)
    doc = json.loads(m.to_json())
    doc["cooperative2"], doc["required"] = doc.pop("cooperative"), ["cooperative2"]  # a block from the future
    with pytest.raises(Exception, match="needs block 'cooperative2'.*upgrade cedana-airflow"):
        parse_manifest(json.dumps(doc))


def test_the_signal_goes_only_to_processes_that_handle_it():
    import signal as s

    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGUSR1, "
                              "lambda *a: None); print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert catches(child.pid, s.SIGUSR1) and not catches(child.pid, s.SIGUSR2)
        assert not catches(os.getpid(), s.SIGUSR1)
    finally:
        child.kill()
        child.wait()


def test_the_verify_drill_runs_the_workloads_own_check_on_a_cooperative_checkpoint(tmp_path):
    """A drill puts the files back in a scratch directory and runs the recorded verify command there: its
    verdict is the drill's, what it said is the problem."""
    check = tmp_path / "check.py"
    check.write_text("import os, pathlib, sys\n"
                     "step, total = map(int, (pathlib.Path(os.environ['CEDANA_RESTORE_DIR']) / 'rank-0' / 'counter')"
                     ".read_text().split())\n"
                     "sys.exit(0 if step >= int(sys.argv[1]) else f'step {step} is before {sys.argv[1]}')\n")
    key = "k" * 32
    for cid, least in (("good", "1"), ("early", "1000")):
        env = cli_env(tmp_path, "n", "w", CEDANA_SIGNING_KEY=key,
                      CEDANA_COOPERATIVE_VERIFY_COMMAND=f"{sys.executable} {check} {least}")
        r = cli("run", "--id", cid, "--mode", "cooperative", "--heartbeat", "0.2", "--", sys.executable, COUNTER,
                "--steps", "12", "--step-seconds", "0.05", env=env)
        assert r.returncode == 0 and manifests(tmp_path / "store", cid), r.stderr
    env = cli_env(tmp_path, "n", "w", CEDANA_SIGNING_KEY=key)  # the command is in each manifest its key verifies
    good = json.loads(cli("drill", "verify", "--ids", "good", "--json", env=env).stdout)
    assert good["ok"] and good["checked"][0]["ok"] and good["checked"][0]["note"] == "", good
    r = cli("drill", "verify", "--ids", "early", "--json", env=env)
    early = json.loads(r.stdout)
    assert r.returncode != 0 and not early["ok"], early
    assert re.search(r"the workload's verify command exited 1: step \d+ is before 1000", early["checked"][0]["problem"])


def test_the_verify_drill_never_runs_a_command_read_from_an_unverified_manifest(tmp_path):
    """The store is not trusted: a store writer rewrites a manifest (unsigned) to name ``verify_command``,
    and a drill, documented as read-only, ran it as root (issue 48 saw it write ``uid=0(root)``). By default
    the drill refuses the unsigned manifest as a restore would; on a node that accepts unsigned ones the
    command is still not run, and the report says why; the node's own command is."""
    from conftest import forge_unsigned

    evil = tmp_path / "evil.sh"
    evil.write_text(f"#!/bin/sh\nid > {tmp_path / 'ran'}\n")
    evil.chmod(0o755)
    r = cli("run", "--id", "forged", "--mode", "cooperative", "--heartbeat", "0.2", "--", sys.executable, COUNTER,
            "--steps", "6", "--step-seconds", "0.05", env=cli_env(tmp_path, "n", "w"))
    assert r.returncode == 0 and manifests(tmp_path / "store", "forged"), r.stderr
    newest = sorted((tmp_path / "store" / "forged").glob("*/manifest.json"))[-1]
    coop = json.loads(newest.read_text())["cooperative"]
    forge_unsigned(newest, cooperative={**coop, "verify_command": [str(evil)]})
    r = cli("drill", "verify", "--ids", "forged", "--json", env=cli_env(tmp_path, "n", "w"))
    report = json.loads(r.stdout)
    assert r.returncode == 1 and "is not signed, and this node refuses unsigned manifests" in report["problems"][0], report
    r = cli("drill", "verify", "--ids", "forged", "--json", env=cli_env(tmp_path, "n", "w", CEDANA_ALLOW_UNSIGNED="true"))
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["ok"] and not (tmp_path / "ran").exists(), report
    assert "its recorded verify command was not run: no key on this node verified the manifest" in \
        report["checked"][0]["note"], report
    own = tmp_path / "own.sh"
    own.write_text(f"#!/bin/sh\necho mine > {tmp_path / 'own-ran'}\n")
    own.chmod(0o755)
    r = cli("drill", "verify", "--ids", "forged", "--json", env=cli_env(tmp_path, "n", "w", CEDANA_ALLOW_UNSIGNED="true",
                                                                        CEDANA_COOPERATIVE_VERIFY_COMMAND=str(own)))
    assert r.returncode == 0 and (tmp_path / "own-ran").read_text() == "mine\n" and not (tmp_path / "ran").exists()


def test_explain_says_the_mode_and_what_it_means_on_this_machine(tmp_path):
    optin = tmp_path / "optin.toml"
    optin.write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
                     '[workload.defaults]\nmode = "auto"\n')
    r = cli("explain", "d", "t", "--optin-file", str(optin), "--json", env=cli_env(tmp_path, "n", "w", CEDANA_CRIU=NO_CRIU))
    out = json.loads(r.stdout)
    assert out["mode"] == "auto" and out["mode_here"].startswith(
        "mode auto: on this machine cooperative once the workload declares it can, else unprotected (CRIU not found")


def test_a_late_writer_never_lands_in_the_next_checkpoint(tmp_path):
    """Request 1 is withdrawn at its deadline while the workload still writes it; what it writes late goes
    nowhere kept, it goes on, and request 2's checkpoint holds request 2's files only."""
    r = cli("run", "--id", "late", "--mode", "cooperative", "--heartbeat", "0.2", "--json", "--", sys.executable,
            COUNTER, "--steps", "40", "--step-seconds", "0.05", "--slow-first", "0.8",
            env=cli_env(tmp_path, "n", "w", CEDANA_COOPERATIVE_TIMEOUT_SECONDS="0.3"))
    assert r.returncode == 0 and "checkpoint request 1 was withdrawn while rank 0 wrote it" in r.stderr, r.stderr
    ms = [parse_manifest(json.dumps(m)) for m in manifests(tmp_path / "store", "late")]
    assert ms and all(m.cooperative and m.cooperative.request > 1 for m in ms), r.stderr
    assert all([f.path for f in m.cooperative.files] == ["rank-0/counter"] for m in ms if m.cooperative)
    assert re.findall(r"done total=\d+", r.stdout) == [_total("--steps", "40")]


def test_a_stop_during_an_open_heartbeat_request_still_gets_a_final_checkpoint(tmp_path):
    env = cli_env(tmp_path, "n", "w", CEDANA_COOPERATIVE_TIMEOUT_SECONDS="30")
    proc = start_cli("run", "--id", "stopped", "--mode", "cooperative", "--heartbeat", "0.3", "--", sys.executable,
                     COUNTER, "--steps", "200", "--step-seconds", "0.05", "--slow-first", "1.5", env=env,
                     out=tmp_path / "s")
    deadline = time.monotonic() + 30
    while not (tmp_path / "w").exists() or not list((tmp_path / "w").rglob("state-1")):  # request 1 is open
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # the heartbeat's request gives way; the stop asks again
    assert proc.wait(60) == 128 + signal.SIGTERM
    err = (tmp_path / "s.err").read_text()
    [final] = [parse_manifest(json.dumps(m)) for m in manifests(tmp_path / "store", "stopped")]
    assert final.cooperative is not None and final.cooperative.request == 2, err
    assert [f.path for f in final.cooperative.files] == ["rank-0/counter"]
    assert re.search(rf"final checkpoint seq {final.seq} in", err), err


@pytest.mark.parametrize("doc", [
    {"files": [{"path": "a", "size": 0, "mode": 384, "chunks": []},
               {"path": "a/b", "size": 0, "mode": 384, "chunks": []}], "request": 1},  # a file and a folder
    {"files": [{"path": "a", "size": 0, "mode": 384, "chunks": []},
               {"path": "a", "size": 0, "mode": 384, "chunks": []}], "request": 1},  # twice
])
def test_a_cooperative_block_that_names_a_path_twice_is_refused(doc):
    from cedana_airflow.format.manifest import CooperativeState

    with pytest.raises(ValueError):
        CooperativeState.model_validate(doc)


def test_a_cooperative_manifest_with_captured_files_or_gpu_state_is_refused(tmp_path):
    _, m = _saved(tmp_path)
    doc = json.loads(m.to_json())
    doc["captured"] = [{"path": "/etc/cron.d/x", "size": 0, "mode": 420, "chunks": []}]
    with pytest.raises(ValueError, match="no image files, captured files or GPU state"):
        parse_manifest(json.dumps(doc))


def test_gc_keeps_the_chunks_of_a_manifest_this_version_cannot_read(tmp_path):
    """A checkpoint of a later format (a required block this node does not know) is another node's to
    restore: gc here must not take its chunks."""
    from cedana_airflow.store.gc import collect_garbage

    store, m = _saved(tmp_path)
    path = next((tmp_path / "store").rglob("manifest.json"))
    doc = json.loads(path.read_text())
    doc["state2"], doc["required"] = doc.pop("cooperative"), ["state2"]
    path.write_text(json.dumps(doc))
    report = collect_garbage(store, grace_seconds=0)
    assert report.chunks_removed == 0 and report.chunks_kept == len(m.chunk_digests())


def test_a_state_of_thousands_of_files_comes_back_within_a_small_descriptor_limit(tmp_path):
    import resource

    top = tmp_path / "state"
    top.mkdir()
    for i in range(600):
        (top / f"f{i}").write_text(str(i))
    store, cfg = _store(tmp_path)
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="", stderr_pipe="")
    m = save_checkpoint(store, cfg, CheckpointMeta("many", "n", "0.6.0", proc), None,
                        state=StateSource(_listing(top)[0], request=1))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        fetch_checkpoint(store, m, tmp_path / "back")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sorted(int(p.read_text()) for p in (tmp_path / "back").iterdir()) == list(range(600))


def test_the_signal_goes_only_to_the_processes_that_said_they_answer(tmp_path):
    """A framework's own SIGUSR1 handler in another process of the tree (Lightning's requeue, say) is not
    asked: the ready file names who answers (in the workload's own PID namespace)."""
    marker = tmp_path / "child-signalled"
    child = tmp_path / "child.py"
    child.write_text(f"import pathlib, signal, time\nsignal.signal(signal.SIGUSR1, lambda *a: pathlib.Path("
                     f"{str(marker)!r}).touch())\ntime.sleep(30)\n")
    script = tmp_path / "w.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from cedana_airflow import coop\n"
        "coop.listen()\n"
        f"child = subprocess.Popen([sys.executable, {str(child)!r}])\n"
        "time.sleep(0.5)\n"  # its handler is in place before any request
        "for step in range(30):\n"
        "    time.sleep(0.05)\n"
        "    if coop.requested():\n"
        "        with coop.checkpoint() as d:\n"
        "            (d / 'step').write_text(str(step))\n"
        "child.kill()\n")
    r = cli("run", "--id", "told", "--mode", "cooperative", "--heartbeat", "0.3", "--json", "--", sys.executable,
            str(script), env=cli_env(tmp_path, "n", "w"))
    assert r.returncode == 0 and _summary(r)["checkpoints"] >= 1, r.stderr
    assert not marker.exists()


#: A supervisor as a hardened cluster runs one: uid 0 but no capabilities (no CAP_SYS_ADMIN: no CRIU, no PID
#: namespace). The interpreter stays readable (it may live under root's home), which another uid would not be.
NO_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def test_without_cap_sys_admin_auto_protects_a_cooperative_workload_and_transparent_says_why(tmp_path):
    run = ["-m", "cedana_airflow", "run", "--id", "caps", "--heartbeat", "0.3"]
    work = [sys.executable, COUNTER, "--steps", "60", "--step-seconds", "0.05"]
    bare = subprocess.run([*NO_CAPS, sys.executable, *run, "--", *work], env=cli_env(tmp_path, "n", "w"),
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 1 and bare.stderr.strip().splitlines()[-1].startswith(
        "EngineUnavailable: this process lacks CAP_SYS_ADMIN"), bare.stderr

    err = open(tmp_path / "a.err", "wb")
    proc = subprocess.Popen([*NO_CAPS, sys.executable, *run, "--mode", "auto", "--", *work],
                            env=cli_env(tmp_path, "node-a", "work-a"), stdout=subprocess.DEVNULL, stderr=err)
    ms = wait_for_checkpoints(tmp_path / "store", "caps", 2, proc)
    kill_node(proc, ms[-1]["process"]["pid"])  # no PID namespace here: the workload's session leader
    assert "CRIU cannot run here (this process lacks CAP_SYS_ADMIN" in (tmp_path / "a.err").read_text()
    r = subprocess.run([*NO_CAPS, sys.executable, *run, "--mode", "auto", "--resume", "--json", "--", *work],
                       env=cli_env(tmp_path, "node-b", "work-b"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and _summary(r)["restored_from"]["engine"] == "cooperative", r.stderr
    assert re.findall(r"done total=\d+", r.stdout) == [_total("--steps", "60")]
