"""Who sees what under one checkpoint ID (issue 48): each manifest, restore record and index row is
shown by the DAG its own ``airflow`` block names, and deleting an ID needs edit permission on every
DAG named under it. An author may set any checkpoint ID, so here DAG a's task wrote the newest
manifest under DAG b's ID: it must not make b's checkpoints (their command lines and paths) a's.

The routes are called in this process against a file store, with the stand-in auth manager of
test_browser.py (tests/airflow/stand_in_auth.py: users scoped to named DAGs) answering for each DAG;
no api-server is started (test_browser.py runs the routes behind a real one).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("airflow")

from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser  # noqa: E402
from fastapi import HTTPException  # noqa: E402
from starlette.requests import Request  # noqa: E402
from stand_in_auth import DagScopedAuthManager  # noqa: E402

from cedana_airflow.airflow.browser import app as browser_app  # noqa: E402
from cedana_airflow.config import load_settings  # noqa: E402
from cedana_airflow.format.manifest import AirflowTask, ProcessInfo  # noqa: E402
from cedana_airflow.ids import derive_checkpoint_id  # noqa: E402
from cedana_airflow.store import index, open_store  # noqa: E402
from cedana_airflow.store.base import Store  # noqa: E402
from cedana_airflow.store.listing import list_store  # noqa: E402
from cedana_airflow.store.restores import RestoreRecord, record_restore  # noqa: E402
from cedana_airflow.store.transfer import CheckpointMeta, load_manifests, save_checkpoint  # noqa: E402

B_TASK = AirflowTask(dag_id="dag_b", task_id="fit", run_id="manual__1")
A_TASK = AirflowTask(dag_id="dag_a", task_id="train", run_id="manual__7")
X = derive_checkpoint_id(B_TASK.dag_id, B_TASK.task_id, B_TASK.run_id)  # dag_b's own ID
#: What b's checkpoints tell about b: its command line and its folders.
B_SECRET = "/srv/dag-b-only/creds.json"
B_PROC = ProcessInfo(pid=42, command=("python", "fit.py", "--creds", B_SECRET), cwd="/srv/dag-b-only",
                     stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
A_PROC = ProcessInfo(pid=43, command=("python", "train.py"), cwd="/srv/a", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
NOW = datetime.now(timezone.utc)
#: Users as the stand-in auth manager reads them: ``name@dag+dag`` may only those DAGs; a viewer reads,
#: a user also edits; no ``@``: every DAG.
USERS = {"alice@dag_a": "viewer", "bella@dag_b": "viewer", "carol@dag_a": "user", "dan@dag_a+dag_b": "user",
         "bob": "viewer", "admin": "admin"}


def _fill(tmp: Path) -> Store:
    """X: two checkpoints of dag_b at try 1, then one written by dag_a's task under b's ID at try 2
    (the newest: the ID's index entry names dag_a); a resume record of each, and one from the CLI."""
    s = open_store(f"file://{tmp / 'store'}", load_settings(environ={}))
    cfg = s.open(create=True, chunk_avg_bytes=64 << 10)
    for n, (owner, proc, try_number) in enumerate(((B_TASK, B_PROC, 1), (B_TASK, B_PROC, 1), (A_TASK, A_PROC, 2))):
        d = tmp / f"img-{n}"
        d.mkdir()
        (d / "pages-1.img").write_bytes(os.urandom(4096))
        m = save_checkpoint(s, cfg, CheckpointMeta(X, f"node-{n}", "4.1.1", proc, try_number=try_number, airflow=owner), d)
        index.record_checkpoint(s, m, load_manifests(s, X))  # as a checkpointer does, after retention
    for at, owner, reason in ((1, B_TASK, f"fresh: {B_SECRET} changed"), (2, A_TASK, "a's"), (3, None, "the CLI's")):
        record_restore(s, RestoreRecord(checkpoint_id=X, outcome="fresh", reason=reason, try_number=at,
                                        at=NOW + timedelta(seconds=at), airflow=owner))
        index.count_restore(s, X, NOW + timedelta(seconds=at))
    index.record_restore_warning(s, X, f"unsigned: {B_SECRET}")  # an ID-level line: no DAG of its own
    return s


@pytest.fixture
def store(tmp_path, monkeypatch) -> Store:
    s = _fill(tmp_path)
    monkeypatch.setattr(browser_app, "_store", lambda: s)
    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", DagScopedAuthManager)
    browser_app.store_cache.clear()
    return s


def _user(name: str) -> SimpleAuthManagerUser:
    return SimpleAuthManagerUser(username=name, role=USERS[name])


def _request(path: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""})


