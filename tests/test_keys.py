"""The node key (keys.py) and what a node trusts (format/trust.py): created once per node, root-only,
never chosen by a DAG, never replaced, and never absent: a key that cannot be read fails in one line
naming where it looked (issue 48). 0.7.0 signed nothing by default and accepted anything."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from cedana_airflow import keys
from cedana_airflow.config import Settings, load_settings
from cedana_airflow.errors import ConfigError
from cedana_airflow.format.manifest import AirflowTask, Manifest, ProcessInfo
from cedana_airflow.format.signing import key_id, sign
from cedana_airflow.format.trust import Trust
from conftest import cli, cli_env

KEY = b"0123456789abcdef0123456789abcdef"
LEGACY = b"fedcba9876543210fedcba9876543210"


def _create(path: str, out: str) -> None:
    keys.DEFAULT_KEY_FILE = Path(path)
    Path(out).write_bytes(keys.node_key(Settings()).key)


def test_the_default_key_is_created_once_root_only_and_every_racer_signs_with_it(tmp_path, monkeypatch):
    path = tmp_path / "etc" / "node.key"
    racers = [multiprocessing.get_context("fork").Process(target=_create, args=(str(path), str(tmp_path / f"got{i}")))
              for i in range(6)]
    for p in racers:
        p.start()
    for p in racers:
        p.join(30)
    got = {(tmp_path / f"got{i}").read_bytes() for i in range(6)}
    assert got == {path.read_bytes().strip()} and len(got.pop()) == 64  # one key, the file's: first wins
    assert stat.S_IMODE(path.stat().st_mode) == 0o400 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name != "node.key"]  # no temp file left


def test_key_init_never_replaces_a_key_and_show_names_only_its_id(tmp_path):
    path = tmp_path / "k" / "node.key"
    env = cli_env(tmp_path, "n", "w")
    made = cli("key", "init", "--file", str(path), "--json", env=env)
    assert made.returncode == 0 and json.loads(made.stdout)["created"] is True, made.stderr
    before = path.read_bytes()
    again = cli("key", "init", "--file", str(path), env=env)
    assert again.returncode == 2 and "exists (key " in again.stderr and "never replace it" in again.stderr
    assert path.read_bytes() == before
    shown = cli("key", "show", "--file", str(path), "--json", env=env)
    assert json.loads(shown.stdout) == {"file": str(path), "key_id": key_id(before.strip()), "created": False}
    assert before.strip().decode() not in shown.stdout + shown.stderr + made.stdout + made.stderr


@pytest.mark.parametrize("fault, line", [
    ("missing", r"node key {p} does not exist \(signing_key_file\)\. Copy the key of the other nodes"),
    ("others", r"node key {p} is readable or writable by others \(mode 0644\).*Run 'chmod 0400 {p}'"),
    ("owner", r"node key {p} is owned by uid 65534, not root.*Run 'chown root: {p}'"),
    ("short", r"node key {p} is shorter than 16 bytes"),
])
def test_a_configured_key_that_is_unfit_fails_in_one_line_naming_the_file_never_unsigned(tmp_path, fault, line):
    p = tmp_path / "node.key"
    if fault != "missing":
        p.write_bytes(b"short\n" if fault == "short" else KEY + b"\n")
        p.chmod(0o644 if fault == "others" else 0o400)
    if fault == "owner":
        os.chown(p, 65534, 65534)
    with pytest.raises(ConfigError, match=line.format(p=p)):
        keys.node_key(load_settings(environ={"CEDANA_SIGNING_KEY_FILE": str(p)}))


def test_a_user_who_is_not_root_can_neither_read_the_key_nor_create_the_default(tmp_path):
    folder = tmp_path / "etc"
    keys.init_key(folder / "node.key")
    tmp_path.chmod(0o755)
    code = ("import sys; from pathlib import Path; from cedana_airflow import keys; from cedana_airflow.config import "
            "Settings\nfor p in sys.argv[1:]:\n  keys.DEFAULT_KEY_FILE = Path(p)\n  try: keys.node_key(Settings())\n"
            "  except Exception as e: print(e)")
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c", code,
                        str(folder / "node.key"), "/nonexistent-cedana-airflow-test/node.key"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    first, second = r.stdout.splitlines()
    assert f"node key {folder / 'node.key'} cannot be read as uid 65534: Permission denied" in first, r.stdout + r.stderr
    assert second.startswith("no node key: /nonexistent-cedana-airflow-test/node.key (the default; signing_key_file is "
                             "unset) does not exist and uid 65534 cannot create it. Run 'cedana-airflow key init'")


def test_a_config_file_that_names_a_node_setting_must_be_roots_alone(tmp_path):
    conf = tmp_path / "node.toml"
    conf.write_text("[cedana]\nallow_unsigned = true\n")
    conf.chmod(0o664)
    with pytest.raises(ConfigError, match=r"sets allow_unsigned, node settings, but root does not own it alone"):
        load_settings(environ={"CEDANA_CONFIG": str(conf)})
    conf.chmod(0o644)
    assert load_settings(environ={"CEDANA_CONFIG": str(conf)}).allow_unsigned is True
    os.chown(conf, 65534, 65534)
    with pytest.raises(ConfigError, match="uid 65534"):
        load_settings(environ={"CEDANA_CONFIG": str(conf)})


def _manifest(airflow: AirflowTask | None = None) -> Manifest:
    return Manifest(checkpoint_id="job", seq=1, created_at=datetime.now(timezone.utc), node="a",
                    engine="criu", engine_version="4.2.1", files=(), image_bytes=0, stored_bytes=0,
                    process=ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="p", stderr_pipe="p"),
                    airflow=airflow, format_version=3 if airflow else 1)


def test_trust_legacy_keys_verify_only_unsigned_needs_allow_unsigned_and_a_task_restores_only_its_own():
    mine = AirflowTask(dag_id="b", task_id="u", run_id="r2")
    own = sign(_manifest(AirflowTask(dag_id="b", task_id="u", run_id="r1")), KEY)  # run_id is not compared
    trust = Trust(KEY, owner=mine)
    assert trust.refusal(own) is None and trust.signed_by(own) == "node"
    old = sign(_manifest(AirflowTask(dag_id="b", task_id="u", run_id="r1")), LEGACY)
    assert "is signed with key" in trust.refusal(old)
    assert Trust(KEY, legacy=(LEGACY,), owner=mine).refusal(old) is None
    assert Trust(KEY, legacy=(LEGACY,)).signed_by(old) == "legacy"
    unsigned = _manifest(AirflowTask(dag_id="b", task_id="u", run_id="r1"))
    assert trust.refusal(unsigned) == "it is not signed, and this node refuses unsigned manifests (allow_unsigned = false)"
    loose = Trust(KEY, allow_unsigned=True, owner=mine)
    assert loose.refusal(unsigned) is None and loose.signed_by(unsigned) is None  # accepted, never vouched for
    assert "is signed with key" in loose.refusal(sign(unsigned, LEGACY))  # a wrong key is refused all the same
    theirs = sign(_manifest(AirflowTask(dag_id="a", task_id="t", run_id="r1")), KEY)
    assert trust.refusal(theirs) == ("it belongs to DAG 'a' task 't' (map index -1), not to this task (DAG 'b' task "
                                     "'u' (map index -1)); give this task its own checkpoint_id")
    assert "written outside Airflow" in trust.refusal(sign(_manifest(), KEY))
    assert Trust(KEY).refusal(theirs) is None  # a restore by hand is the node operator's choice


def test_the_workload_never_keeps_the_node_key_in_its_environment():
    from cedana_airflow.run.environment import workload_env

    assert "CEDANA_SIGNING_KEY" not in workload_env({"CEDANA_SIGNING_KEY": KEY.decode()}, ["CEDANA_SIGNING_KEY"])
    with pytest.raises(ConfigError, match="CEDANA_SIGNING_KEY is the node key"):
        load_settings(environ={"CEDANA_KEEP_ENV": "CEDANA_SIGNING_KEY"})


def test_retention_and_the_lease_judge_only_what_this_node_would_restore(tmp_path):
    """A forged manifest ranked newest (a high try number, an old date) pushed real checkpoints out of
    retention, started the task fresh and ran lease_renew_command (0.7.0 judged whatever was newest)."""
    from datetime import timedelta

    from cedana_airflow.format.selection import AgeLimit
    from cedana_airflow.run.restore_gap import judge_restore_gap
    from cedana_airflow.store import open_store
    from cedana_airflow.store.gc import prune_checkpoints
    from cedana_airflow.store.transfer import CheckpointMeta, load_manifests, save_checkpoint
    from conftest import forge_unsigned

    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    proc = ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="p", stderr_pipe="p")
    images = tmp_path / "img"
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(4000))
    for try_number in (1, 1, 99):
        m = save_checkpoint(store, cfg, CheckpointMeta("job", "n", "4.2.1", proc, try_number=try_number), images,
                            signing_key=KEY)
    old = (datetime.now(timezone.utc) - timedelta(days=2)).isoformat()
    forge_unsigned(tmp_path / "store" / "job" / f"{m.seq:010d}" / "manifest.json", created_at=old)
    trust = Trust(KEY)
    renewed = tmp_path / "renewed"
    verdict = judge_restore_gap(store, "job", [AgeLimit("lease", 3600)], ["touch", str(renewed)],
                                trusted=lambda x: trust.refusal(x) is None)
    assert verdict.resume and not renewed.exists()
    kept, removed = prune_checkpoints(store, "job", 1, lambda x: trust.refusal(x) is None)
    assert [k.seq for k in kept] == [2] and [r.seq for r in removed] == [1]
    assert sorted(x.seq for x in load_manifests(store, "job")) == [2, 3]  # the forged one is no writer's to prune


def test_a_pem_file_a_uniform_key_or_a_key_in_a_folder_others_may_write_is_refused_and_no_key_is_ever_said(tmp_path):
    """Review of issue 48: the first line of a PEM file (an SSH host key linked from a writable folder) is
    a public constant; reprs and error reports must never carry the key."""
    pem = tmp_path / "pem.key"
    pem.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    pem.chmod(0o400)
    with pytest.raises(ConfigError, match="does not hold a random key on its first line"):
        keys.read_key_file(pem, "node key", "signing_key_file")
    (tmp_path / "zeros.key").write_text("0" * 64 + "\n")
    (tmp_path / "zeros.key").chmod(0o400)
    with pytest.raises(ConfigError, match="too few distinct bytes"):
        keys.read_key_file(tmp_path / "zeros.key", "node key", "signing_key_file")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "node.key").write_bytes(KEY + b"\n")
    (shared / "node.key").chmod(0o400)
    with pytest.raises(ConfigError, match=r"lies in a folder others may write \(mode 0777\)"):
        keys.read_key_file(shared / "node.key", "node key", "signing_key_file")
    made = keys.init_key(tmp_path / "etc" / "node.key")
    assert made.key.decode() not in repr(made) + repr(Trust(made.key, legacy=(LEGACY,)))
    assert LEGACY.decode() not in repr(Trust(made.key, legacy=(LEGACY,)))
    conf = tmp_path / "node.toml"
    conf.write_text("[cedana]\nsigning_key = 1234567890123456789\n")  # TOML reads an integer: invalid
    with pytest.raises(ConfigError, match=r"setting signing_key = '\*\*\*'") as bad:
        load_settings(environ={"CEDANA_CONFIG": str(conf)})
    assert "1234567890123456789" not in str(bad.value)
