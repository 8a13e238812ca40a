"""The agent's ``checkpoints`` query (agent/views.py), as callers of other uids ask it: a caller sees its
own uid's IDs, as the key vouches for them, and nothing of another uid's (an ID it may not see answers
exactly as one that does not exist); a member of the node's ``agent_readers`` and root see every ID; a
manifest the key does not vouch for is nobody's. With real CRIU checkpoints of a tree run as nobody."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cedana_airflow.agent.client import AgentClient
from conftest import cli_env, node_key_bytes, start_agent
from test_agent import NOBODY, OTHER, _checkpointed, as_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent runs as root")

READER = 65532  # a uid whose own group (as_uid: gid = uid) the agent lists in agent_readers


@pytest.fixture
def agent(tmp_path) -> Iterator[Path]:
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    sock, log = folder / "agent.sock", tmp_path / "agent.log"
    proc = start_agent(sock, cli_env(tmp_path, "node-a", "work", CEDANA_AGENT_READERS=str(READER)), log)
    try:
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
        print(log.read_text()[-4000:])  # shown with a failure


def _copy_as(store: Path, src: str, dst: str, *, uid: int | None, key: bytes | None) -> None:
    """``src``'s newest manifest under ID ``dst``, taken for ``uid`` and signed with ``key`` (None: unsigned,
    as a store writer without the node key could write it)."""
    from cedana_airflow.format.manifest import CallerInfo, parse_manifest
    from cedana_airflow.format.signing import sign

    newest = max(p for p in (store / src).iterdir() if p.name.isdigit())
    m = parse_manifest((newest / "manifest.json").read_text())
    m = m.model_copy(update={"checkpoint_id": dst, "signature": None,
                             "caller": CallerInfo(uid=uid) if uid is not None else None})
    (store / dst / newest.name).mkdir(parents=True)
    (store / dst / newest.name / "manifest.json").write_bytes(sign(m, key).to_json() if key else m.to_json())


def _ask(sock: Path, uid: int, ids: list[str] | None = None, **kw: Any) -> Any:
    msg, _ = as_uid(uid, lambda: (AgentClient.connect(sock).checkpoints(ids, **kw), []))
    assert "ok" in msg, msg
    return msg["ok"]


def test_a_caller_sees_its_own_checkpoints_only_and_readers_and_root_see_every_vouched_one(agent, tmp_path):
    store = tmp_path / "store"
    _checkpointed(agent, store, NOBODY, "mine")
    key = node_key_bytes()
    _copy_as(store, "mine", "theirs", uid=OTHER, key=key)
    _copy_as(store, "mine", "roots", uid=None, key=key)  # a supervisor running as root wrote it
    _copy_as(store, "mine", "forged", uid=NOBODY, key=None)  # names nobody, vouched for by no key
    _copy_as(store, "mine", "wrong-key", uid=NOBODY, key=b"x" * 32)

    rows = _ask(agent, NOBODY)
    assert [r["id"] for r in rows] == ["mine"]
    row = rows[0]
    assert row["uid"] == NOBODY and row["engine"] == "criu" and row["node"] == "node-a"
    assert row["seq"] >= 1 and row["checkpoints"] >= 1 and row["image_bytes"] > 0
    assert not {"chunks", "files", "signature", "path"} & row.keys()  # facts, never how to read the image
    # another uid's ID, root's, a forged one and one that does not exist all answer alike: nothing
    assert _ask(agent, NOBODY, ["theirs", "roots", "forged", "wrong-key", "nosuch"]) == []
    assert [r["id"] for r in _ask(agent, OTHER)] == ["theirs"]

    every = ["mine", "roots", "theirs"]  # sorted; the unvouched two are nobody's, for readers and root too
    assert [r["id"] for r in _ask(agent, READER)] == every
    assert [r["id"] for r in _ask(agent, 0)] == every
    assert [r["uid"] for r in _ask(agent, READER, every)] == [NOBODY, None, OTHER]

    detailed = _ask(agent, NOBODY, ["mine"], detail=True)[0]
    assert detailed["lease"] is None or {"node", "try_number", "renewed_at", "ttl_seconds"} == detailed["lease"].keys()
    assert detailed["restores"] == []
    assert [s["seq"] for s in detailed["seqs"]][0] == row["seq"]
    assert _ask(agent, NOBODY, ["theirs"], detail=True) == []
    # who sees what, as hello tells it (a drill says so when it sees only its own)
    assert _hello(agent, NOBODY)["sees"] == "own" and _hello(agent, READER)["sees"] == "every"


def _hello(sock: Path, uid: int) -> Any:
    msg, _ = as_uid(uid, lambda: (AgentClient.connect(sock).hello(), []))
    return msg["ok"]


def test_a_bad_query_is_one_line(agent):
    msg, _ = as_uid(NOBODY, lambda: (AgentClient.connect(agent).request("checkpoints", ids=["../etc"])[0], []))
    assert msg.get("error") and "\n" not in msg["line"] and "etc" in msg["line"], msg
    msg, _ = as_uid(NOBODY, lambda: (AgentClient.connect(agent).request("checkpoints", detail=True)[0], []))
    assert msg.get("error") == "Refused" and "Name it in ids" in msg["line"], msg
    msg, _ = as_uid(NOBODY, lambda: (AgentClient.connect(agent).request("checkpoints", ids=["a"] * 33)[0], []))
    assert msg.get("error") == "Refused" and "ids" in msg["line"], msg


def test_an_unknown_reader_group_stops_the_agent_in_one_line(tmp_path):
    env = cli_env(tmp_path, "node-a", "work", CEDANA_AGENT_READERS="no-such-group-here")
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-m", "cedana_airflow", "agent", "--socket",
                          str(tmp_path / "s" / "agent.sock")], env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode != 0
    assert "agent_readers names group 'no-such-group-here'" in got.stderr, got.stderr


def test_a_checkpoint_sensor_that_is_not_root_asks_the_agent_and_sees_only_its_uid_s_checkpoints(agent, tmp_path):
    """CheckpointSensor's check (its poke, and its trigger's) in a process of nobody's, with the default
    ``agent = auto``: it holds no store and no key, and the agent answers; another uid waits on for ever."""
    pytest.importorskip("airflow")
    from cedana_airflow.sensors.checkpoint import fresh_checkpoint

    _checkpointed(agent, tmp_path / "store", NOBODY, "sensed")

    def sensed(max_age: float | None) -> Any:
        def prepare() -> None:
            for k in [k for k in os.environ if k.startswith("CEDANA_")]:
                del os.environ[k]
            os.environ["CEDANA_AGENT_SOCKET"] = str(agent)
        return lambda: (fresh_checkpoint("sensed", max_age, None, None), []), prepare

    fn, prepare = sensed(None)
    msg, _ = as_uid(NOBODY, fn, prepare)
    assert msg["ok"]["checkpoint_id"] == "sensed" and msg["ok"]["seq"] >= 1 and msg["ok"]["node"] == "node-a", msg
    fn, prepare = sensed(0.001)  # older than that by now
    assert as_uid(NOBODY, fn, prepare)[0] == {"ok": None}
    fn, prepare = sensed(None)
    assert as_uid(OTHER, fn, prepare)[0] == {"ok": None}


def test_drills_through_the_agent_are_for_its_readers_it_runs_verify_itself_and_keeps_a_live_report(agent, tmp_path):
    """A drill task that is not root: the agent runs ``verify`` with its own store and key and keeps the
    report; it keeps a live drill's report its caller ran; a caller outside agent_readers gets one line."""
    from cedana_airflow.drill.report import new_drill_id

    store = tmp_path / "store"
    _checkpointed(agent, store, NOBODY, "verified")

    def drill(uid: int, mode: str, **kw: Any) -> dict[str, Any]:
        msg, _ = as_uid(uid, lambda: (AgentClient.connect(agent).drill(mode, **kw), []))
        return msg

    refused = drill(NOBODY, "verify")
    assert refused.get("error") == "Refused" and "Add its group to the node's agent_readers" in refused["line"], refused

    report = drill(READER, "verify", params={"ids": "verif*"})["ok"]["report"]
    assert report["mode"] == "verify" and report["ok"] is True, report
    assert [c["checkpoint_id"] for c in report["checked"]] == ["verified"]
    assert (store / "drills" / f"{report['drill_id']}.json").exists()  # kept by the agent

    bad = drill(READER, "verify", params={"sample": 0})
    assert bad.get("error") == "Refused" and "sample" in bad["line"], bad

    live = {"drill_id": new_drill_id("live"), "mode": "live", "ok": True, "node": "node-a",
            "started_at": "2026-12-06T00:00:00+00:00", "finished_at": "2026-12-06T00:01:00+00:00"}
    assert drill(READER, "keep", report=live)["ok"]["kept"] is True
    assert (store / "drills" / f"{live['drill_id']}.json").exists()
    forged = drill(READER, "keep", report={**live, "drill_id": "../../etc/x", "mode": "live"})
    assert forged.get("error") == "Refused" and "only a live drill's report" in forged["line"], forged
    assert drill(READER, "keep", report={**live, "mode": "verify"}).get("error") == "Refused"


def test_the_cli_s_drill_as_a_reader_that_is_not_root_is_run_by_the_agent(agent, tmp_path):
    """`cedana-airflow drill verify` from the worker environment (the installed wheel) as a reader: it holds no
    store and no key, and prints the agent's report as it prints its own."""
    import subprocess

    from conftest import WORKER_ENV

    _checkpointed(agent, tmp_path / "store", NOBODY, "clied")

    def as_reader() -> None:
        os.setgroups([])
        os.setresgid(READER, READER, READER)
        os.setresuid(READER, READER, READER)

    env = {"PATH": os.environ["PATH"], "CEDANA_AGENT_SOCKET": str(agent), "HOME": "/"}
    got = subprocess.run([str(WORKER_ENV / "bin" / "cedana-airflow"), "drill", "verify", "--ids", "clied"], env=env,
                         capture_output=True, text=True, timeout=120, preexec_fn=as_reader, cwd="/")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("OK   clied seq ") and "passed" in got.stdout, got.stdout
