"""Jobs that span nodes, checkpointed as one (issue 53, run/job.py): each part on its own test node (a
network namespace with its own address, scripts/netns_nodes.py), each under its own ``cedana-airflow run
--job-part``, all under one checkpoint ID, with real CRIU. The parts freeze together, their connections
to each other are dumped in one cut, a seq exists once every part is stored, and after one node is lost
every part resumes from the same seq (the lost one on a node that took its address) and the job ends
as an uninterrupted run does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, cli_env, manifests, wait_for_checkpoint_after, wait_for_line
from netns_nodes import NetNode, NetNodes
import pod_jobs

pytestmark = pytest.mark.integration

PINGPONG = REPO / "tests" / "workloads" / "job_pingpong.py"
DDP = REPO / "tests" / "workloads" / "ddp_transparent.py"


@pytest.fixture
def nodes():
    with NetNodes(3) as three:
        yield three


def _part(node: NetNode, tmp_path: Path, part: int, cmd: list[str], *, try_number: int, heartbeat: str, out: str,
          pod: bool = False, mode: str = "transparent", **env: str) -> subprocess.Popen[bytes]:
    """Part ``part`` of 2 of the job ``job``, supervised on ``node`` (in a pod there: torchrun's gloo binds the
    address its hostname resolves to)."""
    argv = [sys.executable, "-m", "cedana_airflow", "run", "--resume", "--id", "job", "--job-part", f"{part}/2",
            "--try-number", str(try_number), "--heartbeat", heartbeat, "--mode", mode, "--", *cmd]
    argv = node.pod(argv, f"pod-{part}", str(tmp_path / f"hosts-{out}")) if pod else node.cmd(argv)
    cwd = tmp_path / f"cwd-{node.name}"  # a node's own disk: CRIU's proc.crtools goes into the workload's cwd
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen(argv, env=cli_env(tmp_path, node.name, f"work-{node.name}", **env), cwd=cwd,
                            stdout=open(tmp_path / f"{out}.out", "wb"), stderr=open(tmp_path / f"{out}.err", "wb"))


def _steps(path: Path) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+)\b", path.read_text(), re.M)]


def _resumed(tmp_path: Path, a: NetNode, b: NetNode, c: NetNode, cmds: tuple[list[str], list[str]], *,
             pod: bool = False, timeout: float = 240, mode: str = "transparent") -> tuple[str, str]:
    """Node b is lost and node c takes its address (a transparent part's connections need it; a cooperative
    part starts its processes anew); the job's retry (try 2) runs part 0 on a and part 1 on c. Both exit 0;
    their logs."""
    b.lose()
    if mode == "transparent":
        c.take_over(b)
    runs = [_part(a, tmp_path, 0, cmds[0], try_number=2, heartbeat="0", out="a2", pod=pod, mode=mode),
            _part(c, tmp_path, 1, cmds[1], try_number=2, heartbeat="0", out="c2", pod=pod, mode=mode)]
    try:
        for r, out in zip(runs, ("a2", "c2")):
            assert r.wait(timeout=timeout) == 0, (tmp_path / f"{out}.err").read_text()[-3000:]
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
    return (tmp_path / "a2.err").read_text(), (tmp_path / "c2.err").read_text()


def test_a_two_part_job_resumes_on_two_nodes_from_its_last_whole_seq_after_a_part_died_mid_checkpoint(nodes, tmp_path):
    """Part 0 serves on node a, part 1 talks to it from node b, over one TCP connection. Two rounds commit;
    at the third, part 1's supervisor dies while its tree is frozen: part 0 holds for the barrier, then runs
    on without a checkpoint, and the store's latest stays seq 2 (never part 0's seq 3 alone). Node b is lost;
    the retry resumes part 0 on node a and part 1 on node c (which took b's address) from seq 2, their
    connection whole: both go on from where they were and end with an uninterrupted run's digests."""
    a, b, c = nodes
    steps = 100
    serve = [sys.executable, str(PINGPONG), "--serve", f"{a.address}:7000", "--steps", str(steps)]
    talk = [sys.executable, str(PINGPONG), "--connect", f"{a.address}:7000", "--steps", str(steps)]
    reference = pod_jobs.uninterrupted(steps)
    runs = [_part(a, tmp_path, 0, serve, try_number=1, heartbeat="1", out="a1", CEDANA_JOB_BARRIER_SECONDS="3"),
            _part(b, tmp_path, 1, talk, try_number=1, heartbeat="1", out="b1", CEDANA_JOB_BARRIER_SECONDS="3",
                  CEDANA_FAILPOINTS="heartbeat.frozen=kill-supervisor@3")]
    try:
        wait_for_line(tmp_path / "a1.err", "did not freeze within job_barrier_seconds", runs[0], timeout=120)
    finally:  # the job has failed: its scheduler ends the part still running (it waits on a peer that is gone)
        a.kill_all()
        b.kill_all()
    err = (tmp_path / "a1.err").read_text()
    assert re.search(r"checkpoint seq=2: .*job of 2 parts committed, freeze skew [\d.]+ ms", err), err[-3000:]
    assert "job round seq 3: part(s) 1 did not freeze" in err, err[-3000:]
    ms = manifests(tmp_path / "store", "job")
    assert [m["seq"] for m in ms] == [1, 2] and all(m["engine"] == "job" for m in ms)
    assert [mb["node"] for mb in ms[-1]["job"]["members"]] == ["node-a", "node-b"]
    last = {p: _steps(tmp_path / f"{p}.out")[-1] for p in ("a1", "b1")}
    a2, c2 = _resumed(tmp_path, a, b, c, (serve, talk))
    assert re.search(r"restored seq 2 of try 1 \(node node-a\) on node node-a", a2), a2[-3000:]
    assert re.search(r"restored seq 2 of try 1 \(node node-b\) on node node-c", c2), c2[-3000:]
    assert "closes" not in c2 and "closes" not in a2  # the connection between the parts came back whole
    for p, q in (("a1", "a2"), ("b1", "c2")):
        resumed = _steps(tmp_path / f"{q}.out")
        assert 1 < resumed[0] <= last[p] + 1, (p, resumed[:2], last[p])  # went on from where it was
        assert (tmp_path / f"{q}.out").read_text().splitlines()[-1] == reference, q


def test_a_two_node_torchrun_job_resumes_on_two_nodes_with_an_uninterrupted_runs_parameters(nodes, tmp_path):
    """The job people launch: ``torchrun --nnodes 2``, one rank per node, gloo DDP with no checkpoint code,
    rank 1's node reaching rank 0's rendezvous store and rank 0 over its node's address. Checkpointed as one
    on part 0's heartbeat, node b lost, both parts resumed from the same seq (part 1 on node c, which took
    b's address): the job goes on from a later step and ends with an uninterrupted run's parameters."""
    pytest.importorskip("torch")
    a, b, c = nodes
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                str(DDP), "--steps", "150", "--step-seconds", "0"], capture_output=True, text=True,
                               timeout=300, check=True, env=env).stdout.splitlines()[-1]
    assert reference.startswith("done digest=")

    def rank(r: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                "--nproc-per-node", "1", "--master-addr", a.address, "--master-port", "29511", str(DDP),
                "--steps", "150"]

    runs = [_part(a, tmp_path, 0, rank(0), try_number=1, heartbeat="2", out="a1", pod=True),
            _part(b, tmp_path, 1, rank(1), try_number=1, heartbeat="2", out="b1", pod=True)]
    try:
        wait_for_checkpoint_after(tmp_path / "store", "job", tmp_path / "a1.out", "step 3/", runs[0], timeout=180)
    finally:
        for r in runs:
            r.kill()
            r.wait()
    a.kill_all()  # the job's other part goes with it: its retry restarts every part
    assert "done digest" not in (tmp_path / "a1.out").read_text(), "the job ended before the node was lost"
    err = (tmp_path / "a1.err").read_text()
    assert "heartbeat failed" not in err and "job of 2 parts committed" in err, err[-3000:]
    seq = manifests(tmp_path / "store", "job")[-1]["seq"]
    last = _steps(tmp_path / "a1.out")[-1]
    a2, c2 = _resumed(tmp_path, a, b, c, (rank(0), rank(1)), pod=True, timeout=300)
    assert re.search(rf"restored seq {seq} of try 1 \(node node-b\) on node node-c", c2), c2[-3000:]
    resumed = _steps(tmp_path / "a2.out")
    assert 3 < resumed[0] <= last + 1, (resumed[:2], last)
    assert (tmp_path / "a2.out").read_text().splitlines()[-1] == reference


