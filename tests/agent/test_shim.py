"""The shim's invariants (agent/shim.py), with the real shim as the agent starts it, as root, running
workloads as ``nobody``: the workload runs as its caller and no more; it never outlives its caller; it
does not need the agent to live; its output and exit reach the caller. (A tree whose shim dies is the
agent's to kill: tests/agent/test_agent.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cedana_airflow.agent import shim
from cedana_airflow.run.no_io_uring import filter_program
from conftest import uid_folder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the shim runs as root, as the agent starts it")

NOBODY = 65534


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    ctl: socket.socket  # the agent's end
    lifeline: socket.socket  # the caller's end
    out: int  # the caller's read end of the workload's stdout
    events: list[dict[str, Any]] = field(default_factory=list)

    def event(self, sock: socket.socket, timeout: float = 10) -> dict[str, Any]:
        sock.settimeout(timeout)
        data = sock.recv(1 << 16)
        assert data, "the shim closed its end before saying anything more"
        return json.loads(data)

    def output(self) -> str:
        chunks = []
        while chunk := os.read(self.out, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks).decode()


@contextmanager
def started(argv: list[str], cwd: str = "/", uid: int = NOBODY, **more: Any) -> Iterator[Started]:
    """A workload started through a shim as the agent does it: the caller's ends are returned."""
    caller, shim_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    out_r, out_w = os.pipe()
    spec = {"uid": uid, "gid": uid, "groups": [], "argv": argv, "cwd": cwd,
            "env": {"PATH": "/usr/bin:/bin"}, "seccomp": None, **more}
    proc, ctl = shim.spawn(spec, shim_end.fileno(), out_w, out_w)
    shim_end.close()
    os.close(out_w)
    s = Started(proc, ctl, caller, out_r)
    try:
        yield s
    finally:
        for sock in (ctl, caller):
            sock.close()
        if proc.poll() is None:
            with suppress(ProcessLookupError):  # it ended between the poll and the kill
                proc.kill()
        proc.wait()
        os.close(out_r)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_workload_runs_as_its_caller_with_no_capability_and_no_way_to_gain_one():
    probe = "cat /proc/self/status; echo fds=$(ls /proc/self/fd)"
    with started(["sh", "-c", probe], cwd="/tmp", seccomp=filter_program().hex()) as s:
        assert s.event(s.lifeline)["ev"] == "started"
        out = s.output()
        status = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
        end = s.event(s.lifeline)
    assert end == {"ev": "exit", "code": 0, "cause": "exited", "signal": None}
    assert status.get("fds") is None and "fds=0 1 2 3\n" in out  # ls: stdin, stdout, stderr, its listing; nothing of the shim's
    assert status["Uid"].split() == [str(NOBODY)] * 4 and status["Gid"].split() == [str(NOBODY)] * 4
    assert status["Groups"].strip() == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, caps
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2" and status["Seccomp_filters"].strip() == "1"  # the io_uring filter


def test_the_workload_is_the_init_of_its_own_pid_namespace_and_its_output_reaches_the_caller():
    with started(["sh", "-c", "echo pid=$$; echo cwd=$(pwd); exit 3"], cwd="/tmp") as s:
        started_ev = s.event(s.ctl)
        assert s.event(s.lifeline) == started_ev
        out = s.output()
        assert s.event(s.ctl) == s.event(s.lifeline) == {"ev": "exit", "code": 3, "cause": "exited", "signal": None}
    assert started_ev["ev"] == "started" and started_ev["pid"] > 1
    assert out == "pid=1\ncwd=/tmp\n"  # and the pipe ended with it: no write end leaked into the shim


def test_a_command_that_does_not_exist_and_a_cwd_the_caller_cannot_enter_are_one_line_each(tmp_path):
    with started(["no-such-command-here"]) as s:
        assert s.event(s.lifeline) == {"ev": "exit", "code": 127, "cause": "exec", "signal": None,
                                       "line": "no-such-command-here: No such file or directory"}
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    with started(["true"], cwd=str(private)) as s:
        end = s.event(s.lifeline)
    assert end == {"ev": "exit", "code": 126, "cause": "exec", "signal": None, "line": f"entering {private}: Permission denied"}


