"""@task.checkpointed's folder (issue 48): ``<taskflow_dir>/<checkpoint_id>``, the same path every try,
the worker's and 0700, never under a folder others may write; nothing planted there is followed.

The tasks run with a broken opt-in list, so unprotected (a plain subprocess: no CRIU, no Airflow stack),
except the last test, in scope, which fails before anything runs. Tests run as root: uid 65534 is the
other local user. The base is a folder under tmp_path, walked from tmp_path (the real /tmp is everyone's).
"""

from __future__ import annotations

import os
import stat
import tempfile
import types
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from cedana_airflow.config import load_settings
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CheckpointMeta, save_checkpoint

OTHER = 65534
CID = "train_llm.probe.manual-1"
IN_SCOPE = ('[node]\nlabels = { "cedana.ai/enabled" = "true" }\npartitions = ["cedana"]\n'
            '[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n')


class _StateStore(dict):
    def set(self, key, value):
        self[key] = value


def _context(task_id):
    ti = types.SimpleNamespace(dag_id="train_llm", task_id=task_id, try_number=1, map_index=-1, queue="default",
                               xcom_push=lambda key, value: None)
    return {"ti": ti, "dag": types.SimpleNamespace(dag_id="train_llm", tags=[]), "run_id": "manual-1",
            "task_state_store": _StateStore()}


@pytest.fixture
def base(tmp_path, monkeypatch):
    """The task's taskflow_dir, walked from tmp_path; the old code's /tmp is ``tmp_path / "tmp"`` (1777)."""
    from cedana_airflow.airflow import decorators

    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    os.chmod(shared_tmp, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    b = tmp_path / "var" / "taskflow"
    folder = getattr(decorators, "taskflow_folder", None)
    if folder is not None:
        monkeypatch.setattr(decorators, "taskflow_dir", lambda settings: b)
        monkeypatch.setattr(decorators, "taskflow_folder", lambda base, cid: folder(base, cid, below=tmp_path))
    return b


@pytest.fixture
def unprotected(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__CEDANA__STORE", f"file://{tmp_path / 'store'}")
    p = tmp_path / "optin.toml"
    p.write_text("[node\nthis is not toml")
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))


def _probe():
    """A task whose value says where it ran: [x + 1, its cwd, the cwd's mode, the cwd's owner]."""
    from airflow.sdk import DAG, task

    with DAG("train_llm", schedule=None):
        @task.checkpointed(checkpoint_id=CID)
        def probe(x: int) -> list:
            import os
            st = os.stat(".")
            return [x + 1, os.getcwd(), st.st_mode & 0o7777, st.st_uid]

        return probe(41).operator


def test_the_folder_is_the_same_every_try_ours_and_0700_and_gone_after_success(base, unprotected):
    op = _probe()
    first = op.execute(_context(op.task_id))
    second = op.execute(_context(op.task_id))
    assert first == second == [42, str(base / CID), 0o700, os.geteuid()]
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700 and not (base / CID).exists()


def test_a_folder_another_user_made_first_under_tmp_is_never_used(tmp_path, base, unprotected):
    """The finding: a local user pre-creates /tmp/cedana-taskflow/<id> and links args.json to a root file."""
    victim = tmp_path / "root-owned"
    victim.write_text("root's own\n")
    planted = tmp_path / "tmp" / "cedana-taskflow" / CID
    planted.mkdir(parents=True, mode=0o777)
    for d in (planted, planted.parent):
        os.chmod(d, 0o777)
        os.chown(d, OTHER, OTHER)
    (planted / "args.json").symlink_to(victim)
    op = _probe()
    value = op.execute(_context(op.task_id))
    assert victim.read_text() == "root's own\n"  # the old code wrote the task's arguments into it
    assert sorted(p.name for p in planted.iterdir()) == ["args.json"]
    assert value[:2] == [42, str(base / CID)]


@pytest.mark.parametrize("plant", ["owned by another user", "a symlink to another user's folder"])
def test_a_planted_folder_at_the_id_is_refused_in_one_line(tmp_path, base, unprotected, plant):
    base.mkdir(parents=True, mode=0o700)
    decoy = tmp_path / "decoy"
    decoy.mkdir(mode=0o777)
    os.chown(decoy, OTHER, OTHER)
    if plant.startswith("owned"):
        (base / CID).mkdir(mode=0o700)
        os.chown(base / CID, OTHER, OTHER)
    else:
        (base / CID).symlink_to(decoy)
    op = _probe()
    with pytest.raises(AirflowFailException) as e:
        op.execute(_context(op.task_id))
    msg = str(e.value)
    assert "\n" not in msg and str(base / CID) in msg
    assert ("is not ours" if plant.startswith("owned") else "is a symbolic link") in msg
    assert list(decoy.iterdir()) == []


def test_links_planted_at_the_arguments_and_the_result_are_replaced_not_followed(tmp_path, base, unprotected):
    """An earlier try's folder (ours) where args.json, result.json and result.json.tmp are links."""
    victim, forged = tmp_path / "root-owned", tmp_path / "forged.json"
    victim.write_text("root's own\n")
    forged.write_text("666")
    (base / CID).mkdir(parents=True, mode=0o700)
    os.chmod(base, 0o700)
    for name, target in (("args.json", victim), ("result.json", forged), ("result.json.tmp", victim),
                         ("script.py", victim)):
        (base / CID / name).symlink_to(target)
    op = _probe()
    value = op.execute(_context(op.task_id))
    assert victim.read_text() == "root's own\n" and forged.read_text() == "666"
    assert value[:2] == [42, str(base / CID)]


def test_a_checkpoint_taken_in_the_old_tmp_folder_is_not_restored(tmp_path, base, monkeypatch):
    url = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv("AIRFLOW__CEDANA__STORE", url)
    monkeypatch.setenv("CEDANA_NODE_LABELS", "cedana.ai/enabled=true")
    (tmp_path / "optin.toml").write_text(IN_SCOPE)
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(tmp_path / "optin.toml"))
    store = open_store(url, load_settings(environ={}))
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "pages-1.img").write_bytes(os.urandom(5000))
    proc = ProcessInfo(pid=1, command=("python",), cwd=f"/tmp/cedana-taskflow/{CID}", stdout_pipe="pipe:[1]",
                       stderr_pipe="pipe:[2]")
    from conftest import node_key_bytes

    # a checkpoint this node trusts (signed with its key); an unsigned one is a store writer's, judged as such
    save_checkpoint(store, cfg, CheckpointMeta(CID, "node-a", "4.1.1", proc), tmp_path / "img",
                    signing_key=node_key_bytes())
    op = _probe()
    with pytest.raises(AirflowFailException) as e:
        op.execute(_context(op.task_id))
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint {CID} seq 1 was taken by an older cedana-airflow" in msg
    assert "start fresh" in msg


def test_the_base_is_the_setting_else_roots_or_the_users_own(monkeypatch):
    from cedana_airflow.airflow.decorators import taskflow_dir

    assert taskflow_dir(types.SimpleNamespace(taskflow_dir=Path("/srv/tf"))) == Path("/srv/tf")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert taskflow_dir(types.SimpleNamespace()) == Path("/var/lib/cedana-airflow/taskflow")  # before the setting
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("HOME", "/home/ml")
    assert taskflow_dir(types.SimpleNamespace(taskflow_dir=None)) == Path("/home/ml/.local/state/cedana-airflow/taskflow")