def test_a_two_node_torchrun_job_that_writes_its_own_state_resumes_from_one_seq_of_every_rank(nodes, tmp_path):
    """Cooperative across nodes: ``torchrun --nnodes 2`` of a job using ``coop.torch.Resumable`` (DDP, momentum,
    a step LR schedule, dropout), each node's part under its own supervisor in mode cooperative. At part 0's
    round both supervisors ask at the appointed moment with the round's seq, the ranks agree on the step (one
    all-reduce), each node's ranks write theirs, and part 0 commits both nodes' files as one seq. Node b is
    lost; the retry starts both parts from that seq (part 1 on node c, its own address) and the job ends with
    an uninterrupted run's parameters."""
    pytest.importorskip("torch")
    a, b, c = nodes
    coop = REPO / "tests" / "workloads" / "ddp_coop.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                str(coop), "--steps", "150", "--step-seconds", "0"], capture_output=True, text=True,
                               timeout=300, check=True, env=env).stdout.splitlines()[-1]

    def rank(r: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                "--nproc-per-node", "1", "--master-addr", a.address, "--master-port", "29512", str(coop),
                "--steps", "150"]

    runs = [_part(a, tmp_path, 0, rank(0), try_number=1, heartbeat="2", out="a1", pod=True, mode="cooperative"),
            _part(b, tmp_path, 1, rank(1), try_number=1, heartbeat="2", out="b1", pod=True, mode="cooperative")]
    try:
        ms = wait_for_checkpoint_after(tmp_path / "store", "job", tmp_path / "a1.out", "step 5 ", runs[0], timeout=180)
    finally:
        a.kill_all()
    seq = ms[-1]["seq"]
    members = ms[-1]["job"]["members"]
    assert [sorted(f["path"] for f in mb["manifest"]["cooperative"]["files"]) for mb in members] == \
        [["rank-0.pt"], ["rank-1.pt"]]  # each node's supervisor stored its own rank's file, in one seq
    a2, c2 = _resumed(tmp_path, a, b, c, (rank(0), rank(1)), pod=True, timeout=300, mode="cooperative")
    assert re.search(rf"restored seq {seq} of try 1 \(node node-b\) on node node-c", c2), c2[-3000:]
    out = (tmp_path / "a2.out").read_text().splitlines()
    assert out[0].startswith("resumed at step ") and int(out[0].split()[-1]) > 5, out[:2]
    assert out[-1] == reference, (out[-2:], reference)
