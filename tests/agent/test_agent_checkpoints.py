"""The agent's ``checkpoints`` query (agent/views.py), as callers of other uids ask it: a caller sees its
own uid's IDs, as the key vouches for them, and nothing of another uid's (an ID it may not see answers
exactly as one that does not exist); a member of the node's ``agent_readers`` or ``agent_drillers`` and
root see every ID, and only drillers and root have drills run; a manifest the key does not vouch for is
nobody's. With real CRIU checkpoints of a tree run as nobody."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cedana_airflow.agent.client import AgentClient
from conftest import cli_env, node_key_bytes, remove_agent_folder, start_agent
from test_agent import NOBODY, OTHER, _checkpointed, as_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent runs as root")

READER = 65532  # a uid whose own group (as_uid: gid = uid) the agent lists in agent_readers
DRILLER = 65531  # and one in agent_drillers


@pytest.fixture
def agent(tmp_path) -> Iterator[Path]:
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    sock, log = folder / "agent.sock", tmp_path / "agent.log"
    proc = start_agent(sock, cli_env(tmp_path, "node-a", "work", CEDANA_AGENT_READERS=str(READER),
                                        CEDANA_AGENT_DRILLERS=str(DRILLER)), log)
    try:
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
        remove_agent_folder(folder)
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


def _ask(sock: Path, uid: int, ids: list[str] | None = None, *, just_ids: bool = False, **kw: Any) -> Any:
    def ask() -> tuple[Any, list[int]]:
        rows = AgentClient.connect(sock).checkpoints(ids, **kw)
        return ([r["id"] for r in rows] if just_ids else rows), []  # (the child's answer is one message too)
    msg, _ = as_uid(uid, ask)
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

    rows = _ask(agent, NOBODY, ["mine", "theirs"])
    assert [r["id"] for r in rows] == ["mine"]
    row = rows[0]
    assert row["uid"] == NOBODY and row["engine"] == "criu" and row["node"] == "node-a"
    assert row["seq"] >= 1 and row["checkpoints"] >= 1 and row["image_bytes"] > 0
    assert not {"chunks", "files", "signature", "path"} & row.keys()  # facts, never how to read the image
    # another uid's ID, root's, a forged one and one that does not exist all answer alike: nothing
    assert _ask(agent, NOBODY, ["theirs", "roots", "forged", "wrong-key", "nosuch"]) == []
    assert [r["id"] for r in _ask(agent, OTHER, ["mine", "theirs"])] == ["theirs"]
    # listing every ID is for those who see every ID: a paging cursor must not name another uid's IDs
    msg, _ = as_uid(NOBODY, lambda: (AgentClient.connect(agent).checkpoints(), []))
    assert msg.get("error") == "Refused" and "Listing every ID is for the node's agent_readers" in msg["line"], msg

    every = ["mine", "roots", "theirs"]  # sorted; the unvouched two are nobody's, for readers and root too
    assert [r["id"] for r in _ask(agent, READER)] == every
    assert [r["id"] for r in _ask(agent, DRILLER)] == every
    assert [r["id"] for r in _ask(agent, 0)] == every
    assert [r["uid"] for r in _ask(agent, READER, every)] == [NOBODY, None, OTHER]

    detailed = _ask(agent, NOBODY, ["mine"], detail=True)[0]
    assert detailed["lease"] is None or {"node", "try_number", "renewed_at", "ttl_seconds"} == detailed["lease"].keys()
    assert detailed["restores"] == []
    assert [s["seq"] for s in detailed["seqs"]][0] == row["seq"]
    assert _ask(agent, NOBODY, ["theirs"], detail=True) == []
    # who sees what, as hello tells it (a drill says so when it sees only its own)
    assert (_hello(agent, NOBODY)["sees"], _hello(agent, READER)["sees"]) == ("own", "every")
    assert (_hello(agent, READER)["drills"], _hello(agent, DRILLER)["drills"], _hello(agent, 0)["drills"]) == (
        False, True, True)


def test_replies_are_bounded_in_bytes_and_what_does_not_fit_is_asked_for_again(agent, tmp_path):
    """A task's names may be 250 characters of anything (12 bytes each in JSON): 40 IDs of such rows do not fit
    one reply, and every row still comes back, to a reader listing every ID and to their owner naming them."""
    from cedana_airflow.format.manifest import AirflowTask, parse_manifest
    from cedana_airflow.format.signing import sign

    store = tmp_path / "store"
    _checkpointed(agent, store, NOBODY, "wide")
    newest = max(p for p in (store / "wide").iterdir() if p.name.isdigit())
    m = parse_manifest((newest / "manifest.json").read_text())
    wide = "\U0001F600" * 250
    ids = [f"wide-{i:02d}" for i in range(40)]
    for cid in ids:
        copy = m.model_copy(update={"checkpoint_id": cid, "signature": None,
                                    "airflow": AirflowTask(dag_id=wide, task_id=wide, run_id=wide)})
        (store / cid / newest.name).mkdir(parents=True)
        (store / cid / newest.name / "manifest.json").write_bytes(sign(copy, node_key_bytes()).to_json())
    assert _ask(agent, READER, just_ids=True) == ["wide", *ids]
    assert _ask(agent, NOBODY, ids[:32], just_ids=True) == ids[:32]


def _hello(sock: Path, uid: int) -> Any:
    msg, _ = as_uid(uid, lambda: (AgentClient.connect(sock).hello(), []))
    return msg["ok"]


def test_a_bad_query_is_one_line(agent):
    msg, _ = as_uid(NOBODY, lambda: (AgentClient.connect(agent).request("checkpoints", ids=["../etc"])[0], []))
    assert msg.get("error") and "\n" not in msg["line"] and "etc" in msg["line"], msg
    msg, _ = as_uid(READER, lambda: (AgentClient.connect(agent).request("checkpoints", detail=True)[0], []))
    assert msg.get("error") == "Refused" and "Name it in ids" in msg["line"], msg
    msg, _ = as_uid(NOBODY, lambda: (AgentClient.connect(agent).request("checkpoints", ids=["a", "b"], detail=True)[0],
                                     []))
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


def test_drills_through_the_agent_are_for_its_drillers_it_runs_verify_itself_and_keeps_a_live_report(agent, tmp_path):
    """A drill task that is not root: the agent runs ``verify`` with its own store and key and keeps the
    report; it keeps a live drill's report its caller ran; a caller outside agent_drillers (a reader too) gets one line."""
    from cedana_airflow.drill.report import new_drill_id

    store = tmp_path / "store"
    _checkpointed(agent, store, NOBODY, "verified")

    def drill(uid: int, mode: str, **kw: Any) -> dict[str, Any]:
        msg, _ = as_uid(uid, lambda: (AgentClient.connect(agent).drill(mode, **kw), []))
        return msg

    for uid in (NOBODY, READER):  # a reader sees facts; only drillers have the agent run drills as root
        refused = drill(uid, "verify")
        assert refused.get("error") == "Refused" and "Add its group to the node's agent_drillers" in refused["line"], refused

    report = drill(DRILLER, "verify", params={"ids": "verif*"})["ok"]["report"]
    assert report["mode"] == "verify" and report["ok"] is True, report
    assert [c["checkpoint_id"] for c in report["checked"]] == ["verified"]
    assert (store / "drills" / f"{report['drill_id']}.json").exists()  # kept by the agent

    bad = drill(DRILLER, "verify", params={"sample": 0})
    assert bad.get("error") == "Refused" and "sample" in bad["line"], bad

    live = {"drill_id": new_drill_id("live"), "mode": "live", "ok": True, "node": "node-a",
            "started_at": "2026-12-06T00:00:00+00:00", "finished_at": "2026-12-06T00:01:00+00:00"}
    # a busy fleet's live report is larger than a message: it travels in a memfd
    live["targets"] = [{"dag_id": "d" * 200, "task_id": f"t{i}", "run_id": "r" * 200, "map_index": -1, "try_number": 1,
                        "pool": "default_pool", "chosen": False, "reason": "x" * 200} for i in range(300)]
    assert drill(DRILLER, "keep", report=live)["ok"]["kept"] is True
    assert len(json.loads((store / "drills" / f"{live['drill_id']}.json").read_text())["targets"]) == 300
    for bad_id in ("../../etc/x", live["drill_id"] + "\n"):
        forged = drill(DRILLER, "keep", report={**live, "drill_id": bad_id})
        assert forged.get("error") == "Refused" and "only a live drill's report" in forged["line"], forged
    assert drill(DRILLER, "keep", report={**live, "mode": "verify"}).get("error") == "Refused"
    assert sorted(p.name for p in (store / "drills").iterdir()) == sorted(
        [f"{report['drill_id']}.json", f"{live['drill_id']}.json"])


def test_agent_group_settings_take_ascii_gids_and_known_names_only():
    from cedana_airflow.agent.server import group_ids
    from cedana_airflow.errors import ConfigError

    assert group_ids(("0", "65534", "nogroup"), "agent_readers") == {0, 65534}
    for bad in ("\uff10", "\u00b2", "no-such-group-here"):  # a fullwidth 0 is no gid 0
        with pytest.raises(ConfigError, match="agent_readers names group"):
            group_ids((bad,), "agent_readers")


def test_the_cli_s_drill_as_a_driller_that_is_not_root_is_run_by_the_agent(agent, tmp_path):
    """`cedana-airflow drill verify` from the worker environment (the installed wheel) as a driller: it holds no
    store and no key, and prints the agent's report as it prints its own."""
    import subprocess

    from conftest import WORKER_ENV

    _checkpointed(agent, tmp_path / "store", NOBODY, "clied")

    def as_reader() -> None:
        os.setgroups([])
        os.setresgid(DRILLER, DRILLER, DRILLER)
        os.setresuid(DRILLER, DRILLER, DRILLER)

    env = {"PATH": os.environ["PATH"], "CEDANA_AGENT_SOCKET": str(agent), "HOME": "/"}
    got = subprocess.run([str(WORKER_ENV / "bin" / "cedana-airflow"), "drill", "verify", "--ids", "clied"], env=env,
                         capture_output=True, text=True, timeout=120, preexec_fn=as_reader, cwd="/")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("OK   clied seq ") and "passed" in got.stdout, got.stdout


def test_a_sensor_that_is_not_root_on_a_node_without_an_agent_reads_the_store_itself_unless_it_requires_one():
    """As before 0.8.4 (a non-root Airflow image with no agent beside it): ``agent = auto`` falls back to the
    store, saying so in the log; ``agent = require`` fails in one line naming the socket."""
    pytest.importorskip("airflow")
    from cedana_airflow.sensors.checkpoint import fresh_checkpoint

    def sensed(agent: str) -> Any:
        def prepare() -> None:
            for k in [k for k in os.environ if k.startswith("CEDANA_")]:
                del os.environ[k]
            os.environ.update(CEDANA_AGENT_SOCKET="/run/no-agent-here/agent.sock", CEDANA_AGENT=agent,
                              CEDANA_STORE="file:///nonexistent-store-of-this-test")
        return as_uid(NOBODY, lambda: (fresh_checkpoint("s", None, None, None), []), prepare)[0]

    assert sensed("auto") == {"ok": None}  # the store, read as before: nothing there yet
    got = sensed("require")
    assert got.get("error") == "AgentUnavailable" and "/run/no-agent-here/agent.sock" in got["line"], got


def test_root_in_another_namespace_is_not_the_root_the_agent_trusts_it_sees_its_own_only_and_runs_no_drill(agent):
    """As for a start: root in a container (here, a network namespace of its own) may be anyone's root."""
    from test_agent import _unshare

    def ask() -> tuple[Any, list[int]]:
        with AgentClient.connect(agent) as c:
            return {"hello": c.hello()}, []

    hello = as_uid(0, ask, lambda: _unshare(0x40000000))[0]["ok"]["hello"]  # CLONE_NEWNET
    assert (hello["sees"], hello["drills"]) == ("own", False), hello
    msg, _ = as_uid(0, lambda: (AgentClient.connect(agent).checkpoints(), []), lambda: _unshare(0x40000000))
    assert msg.get("error") == "Refused" and "Listing every ID is for the node's agent_readers" in msg["line"], msg
    msg, _ = as_uid(0, lambda: (AgentClient.connect(agent).drill("verify"), []), lambda: _unshare(0x40000000))
    assert msg.get("error") == "Refused" and "another net namespace" in msg["line"], msg
