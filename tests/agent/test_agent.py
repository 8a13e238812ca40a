"""The node agent as a node runs it (``python -m cedana_airflow.agent``, root, with real CRIU) and
callers as the Airflow worker's user would be (forked children that became ``nobody`` or another
uid): a caller's workload runs as that caller; another uid cannot see, stop or ask about it; every
request is audited; the agent's death leaves workloads running; bad requests are one line each. A
root caller's workload is checkpointed on its heartbeat, signed with the node's key, and its stop takes
a final checkpoint; another caller's too, in namespaces of its own, and it resumes as that caller with
nothing more (agent/shim.py, agent/trees.py)."""

from __future__ import annotations

import errno
import json
import re
import os
import shutil
import signal
import stat
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cedana_airflow import __version__, errors
from cedana_airflow.agent import protocol
from cedana_airflow.agent.client import AgentClient
from conftest import (REPO, WORKER_ENV, cli, cli_env, kill_node, manifests, node_key_bytes, pipe_of, remove_agent_folder,
                      start_agent, start_cli, uid_folder, wait_for_checkpoints)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent runs as root")

NOBODY, OTHER = 65534, 65533


@pytest.fixture
def agent(tmp_path) -> Iterator[tuple[Path, Path]]:
    """A running agent: its socket (in a 0755 root folder every uid can reach) and its audit log. Its
    store and work dir are under ``tmp_path`` (root's: no caller can reach them)."""
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    sock, audit = folder / "agent.sock", tmp_path / "audit.jsonl"
    agent_log = tmp_path / "agent.log"
    proc = start_agent(sock, cli_env(tmp_path, "node-a", "work"), agent_log, "--audit", str(audit))
    try:
        yield sock, audit
    finally:
        proc.terminate()
        proc.wait(10)
        remove_agent_folder(folder)
        print(agent_log.read_text()[-6000:])  # shown with a failure


def as_uid(uid: int, fn: Callable[[], tuple[Any, list[int]]],
           prepare: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], list[int]]:
    """``fn`` run by a forked child that ran ``prepare`` as root and then became ``uid`` (no groups): what
    it returned (or raised, as ``{"error": class, "line": ...}``) and the fds it sent back."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            mine.close()
            try:
                prepare()
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                result, fds = fn()
                protocol.send(theirs, {"ok": result}, fds)
            except errors.CedanaError as e:
                protocol.send(theirs, {"error": type(e).__name__, "line": str(e)})
            except BaseException as e:  # noqa: BLE001 (said to the test, not lost with the child)
                protocol.send(theirs, {"error": type(e).__name__, "line": repr(e)})
        finally:
            os._exit(0)
    theirs.close()
    msg, fds = protocol.recv(mine)
    os.waitpid(pid, 0)
    mine.close()
    assert msg is not None, "the child died before it answered"
    return msg, fds


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def _read_all(fd: int) -> str:
    out = b""
    while chunk := os.read(fd, 1 << 16):
        out += chunk
    os.close(fd)
    return out.decode()


def _event(sock: socket.socket, timeout: float = 10) -> dict[str, Any]:
    sock.settimeout(timeout)
    msg, _ = protocol.recv(sock)
    assert msg is not None
    return msg


def _start(sock_path: Path, argv: list[str], out_w: int, **more: Any) -> Callable[[], tuple[Any, list[int]]]:
    def run() -> tuple[Any, list[int]]:
        with AgentClient.connect(sock_path) as c:
            hello = c.hello()
            s = c.start(more.pop("checkpoint_id", "job"), argv, cwd="/tmp", env={"PATH": "/usr/bin:/bin"},
                        stdout=out_w, stderr=out_w, **more)
            return ({"hello": hello, "wid": s.wid, "handle": s.handle, "pid": s.pid, "fresh": s.fresh,
                     "restored_seq": s.restored_seq}, [s.lifeline.detach()])
    return run


def test_a_caller_s_workload_runs_as_that_caller_and_its_exit_reaches_it(agent):
    sock, audit = agent
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, ["sh", "-c", "id -u; grep CapEff /proc/self/status; echo pid=$$"], out_w))
    os.close(out_w)
    assert "ok" in msg, msg
    lifeline = socket.socket(fileno=fds[0])
    hello = msg["ok"]["hello"]
    assert hello["you"] == {"uid": NOBODY, "gid": NOBODY} and hello["node"] == "node-a" and hello["protected"] is True
    assert _event(lifeline)["ev"] == "started"
    assert _read_all(out_r) == f"{NOBODY}\nCapEff:\t0000000000000000\npid=1\n"
    assert _event(lifeline) == {"ev": "exit", "code": 0, "cause": "exited", "signal": None}
    rows = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["op"], r["uid"], r["decision"]) for r in rows] == [("hello", NOBODY, "allowed"), ("start", NOBODY, "allowed")]
    assert rows[1]["argv0"] == "sh" and "handle" not in json.dumps(rows) and "PATH" not in json.dumps(rows)


def test_another_uid_can_neither_see_nor_stop_nor_ask_about_it_and_a_wrong_handle_is_refused(agent):
    sock, audit = agent
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, ["sleep", "30"], out_w))
    os.close(out_w)
    os.close(out_r)
    lifeline = socket.socket(fileno=fds[0])  # the caller's end, kept here: the workload lives while we hold it
    wid, handle, pid = msg["ok"]["wid"], msg["ok"]["handle"], msg["ok"]["pid"]

    def ops(h: str) -> Callable[[], tuple[Any, list[int]]]:
        def run() -> tuple[Any, list[int]]:
            out = {}
            with AgentClient.connect(sock) as c:
                out["list"] = c.list()
                for op in ("status", "kill"):
                    try:
                        out[op] = getattr(c, op)(wid, h)
                    except errors.Refused as e:
                        out[op] = f"Refused: {e}"
            return out, []
        return run

    other, _ = as_uid(OTHER, ops(handle))  # even with the right handle
    assert other["ok"]["list"] == []
    for op in ("status", "kill"):
        assert other["ok"][op].startswith(f"Refused: workload {wid} belongs to uid {NOBODY}, not to uid {OTHER} (pid ")
    guess, _ = as_uid(NOBODY, ops("0" * 32))
    assert guess["ok"]["status"] == f"Refused: workload {wid}: that is not its handle. Use the handle its start returned"
    assert [w["wid"] for w in guess["ok"]["list"]] == [wid] and "handle" not in guess["ok"]["list"][0]
    assert os.path.exists(f"/proc/{pid}")  # none of that touched it
    owner, _ = as_uid(NOBODY, ops(handle))
    assert owner["ok"]["status"]["state"] == "running" and owner["ok"]["status"]["uid"] == NOBODY
    assert owner["ok"]["status"]["protected"] is True and "why_unprotected" not in owner["ok"]["status"]
    assert owner["ok"]["kill"]["state"] == "ended" and owner["ok"]["kill"]["cause"] == "killed"
    assert _event(lifeline) == {"ev": "started", "pid": pid}
    assert _event(lifeline) == {"ev": "exit", "code": 128 + signal.SIGKILL, "cause": "killed", "signal": signal.SIGKILL}
    refused = [json.loads(line) for line in audit.read_text().splitlines() if '"refused' in line]
    assert {(r["uid"], r["op"]) for r in refused} == {(OTHER, "status"), (OTHER, "kill"), (NOBODY, "status"), (NOBODY, "kill")}


def test_the_agent_dying_leaves_the_workload_running_and_its_exit_still_reaches_the_caller(tmp_path):
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    sock = folder / "agent.sock"
    proc = start_agent(sock, cli_env(tmp_path, "node-a", "work"), tmp_path / "agent.log")
    try:
        out_r, out_w = pipe_of(NOBODY)
        msg, fds = as_uid(NOBODY, _start(sock, ["sh", "-c", "sleep 1; echo after-the-agent; exit 4"], out_w))
        os.close(out_w)
        lifeline = socket.socket(fileno=fds[0])
        assert _event(lifeline)["ev"] == "started"
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and its process group: a shim is in its own session
        proc.wait()
        assert _event(lifeline) == {"ev": "exit", "code": 4, "cause": "exited", "signal": None}
        assert _read_all(out_r) == "after-the-agent\n"
    finally:
        if proc.poll() is None:
            proc.kill()
        remove_agent_folder(folder)


def test_bad_requests_are_one_line_each(agent):
    sock, _ = agent
    _, roots = os.pipe()  # a pipe root made, which the child (nobody) inherits

    def run() -> tuple[Any, list[int]]:
        out = {}
        r, w = os.pipe()
        with tempfile.TemporaryDirectory() as d:
            os.mkfifo(f"{d}/fifo")
            fifo = os.open(f"{d}/fifo", os.O_RDWR)
        with AgentClient.connect(sock) as c:
            for name, call in {
                "unknown": lambda: c.request("dump"),
                "no fds": lambda: c.request("start", checkpoint_id="job", argv=["true"], cwd="/"),
                "relative cwd": lambda: c.start("job", ["true"], cwd="tmp", stdout=w, stderr=w),
                "empty argv": lambda: c.start("job", [], cwd="/", stdout=w, stderr=w),
                "missing": lambda: c.start("job", ["no-such-command-here"], cwd="/", env={}, stdout=w, stderr=w),
                "node setting": lambda: c.start("job", ["true"], cwd="/", stdout=w, stderr=w,
                                                settings={"lease_renew_command": "id > /etc/x"}),
                "unsafe id": lambda: c.start("../etc", ["true"], cwd="/", stdout=w, stderr=w),
                "keeps too many": lambda: c.start("job", ["true"], cwd="/", stdout=w, stderr=w,
                                                  settings={"keep_checkpoints": 51}),
                # a restore would give CRIU these to reopen, as root where the tree may not (review 49, F1)
                "O_PATH stdout": lambda: c.start("job", ["true"], cwd="/", stdout=os.open("/etc/shadow", os.O_PATH),
                                                 stderr=w),
                "read end": lambda: c.start("job", ["true"], cwd="/", stdout=w, stderr=r),
                "named FIFO": lambda: c.start("job", ["true"], cwd="/", stdout=w, stderr=fifo),
                "root's pipe": lambda: c.start("job", ["true"], cwd="/", stdout=roots, stderr=w),
                "unknown wid": lambda: c.status("w-nope", "x"),
            }.items():
                try:
                    call()
                    out[name] = "accepted"
                except errors.CedanaError as e:
                    out[name] = f"{type(e).__name__}: {e}"
        return out, []

    msg, _ = as_uid(NOBODY, run)
    got = msg["ok"]
    assert got["unknown"].startswith("Refused: unknown op 'dump': this agent (") and "hello, kill, list" in got["unknown"]
    assert got["no fds"] == "Refused: start needs the workload's stdout and stderr as 2 fds, got 0. Use the agent client"
    assert got["relative cwd"] == "Refused: start: cwd must be an absolute path. Fix the request"
    assert got["empty argv"].startswith("Refused: start: argv List should have at least 1 item")
    assert got["missing"] == ("CommandNotFound: cannot start the workload: no-such-command-here: No such file or "
                              "directory. Check the command and PATH")
    assert got["unknown wid"] == "Refused: no workload 'w-nope' on node node-a. List yours with the list op"
    assert got["node setting"].startswith("Refused: setting 'lease_renew_command' is the node's, not a task's: the "
                                          "agent's configuration sets it. A request may set ")
    assert got["unsafe id"].startswith("CheckpointIdError: ")
    assert got["O_PATH stdout"] == ("Refused: start: the workload's stdout must be the write end of a pipe the caller "
                                    "made (an O_PATH descriptor). Use the agent client")
    assert got["read end"] == ("Refused: start: the workload's stderr must be the write end of a pipe the caller made "
                               "(not open for writing only). Use the agent client")
    assert got["named FIFO"] == ("Refused: start: the workload's stderr must be the write end of a pipe the caller made "
                                 "(not an anonymous pipe). Use the agent client")
    assert got["root's pipe"] == ("Refused: start: the workload's stdout must be the write end of a pipe the caller "
                                  "made (made by uid 0). Use the agent client")
    assert got["keeps too many"] == ("Refused: keep_checkpoints = 51 is more than this node's agent keeps per checkpoint "
                                     "ID (50, agent_max_keep_checkpoints): ask for fewer, or have the node's operator "
                                     "raise it")
    assert all("\n" not in line for line in got.values())


def test_no_agent_is_one_line_naming_the_socket_and_the_fix(tmp_path):
    with pytest.raises(errors.AgentUnavailable, match=rf"^no cedana agent answers at {tmp_path}/agent.sock \(No such "
                       r"file or directory\)\. Start `cedana-airflow agent` on this node"):
        AgentClient.connect(tmp_path / "agent.sock")


def test_a_socket_served_by_a_uid_other_than_root_is_no_agent_and_gets_nothing(tmp_path):
    """A path a caller was pointed at (a folder someone else could write, a %n that named none) served by
    nobody: the client refuses it before it sends anything (its env, its pipes), in one line."""
    folder = Path(f"/run/cedana-test-fake-{os.getpid()}")
    folder.mkdir()
    folder.chmod(0o777)
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the impostor: binds and listens as nobody, then waits to be killed
            try:
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                server.bind(str(folder / "agent.sock"))
                server.listen(1)
                time.sleep(60)
            finally:
                os._exit(0)
        try:
            deadline = time.monotonic() + 10
            while not (folder / "agent.sock").exists():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(errors.AgentUnavailable, match=rf"^the socket {folder}/agent.sock is served by uid "
                               rf"{NOBODY}, not root: not a node agent, and nothing was sent to it"):
                AgentClient.connect(folder / "agent.sock")
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        remove_agent_folder(folder)


def test_a_root_caller_s_workload_is_checkpointed_on_its_heartbeat_and_its_stop_takes_a_final_checkpoint(agent, tmp_path):
    sock, _ = agent
    out_r, out_w = os.pipe()
    counter = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done"
    claim = {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": -1}
    with AgentClient.connect(sock) as c:
        s = c.start("agent-job", ["sh", "-c", counter], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, stdout=out_w,
                    stderr=out_w, settings={"heartbeat_seconds": 0.5}, claim=claim)
        os.close(out_w)
        deadline = time.monotonic() + 60
        while len(manifests(tmp_path / "store", "agent-job")) < 2:  # two heartbeats
            assert time.monotonic() < deadline, "no heartbeat checkpoint within 60 s"
            time.sleep(0.2)
        status = c.stop(s.wid, s.handle)
    assert status["state"] == "ended" and status["protected"] is True and "error" not in status, status
    result = status["result"]
    ms = manifests(tmp_path / "store", "agent-job")
    assert result["final_checkpoint_seq"] == result["checkpoints"] == len(ms) >= 3, result
    assert result["exit_code"] == 128 + signal.SIGTERM and result["failed_heartbeats"] == 0
    assert [m["seq"] for m in ms] == list(range(1, len(ms) + 1))
    assert all(m.get("signature") for m in ms)  # signed by the node's key, which the caller never saw
    assert ms[-1]["airflow"] == claim and ms[-1]["node"] == "node-a"
    assert _event(s.lifeline)["ev"] == "started"
    assert _event(s.lifeline)["ev"] == "exit"
    out = _read_all(out_r).split()
    assert out == [str(i) for i in range(1, len(out) + 1)]  # it counted, untouched by the heartbeats, until the stop


def test_a_root_caller_s_retry_resumes_from_the_newest_checkpoint_under_a_new_shim(agent, tmp_path):
    """Try 1's caller dies (its lifeline closes: the shim kills the tree); try 2 asks to resume and the
    same count goes on from the checkpoint, printed into try 2's own pipe, to its end."""
    sock, _ = agent
    counter = ["sh", "-c", "i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo $i; sleep 0.1; done"]
    with AgentClient.connect(sock) as c:
        out_r, out_w = os.pipe()
        first = c.start("agent-resume", counter, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, stdout=out_w,
                        stderr=out_w, settings={"heartbeat_seconds": 0.5}, resume=True)
        os.close(out_w)
        assert first.restored_seq is None  # nothing to resume yet
        deadline = time.monotonic() + 60
        while len(manifests(tmp_path / "store", "agent-resume")) < 2:
            assert time.monotonic() < deadline, "no heartbeat checkpoint within 60 s"
            time.sleep(0.1)
        first.lifeline.close()  # the caller is gone (its worker died): so is its tree
        deadline = time.monotonic() + 30
        while (status := c.status(first.wid, first.handle))["state"] != "ended":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status["cause"] == "caller-lost", status
        before = _read_all(out_r).split()
        latest = manifests(tmp_path / "store", "agent-resume")[-1]["seq"]

        out_r, out_w = os.pipe()
        second = c.start("agent-resume", counter, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, stdout=out_w,
                         stderr=out_w, settings={"heartbeat_seconds": 0.5}, resume=True, try_number=1)
        os.close(out_w)
        assert second.restored_seq == latest
        assert _event(second.lifeline)["ev"] == "started"
        assert _event(second.lifeline, timeout=60) == {"ev": "exit", "code": 0, "cause": "exited", "signal": None}
        after = _read_all(out_r).split()
    assert before and after and int(after[0]) > 1, (before, after)  # resumed, not started over
    assert int(after[0]) <= int(before[-1]) + 1  # from a checkpoint of what try 1 had done
    assert after == [str(i) for i in range(int(after[0]), 41)]  # and on to the end, nothing skipped


