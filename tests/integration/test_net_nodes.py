"""Workloads that talk, on nodes as they are in life (issue 47): node-a and node-b each in a network
namespace of their own with their own address (scripts/netns_nodes.py), services outside the workload
on the machine's side of their bridge. ``cedana-airflow run`` runs inside a node, so the workload it
starts and the CRIU it calls see that node's addresses only: a restored socket binds as it would on
another machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, Echo, UdpEcho, cli_env, descendants, manifests, wait_for_checkpoint_after
from netns_nodes import NetNode, NetNodes

pytestmark = pytest.mark.integration

SHAPES = REPO / "tests" / "integration" / "shapes"
SERVE = REPO / "tests" / "workloads" / "serve_counter.py"
DDP = REPO / "tests" / "workloads" / "ddp_transparent.py"


@pytest.fixture
def nodes():
    with NetNodes(2) as pair:
        yield pair


def _run(node: NetNode, tmp_path: Path, cid: str, cmd: list[str], *, resume: bool, heartbeat: str,
         out: str, pod: str | None = None) -> subprocess.Popen[bytes]:
    """``cedana-airflow run`` on ``node``; with ``pod``, in a pod of that hostname there (NetNode.pod)."""
    env = cli_env(tmp_path, node.name, f"work-{node.name}")
    argv = [sys.executable, "-m", "cedana_airflow", "run", *(["--resume"] if resume else []), "--id", cid,
            "--heartbeat", heartbeat, "--json-file", str(tmp_path / f"{out}.json"), "--", *cmd]
    argv = node.pod(argv, pod, str(tmp_path / f"hosts-{pod}")) if pod else node.cmd(argv)
    return subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=open(tmp_path / f"{out}.out", "wb"),
                            stderr=open(tmp_path / f"{out}.err", "wb"))


def _wait(pred, what: str, proc: subprocess.Popen[bytes], err: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what}: {err.read_text()[-3000:]}"
        time.sleep(0.1)


def _lose(proc: subprocess.Popen[bytes], workload_pid: int) -> None:
    """node-a dies: its supervisor and the workload's PID namespace, SIGKILLed."""
    proc.kill()
    proc.wait()
    try:
        os.kill(workload_pid, 9)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{workload_pid}") and time.monotonic() < deadline:
        time.sleep(0.05)


def _checkpointed_then_lost(node: NetNode, tmp_path: Path, cid: str, cmd: list[str]) -> None:
    """``cmd`` run on ``node`` until a checkpoint froze it in its loop (after step 3); then the node dies."""
    run = _run(node, tmp_path, cid, cmd, resume=False, heartbeat="0.5", out="a")
    ms = wait_for_checkpoint_after(tmp_path / "store", cid, tmp_path / "a.out", "step 3/", run, timeout=90)
    _lose(run, ms[-1]["process"]["pid"])


def _resumed_as_uninterrupted(node: NetNode, tmp_path: Path, cid: str, cmd: list[str], reference: str) -> str:
    """``run --resume`` of ``cid`` on ``node``: it exits 0, goes on from where it was (no start-up again) and
    ends as an uninterrupted run; its log."""
    run = _run(node, tmp_path, cid, cmd, resume=True, heartbeat="0", out="b")
    assert run.wait(timeout=120) == 0, (tmp_path / "b.err").read_text()[-3000:]
    out = (tmp_path / "b.out").read_text().splitlines()
    assert not out[0].startswith("start-up") and out[-1] == reference, (out[:2], out[-1], reference)
    return (tmp_path / "b.err").read_text()


def _reference(cmd: list[str], tmp_path: Path) -> str:
    return subprocess.run([*cmd, "--step-seconds", "0"], capture_output=True, text=True, check=True, cwd=tmp_path,
                          timeout=120).stdout.strip().splitlines()[-1]


def test_a_connection_to_a_service_outside_moves_to_another_node_closed_and_the_client_reconnects(nodes, tmp_path):
    """Its local address was node-a's, which node-b has not: restored exactly, CRIU could not bind it.
    Restored closed, the client reconnects from node-b and ends as an uninterrupted run."""
    a, b = nodes
    echo = Echo(a.gateway)
    cmd = [sys.executable, str(SHAPES / "tcp_client.py"), "--steps", "60", "--step-seconds", "0.1",
           "--host", a.gateway, "--port", str(echo.port)]
    reference = _reference(cmd, tmp_path)
    _checkpointed_then_lost(a, tmp_path, "out", cmd)
    err = _resumed_as_uninterrupted(b, tmp_path, "out", cmd, reference)
    assert f"restore closes 1 connection(s) to peers outside the tree (the process gets an error and reconnects): TCP " \
           f"{a.address}:" in err and f"ESTABLISHED to {a.gateway}:{echo.port}" in err, err[-3000:]