def _one(name: str) -> dict[str, Any]:
    r = browser_app.api_checkpoint(_request(f"/cedana/api/v1/checkpoints/{X}"), X, user=_user(name))
    assert r.status_code == 200, r.body
    return json.loads(bytes(r.body))


def _listed(name: str) -> dict[str, Any]:
    [x] = json.loads(bytes(browser_app.api_checkpoints(_request("/cedana/api/v1/checkpoints"), user=_user(name)).body))
    return x


def _page(name: str) -> str:
    return bytes(browser_app.page_id(_request(f"/cedana/ids/{X}"), X, user=_user(name)).body).decode()


def test_a_manifest_claiming_another_dags_id_shows_each_dag_only_its_own_checkpoints(store):
    alice = _one("alice@dag_a")  # may read dag_a only: the newest manifest is hers, b's are not
    assert [(m["seq"], m["airflow"]["dag_id"]) for m in alice["manifests"]] == [(3, "dag_a")]
    assert B_SECRET not in json.dumps(alice) and "fit.py" not in json.dumps(alice)
    assert [c["seq"] for c in alice["checkpoints"]] == [3] and alice["partial"] is True
    assert alice["restore_warning"] == ""  # the ID's own lines name no DAG: kept for who reads every one
    page = _page("alice@dag_a")
    assert B_SECRET not in page and "fit.py" not in page and "train.py" in page
    assert [c["seq"] for c in _listed("alice@dag_a")["checkpoints"]] == [3]

    bella = _one("bella@dag_b")  # dag_b's reader still sees dag_b's, and nothing of a's
    assert [(m["seq"], m["airflow"]["dag_id"]) for m in bella["manifests"]] == [(1, "dag_b"), (2, "dag_b")]
    assert B_SECRET in json.dumps(bella) and "train.py" not in json.dumps(bella)
    assert bella["airflow"]["dag_id"] == "dag_b"  # her newest, not the ID's newest (a's)
    listed = _listed("bella@dag_b")
    assert [c["seq"] for c in listed["checkpoints"]] == [1, 2] and listed["airflow"] is None  # the entry names a
    assert B_SECRET in _page("bella@dag_b")

    everything = _one("bob")  # may read every DAG: the whole ID, as before
    assert [m["seq"] for m in everything["manifests"]] == [1, 2, 3] and everything["partial"] is False
    assert everything["restore_warning"] == f"unsigned: {B_SECRET}" and everything["restore_count"] == 3

    # the task instance tab of a's task finds the ID by its entry (a's), and shows a's part only
    tab = browser_app.page_task_instance(_request("/cedana/ti"), user=_user("alice@dag_a"), dag_id="dag_a",
                                         run_id=A_TASK.run_id, task_id=A_TASK.task_id)
    html = bytes(tab.body).decode()
    assert X in html and B_SECRET not in html