def test_a_tree_whose_shim_is_killed_is_killed_by_the_agent(agent):
    sock, _ = agent
    out_r, out_w = os.pipe()
    with AgentClient.connect(sock) as c:
        s = c.start("agent-orphan", ["sleep", "60"], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, stdout=out_w,
                    stderr=out_w, settings={"heartbeat_seconds": 0})
        os.close(out_w)
        with open(f"/proc/{s.pid}/stat") as f:
            shim_pid = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(shim_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (status := c.status(s.wid, s.handle))["state"] != "ended":
            assert time.monotonic() < deadline, "the agent left the tree of a dead shim running"
            time.sleep(0.05)
    assert status["cause"] == "shim-lost"
    assert _read_all(out_r) == ""  # its write end is closed: the tree (sleep, the namespace's init) is gone


# -- what a caller cannot get from the agent (review49-agent.md's findings, each reproduced first) --------


def _start_as(sock: Path, uid: int, argv: list[str], prepare: Callable[[], None] = lambda: None,
              settings: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """``argv`` started through the agent by a child that ran ``prepare`` as root and then became ``uid``;
    what it got back, and the workload's output (once it ended)."""
    out_r, out_w = pipe_of(uid)

    def run() -> tuple[Any, list[int]]:
        with AgentClient.connect(sock) as c:
            s = c.start(f"agent-caller-{uid}", argv, cwd="/", env={"PATH": "/usr/bin:/bin"}, stdout=out_w, stderr=out_w,
                        settings=settings or {"heartbeat_seconds": 0})
            _event(s.lifeline)
            return {"end": _event(s.lifeline, timeout=30)}, []

    msg, _ = as_uid(uid, run, prepare)
    os.close(out_w)  # the child and its workload are gone: the pipe ends here
    return msg, _read_all(out_r)


def _unshare(flags: int) -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")


def test_a_caller_in_another_namespace_and_a_confined_root_caller_are_refused_in_one_line(agent):
    sock, audit = agent
    netns, _ = _start_as(sock, NOBODY, ["true"], prepare=lambda: _unshare(0x40000000))  # CLONE_NEWNET
    assert netns["error"] == "Refused" and netns["line"].startswith(f"uid {NOBODY} (pid ")
    assert "is in another net namespace than the agent (a container or a sandbox); its workload would leave it" \
        in netns["line"]

    def a_thread_in_a_netns() -> None:  # one thread elsewhere: the process stands nowhere the agent is (R2)
        import threading

        ready = threading.Event()

        def elsewhere() -> None:
            _unshare(0x40000000)  # CLONE_NEWNET, this thread only
            ready.set()
            time.sleep(60)

        threading.Thread(target=elsewhere, daemon=True).start()
        assert ready.wait(10)

    thread, _ = _start_as(sock, NOBODY, ["true"], prepare=a_thread_in_a_netns)
    assert thread["error"] == "Refused" and "is in another net namespace than the agent" in thread["line"], thread

    def bounded() -> None:
        import ctypes

        ctypes.CDLL(None).prctl(24, 21, 0, 0, 0)  # PR_CAPBSET_DROP CAP_SYS_ADMIN

    root, _ = _start_as(sock, 0, ["true"], prepare=bounded)
    assert root["error"] == "Refused" and "is root with fewer capabilities than the agent or no_new_privs set; its " \
        "workload would be full root. Run the task as a user other than root" in root["line"]
    assert sum('"refused: ' in line for line in audit.read_text().splitlines()) == 3


def test_a_workload_keeps_its_caller_s_cgroup_limits_umask_nice_and_oom_score(agent):
    sock, _ = agent
    cgroup = Path(f"/sys/fs/cgroup/pids/cedana-agent-test-{os.getpid()}")
    cgroup.mkdir()
    (cgroup / "pids.max").write_text("20")

    def confine() -> None:
        import resource

        (cgroup / "cgroup.procs").write_text("0")
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        os.umask(0o077)
        os.nice(5)
        Path("/proc/self/oom_score_adj").write_text("500")

    probe = ("grep pids /proc/self/cgroup; grep 'open files' /proc/self/limits; umask; "
             "cut -d' ' -f19 /proc/self/stat; cat /proc/self/oom_score_adj")
    try:
        msg, out = _start_as(sock, NOBODY, ["sh", "-c", probe], prepare=confine)
    finally:
        deadline = time.monotonic() + 10
        while (cgroup / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        cgroup.rmdir()
    assert msg.get("ok", {}).get("end", {}).get("code") == 0, (msg, out)
    lines = out.splitlines()
    assert lines[0].endswith(f":pids:/cedana-agent-test-{os.getpid()}")  # inside its caller's pids limit
    assert lines[1].split()[3:5] == ["64", "64"] and lines[2:] == ["0077", "5", "500"], out


def _child_sends(c: AgentClient, refusal: Callable[[int, int], str], become: int | None = None) -> int:
    """A forked child (that became ``become``, where given) sends a hello on ``c``, its parent's connection:
    0 where it was refused with a line starting ``refusal(parent pid, child pid)``, 2 with another, 1 where
    it was answered."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if become is not None:
                os.setgroups([])
                os.setresgid(become, become, become)
                os.setresuid(become, become, become)
            try:
                c.hello()
            except errors.Refused as e:
                code = 0 if str(e).startswith(refusal(os.getppid(), os.getpid())) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_connection_opened_by_root_then_used_by_another_uid_is_refused(agent):
    sock, _ = agent
    c = AgentClient.connect(sock)  # root connects, and a child that became nobody sends on that connection
    code = _child_sends(c, lambda parent, child: f"this connection was opened by uid 0 (pid {parent}); a message "
                                                 f"from uid {NOBODY} (pid {child}) on it is refused", become=NOBODY)
    c.close()
    assert code == 0


def test_a_connection_handed_to_another_process_of_the_same_uid_or_kept_across_a_confinement_is_refused(agent):
    """The confinement the agent judges is the one the sender has when it sends (review 49, F4): a child
    of the same uid sending on its parent's connection is refused, and so is a start from a process that
    put itself under a seccomp filter after it connected, on the connection it opened before."""
    sock, _ = agent

    def handed() -> tuple[Any, list[int]]:
        c = AgentClient.connect(sock)
        c.hello()  # the opener itself is served
        return _child_sends(c, lambda parent, child: f"this connection was opened by uid {NOBODY} (pid {parent}); "
                                                     f"a message from pid {child} on it is refused"), []

    assert as_uid(NOBODY, handed)[0] == {"ok": 0}

    def confined_after() -> tuple[Any, list[int]]:
        r, w = os.pipe()
        with AgentClient.connect(sock) as c:
            c.hello()
            install_allow_all_filter(no_new_privs=True)
            try:
                c.start("agent-confined-after", ["true"], cwd="/", env={}, stdout=w, stderr=w)
                return "accepted", []
            except errors.CedanaError as e:
                return str(e), []

    got = as_uid(NOBODY, confined_after)[0]["ok"]
    assert got.startswith(f"uid {NOBODY} (pid ") and "runs under a seccomp filter; its workload would not" in got, got

    def a_thread_confined() -> tuple[Any, list[int]]:  # seccomp is a thread's own: the main one stays free (R2)
        import threading

        r, w = os.pipe()
        said: list[str] = []
        with AgentClient.connect(sock) as c:
            c.hello()

            def confined() -> None:
                install_allow_all_filter(no_new_privs=True)  # this thread only
                try:
                    c.start("agent-thread-confined", ["true"], cwd="/", env={}, stdout=w, stderr=w)
                    said.append("accepted")
                except errors.CedanaError as e:
                    said.append(str(e))

            t = threading.Thread(target=confined)
            t.start()
            t.join()
        return said[0], []

    got = as_uid(NOBODY, a_thread_confined)[0]["ok"]
    assert "runs under a seccomp filter; its workload would not" in got, got


def test_one_uid_can_neither_hold_every_connection_nor_break_the_agent_with_garbage(agent):
    sock, audit = agent

    def flood() -> tuple[Any, list[int]]:
        conns = [AgentClient.connect(sock) for _ in range(16)]  # idle, at the per-uid cap
        refused = ""
        try:
            AgentClient.connect(sock).hello()
        except errors.CedanaError as e:
            refused = str(e)
        for c in conns[:8]:
            c.close()
        deadline = time.monotonic() + 10
        while True:  # until the agent has seen them go (its connection threads end on their own time)
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            raw.connect(str(sock))
            raw.send(json.dumps({"op": "hello", "id": 1}).encode())
            if json.loads(raw.recv(1 << 16)).get("ok"):
                break
            raw.close()
            assert time.monotonic() < deadline, "the closed connections were never released"
            time.sleep(0.1)
        raw.send(b"[" * 60000)  # nested past the JSON parser's depth
        garbage = json.loads(raw.recv(1 << 16))
        raw.send(json.dumps({"op": "hello", "id": 2, "wid": "x" * 60000}).encode())
        after = json.loads(raw.recv(1 << 16))
        return {"refused": refused, "garbage": garbage, "after": after["ok"]}, []

    msg, _ = as_uid(NOBODY, flood)
    assert "ok" in msg, msg
    got = msg["ok"]
    assert "(pid " in got["refused"], got["refused"]
    assert got["refused"] == (f"uid {NOBODY} (pid {got['refused'].split('(pid ')[1].split(')')[0]}) already holds 16 "
                              "connections to the agent, at most 16. Close idle connections, or try again later")
    assert got["garbage"]["error"] == "Refused" and "not JSON" in got["garbage"]["line"]
    assert got["after"] is True  # the same connection still served
    other, _ = as_uid(OTHER, lambda: (AgentClient.connect(sock).hello()["you"], []))
    assert other["ok"] == {"uid": OTHER, "gid": OTHER}  # the agent is fine for everyone else
    rows = [json.loads(line) for line in audit.read_text().splitlines()]
    assert max(len(json.dumps(r)) for r in rows) < 1000 and {r["wid"] for r in rows} <= {None, "?"}


def test_garbage_on_the_lifeline_ends_nothing(agent):
    sock, _ = agent
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, ["sh", "-c", "sleep 0.5; echo done"], out_w))
    os.close(out_w)
    lifeline = socket.socket(fileno=fds[0])
    assert _event(lifeline)["ev"] == "started"
    lifeline.send(b"[" * 60000)
    lifeline.send(b"not json")
    assert _event(lifeline) == {"ev": "exit", "code": 0, "cause": "exited", "signal": None}
    assert _read_all(out_r) == "done\n"


def test_a_start_that_hangs_before_its_command_runs_is_killed_and_said_in_one_line(agent, tmp_path):
    """Its cwd is on a FUSE mount that never answers (made here the way fusermount3 makes one for a
    user): the shim gives up after its start time, kills the half-started child, and nothing is left."""
    import ctypes

    mnt = tmp_path / "hung"
    mnt.mkdir()
    fuse = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fuse},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    assert ctypes.CDLL(None, use_errno=True).mount(b"hung", str(mnt).encode(), b"fuse", 0, opts) == 0
    try:
        out_r, out_w = os.pipe()
        t0 = time.monotonic()
        with AgentClient.connect(agent[0]) as c, pytest.raises(errors.Refused) as e:
            c.start("agent-hung", ["true"], cwd=str(mnt / "x"), env={}, stdout=out_w, stderr=out_w)
        took = time.monotonic() - t0
        os.close(out_w)
        os.close(out_r)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        os.close(fuse)
    assert str(e.value).startswith("cannot start the workload as uid 0 (pid ") and str(e.value).endswith(
        "it did not start within 8 s (a cwd or a command on a mount that does not answer?)"), str(e.value)
    assert took < 15
    # nothing of that start is left: the agent (found by its socket, unique to this test) has no child
    agent_pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).endswith(
        f"--socket\0{agent[0]}\0--audit\0{agent[1]}\0"))
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    assert children == [], [_cmdline(int(c)) for c in children]


# -- the second review's findings (review49-agent-2.md) ------------------------------------------------


_KEYRING_ID = ("/usr/bin/python3 -c 'import ctypes; print(ctypes.CDLL(None).syscall(250, 0, -3, 0))'")  # x86_64


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe names x86_64's keyctl number")
def test_every_workload_has_a_session_keyring_of_its_own(agent):
    import ctypes

    sock, _ = agent
    agents = ctypes.CDLL(None).syscall(250, 0, -3, 0)  # the agent inherited ours (KEYCTL_GET_KEYRING_ID, @s)
    ids = [_start_as(sock, uid, ["sh", "-c", _KEYRING_ID])[1].strip() for uid in (NOBODY, OTHER, 0)]
    assert all(i.isdigit() for i in ids) and len(set(ids)) == 3 and str(agents) not in ids, (agents, ids)


def test_a_caller_s_cgroup_named_to_fool_a_line_split_is_still_its_workload_s(agent):
    sock, _ = agent
    cgroup = Path(f"/sys/fs/cgroup/pids/cedana-cr-{os.getpid()}\r0::")  # "\r" ends a line for str.splitlines
    cgroup.mkdir()
    try:
        msg, out = _start_as(sock, NOBODY, ["sh", "-c", "grep pids /proc/self/cgroup; cat /proc/self/cgroup | wc -l"],
                             prepare=lambda: (cgroup / "cgroup.procs").write_text("0"))
    finally:
        time.sleep(0.2)
        cgroup.rmdir()
    assert msg.get("ok", {}).get("end", {}).get("code") == 0, (msg, out)
    assert out.split("\n")[0].endswith(f":pids:/cedana-cr-{os.getpid()}\r0::"), repr(out)


def test_a_filtered_caller_and_a_root_caller_with_fewer_capabilities_are_refused(agent):
    import ctypes

    sock, _ = agent

    # installed as root, without no_new_privs, as a hardened unit has it
    filtered, _ = _start_as(sock, NOBODY, ["true"], prepare=install_allow_all_filter)
    assert filtered["error"] == "Refused" and "runs under a seccomp filter; its workload would not" in filtered["line"]

    def fewer_caps() -> None:  # a root service with its capabilities dropped from the permitted set
        libc = ctypes.CDLL(None)
        hdr, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
        assert libc.capget(hdr, data) == 0
        data[0] &= ~(1 << 21)  # CAP_SYS_ADMIN out of effective and permitted
        data[1] &= ~(1 << 21)
        assert libc.capset(hdr, data) == 0

    root, _ = _start_as(sock, 0, ["true"], prepare=fewer_caps)
    assert root["error"] == "Refused" and "is root with fewer capabilities than the agent" in root["line"]


def test_a_confined_root_caller_neither_lists_nor_stops_nor_kills_another_uid_s_workload(agent):
    """Root the agent refuses to start for (here: CAP_SYS_ADMIN out of its bounding set, as a sandboxed
    service has it) is uid 0 and no more: nobody's workload is not in its list and not its to stop,
    kill or ask about (review 49, F3); root the agent trusts lists it."""
    sock, _ = agent
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, ["sleep", "30"], out_w, checkpoint_id="agent-confined"))
    os.close(out_w)
    os.close(out_r)
    assert "ok" in msg, msg
    wid = msg["ok"]["wid"]

    def bounded() -> None:
        import ctypes

        ctypes.CDLL(None).prctl(24, 21, 0, 0, 0)  # PR_CAPBSET_DROP CAP_SYS_ADMIN

    def ask() -> tuple[Any, list[int]]:
        out: dict[str, Any] = {}
        with AgentClient.connect(sock) as c:
            out["list"] = [w["wid"] for w in c.list()]
            for op in ("status", "stop", "kill"):
                try:
                    c.request(op, wid=wid, handle="")
                    out[op] = "accepted"
                except errors.CedanaError as e:
                    out[op] = str(e)
        return out, []

    got, _ = as_uid(0, ask, prepare=bounded)
    assert got["ok"]["list"] == [], got
    for op in ("status", "stop", "kill"):
        assert got["ok"][op].startswith(f"workload {wid} belongs to uid {NOBODY}, not to uid 0 (pid "), got
    with socket.socket(fileno=fds[0]) as lifeline, AgentClient.connect(sock) as c:  # still running, and root sees it
        assert [w["state"] for w in c.list() if w["wid"] == wid] == ["running"]
        c.kill(wid, "")
        assert [_event(lifeline, timeout=30)["ev"] for _ in range(2)] == ["started", "exit"]


def struct_pack_allow() -> bytes:
    import struct

    return struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF_RET|BPF_K SECCOMP_RET_ALLOW


def install_allow_all_filter(no_new_privs: bool = False) -> None:
    """An allow-all seccomp filter on the calling thread (a filter all the same: Seccomp 2). Without
    CAP_SYS_ADMIN a filter needs ``no_new_privs`` first (PR_SET_NO_NEW_PRIVS)."""
    import ctypes

    raw = ctypes.create_string_buffer(struct_pack_allow())

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None)
    if no_new_privs:
        assert libc.prctl(38, 1, 0, 0, 0) == 0
    assert libc.prctl(22, 2, ctypes.byref(Prog(1, ctypes.addressof(raw))), 0, 0) == 0  # SECCOMP_MODE_FILTER


def test_an_audit_log_that_cannot_be_written_refuses_starts_and_leaves_nothing_running(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    sock = folder / "agent.sock"
    proc = start_agent(sock, cli_env(tmp_path, "node-a", "work"), tmp_path / "agent.log", "--audit",
                       str(small / "audit.jsonl"))
    try:
        (small / "filler").write_bytes(b"x" * (64 << 10))  # the disk under the audit log is full
        out_r, out_w = os.pipe()
        with AgentClient.connect(sock) as c:
            c.hello()  # its row cannot be written: from now on no start
            with pytest.raises(errors.Refused, match=r"^the agent's audit log .* cannot be written \(No space left on "
                                                     r"device\); no workload starts until it can\. Free its disk$"):
                c.start("agent-audit", ["sleep", "30"], cwd="/", env={}, stdout=out_w, stderr=out_w)
            (small / "filler").unlink()
            c.hello()  # written again
            s = c.start("agent-audit", ["true"], cwd="/", env={}, stdout=out_w, stderr=out_w,
                        settings={"heartbeat_seconds": 0})
            assert _event(s.lifeline)["ev"] == "started"
        os.close(out_w)
        assert _read_all(out_r) == ""  # the refused sleep never ran (nothing holds the pipe)
    finally:
        proc.kill()
        proc.wait()
        remove_agent_folder(folder)
        subprocess.run(["umount", str(small)], check=False)


def test_refusals_are_written_one_by_one_only_so_often_and_garbage_ends_a_connection(agent):
    sock, audit = agent

    def garbage() -> tuple[Any, list[int]]:
        closed = 0
        for _ in range(8):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            raw.connect(str(sock))
            for _ in range(12):
                try:
                    raw.send(b"not json")
                    if not raw.recv(1 << 16):
                        closed += 1
                        break
                except OSError:
                    closed += 1
                    break
            raw.close()
        return {"closed": closed}, []

    msg, _ = as_uid(NOBODY, garbage)
    assert msg["ok"]["closed"] == 8  # each after its 10th message that was not a request
    rows = [json.loads(line) for line in audit.read_text().splitlines()]
    assert sum(r["decision"].startswith("refused") for r in rows if r.get("uid") == NOBODY) == 50


def test_many_commands_that_end_at_once_all_start(agent):
    sock, _ = agent
    with AgentClient.connect(sock) as c:
        for _ in range(20):
            out_r, out_w = os.pipe()
            s = c.start("agent-quick", ["true"], cwd="/", env={}, stdout=out_w, stderr=out_w,
                        settings={"heartbeat_seconds": 0})
            os.close(out_w)
            assert _event(s.lifeline)["ev"] == "started"
            assert _event(s.lifeline)["code"] == 0
            s.lifeline.close()
            os.close(out_r)


def test_a_shim_ignores_what_a_service_manager_s_stop_sends_and_still_ends_with_its_caller(agent):
    sock, _ = agent
    out_r, out_w = os.pipe()
    with AgentClient.connect(sock) as c:
        s = c.start("agent-term", ["sleep", "60"], cwd="/", env={}, stdout=out_w, stderr=out_w,
                    settings={"heartbeat_seconds": 0})
    os.close(out_w)
    with open(f"/proc/{s.pid}/stat") as f:
        shim_pid = int(f.read().rsplit(")", 1)[1].split()[1])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(shim_pid, sig)
    time.sleep(0.3)
    assert os.path.exists(f"/proc/{shim_pid}") and os.path.exists(f"/proc/{s.pid}")
    s.lifeline.close()
    assert _read_all(out_r) == ""  # the tree ended with its caller


def test_a_resumed_tree_runs_in_its_retry_caller_s_cgroup_not_the_dumped_one(agent, tmp_path):
    sock, _ = agent
    retry_cgroup = Path(f"/sys/fs/cgroup/pids/cedana-retry-{os.getpid()}")
    retry_cgroup.mkdir()
    counter = ["sh", "-c", "i=0; while [ $i -lt 400 ]; do i=$((i+1)); echo $i; sleep 0.1; done"]
    out_r, out_w = os.pipe()
    try:
        with AgentClient.connect(sock) as c:
            first = c.start("agent-cg", counter, cwd="/", env={"PATH": "/usr/bin:/bin"}, stdout=out_w, stderr=out_w,
                            settings={"heartbeat_seconds": 0.3})
            deadline = time.monotonic() + 60
            while not manifests(tmp_path / "store", "agent-cg"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            first.lifeline.close()  # try 1's caller is gone
            while c.status(first.wid, first.handle)["state"] != "ended":
                time.sleep(0.05)

        def retry() -> tuple[Any, list[int]]:  # try 2's caller, root, in another cgroup
            (retry_cgroup / "cgroup.procs").write_text("0")
            with AgentClient.connect(sock) as c2:
                s = c2.start("agent-cg", counter, cwd="/", env={"PATH": "/usr/bin:/bin"}, stdout=out_w,
                             stderr=out_w, settings={"heartbeat_seconds": 0}, resume=True, try_number=1)
                return {"pid": s.pid, "seq": s.restored_seq}, [s.lifeline.detach()]

        msg, fds = as_uid(0, retry)
        os.close(out_w)
        assert msg["ok"]["seq"] is not None, msg
        pids_line = [ln for ln in Path(f"/proc/{msg['ok']['pid']}/cgroup").read_text().splitlines() if ":pids:" in ln]
        os.close(fds[0])  # the retry's caller is gone too
        assert _read_all(out_r)
        assert pids_line == [pids_line[0].split(":")[0] + f":pids:/cedana-retry-{os.getpid()}"], pids_line
    finally:
        time.sleep(0.3)
        retry_cgroup.rmdir()


def test_a_second_agent_on_the_same_socket_is_refused_and_the_first_keeps_serving(agent, tmp_path):
    sock, _ = agent
    second = subprocess.run([sys.executable, "-m", "cedana_airflow", "agent", "--socket", str(sock)],
                            env=cli_env(tmp_path, "node-a", "work2"), capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and second.stderr.strip().splitlines()[-1] == (
        f"cedana agent: another agent answers at {sock}. Stop it first, or give this one another --socket")
    with AgentClient.connect(sock) as c:
        assert c.hello()["node"] == "node-a"


def test_a_non_root_caller_s_tree_is_checkpointed_and_resumed_as_that_caller_with_nothing_more(agent, tmp_path):
    """A caller as uid nobody: its tree (in user, mount and PID namespaces of its own) is checkpointed on
    its heartbeat; try 1's caller dies; try 2 resumes the count from the newest checkpoint, still as
    nobody with no capability, and on to its end."""
    sock, _ = agent
    counter = ["sh", "-c", "i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo $i; sleep 0.1; done; "
                           "grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs)' /proc/self/status"]
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, counter, out_w, checkpoint_id="agent-nobody",
                                     settings={"heartbeat_seconds": 0.5}, resume=True))
    os.close(out_w)
    assert "ok" in msg, msg
    assert msg["ok"]["hello"]["protected"] is True
    lifeline = socket.socket(fileno=fds[0])
    deadline = time.monotonic() + 60
    while len(manifests(tmp_path / "store", "agent-nobody")) < 2:
        assert time.monotonic() < deadline, "no heartbeat checkpoint of uid nobody's tree within 60 s"
        time.sleep(0.1)
    lifeline.close()  # try 1's caller is gone: so is its tree
    before = _read_all(out_r).split()
    latest = manifests(tmp_path / "store", "agent-nobody")[-1]["seq"]

    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, counter, out_w, checkpoint_id="agent-nobody",
                                     settings={"heartbeat_seconds": 0.5}, resume=True, try_number=1))
    os.close(out_w)
    assert "ok" in msg, msg
    lifeline = socket.socket(fileno=fds[0])
    assert _event(lifeline)["ev"] == "started"
    assert _event(lifeline, timeout=60) == {"ev": "exit", "code": 0, "cause": "exited", "signal": None}
    after = _read_all(out_r).split("\n")
    counted = [x for x in after if x.isdigit()]
    assert before and counted and int(counted[0]) > 1, (before, after)  # resumed, not started over
    assert int(counted[0]) <= int(before[-1]) + 1
    assert counted == [str(i) for i in range(int(counted[0]), 41)]
    status = dict(x.split(":\t", 1) for x in after if ":\t" in x)
    assert status["Uid"].split() == [str(NOBODY)] * 4 and status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    assert manifests(tmp_path / "store", "agent-nobody")[-1]["seq"] >= latest


def _checkpointed(sock: Path, store: Path, uid: int, checkpoint_id: str,
                  script: str = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done") -> None:
    """A count run as ``uid`` until its first checkpoint; then its caller is gone (and its tree with it)."""
    counter = ["sh", "-c", script]
    out_r, out_w = pipe_of(uid)
    msg, fds = as_uid(uid, _start(sock, counter, out_w, checkpoint_id=checkpoint_id,
                                  settings={"heartbeat_seconds": 0.3}))
    os.close(out_w)
    assert "ok" in msg, msg
    deadline = time.monotonic() + 60
    while not manifests(store, checkpoint_id):
        assert time.monotonic() < deadline, f"no checkpoint of uid {uid}'s tree within 60 s"
        time.sleep(0.1)
    socket.socket(fileno=fds[0]).close()
    os.close(out_r)


def _resumed_by(sock: Path, uid: int, checkpoint_id: str, script: str = "id -u") -> str:
    """What a retry as ``uid`` printed, to its end."""
    out_r, out_w = pipe_of(uid)
    msg, fds = as_uid(uid, _start(sock, ["sh", "-c", script], out_w, checkpoint_id=checkpoint_id, resume=True,
                                  try_number=1))
    os.close(out_w)
    assert "ok" in msg, msg
    with socket.socket(fileno=fds[0]) as lifeline:  # held until it ends: closing it would end it
        assert _event(lifeline)["ev"] == "started"
        assert _event(lifeline)["ev"] == "exit"
    return _read_all(out_r)


def _signed_for(store: Path, checkpoint_id: str, uid: int) -> None:
    """Re-sign the newest checkpoint of ``checkpoint_id`` with the node key as if the agent had taken it for
    ``uid`` (what an agent with a bug, or the key's holder, could write): the tree in it is unchanged."""
    from cedana_airflow.format.manifest import CallerInfo, parse_manifest
    from cedana_airflow.format.signing import sign

    path = max(p for p in (store / checkpoint_id).iterdir() if p.name.isdigit()) / "manifest.json"
    m = parse_manifest(path.read_text())
    m = m.model_copy(update={"caller": CallerInfo(uid=uid), "format_version": 4, "signature": None,
                             "writer": m.writer or "cedana-airflow test"})
    path.write_bytes(sign(m, node_key_bytes()).to_json())


def _refused(sock: Path, uid: int, checkpoint_id: str) -> str:
    """A retry as ``uid`` of another uid's ID: the start's one-line refusal."""
    out_r, out_w = pipe_of(uid)
    msg, _ = as_uid(uid, _start(sock, ["sh", "-c", "id -u"], out_w, checkpoint_id=checkpoint_id, resume=True,
                                try_number=7, settings={"delete_on_success": True}))
    os.close(out_w)
    assert _read_all(out_r) == "", msg  # nothing ran
    assert "error" in msg, msg
    return f"{msg['error']}: {msg['line']}"


def test_no_caller_uses_another_uid_s_checkpoint_id_nor_gets_a_tree_restored_with_more_than_it_has(agent, tmp_path):
    """An ID is its caller's uid's (the caller block the agent signs into each manifest): a retry of root's
    ID, or of nobody's, by another uid is refused before anything (its lease, a fetch, a deletion), in one
    line. And where a manifest says the caller but its images hold more (re-signed here with the node
    key), the images' ids and user namespace are checked against the caller before CRIU runs: it starts
    fresh as its caller, and nothing of the checkpoint is put back."""
    sock, _ = agent
    store = tmp_path / "store"
    root_file = tmp_path / "root-file"  # root's tree writes it: the checkpoint holds a copy to put back
    _checkpointed(sock, store, 0, "agent-root-tree", f"exec 3>>{root_file}; i=0; while :; do i=$((i+1)); "
                                                     "echo $i >&3; sleep 0.1; done")
    time.sleep(0.3)  # the tree is gone with its caller
    _checkpointed(sock, store, NOBODY, "agent-nobody-tree")
    ours = {cid: [m["seq"] for m in manifests(store, cid)] for cid in ("agent-root-tree", "agent-nobody-tree")}
    assert manifests(store, "agent-nobody-tree")[-1]["caller"] == {"uid": NOBODY}
    assert _refused(sock, NOBODY, "agent-root-tree") == (
        "ConfigError: checkpoint ID agent-root-tree (seq {}) may be neither written nor restored by this task: it "
        "belongs to another uid, not to uid {}; give this task its own checkpoint_id".format(ours["agent-root-tree"][-1], NOBODY))
    deadline = time.monotonic() + 20  # while nobody's tree still runs, its ID is refused as in use; then by its manifest
    while (line := _refused(sock, OTHER, "agent-nobody-tree")).startswith("Refused: checkpoint ID agent-nobody-tree is "
                                                                           "in use by another uid's workload"):
        assert time.monotonic() < deadline, line
        time.sleep(0.2)
    assert line.startswith("ConfigError: checkpoint ID agent-nobody-tree (seq "), line
    time.sleep(0.5)
    assert {cid: [m["seq"] for m in manifests(store, cid)] for cid in ours} == ours  # nothing deleted or added

    root_file.write_text("root's own, written after the checkpoint\n")
    before = os.stat(root_file)
    _signed_for(store, "agent-root-tree", NOBODY)
    assert _resumed_by(sock, NOBODY, "agent-root-tree") == f"{NOBODY}\n"  # started fresh, as nobody
    after = os.stat(root_file)  # nothing of root's checkpoint was put back, not even for a moment
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (before.st_ino, before.st_mtime_ns, before.st_ctime_ns)
    assert root_file.read_text() == "root's own, written after the checkpoint\n"
    _signed_for(store, "agent-nobody-tree", OTHER)
    assert _resumed_by(sock, OTHER, "agent-nobody-tree") == f"{OTHER}\n"
    log = (tmp_path / "agent.log").read_text()
    assert (f"checkpoint agent-root-tree seq={ours['agent-root-tree'][-1]} is refused for uid {NOBODY}: its tree is "
            "not in a user namespace of its own") in log
    assert f"checkpoint agent-nobody-tree seq={ours['agent-nobody-tree'][-1]} is refused for uid {OTHER}: its user namespace maps ids" in log
    # a new ID, before its first checkpoint: another uid cannot start it beside its running owner (its lease)
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, ["sleep", "30"], out_w, checkpoint_id="agent-busy",
                                     settings={"heartbeat_seconds": 60}))
    os.close(out_w)
    folder_b = Path(f"/run/cedana-test-agent-b-{os.getpid()}")
    agent_b = start_agent(folder_b / "agent.sock", cli_env(tmp_path, "node-b", "work-b"), tmp_path / "agent-b.log")
    try:
        with socket.socket(fileno=fds[0]):
            assert _refused(sock, OTHER, "agent-busy") == ("Refused: checkpoint ID agent-busy is in use by another "
                                                           "uid's workload on this node. Give this task its own checkpoint_id")
            # on another node, its newer try cannot fence the owner's writer lease either (the lease names the uid)
            line = _refused(folder_b / "agent.sock", OTHER, "agent-busy")
            assert line.startswith("WriterLeaseHeld: ") and f"uid={NOBODY}" in line, line
    finally:
        agent_b.terminate()
        agent_b.wait(10)
        remove_agent_folder(folder_b)
    os.close(out_r)


def test_a_retry_that_starts_fresh_says_why_in_its_caller_s_log(agent, tmp_path):
    """Through the agent, a retry that restores nothing says why to its caller (the start's reply), as the
    in-process route's log does: nothing stored yet, or a checkpoint past its license's lease (the
    task's `lease`, a task setting)."""
    sock, _ = agent
    env = cli_env(tmp_path, "node-a", "work", CEDANA_AGENT="require", CEDANA_AGENT_SOCKET=str(sock))
    first = cli("run", "--id", "agent-fresh", "--resume", "--try-number", "2", "--", "true", env=env, timeout=60)
    assert first.returncode == 0 and ("cedana: no checkpoint to resume checkpoint_id=agent-fresh; starting fresh "
                                      "(through the node agent)") in first.stderr, first.stderr
    _checkpointed(sock, tmp_path / "store", 0, "agent-lease")
    time.sleep(1.2)
    out_r, out_w = os.pipe()
    msg, fds = _start(sock, ["sh", "-c", "echo fresh"], out_w, checkpoint_id="agent-lease", resume=True,
                      try_number=2, settings={"lease_seconds": 1})()
    os.close(out_w)
    with socket.socket(fileno=fds[0]) as lifeline:
        assert _event(lifeline)["ev"] == "started" and _event(lifeline)["ev"] == "exit"
    assert _read_all(out_r) == "fresh\n"
    assert msg["restored_seq"] is None and msg["fresh"] == (
        "no checkpoint could be restored: the newest is older than the lease of its license (1 s, lease_seconds) "
        "and was not renewed"), msg


def test_a_non_root_caller_s_cooperative_checkpoints_are_taken_and_resumed_as_that_caller(agent, tmp_path):
    """``mode = cooperative`` through the agent (0.8.4): the workload, as nobody, writes its state when asked
    into a folder of its own; the agent stores it signed for nobody; the caller dies with its tree; a retry
    as nobody gets it back, given to nobody, and the command resumes where it was and ends with an
    uninterrupted run's total. A link the workload leaves in its state is refused, and nothing of that
    request is kept."""
    sock, _ = agent
    store = tmp_path / "store"
    argv = [str(WORKER_ENV / "bin" / "python"), str(REPO / "tests" / "workloads" / "coop_counter.py"), "--steps", "300",
            "--step-seconds", "0.05"]
    settings = {"mode": "cooperative", "heartbeat_seconds": 0.3, "cooperative_signal": "none"}
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, argv, out_w, checkpoint_id="coop-nobody", settings=settings))
    os.close(out_w)
    assert "ok" in msg, msg
    deadline = time.monotonic() + 60
    while len(manifests(store, "coop-nobody")) < 2:
        assert time.monotonic() < deadline, "no two cooperative checkpoints within 60 s"
        time.sleep(0.1)
    socket.socket(fileno=fds[0]).close()  # the caller is gone: its tree with it
    first = _read_all(out_r)
    m = manifests(store, "coop-nobody")[-1]
    assert m["engine"] == "cooperative" and m["caller"]["uid"] == NOBODY, m
    assert not list((sock.parent / "coop").glob("*/state-*")), "a request's folder outlived its run"
    # root never restores it: its command would run nobody's doing as root (format/trust.py)
    out_r, out_w = os.pipe()
    msg, fds = as_uid(0, _start(sock, ["sh", "-c", "id -u"], out_w, checkpoint_id="coop-nobody", resume=True,
                                try_number=1))
    os.close(out_w)
    assert "ok" in msg and "written by uid 65534's workload, whose command runs only as uid 65534" in (
        msg["ok"]["fresh"] or ""), msg
    with socket.socket(fileno=fds[0]) as lifeline:
        assert _event(lifeline)["ev"] == "started" and _event(lifeline)["ev"] == "exit"
    assert _read_all(out_r) == "0\n"  # root's own command, started fresh

    deadline = time.monotonic() + 10
    while True:  # root's run is over once the agent has seen its end, a moment after its caller did
        out_r, out_w = pipe_of(NOBODY)
        msg, fds = as_uid(NOBODY, _start(sock, argv, out_w, checkpoint_id="coop-nobody", settings=settings,
                                         resume=True, try_number=2))
        os.close(out_w)
        if "in use by another uid" not in msg.get("line", "") or time.monotonic() > deadline:
            break
        os.close(out_r)
        time.sleep(0.2)
    assert "ok" in msg and msg["ok"]["restored_seq"] is not None, msg
    with socket.socket(fileno=fds[0]) as lifeline:
        assert _event(lifeline)["ev"] == "started"
        assert _event(lifeline, 60)["ev"] == "exit"
    second = _read_all(out_r)
    resumed = int(second.split("rank 0 resumed at step ")[1].split()[0])
    assert 0 < resumed <= int(first.split("step ")[-1].split()[0]), (first[-200:], second[:200])
    import random
    assert second.strip().endswith(f"done total={sum(random.Random(s).randrange(1000) for s in range(300))}"), second[-300:]