def test_a_udp_client_moves_to_another_node_and_its_service_hears_it_from_there(nodes, tmp_path):
    """A connected UDP socket (a resolver's or a collector's client) bound to node-a's address, which
    node-b has not: it is restored sending from node-b's address, the service's answers reach it there,
    and the job ends as an uninterrupted run, resending nothing."""
    a, b = nodes
    echo = UdpEcho(a.gateway)
    try:
        cmd = [sys.executable, str(SHAPES / "udp_client.py"), "--steps", "60", "--step-seconds", "0.1",
               "--host", a.gateway, "--port", str(echo.port)]
        reference = _reference(cmd, tmp_path)
        _checkpointed_then_lost(a, tmp_path, "udp", cmd)
        err = _resumed_as_uninterrupted(b, tmp_path, "udp", cmd, reference)
        assert "no answer" not in err and "restore closes" not in err, err[-3000:]
        assert echo.senders[-2:] == [a.address, b.address], echo.senders
    finally:
        echo.close()


def test_a_connection_inside_the_tree_over_the_nodes_own_address_resumes_on_the_same_node(nodes, tmp_path):
    """A restore on the same node after a crash: the tree's connection over node-a's address left
    TIME_WAIT behind there, which refuses the same address pair (outside loopback, tcp_tw_reuse does not
    apply); the restore clears the tree's own leftovers, and the job goes on without noticing."""
    a, _ = nodes
    # Without TCP timestamps (some operators turn them off) the kernel lets no connect reuse a TIME_WAIT
    # pair (tcp_twsk_unique); with them, a bound connect may, and the leftover would go unnoticed.
    subprocess.run(a.cmd(["sysctl", "-q", "-w", "net.ipv4.tcp_timestamps=0"]), check=True)
    cmd = [sys.executable, str(SHAPES / "tcp_pair.py"), "--steps", "60", "--step-seconds", "0.1", "--host", a.address]
    reference = _reference([*cmd[:-2], "--host", "127.0.0.1"], tmp_path)
    _checkpointed_then_lost(a, tmp_path, "pair", cmd)
    leftovers = subprocess.run(a.cmd(["ss", "-tan", "state", "time-wait"]), capture_output=True, text=True).stdout
    assert a.address in leftovers, leftovers  # the tree's own connection, in TIME_WAIT on node-a
    _resumed_as_uninterrupted(a, tmp_path, "pair", cmd, reference)
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["outcome"] == "restored" and summary["refused"] == [], summary


def test_a_serving_worker_resumes_on_another_node_on_the_same_port_with_its_memory(nodes, tmp_path):
    """A server holding state in memory (a request counter, as a model and its caches): node-a dies, the
    retry on node-b listens on the same port at node-b's address and answers with the count it had."""
    a, b = nodes
    port = 18000 + os.getpid() % 1000
    cmd = [sys.executable, str(SERVE), "--port", str(port)]
    run_a = _run(a, tmp_path, "serve", cmd, resume=False, heartbeat="0.5", out="a")

    def get(host: str) -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/", timeout=5) as r:
            return r.read().decode().strip()

    _wait(lambda: "serving" in (tmp_path / "a.out").read_text(), "the server", run_a, tmp_path / "a.err")
    assert [get(a.address) for _ in range(3)] == ["hits 1", "hits 2", "hits 3"]
    seen = len(manifests(tmp_path / "store", "serve"))
    _wait(lambda: len(manifests(tmp_path / "store", "serve")) >= seen + 2, "a checkpoint after the third hit",
          run_a, tmp_path / "a.err")
    _lose(run_a, manifests(tmp_path / "store", "serve")[-1]["process"]["pid"])
    run_b = _run(b, tmp_path, "serve", cmd, resume=True, heartbeat="0", out="b")
    try:
        _wait(lambda: "checkpoint_id=serve, mode" in (tmp_path / "b.err").read_text(), "the restore", run_b,
              tmp_path / "b.err")
        assert get(b.address) == "hits 4"
        assert "serving" not in (tmp_path / "b.out").read_text()  # restored, not started again
    finally:
        run_b.kill()
        run_b.wait()