def test_the_caller_going_away_kills_the_tree_and_the_agent_going_away_does_not():
    with started(["sh", "-c", "sleep 60 & sleep 60; wait"]) as s:
        pid = s.event(s.lifeline)["pid"]
        s.ctl.close()  # the agent dies: nothing happens to the workload
        time.sleep(0.3)
        assert _alive(pid)
        s.lifeline.close()  # the caller dies
        assert _gone_within(pid, 10)
        assert s.proc.wait(5) == 0


def test_the_caller_s_kill_ends_the_tree_and_says_so():
    with started(["sleep", "60"]) as s:
        pid = s.event(s.lifeline)["pid"]
        s.lifeline.send(json.dumps({"op": "kill"}).encode())
        assert s.event(s.lifeline) == {"ev": "exit", "code": 128 + signal.SIGKILL, "cause": "killed", "signal": signal.SIGKILL}
        assert not _alive(pid)


def test_a_non_root_caller_s_tree_has_namespaces_of_its_own_and_the_node_s_mounts_it_can_reach(tmp_path):
    """What CRIU needs to dump and restore a tree of a caller other than root (shim.py, ``own_mounts``):
    user, mount and PID namespaces of its own, its root mapped to nobody of the node's, the caller's ids
    and groups meaning what they mean on the node; the node's mounts the caller can reach, and not one
    under a folder it cannot enter."""
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    hidden = tmp_path / "root-only"  # tmp_path's folders are root's, 0700
    (hidden / "m").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(hidden / "m")], check=True)
    Path("/dev/shm").joinpath(f"cedana-test-{os.getpid()}").write_text("from the node")
    probe = ("grep -E '^(Uid|Gid|Groups|CapEff|CapBnd|NoNewPrivs)' /proc/self/status; cat /proc/self/uid_map "
             f"/proc/self/gid_map; echo pid=$$; cat /dev/shm/cedana-test-{os.getpid()}; echo; "
             "readlink /proc/self/ns/user /proc/self/ns/mnt; cat /proc/self/mountinfo")
    try:
        with started(["sh", "-c", probe], cwd="/tmp", own_mounts=str(staging), groups=[100]) as s:
            assert s.event(s.lifeline)["ev"] == "started"
            out = s.output()
            assert s.event(s.lifeline) == {"ev": "exit", "code": 0, "cause": "exited", "signal": None}
        node_mounts = {m.mountpoint for m in shim.mount_table()}
    finally:
        subprocess.run(["umount", str(hidden / "m")], check=True)
        Path("/dev/shm").joinpath(f"cedana-test-{os.getpid()}").unlink()
    lines = out.splitlines()
    status = dict(x.split(":\t", 1) for x in lines if ":\t" in x)
    assert status["Uid"].split() == [str(NOBODY)] * 4 and status["Gid"].split() == [str(NOBODY)] * 4
    assert status["Groups"].split() == ["100"] and status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    maps = [x.split() for x in lines if len(x.split()) == 3 and all(f.isdigit() for f in x.split())]
    assert maps == [["0", str(shim.NS_ROOT), "1"], [str(NOBODY), str(NOBODY), "1"],
                    ["0", str(shim.NS_ROOT), "1"], ["100", "100", "1"], [str(NOBODY), str(NOBODY), "1"]]
    assert "pid=1" in lines and "from the node" in lines
    assert f"user:[{os.stat('/proc/self/ns/user').st_ino}]" not in lines  # not the node's namespaces
    assert f"mnt:[{os.stat('/proc/self/ns/mnt').st_ino}]" not in lines
    tree_mounts = {x.split()[4] for x in lines if x.count(" - ") == 1}
    assert {"/", "/proc", "/dev", "/dev/shm", "/sys"} <= tree_mounts
    assert str(hidden / "m") in node_mounts and str(hidden / "m") not in tree_mounts


def test_id_maps_keep_a_caller_s_group_0_and_refuse_the_id_trees_root_maps_to():
    assert shim.id_maps(1000, 0, [5]) == ("0 4000000 1\n1000 1000 1\n", "0 0 1\n5 5 1\n")
    assert shim.id_maps(1000, 1000, [1000, 27]) == ("0 4000000 1\n1000 1000 1\n", "0 4000000 1\n27 27 1\n1000 1000 1\n")
    with pytest.raises(ValueError, match="4000000"):
        shim.id_maps(shim.NS_ROOT, 1000, [])


def test_a_mount_is_bound_only_as_the_caller_reaches_it_never_through_a_symlink(tmp_path):
    """What the shim binds into a caller's tree, at its start and its restore: the mount on a mountpoint
    the caller itself reaches, opened without a symlink (issue 49 review, H1 and M1)."""
    uid = 4246  # its own, and a folder only it may enter: no other test's tree meets its mounts
    base = uid_folder(f"cedana-test-reach-{os.getpid()}", uid)
    (base / "pub").mkdir()
    locked = tmp_path / "locked"  # tmp_path: root's, 0700
    locked.mkdir()
    (base / "link").symlink_to(base / "pub")
    mounted = []
    try:
        for where in (base / "pub", locked):
            subprocess.run(["mount", "-t", "tmpfs", "none", str(where)], check=True)
            mounted.append(where)
        ids = shim._mount_ids(shim.mount_table())
        spec = {"uid": uid, "gid": uid, "groups": []}
        fd = shim._caller_reaches(str(base / "pub"), ids, spec)
        assert fd is not None and os.readlink(f"/proc/self/fd/{fd}") == str(base / "pub")
        os.close(fd)
        assert shim._caller_reaches(str(locked), ids, spec) is None  # under a folder it cannot enter
        fd = shim._caller_reaches(str(locked), ids, {"uid": 0, "gid": 0, "groups": []})
        assert fd is not None  # root reaches it
        os.close(fd)
        ids[str(base / "link")] = ids[str(base / "pub")]  # even were the symlink a mountpoint's name
        assert shim._caller_reaches(str(base / "link"), ids, spec) is None
        assert shim._caller_reaches(str(base), ids, spec) is None  # a folder, not a mount's root
        assert os.geteuid() == 0 and os.getegid() == 0  # and root is ours again after each look
    finally:
        for where in reversed(mounted):
            subprocess.run(["umount", str(where)], check=True)
        shutil.rmtree(base)


def test_a_mount_criu_cannot_name_is_masked_in_the_tree_never_shows_what_it_hides(tmp_path):
    """A node mount whose path CRIU's --external cannot carry (a space): the tree gets an empty read-only
    mount there, not the folder the node's mount hides (issue 49 review 2, N3)."""
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    uid = 4247  # its own, and a folder only it may enter: no other test's tree meets its mounts
    base = uid_folder(f"cedana-test-mask-{os.getpid()}", uid)
    (base / "team data").mkdir()
    (base / "team data").chmod(0o755)
    (base / "team data" / "beneath.txt").write_text("what the mount hides")
    (base / "team data" / "beneath.txt").chmod(0o644)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "none", str(base / "team data")], check=True)
    try:
        (base / "team data" / "on-the-mount.txt").write_text("the node's mount")
        probe = f"ls -A '{base}/team data'; echo end"
        with started(["sh", "-c", probe], cwd="/tmp", uid=uid, own_mounts=str(staging)) as s:
            assert s.event(s.lifeline)["ev"] == "started"
            out = s.output()
            assert s.event(s.lifeline)["code"] == 0
    finally:
        subprocess.run(["umount", str(base / "team data")], check=True)
        shutil.rmtree(base)
    assert out == "end\n", out  # neither the hidden file nor (unnamed to CRIU) the mount's own