def test_a_cooperative_state_is_copied_and_removed_as_its_caller_never_by_root(tmp_path):
    """What a workload that is not root wrote is copied out by a helper running as its user (run/state_copy.py):
    regular files and folders only (a link or a FIFO refuses the state, without waiting), only what that user
    may read, bounded in bytes before a byte is read; and its folders are removed as that user, so a link in
    them is unlinked, never followed."""
    from cedana_airflow.run.state_copy import copy_as, remove_as

    top = Path(tempfile.mkdtemp(prefix="cedana-state-copy-"))  # /tmp's: nobody may reach it (tmp_path is root's)
    top.chmod(0o755)
    me = (NOBODY, NOBODY, ())
    try:
        def state(name: str, **files: str) -> Path:
            d = top / name
            (d / "sub").mkdir(parents=True)
            (d / "rank-0").write_text("weights")
            (d / "sub" / "opt").write_text("moments")
            (d / "COMPLETE").write_text("")
            (d / ".done-0").write_text("")  # two ranks' markers: counted, not copied
            (d / ".done-1").write_text("")
            for rel, what in files.items():
                p = d / rel
                if what == "link":
                    p.symlink_to("/etc/shadow")
                elif what == "fifo":
                    os.mkfifo(p)
                elif what == "root-only":
                    p.write_text("root's")
                    p.chmod(0o600)
                    continue  # stays root's
                elif what == "sparse":
                    with open(p, "wb") as f:
                        f.truncate(1 << 40)
            for p in [d, *d.rglob("*")]:
                if p.name != "secret":
                    os.lchown(p, NOBODY, NOBODY)
            return d

        files, ranks = copy_as(me, state("good"), top / "out-good", max_bytes=1 << 20, timeout=60)
        assert sorted((rel, p.read_text(), mode) for rel, p, mode in files) == [
            ("rank-0", "weights", 0o644), ("sub/opt", "moments", 0o644)]
        assert ranks == 2 and all(p.stat().st_uid == 0 for _, p, _ in files)  # our copies, not the caller's files
        for name, kind, says in (("link", "link", "a symlink, 'sub/x'"), ("fifo", "fifo", "a special file, 'sub/x'"),
                                 ("secret", "root-only", "Permission denied"),
                                 ("sparse", "sparse", f"more than {1 << 20} bytes")):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=re.escape(says)):
                copy_as(me, state(name, **{"sub/x" if kind != "root-only" else "secret": kind}), top / f"out-{name}",
                        max_bytes=1 << 20, timeout=60)
            assert time.monotonic() - t0 < 30, name  # refused, not waited on

        deep = state("deep")
        far = deep.joinpath(*["d" * 200] * 6)
        far.mkdir(parents=True)
        (far / "f").write_text("x")
        for p in deep.rglob("*"):
            os.lchown(p, NOBODY, NOBODY)
        with pytest.raises(ValueError, match="a path longer than 1024 bytes"):
            copy_as(me, deep, top / "out-deep", max_bytes=1 << 20, timeout=60)
        assert not (top / "out-deep").exists()  # nothing of a refused state stays on the agent's disk

        victim = top / "victim"
        victim.write_text("root's file")
        d = state("removed")
        (d / "sub" / "link").symlink_to(victim)
        os.lchown(d / "sub" / "link", NOBODY, NOBODY)
        (d / "sub").chmod(0o300)  # its own folder, made unlistable to itself: still emptied, as its user
        remove_as(me, d)
        assert not d.exists() and victim.read_text() == "root's file"
    finally:
        shutil.rmtree(top)