@pytest.mark.parametrize(("shape", "moved"), [("tcp_pair.py", 3), ("udp_pair.py", 1)], ids=["tcp", "udp"])
def test_a_tree_that_talks_to_itself_over_its_nodes_address_moves_to_the_next_nodes(nodes, tmp_path, shape, moved):
    """As torchrun in a pod does (its store and gloo bind the address the hostname resolves to, the pod's
    IP): the listener and both ends of the connection are on node-a's address, which node-b has not. They
    move to node-b's address, keeping their ports and their connection; the job goes on without noticing.
    Over UDP (a worker and its metrics sidecar, reached at the node's address): the sender's address and
    its destination move, and the sidecar, on every address, hears it on node-b's."""
    a, b = nodes
    cmd = [sys.executable, str(SHAPES / shape), "--steps", "60", "--step-seconds", "0.1", "--host", a.address]
    reference = _reference([*cmd[:-2], "--host", "127.0.0.1"], tmp_path)
    _checkpointed_then_lost(a, tmp_path, "self", cmd)
    err = _resumed_as_uninterrupted(b, tmp_path, "self", cmd, reference)
    assert f"restore moves the tree's address {a.address} to {b.address} on this node ({moved} socket(s)" in err, \
        err[-3000:]
    assert "restore closes" not in err, err[-3000:]


def test_a_torchrun_job_in_a_pod_resumes_in_a_pod_on_another_node_with_an_uninterrupted_runs_parameters(nodes, tmp_path):
    """torchrun as a pod runs it (issue 47): ``--standalone``, two ranks, gloo DDP, no checkpoint code, and
    gloo bound to the address the pod's hostname resolves to, node-a's. Checkpointed on its heartbeat (the
    launcher's io_uring refused, its store and gloo connections carried), node-a dies, and the retry in a
    pod on node-b moves the tree's address to node-b's, goes on from a later step and ends with the
    parameters of an uninterrupted run."""
    pytest.importorskip("torch")
    a, b = nodes
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DDP),
           "--steps", "200"]
    reference = subprocess.run([*job, "--step-seconds", "0"], capture_output=True, text=True, timeout=300, check=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}).stdout.splitlines()[-1]
    assert reference.startswith("done digest=")
    run_a = _run(a, tmp_path, "ddp", job, resume=False, heartbeat="2", out="a", pod="pod-a")
    try:
        wait_for_checkpoint_after(tmp_path / "store", "ddp", tmp_path / "a.out", "step 2/", run_a)
        held = [p for p in descendants(run_a.pid)[1:] for fd in _fds(p) if "io_uring" in fd]
        assert held == [], f"pids {held} hold an io_uring"  # the launcher's libuv stores, refused
        _lose(run_a, manifests(tmp_path / "store", "ddp")[-1]["process"]["pid"])
    finally:
        if run_a.poll() is None:
            run_a.kill()
    err = (tmp_path / "a.err").read_text()
    assert "heartbeat failed" not in err, err[-3000:]
    assert "done digest" not in (tmp_path / "a.out").read_text(), "the job ended before the node was lost"
    run_b = _run(b, tmp_path, "ddp", job, resume=True, heartbeat="0", out="b", pod="pod-b")
    assert run_b.wait(timeout=300) == 0, (tmp_path / "b.err").read_text()[-3000:]
    err = (tmp_path / "b.err").read_text()
    assert re.search(r"restored seq \d+(?: of try \d+)? \(node node-a\) on node node-b: .*checkpoint_id=ddp,", err), err[-3000:]
    assert f"restore moves the tree's address {a.address} to {b.address} on this node" in err, err[-3000:]
    out = (tmp_path / "b.out").read_text().splitlines()
    printed_on_a = [ln for ln in (tmp_path / "a.out").read_text().splitlines() if ln.startswith("step ")]
    first, last_on_a = (int(ln.split()[1].split("/")[0]) for ln in (out[0], printed_on_a[-1]))
    assert 2 < first <= last_on_a + 1, (out[:2], printed_on_a[-2:])  # went on from where it was
    assert out[-1] == reference, (out[-2:], reference)


def _fds(pid: int) -> list[str]:
    try:
        return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []
