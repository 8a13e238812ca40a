"""The node agent's own faults (issue 49): the agent is killed (SIGKILL, as an OOM kill or a crash would)
mid-dump, mid-stream (chunks half uploaded) and mid-restore, through the failpoints the fault matrix
uses (failpoints.py). What a user would notice is asserted: the workload runs on or its end reaches its
caller; nothing half-written becomes the latest checkpoint; an agent started after it goes on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cedana_airflow.agent.client import AgentClient
from conftest import cli_env, manifests, pipe_of, remove_agent_folder, start_agent
from test_agent import NOBODY, _event, _read_all, _start, as_uid

COUNTER = ["sh", "-c", "i=0; while [ $i -lt 600 ]; do i=$((i+1)); echo $i; sleep 0.05; done"]


@dataclass
class Node:
    folder: Path
    sock: Path
    tmp: Path
    procs: list[subprocess.Popen[bytes]]

    def agent(self, name: str, failpoints: str = "") -> subprocess.Popen[bytes]:
        env = cli_env(self.tmp, "node-a", "work", **({"CEDANA_FAILPOINTS": failpoints} if failpoints else {}))
        proc = start_agent(self.sock, env, self.tmp / f"{name}.log")
        self.procs.append(proc)
        return proc

    def checkpoints(self, cid: str) -> list[int]:
        return [m["seq"] for m in manifests(self.tmp / "store", cid)]


@contextmanager
def node(tmp_path: Path) -> Iterator[Node]:
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    n = Node(folder, folder / "agent.sock", tmp_path, [])
    try:
        yield n
    finally:
        for proc in n.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        remove_agent_folder(folder)
        for log in sorted(tmp_path.glob("*.log")):
            print(log.name, log.read_text()[-3000:])


def _until(what: str, cond: Any, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _stop(sock: Path, wid: str, handle: str) -> dict[str, Any]:
    def run() -> tuple[Any, list[int]]:
        with AgentClient.connect(sock) as c:
            return c.stop(wid, handle), []
    msg, _ = as_uid(NOBODY, run)
    assert "ok" in msg, msg
    return msg["ok"]


def _first_run(n: Node, cid: str, argv: list[str]) -> tuple[dict[str, Any], socket.socket, int]:
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(n.sock, argv, out_w, checkpoint_id=cid, settings={"heartbeat_seconds": 0.5}))
    os.close(out_w)
    assert "ok" in msg, msg
    lifeline = socket.socket(fileno=fds[0])
    assert _event(lifeline)["ev"] == "started"
    return msg["ok"], lifeline, out_r


def _goes_on_under_the_next_agent(n: Node, cid: str, started: dict[str, Any], lifeline: socket.socket, out_r: int,
                                  before: list[int]) -> None:
    """The workload outlived the agent: the next one takes it up, checkpoints it, and its owner's stop takes
    the final checkpoint; its count never restarted."""
    n.agent("second")
    assert f"agent took up {started['wid']}" in (n.tmp / "second.log").read_text()
    _until("the next agent did not checkpoint the workload", lambda: len(set(n.checkpoints(cid)) - set(before)) >= 1)
    status = _stop(n.sock, started["wid"], started["handle"])
    assert status["state"] == "ended" and "error" not in status, status
    assert status["result"]["final_checkpoint_seq"] == n.checkpoints(cid)[-1]
    assert _event(lifeline)["ev"] == "exit"
    out = _read_all(out_r).split()
    assert out == [str(i) for i in range(1, len(out) + 1)], out[:20]


def test_the_agent_killed_mid_dump_leaves_the_workload_running_and_the_half_dump_never_latest(tmp_path):
    with node(tmp_path) as n:
        # Inside the second dump: the tree frozen, its images written, CRIU waiting on the agent (failpoints.py).
        first = n.agent("first", "heartbeat.frozen=kill-supervisor@2")
        started, lifeline, out_r = _first_run(n, "mid-dump", COUNTER)
        first.wait(60)
        assert first.returncode == -signal.SIGKILL
        assert n.checkpoints("mid-dump") == [1]  # the second was never committed
        _goes_on_under_the_next_agent(n, "mid-dump", started, lifeline, out_r, [1])


def test_the_agent_killed_mid_stream_commits_nothing_and_the_next_agent_goes_on(tmp_path):
    with node(tmp_path) as n:
        first = n.agent("first", "heartbeat.upload=kill-supervisor@3")  # the first heartbeat's third chunk
        started, lifeline, out_r = _first_run(n, "mid-stream", COUNTER)
        first.wait(60)
        assert first.returncode == -signal.SIGKILL
        assert n.checkpoints("mid-stream") == []  # chunks were sent, no manifest: nothing to restore from
        assert list((tmp_path / "store").rglob("*")), "nothing was streamed before the kill"
        _goes_on_under_the_next_agent(n, "mid-stream", started, lifeline, out_r, [])


def test_the_agent_killed_mid_restore_leaves_nothing_running_and_the_retry_resumes(tmp_path):
    with node(tmp_path) as n:
        first = n.agent("first", "restore.criu=kill-supervisor")  # its checks passed, CRIU about to run
        started, lifeline, out_r = _first_run(n, "mid-restore", COUNTER)
        _until("no checkpoint", lambda: len(n.checkpoints("mid-restore")) >= 2)
        lifeline.close()  # try 1's caller is gone, and its tree with it
        _until("try 1's tree did not end", lambda: not os.path.exists(f"/proc/{started['pid']}"), 30)
        before = _read_all(out_r).split()
        latest = n.checkpoints("mid-restore")[-1]

        out_r, out_w = pipe_of(NOBODY)
        msg, _ = as_uid(NOBODY, _start(n.sock, COUNTER, out_w, checkpoint_id="mid-restore", resume=True, try_number=1,
                                       settings={"heartbeat_seconds": 0.5}))
        os.close(out_w)
        assert "error" in msg, msg  # the agent died under the request: the caller is told, not left waiting
        first.wait(60)
        assert _read_all(out_r) == ""  # and nothing of the restore runs: it never printed
        n.agent("second")
        out_r, out_w = pipe_of(NOBODY)
        msg, fds = as_uid(NOBODY, _start(n.sock, COUNTER, out_w, checkpoint_id="mid-restore", resume=True, try_number=2,
                                         settings={"heartbeat_seconds": 0.5}))
        os.close(out_w)
        assert "ok" in msg, msg
        lifeline = socket.socket(fileno=fds[0])
        assert _event(lifeline)["ev"] == "started"
        status = _stop(n.sock, msg["ok"]["wid"], msg["ok"]["handle"])
        assert status["result"]["restored_from"]["seq"] == latest, status
        after = _read_all(out_r).split()
        assert before and after and 1 < int(after[0]) <= int(before[-1]) + 1, (before[-3:], after[:3])


def test_two_restores_of_the_same_seq_at_once_in_one_agent_each_resume_their_own_tree(tmp_path):
    """One agent is one process for every run on its node: two retries restoring seq 1 of two IDs at once
    (the first held 2 s just before CRIU runs, while the second fetches) each get their own tree back. Their
    work folders were once named by the process and the seq alone: the second's fetch removed the first's
    images, and the first started fresh (the stack's torch tests met it on node-b)."""
    count = "i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo {id} $i; sleep 0.1; done"
    with node(tmp_path) as n:
        n.agent("agent", failpoints="restore.criu=run:sleep 2")
        for cid in ("twin-a", "twin-b"):  # one checkpoint each, seq 1: the stop's final one
            out_r, out_w = os.pipe()
            with AgentClient.connect(n.sock) as c:
                s = c.start(cid, ["sh", "-c", count.format(id=cid)], cwd="/tmp", env={"PATH": "/usr/bin:/bin"},
                            stdout=out_w, stderr=out_w, settings={"heartbeat_seconds": 600})
                os.close(out_w)
                time.sleep(1.0)
                assert c.stop(s.wid, s.handle)["result"]["final_checkpoint_seq"] == 1
            s.lifeline.close()
            os.close(out_r)
            assert n.checkpoints(cid) == [1]

        outs: dict[str, str] = {}

        def resume(cid: str) -> None:
            out_r, out_w = os.pipe()
            msg, fds = _start(n.sock, ["sh", "-c", count.format(id=cid)], out_w, checkpoint_id=cid, resume=True,
                              try_number=1)()
            os.close(out_w)
            assert msg["restored_seq"] == 1, msg
            with socket.socket(fileno=fds[0]) as lifeline:
                assert _event(lifeline, timeout=60)["ev"] == "started"
                assert _event(lifeline, timeout=60)["ev"] == "exit"
            outs[cid] = _read_all(out_r)

        import threading

        threads = [threading.Thread(target=resume, args=(cid,)) for cid in ("twin-a", "twin-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for cid in ("twin-a", "twin-b"):
            lines = outs[cid].split("\n")
            counted = [int(x.split()[1]) for x in lines if x.startswith(f"{cid} ")]
            assert counted and counted[0] > 1 and counted == list(range(counted[0], 41)), (cid, outs[cid][-500:])
            assert not [x for x in lines if x.startswith("twin-") and not x.startswith(f"{cid} ")], outs[cid][-500:]