def test_an_agent_started_after_a_killed_one_takes_up_its_workloads(tmp_path):
    """The agent is killed while uid nobody's workload heartbeats; the workload runs on. An agent started
    after it takes the workload up (agent/remembered.py): heartbeats go on into the same checkpoint ID,
    the owner's handle still works, and its stop takes the final checkpoint; the count never restarted."""
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-{tmp_path.name}")
    sock = folder / "agent.sock"
    env = cli_env(tmp_path, "node-a", "work")

    def agent(name: str) -> subprocess.Popen[bytes]:
        return start_agent(sock, env, tmp_path / f"{name}.log")

    def checkpoints() -> int:
        return len(manifests(tmp_path / "store", "agent-takeup"))

    first = agent("first")
    second = None
    try:
        counter = ["sh", "-c", "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo $i; sleep 0.1; done"]
        out_r, out_w = pipe_of(NOBODY)
        msg, fds = as_uid(NOBODY, _start(sock, counter, out_w, checkpoint_id="agent-takeup",
                                         settings={"heartbeat_seconds": 0.3}, resume=True))
        os.close(out_w)
        assert "ok" in msg, msg
        lifeline = socket.socket(fileno=fds[0])
        wid, handle = msg["ok"]["wid"], msg["ok"]["handle"]
        deadline = time.monotonic() + 60
        while checkpoints() < 1:
            assert time.monotonic() < deadline, "no heartbeat checkpoint within 60 s"
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGKILL)  # the agent, not its shims (their own sessions)
        first.wait()
        before = checkpoints()

        second = agent("second")
        assert f"agent took up {wid} of uid {NOBODY}" in (tmp_path / "second.log").read_text()
        deadline = time.monotonic() + 60
        while checkpoints() < before + 2:
            assert time.monotonic() < deadline, "the agent started after did not go on checkpointing"
            time.sleep(0.1)

        def stop() -> tuple[Any, list[int]]:
            with AgentClient.connect(sock) as c:
                return c.stop(wid, handle), []

        msg, _ = as_uid(NOBODY, stop)
        status = msg["ok"]
        assert status["state"] == "ended" and "error" not in status, status
        assert status["fresh"] == "no checkpoint to resume"  # what the first agent knew, the second says too
        assert status["result"]["final_checkpoint_seq"] == manifests(tmp_path / "store", "agent-takeup")[-1]["seq"]
        assert _event(lifeline)["ev"] == "started"
        assert _event(lifeline)["ev"] == "exit"
        out = _read_all(out_r).split()
        assert out == [str(i) for i in range(1, len(out) + 1)] and len(out) > 5  # one count, never restarted
        assert not list((folder / "runs").glob("w-*"))  # nothing left to take up
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        remove_agent_folder(folder)
        for name in ("first", "second"):
            print((tmp_path / f"{name}.log").read_text()[-3000:])