def test_deleting_an_id_needs_edit_permission_on_every_dag_under_it(store, monkeypatch):
    audited: list[tuple[str, list[str | None]]] = []
    monkeypatch.setattr(browser_app, "_audit", lambda who, *args: audited.append((who, args[-2])))  # (who, ID, DAGs, n)
    with pytest.raises(HTTPException) as refused:
        browser_app.api_delete(X, user=_user("carol@dag_a"))  # edits dag_a, may not even read dag_b
    assert refused.value.status_code == 403
    assert str(refused.value.detail).endswith("missing: 1 DAG(s) you may not read, every DAG (some of it was "
                                              "taken outside Airflow)")  # b by no name; the CLI's record
    assert len(load_manifests(store, X)) == 3 and "Delete this checkpoint ID" not in _page("carol@dag_a")
    with pytest.raises(HTTPException) as refused:
        browser_app.api_delete(X, user=_user("bob"))  # reads every DAG, edits none: each is named
    assert refused.value.status_code == 403 and "missing: 'dag_a', 'dag_b', every DAG" in str(refused.value.detail)

    store.delete(next(o.key for o in store.list_objects(f"{X}/restores/")
                      if b"the CLI's" in (store.get(o.key) or b"")))  # now only a's and b's items
    with pytest.raises(HTTPException) as refused:
        browser_app.api_delete(X, user=_user("carol@dag_a"))
    assert refused.value.status_code == 403 and str(refused.value.detail).endswith("missing: 1 DAG(s) you may not read")
    assert "Delete this checkpoint ID" in _page("dan@dag_a+dag_b")
    done = browser_app.api_delete(X, user=_user("dan@dag_a+dag_b"))  # edits both
    assert (done.status_code, json.loads(bytes(done.body))) == (200, {"id": X, "deleted_checkpoints": 3})
    assert load_manifests(store, X) == [] and audited == [("dan@dag_a+dag_b", ["dag_a", "dag_b"])]


def test_restore_records_are_shown_by_their_own_dag(store):
    def reasons(name: str) -> list[str]:
        return [r["reason"] for r in _one(name)["restores"]]

    assert reasons("alice@dag_a") == ["a's"] and _one("alice@dag_a")["restore_count"] == 1
    assert reasons("bella@dag_b") == [f"fresh: {B_SECRET} changed"] and _one("bella@dag_b")["restore_count"] == 1
    assert reasons("bob") == [f"fresh: {B_SECRET} changed", "a's", "the CLI's"]  # the CLI's: for who reads every DAG
    assert _listed("alice@dag_a")["restores"] == 0  # the index's count covers every record: not hers to see


def test_index_rows_written_before_they_named_their_dag_are_read_from_the_manifests(store):
    def unlabelled(ids: dict[str, index.IndexEntry]) -> None:
        e = ids[X]
        ids[X] = e.model_copy(update={"checkpoints": tuple(index.IndexRow(**r.model_dump(exclude={"dag_id"}))
                                                           for r in e.checkpoints)})

    index._update(store, index.shard_key(X), unlabelled)
    assert [r.dag_id for r in index.read_entry(store, X).checkpoints] == [None, None, None]
    [x] = list_store(store)
    assert x.source == "manifests" and [r.dag_id for r in x.checkpoints] == ["dag_b", "dag_b", "dag_a"]
    assert [c["seq"] for c in _listed("alice@dag_a")["checkpoints"]] == [3]


def test_a_checkpoint_written_after_a_delete_was_allowed_is_kept(store, monkeypatch):
    """Review of issue 48 (L5): the permission was judged on the items read, then every seq present at
    delete time went, so another DAG's checkpoint committed in between was deleted by a user who may
    not even read it."""
    monkeypatch.setattr(browser_app, "_audit", lambda *args: None)
    store.delete(next(o.key for o in store.list_objects(f"{X}/restores/") if b"the CLI's" in (store.get(o.key) or b"")))
    judged = browser_app._detail

    def then_another_commits(s, cid, user):  # what a supervisor of dag_c does between the read and the delete
        detail = judged(s, cid, user)
        cfg = s.open(create=False, chunk_avg_bytes=64 << 10)
        m = load_manifests(s, X)[0]
        save_checkpoint(s, cfg, CheckpointMeta(X, "node-9", "4.1.1", m.process, try_number=3,
                                               airflow=m.airflow.model_copy(update={"dag_id": "dag_c"})),
                        _images(s))
        return detail

    monkeypatch.setattr(browser_app, "_detail", then_another_commits)
    done = browser_app.api_delete(X, user=_user("dan@dag_a+dag_b"))
    assert json.loads(bytes(done.body))["deleted_checkpoints"] == 3
    assert [m.airflow.dag_id for m in load_manifests(store, X)] == ["dag_c"]  # not dan's to delete
    assert [r.seq for r in index.read_entry(store, X).checkpoints] == [4]


def _images(s: Store) -> Path:
    d = Path(s.root) / ".." / "img-late"
    d.mkdir(exist_ok=True)
    (d / "pages-1.img").write_bytes(os.urandom(4096))
    return d