def test_doctor_says_whether_an_agent_answers_which_and_for_whom(agent, tmp_path):
    sock, _ = agent
    env = cli_env(tmp_path, "node-a", "work", CEDANA_AGENT_SOCKET=str(sock))
    lines = cli("doctor", env=env).stdout.splitlines()
    assert f"OK    agent: {sock}: agent {__version__} on node node-a; it checkpoints this uid's (0) workloads" in lines
    env["CEDANA_AGENT_SOCKET"] = str(tmp_path / "none.sock")
    lines = cli("doctor", env=env).stdout.splitlines()
    assert any(x.startswith(f"SKIP  agent: no agent answers at {tmp_path / 'none.sock'}; nothing needs one yet -> fix: "
                            "start `cedana-airflow agent`") for x in lines), lines


@pytest.mark.parametrize("within", ["the root", "a mount"])
def test_a_restore_that_would_show_what_a_mount_of_this_node_hides_is_refused(agent, tmp_path, within):
    """The node mounts, since the checkpoint, a 0700 tmpfs over a folder that holds a file: a tree restored
    with no mount there would see that file (its root is the node's root file system alone, each of its
    mounts a childless copy), so that checkpoint is refused in one line and the retry starts fresh (issue
    49 reviews: H1, and N1 for a folder inside one of the tree's mounts)."""
    sock, _ = agent
    # Its own uid, and a folder only that uid may enter: other tests' trees running at the same time must
    # not meet this node's mounts (they would be refused for them too, rightly).
    uid = {"the root": 4242, "a mount": 4243}[within]
    top = uid_folder(f"cedana-test-hides-{os.getpid()}-{tmp_path.name}", uid)
    base = top / "b"
    base.mkdir()
    mounted = []
    try:
        if within == "a mount":  # a mount of the node's the tree gets, with the folder inside it
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "none", str(base)], check=True)
            mounted.append(base)
        os.chown(base, uid, uid)
        base.chmod(0o700)
        (base / "x").mkdir()
        (base / "x").chmod(0o755)
        (base / "x" / "beneath.txt").write_text("what the mount hides\n")
        (base / "x" / "beneath.txt").chmod(0o644)
        _checkpointed(sock, tmp_path / "store", uid, "agent-hides")
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "none", str(base / "x")], check=True)
        mounted.append(base / "x")
        out = _resumed_by(sock, uid, "agent-hides", f"cat {base}/x/beneath.txt 2>/dev/null; id -u")
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", str(m)], check=True)
        shutil.rmtree(top)
    assert out == f"{uid}\n"  # started fresh; the node's mount hides the file from it, as from the caller
    assert (f"this node mounts {base}/x, which the checkpoint's tree had no mount on, and the folder beneath that "
            "mount holds files the tree would see") in (tmp_path / "agent.log").read_text()


def test_a_tree_restores_where_a_mount_it_had_but_never_used_is_gone(agent, tmp_path):
    """A mount of the node's the tree got at its start (a tmpfs, suid and dev allowed) is gone from the node
    at its restore: the tree gets an empty folder in its place, with that mount's flags, and resumes
    (issue 49 review 2, N4)."""
    sock, _ = agent
    uid = 4244  # its own, and a folder only it may enter (uid_folder)
    top = uid_folder(f"cedana-test-gone-{os.getpid()}-{tmp_path.name}", uid)
    base = top / "m"
    base.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "none", str(base)], check=True)
    try:
        _checkpointed(sock, tmp_path / "store", uid, "agent-gone",
                      "i=0; while [ $i -lt 25 ]; do i=$((i+1)); echo $i; sleep 0.1; done")
    finally:
        subprocess.run(["umount", str(base)], check=True)
    try:
        latest = manifests(tmp_path / "store", "agent-gone")[-1]["seq"]
        out = _resumed_by(sock, uid, "agent-gone", "echo started over").split()
    finally:
        shutil.rmtree(top)
    log = (tmp_path / "agent.log").read_text()
    assert re.search(rf"restored seq {latest} .*checkpoint_id=agent-gone,", log), log[-3000:]
    assert out and out[0] != "started" and int(out[0]) > 1 and out[-1] == "25", out  # it went on, to its end


def test_a_tree_with_a_masked_mount_is_checkpointed_and_resumed(agent, tmp_path):
    """A node mount CRIU cannot name (a space in its path) is masked in the tree (shim.py); such a tree
    still checkpoints and resumes, its mask with it (issue 49 review 2, N3)."""
    sock, _ = agent
    uid = 4245  # its own, and a folder only it may enter (uid_folder)
    base = uid_folder(f"cedana-test-mask-{os.getpid()}-{tmp_path.name}", uid)
    (base / "team data").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "none", str(base / "team data")], check=True)
    try:
        _checkpointed(sock, tmp_path / "store", uid, "agent-mask",
                      "i=0; while [ $i -lt 25 ]; do i=$((i+1)); echo $i; sleep 0.1; done")
        latest = manifests(tmp_path / "store", "agent-mask")[-1]["seq"]
        out = _resumed_by(sock, uid, "agent-mask", "echo started over").split()
    finally:
        subprocess.run(["umount", str(base / "team data")], check=True)
        shutil.rmtree(base)
    assert re.search(rf"restored seq {latest} .*checkpoint_id=agent-mask,", (tmp_path / "agent.log").read_text())
    assert out and int(out[0]) > 1 and out[-1] == "25", out


def test_the_cli_s_run_goes_through_the_agent_and_its_stop_takes_a_final_checkpoint_a_restore_resumes(agent, tmp_path):
    """``cedana-airflow run`` as a caller (agent = require; a CLI user who is not root gets the same with
    agent = auto): SIGTERM stops it with a final checkpoint, its --json summary says so, and ``restore``
    (no command) goes on from it, to the end; a restore of an ID with nothing stored is one line, exit 1."""
    sock, _ = agent
    env = cli_env(tmp_path, "node-a", "work", CEDANA_AGENT="require", CEDANA_AGENT_SOCKET=str(sock))
    counter = ["sh", "-c", "i=0; while [ $i -lt 60 ]; do i=$((i+1)); echo $i; sleep 0.1; done"]
    first = subprocess.Popen([sys.executable, "-m", "cedana_airflow", "run", "--id", "cli-agent", "--heartbeat", "0.5",
                              "--json", "--", *counter], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(manifests(tmp_path / "store", "cli-agent")) < 2:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=60)
    *printed, last = out.decode().splitlines()
    summary = json.loads(last)
    assert first.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert summary["stopped_by"] and summary["final_checkpoint_seq"] == manifests(tmp_path / "store", "cli-agent")[-1]["seq"]
    counted = [x for x in printed if x.isdigit()]
    # the agent's own lines about the run reach its caller, as a supervisor's would (0.8.3)
    assert "cedana: node agent: checkpoint seq=1: froze " in err.decode(), err.decode()[-2000:]

    second = subprocess.run([sys.executable, "-m", "cedana_airflow", "restore", "--id", "cli-agent", "--json",
                             "--try-number", "1"], env=env, capture_output=True, timeout=120)
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    summary2 = json.loads(second.stdout.decode().splitlines()[-1])
    assert summary2["restored_from"]["seq"] == summary["final_checkpoint_seq"]
    # said once: the supervisor's own line, through the agent (0.11.0; its caller printed a second one before)
    said = [x for x in second.stderr.decode().splitlines() if "restored seq" in x]
    assert len(said) == 1 and said[0].startswith("cedana: node agent: restored seq ") and "checkpoint_id=cli-agent," in said[0], said
    went_on = [x for x in second.stdout.decode().splitlines()[:-1] if x.isdigit()]
    assert went_on[0] == str(int(counted[-1]) + 1) and went_on[-1] == "60", (counted[-3:], went_on[:3])
    again = cli("run", "--id", "cli-agent", "--json", "--", "echo", "again", env=env, timeout=60)  # no --resume
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1])["outcome"] == "fresh", again.stderr
    assert again.stdout.splitlines()[0] == "again"
    nothing = cli("restore", "--id", "cli-agent-nothing", env=env, timeout=60)
    assert nothing.returncode == 1 and nothing.stderr.strip().splitlines()[-1].startswith("CheckpointNotFound: "), nothing.stderr


def test_a_slurm_job_on_a_node_without_an_agent_runs_unprotected_and_says_why(tmp_path):
    """A job of nobody in a checkpoint partition with CEDANA_ENABLE, agent = auto (the default), and no agent
    at its node's socket (%n: the Slurm node's name): one line says why, and the command runs unchanged, as
    a job runs where CRIU is missing. From the worker environment, as a job runs our CLI."""
    worker = WORKER_ENV / "bin" / "python"
    assert worker.exists(), "no worker environment: run `make worker`"
    home = Path(tempfile.mkdtemp(prefix="cedana-job-"))
    try:
        home.chmod(0o755)
        (home / "optin.toml").write_text('[node]\npartitions = ["cedana"]\n[queue]\nqueues = ["*"]\n'
                                         '[workload]\ndags = ["*"]\n')
        sock = f"/run/cedana-none-{os.getpid()}/%n/agent.sock"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "SLURM_JOB_PARTITION": "cedana", "CEDANA_ENABLE": "1",
               "SLURMD_NODENAME": "node9", "SLURM_JOB_ID": "7", "CEDANA_OPTIN_FILE": str(home / "optin.toml"),
               "CEDANA_AGENT_SOCKET": sock, "CEDANA_STORE": f"file://{home / 'store'}"}
        r = subprocess.run([str(worker), "-m", "cedana_airflow", "slurm-job", "--id", "job-x", "--", "sh", "-c",
                            "echo ran as $(id -u)"], env=env, user=NOBODY, group=NOBODY, extra_groups=[], cwd=home,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [
            "cedana: this job runs unprotected (agent = auto, not root): no cedana agent answers at "
            f"{sock.replace('%n', 'node9')} (No such file or directory). Start `cedana-airflow agent` on this node "
            "(docs/deploying.md)", f"ran as {NOBODY}"], r.stdout
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_task_s_code_reads_neither_the_key_nor_another_uid_s_images_nor_its_memory(tmp_path):
    """What a DAG author's code can reach on a node as the worker's uid, against the node's default key
    file, a store and a work dir in folders every uid may enter (a shared mount), and the local images
    kept: another uid's workload, checkpointed there, holds a secret it read from a file of its own. The
    key, every stored and staged file, and that workload's memory and environment are each refused, and
    the secret is in nothing the code could read (root finds it in the kept images: the probe could)."""
    from cedana_airflow.keys import DEFAULT_KEY_FILE

    folder = Path(f"/run/cedana-test-open-{os.getpid()}-{tmp_path.name}")
    folder.mkdir(mode=0o755)
    try:
        secret = "s3cr3t-" + os.urandom(8).hex()
        (folder / "secret").write_text(secret)
        os.chown(folder / "secret", OTHER, OTHER)
        (folder / "secret").chmod(0o400)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
        env.update(CEDANA_STORE=f"file://{folder / 'store'}", CEDANA_WORK_DIR=str(folder / "work"),
                   CEDANA_KEEP_LOCAL="true", CEDANA_NODE="node-a", PYTHONUNBUFFERED="1")
        agent = start_agent(folder / "agent.sock", env, tmp_path / "agent.log")
        try:
            script = f"read secret < {folder / 'secret'}; i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done"
            out_r, out_w = pipe_of(OTHER)
            msg, fds = as_uid(OTHER, _start(folder / "agent.sock", ["sh", "-c", script], out_w,
                                            checkpoint_id="agent-secret", settings={"heartbeat_seconds": 0.3}))
            os.close(out_w)
            assert "ok" in msg, msg
            with socket.socket(fileno=fds[0]):
                deadline = time.monotonic() + 60
                while not manifests(folder / "store", "agent-secret"):
                    assert time.monotonic() < deadline, "no checkpoint of the secret holder within 60 s"
                    time.sleep(0.1)
                pid = msg["ok"]["pid"]
                # os.walk, not rglob: the store's folders come and go with each 0.3 s heartbeat (an emptied
                # locks/ is removed), and a file may go between listing and reading
                files = [Path(r) / n for r, _, names in os.walk(folder) for n in names
                         if n not in ("secret", "agent.sock") and (Path(r) / n).is_file()]
                assert any(secret.encode() in _read_if_there(p) for p in files)  # as root: the images hold it
                targets = [str(DEFAULT_KEY_FILE), f"/proc/{pid}/mem", f"/proc/{pid}/environ",
                           *(str(p) for p in files)]

                def probe() -> tuple[dict[str, list[str]], list[int]]:
                    opened, leaked = [], []
                    for root, _dirs, names in os.walk(folder):  # what it can list, it tries to read
                        targets.extend(os.path.join(root, n) for n in names)
                    for t in targets:
                        try:
                            with open(t, "rb") as f:
                                data = f.read(1 << 26)
                        except OSError:
                            continue
                        opened.append(t)
                        if secret.encode() in data:
                            leaked.append(t)
                    return {"opened": opened, "leaked": leaked}, []

                got, _ = as_uid(NOBODY, probe)
            os.close(out_r)
        finally:
            agent.terminate()
            agent.wait(10)
        assert DEFAULT_KEY_FILE.exists() and len(targets) > 20, targets
        assert got == {"ok": {"opened": [], "leaked": []}}, got
    finally:
        remove_agent_folder(folder)


def _listening_tree_checkpointed(sock: Path, store: Path, cid: str, parent: str) -> tuple[list[str], str]:
    """A nobody tree listening on a unix socket in a folder of its own under ``parent`` (as Python's
    multiprocessing does under /tmp: pymp-*), counting to 40; its caller gone after two checkpoints, and
    its folder removed (the retry's node has none). Its argv, and the folder."""
    code = ("import os, socket, sys, tempfile, time\n"
            f"d = tempfile.mkdtemp(prefix='pymp-cedana-test-', dir={parent!r})\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(d, 'listener')); s.listen()\n"
            "print('dir', d, flush=True)\n"
            "for i in range(1, 41):\n    print(i, flush=True); time.sleep(0.1)\n"
            "print('still listening', os.path.exists(os.path.join(d, 'listener')), flush=True)\n")
    argv = ["/usr/bin/python3", "-c", code]  # an interpreter any uid may run (the tests' lives in root's home)
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, argv, out_w, checkpoint_id=cid, settings={"heartbeat_seconds": 0.5}))
    os.close(out_w)
    assert "ok" in msg, msg
    deadline = time.monotonic() + 60
    while len(manifests(store, cid)) < 2:
        assert time.monotonic() < deadline, "no heartbeat checkpoint within 60 s"
        time.sleep(0.1)
    socket.socket(fileno=fds[0]).close()  # try 1's caller is gone, and its tree
    folder = _read_all(out_r).split("\n")[0].split()[1]
    assert folder.startswith(f"{parent}/pymp-cedana-test-"), folder
    shutil.rmtree(folder)
    return argv, folder


def test_a_non_root_tree_listening_in_a_temp_folder_resumes_on_a_node_without_that_folder(agent, tmp_path):
    """Python's multiprocessing (a PyTorch DataLoader's workers) listens on a unix socket in a folder of its
    own under /tmp (pymp-*); the retry's node has none. Through the agent, a nobody tree's restore gets
    that folder back (made by its caller's user, 0700), as a root supervisor's does, and the count goes on."""
    sock, _ = agent
    argv, folder = _listening_tree_checkpointed(sock, tmp_path / "store", "agent-pymp", "/tmp")
    out_r, out_w = pipe_of(NOBODY)
    msg, fds = as_uid(NOBODY, _start(sock, argv, out_w, checkpoint_id="agent-pymp", resume=True, try_number=1))
    os.close(out_w)
    assert "ok" in msg and msg["ok"]["restored_seq"] is not None, msg
    with socket.socket(fileno=fds[0]) as lifeline:
        assert _event(lifeline)["ev"] == "started"
        assert _event(lifeline, timeout=60)["ev"] == "exit"
    after = _read_all(out_r).split("\n")
    counted = [int(x) for x in after if x.isdigit()]
    assert counted and counted[0] > 1 and counted == list(range(counted[0], 41)), after
    assert "still listening True" in after
    st = os.stat(folder)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o700)
    shutil.rmtree(folder)


def test_no_socket_folder_is_made_for_a_non_root_tree_where_an_acl_forbids_its_user(agent, tmp_path):
    """The same tree under a folder every user may write but for an ACL that denies nobody (added after
    try 1): the agent makes nothing there (the caller could not), the retry says why and starts fresh."""
    sock, _ = agent
    parent = Path(tempfile.mkdtemp(prefix="cedana-acl-", dir="/tmp"))
    try:
        parent.chmod(0o1777)
        argv, folder = _listening_tree_checkpointed(sock, tmp_path / "store", "agent-acl", str(parent))
        subprocess.run(["setfacl", "-m", f"u:{NOBODY}:r-x", str(parent)], check=True)
        out_r, out_w = pipe_of(NOBODY)
        msg, fds = as_uid(NOBODY, _start(sock, argv, out_w, checkpoint_id="agent-acl", resume=True, try_number=1))
        os.close(out_w)
        assert "ok" in msg and msg["ok"]["restored_seq"] is None, msg
        assert f"cannot be created as the tree's user, uid {NOBODY} (Permission denied)" in msg["ok"]["fresh"], msg["ok"]["fresh"]
        socket.socket(fileno=fds[0]).close()
        os.close(out_r)
        assert not os.path.exists(folder)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_stop_signal_delivered_to_any_thread_of_the_agent_stops_it(tmp_path):
    """The kernel may hand a process's SIGTERM to any thread; Python runs the handler only in the main one,
    which waited in accept() for ever: under load the agent outlived `systemctl stop` until its next caller
    came. Sent here to a thread other than the main one (tgkill), it must stop within seconds."""
    import ctypes
    import platform

    tgkill = {"x86_64": 234, "aarch64": 131}.get(platform.machine())
    if tgkill is None:
        pytest.skip(f"tgkill's number on {platform.machine()} is not listed here")
    folder = Path(f"/run/cedana-test-agent-{os.getpid()}-sigterm")
    proc = start_agent(folder / "agent.sock", cli_env(tmp_path, "node-a", "work"), tmp_path / "agent.log")
    try:
        others = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir() if int(t.name) != proc.pid]
        assert others, "the agent has no thread but its main one"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(tgkill, proc.pid, others[0], signal.SIGTERM) == 0
        proc.wait(10)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_agent_folder(folder)


def _read_if_there(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
