"""Common workload shapes, each checkpointed by the real CLI on node-a, killed as if the node died, and
restored by ``run --resume`` on node-b with default settings. docs/compatibility.md is the table of
what these tests observed: one row per test id of ``test_workload_shape``.

A shape that works must continue where it was (no second start-up line, a first step above 1) and
end with the digest an uninterrupted run prints. A shape that cannot work asserts the one line a
user sees. Files outside the workload's working directory are written back by a restore only from
a signed checkpoint (the default under Airflow; the plain CLI signs when CEDANA_SIGNING_KEY is set),
so the cases that keep such files open run signed, and say so in their id.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Echo, UdpEcho, _free_port, cli, cli_env, descendants, drop_pymp, kill_node, manifests, pymp_dirs_held, start_cli

pytestmark = pytest.mark.integration

SHAPES = Path(__file__).resolve().parent / "shapes"
HEARTBEAT = "0.4"
#: 8 s of steps: two checkpoints begun in the loop (each 0.4 s after the last one ended) come well before the end,
#: on a machine busy with other tests too
STEPS = 80
#: Processes a case started; whatever is still running when it ends is killed (a failed case leaves none).
_STARTED: list[subprocess.Popen] = []


def _py(script: str, *args: object) -> list[str]:
    return [sys.executable, str(SHAPES / script), *map(str, args)]


def _env(tmp_path: Path, node: str, *, key: str | None = None, **extra: str) -> dict[str, str]:
    if key:
        extra["CEDANA_SIGNING_KEY"] = key
    return cli_env(tmp_path, node, f"work-{node}", **extra)


def _reference(cmd: list[str], cwd: Path) -> str:
    """The digest of an uninterrupted run (no pauses between steps)."""
    cwd.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([*cmd, "--step-seconds", "0"], cwd=cwd, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=120).stdout
    return out.strip().splitlines()[-1]


class Node:
    """The run on node-a: started, checkpointed, then lost."""

    def __init__(self, tmp_path: Path, cid: str, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        self.tmp_path, self.cid, self.cwd = tmp_path, cid, cwd
        cwd.mkdir(parents=True, exist_ok=True)
        self.pymp_held: set[str] = set()
        self.proc = start_cli("run", "--id", cid, "--heartbeat", HEARTBEAT, "--", *cmd, env=env, out=tmp_path / "a",
                              cwd=cwd)
        _STARTED.append(self.proc)

    @property
    def out(self) -> str:
        return (self.tmp_path / "a.out").read_text()

    @property
    def err(self) -> str:
        return (self.tmp_path / "a.err").read_text(errors="replace")

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        sampled = 0.0
        while not predicate():
            if time.monotonic() - sampled > 0.5:  # an ended epoch's workers held theirs
                self.pymp_held |= pymp_dirs_held(descendants(self.proc.pid))
                sampled = time.monotonic()
            assert self.proc.poll() is None, f"supervisor exited early ({what}): {self.err[-2000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.err[-2000:]}"
            time.sleep(0.05)

    def seqs(self) -> list[int]:
        return [m["seq"] for m in manifests(self.tmp_path / "store", self.cid)]

    def checkpoints_after_first_step(self, n: int = 2, holds: Callable[[dict], bool] = lambda m: True) -> list[dict]:
        """Wait for ``n`` checkpoints begun once the workload was in its loop (not during its start-up;
        older ones are pruned: keep_checkpoints), and at least two in all, the newest of which ``holds``;
        return the manifests, that one last."""
        self.wait_for(lambda: "step 1/" in self.out, "the first step", 120)
        base = max(self.seqs(), default=0) + 1  # one may be under way: it began before the first step

        def ready() -> list[dict]:
            ms = manifests(self.tmp_path / "store", self.cid)
            while ms and not holds(ms[-1]):
                ms.pop()
            return ms if ms and ms[-1]["seq"] >= max(base + n, 2) else []

        self.wait_for(lambda: bool(ready()), f"{n} checkpoint(s) in the loop", 120)
        return ready()

    def lose(self, ms: list[dict]) -> None:
        """The node dies: the supervisor and the workload's PID namespace are SIGKILLed, and its work
        directory is gone with it."""
        self.pymp_held |= pymp_dirs_held(descendants(self.proc.pid))  # its own, read while it lives
        kill_node(self.proc, ms[-1]["process"]["pid"])
        shutil.rmtree(self.tmp_path / "work-node-a", ignore_errors=True)
        assert "done digest" not in self.out, "the workload ended before the node was lost: make it longer"


def _resume(tmp_path: Path, cid: str, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return cli("run", "--resume", "--id", cid, "--heartbeat", "0", "--", *cmd, env=env, cwd=cwd, timeout=120)


def _resume_serving(tmp_path: Path, cid: str, cmd: list[str]) -> subprocess.Popen[bytes]:
    """``run --resume`` of a serving shape on node-b, left running once the restored process has printed a
    step: the test talks to it, then waits for its end (_ended_as_uninterrupted)."""
    proc = start_cli("run", "--resume", "--id", cid, "--heartbeat", "0", "--", *cmd,
                     env=_env(tmp_path, "node-b"), out=tmp_path / "b", cwd=tmp_path / "job")
    _STARTED.append(proc)
    deadline = time.monotonic() + 60
    while "step " not in (tmp_path / "b.out").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "b.err").read_text()[-3000:]
        time.sleep(0.05)
    return proc


def _ended_as_uninterrupted(proc: subprocess.Popen[bytes], tmp_path: Path, cid: str, reference: str) -> list[str]:
    """_assert_continued for a run started by _resume_serving, once it has ended."""
    assert proc.wait(timeout=60) == 0
    r = subprocess.CompletedProcess(proc.args, 0, (tmp_path / "b.out").read_text(), (tmp_path / "b.err").read_text())
    return _assert_continued(r, cid, reference)


def _assert_continued(r: subprocess.CompletedProcess[str], cid: str, reference: str) -> list[str]:
    """It restored node-a's checkpoint on node-b, went on from a later step, and ended as an
    uninterrupted run does."""
    assert r.returncode == 0, r.stderr[-3000:]
    said = "\n".join(ln for ln in r.stderr.splitlines() if ln.startswith("cedana:"))
    assert re.search(rf"restored seq \d+(?: of try \d+)? \(node node-a\) on node node-b: .*checkpoint_id={re.escape(cid)},", said), said
    assert "checkpoint refused" not in said, said  # the newest one, not a fallback to an older one
    out = r.stdout.splitlines()
    assert not any(ln.startswith("start-up") for ln in out), out[:3]
    first = next(ln for ln in out if ln.startswith("step "))
    assert int(first.split()[1].split("/")[0]) > 1, (out[:3], said)
    assert out[-1] == reference, (out[-3:], reference)
    return out


def _image_bytes(tmp_path: Path, manifest: dict) -> bytes:
    """Every byte of a stored checkpoint's images (each chunk fetched, decoded and verified)."""
    from cedana_airflow.config import load_settings
    from cedana_airflow.format.manifest import Manifest
    from cedana_airflow.store import open_store
    from cedana_airflow.store.transfer import fetch_checkpoint

    store = open_store(f"file://{tmp_path / 'store'}", load_settings(environ={}))
    store.open(create=False, chunk_avg_bytes=1 << 20)
    dest = tmp_path / f"images-{manifest['seq']}"
    fetch_checkpoint(store, Manifest.model_validate(manifest), dest)
    return b"".join(p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file())


def _processes(m: dict) -> int:
    """How many processes a checkpoint holds (CRIU writes one mm-<pid>.img per process)."""
    return sum(1 for f in m["files"] if re.fullmatch(r"mm-\d+\.img", f["name"]))


def _drop_workload_pymp(node: Node) -> tuple[list[str], list[str]]:
    """Another node's /tmp has none of the workload's /tmp/pymp-* directories (those its processes held a
    socket in while it ran, never a neighbour test's). Returns (removed, already gone)."""
    return drop_pymp(node.pymp_held)


# -- the shapes ---------------------------------------------------------------------------------------------

def torch_dataloader(tmp_path: Path) -> None:
    """PyTorch CPU training: DataLoader(num_workers=2), dataset, log and checkpoint directories
    outside the cwd, a progress bar on stderr. Signed (captured log outside the cwd)."""
    import numpy as np

    key = secrets.token_hex(16)
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 1))
    for i in range(256):  # the dataset: one file per sample
        x = rng.standard_normal(16).astype(np.float32)
        np.save(tmp_path / "data" / f"{i:05d}.npy", np.concatenate([x, np.tanh(x @ w).astype(np.float32)]))
    (tmp_path / "logs").mkdir()
    job = ["--data", tmp_path / "data", "--epochs", 2, "--step-seconds", 0.4]
    cmd = _py("torch_loader.py", *job, "--log", tmp_path / "logs" / "train.log", "--ckpt", tmp_path / "ckpt")
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    # the uninterrupted run, beside node-a's (it waits on checkpoints most of the time)
    ref = subprocess.Popen(_py("torch_loader.py", *job, "--log", ref_dir / "train.log", "--ckpt", ref_dir / "ckpt",
                               "--step-seconds", 0), cwd=ref_dir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    _STARTED.append(ref)
    node = Node(tmp_path, "torch", cmd, _env(tmp_path, "node-a", key=key), tmp_path / "job")
    # a checkpoint that holds the DataLoader's workers (each takes seconds here: 800 MB of RSS) and was
    # begun in the loop: the workers start before the first batch, so one begun before "step 1" is
    # rightly restored to print "step 1" again, which would not show that it went on
    ms = node.checkpoints_after_first_step(1, lambda m: _processes(m) >= 3)
    node.lose(ms)
    reference = ref.communicate(timeout=120)[0].strip().splitlines()[-1]
    assert ref.returncode == 0
    assert str(tmp_path / "logs" / "train.log") in [c["path"] for c in ms[-1]["captured"]]
    # their workers' listener directories: those of an ended epoch's workers are gone already (removed at
    # their exit), the live ones die with the node; before run/preflight.py created them again, CRIU
    # refused every checkpoint with workers in it ("Can't bind ... /tmp/pymp-*/listener-*")
    removed, gone = _drop_workload_pymp(node)
    assert removed or gone
    print(f"torch: the workload's /tmp/pymp-* removed before the restore: {removed}; already gone: {gone}")
    r = _resume(tmp_path, "torch", cmd, _env(tmp_path, "node-b", key=key), tmp_path / "job")
    _assert_continued(r, "torch", reference)
    # the log went on from the checkpoint: every step once, in order, as in the uninterrupted run
    assert [ln.split()[3] for ln in (tmp_path / "logs" / "train.log").read_text().splitlines()] == \
        [ln.split()[3] for ln in (ref_dir / "train.log").read_text().splitlines()]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch-0.pt", "epoch-1.pt"]
    assert "train |" in r.stderr and "| 32/32" in r.stderr  # the progress bar went on on the new node


def mp_pool_fork(tmp_path: Path) -> None:
    cmd = _py("pool_map.py", "--steps", STEPS, "--step-seconds", 0.1)
    reference = _reference(cmd, tmp_path / "ref")
    node = Node(tmp_path, "pool", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    removed, gone = _drop_workload_pymp(node)
    print(f"pool: the workload's /tmp/pymp-* removed before the restore: {removed}; already gone: {gone}")
    _assert_continued(_resume(tmp_path, "pool", cmd, _env(tmp_path, "node-b"), tmp_path / "job"), "pool", reference)


def posix_shm(tmp_path: Path) -> None:
    """A SharedMemory segment is a file in /dev/shm that the workload holds open for writing: it is
    captured and, signed, put back in /dev/shm (a tmpfs like /tmp, the one place under /dev a restore
    writes) on a node whose /dev/shm does not have it."""
    key = secrets.token_hex(16)
    cmd = _py("shm.py", "--steps", STEPS, "--step-seconds", 0.1)
    reference = _reference(cmd, tmp_path / "ref")
    node = Node(tmp_path, "shm", cmd, _env(tmp_path, "node-a", key=key), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    [segment] = re.findall(r"^segment (\S+)$", node.out, re.M)
    assert [c["path"] for c in ms[-1]["captured"]] == [segment]
    Path(segment).unlink(missing_ok=True)  # another node's /dev/shm does not have it (and the dead run's leaks)
    try:
        _assert_continued(_resume(tmp_path, "shm", cmd, _env(tmp_path, "node-b", key=key), tmp_path / "job"), "shm",
                          reference)
    finally:
        Path(segment).unlink(missing_ok=True)


def np_memmap(tmp_path: Path) -> None:
    """np.memmap outside the cwd: Python's mmap keeps a duplicate of the file's descriptor, so the file
    is captured (signed: outside the cwd) and put back as it was at the checkpoint."""
    key = secrets.token_hex(16)
    data = tmp_path / "data"
    data.mkdir()
    cmd = _py("memmap.py", "--steps", STEPS, "--step-seconds", 0.1, "--file", data / "state.dat")
    reference = _reference(_py("memmap.py", "--steps", STEPS, "--file", tmp_path / "ref-state.dat"), tmp_path / "ref")
    node = Node(tmp_path, "memmap", cmd, _env(tmp_path, "node-a", key=key), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    assert [c["path"] for c in ms[-1]["captured"]] == [str(data / "state.dat")]
    # the file on the shared volume went on changing after the checkpoint: a replayed step would show
    r = _resume(tmp_path, "memmap", cmd, _env(tmp_path, "node-b", key=key), tmp_path / "job")
    _assert_continued(r, "memmap", reference)


def sqlite_signed(tmp_path: Path) -> None:
    key = secrets.token_hex(16)
    (tmp_path / "data").mkdir()
    db = tmp_path / "data" / "steps.db"
    cmd = _py("sqlite_loop.py", "--steps", STEPS, "--step-seconds", 0.1, "--db", db)
    reference = _reference(_py("sqlite_loop.py", "--steps", STEPS, "--db", tmp_path / "ref.db"), tmp_path / "ref")
    node = Node(tmp_path, "sqlite", cmd, _env(tmp_path, "node-a", key=key), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    assert str(db) in [c["path"] for c in ms[-1]["captured"]]
    # the database on the shared volume has rows from after the checkpoint: the restore puts back its copy
    _assert_continued(_resume(tmp_path, "sqlite", cmd, _env(tmp_path, "node-b", key=key), tmp_path / "job"), "sqlite",
                      reference)
    import sqlite3

    assert [n for (n,) in sqlite3.connect(db).execute("SELECT n FROM steps ORDER BY n")] == list(range(1, STEPS + 1))


def shell_pipeline(tmp_path: Path) -> None:
    job = tmp_path / "job"
    line = f"{sys.executable} {SHAPES / 'step.py'} --steps {STEPS} --step-seconds 0.1 | tee steps.log"
    reference = _reference(_py("step.py", "--steps", STEPS), tmp_path / "ref")
    node = Node(tmp_path, "pipe", ["sh", "-c", line], _env(tmp_path, "node-a"), job)
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    assert [c["path"] for c in ms[-1]["captured"]] == [str(job / "steps.log")]
    (job / "steps.log").unlink()  # another node's disk: only the checkpoint has it
    _assert_continued(_resume(tmp_path, "pipe", ["sh", "-c", line], _env(tmp_path, "node-b"), job), "pipe", reference)
    steps = [ln for ln in (job / "steps.log").read_text().splitlines() if ln.startswith("step ")]
    assert steps == [f"step {i}/{STEPS}" for i in range(1, STEPS + 1)]


def tcp_listen(tmp_path: Path) -> None:
    """A listening socket (a serving worker's): checkpointed by CRIU 4.2 (4.1 could not on Linux 6.16+:
    SO_PASSCRED, criu#2718) and listening again on the same port after the restore."""
    port = _free_port()
    cmd = _py("tcp_listen.py", "--steps", STEPS, "--step-seconds", 0.1, "--port", port)
    node = Node(tmp_path, "listen", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
    reference = _reference(_py("tcp_listen.py", "--steps", STEPS, "--port", _free_port()), tmp_path / "ref")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    proc = _resume_serving(tmp_path, "listen", cmd)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:  # the restored listener answers
        answer = c.makefile().readline()
    assert re.fullmatch(r"at step \d+\n", answer), answer
    _ended_as_uninterrupted(proc, tmp_path, "listen", reference)


def tcp_port_taken(tmp_path: Path) -> None:
    """The node, not the checkpoint: a process took the serving worker's port on the node that restores
    it. The try fails with one line naming that process (exit 1, nothing started fresh), the checkpoint
    stays the latest, and once the port is free the next try resumes it."""
    port = _free_port()
    cmd = _py("tcp_listen.py", "--steps", STEPS, "--step-seconds", 0.1, "--port", port)
    reference = _reference(_py("tcp_listen.py", "--steps", STEPS, "--port", _free_port()), tmp_path / "ref")
    node = Node(tmp_path, "taken", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    holder = subprocess.Popen([sys.executable, "-c", f"import socket, time\ns = socket.create_server(('127.0.0.1', "
                               f"{port}))\nprint('held', flush=True)\ntime.sleep(120)"], stdout=subprocess.PIPE)
    _STARTED.append(holder)
    assert holder.stdout.readline() == b"held\n"
    r = _resume(tmp_path, "taken", cmd, _env(tmp_path, "node-b"), tmp_path / "job")
    assert r.returncode == 1 and r.stdout == "", r.stderr[-3000:]
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("NodeInTheWay:")]
    assert line.startswith(f"NodeInTheWay: checkpoint taken seq={ms[-1]['seq']} cannot be restored on this node: the "
                           f"port of its socket TCP 127.0.0.1:{port} LISTEN is held here by pid {holder.pid} "), line
    assert "starting fresh" not in r.stderr and "checkpoint refused" not in r.stderr
    assert max(node.seqs()) == ms[-1]["seq"]  # nothing newer: the checkpoint stays the latest
    holder.kill()
    holder.wait()
    _assert_continued(_resume(tmp_path, "taken", cmd, _env(tmp_path, "node-b"), tmp_path / "job"), "taken", reference)


def tcp_established(tmp_path: Path) -> None:
    """A connection to a service outside the tree: checkpointed with it (--tcp-established), restored
    closed (the peer saw it reset when the node died), so the client's next call fails, it reconnects as client
    libraries do, and ends as an uninterrupted run does."""
    echo = Echo()
    try:
        cmd = _py("tcp_client.py", "--steps", STEPS, "--step-seconds", 0.1, "--port", echo.port)
        reference = _reference(cmd, tmp_path / "ref")
        node = Node(tmp_path, "conn", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
        ms = node.checkpoints_after_first_step(2)
        assert "heartbeat failed" not in node.err, node.err[-2000:]
        node.lose(ms)
        r = _resume(tmp_path, "conn", cmd, _env(tmp_path, "node-b"), tmp_path / "job")
        _assert_continued(r, "conn", reference)
        assert ("restore closes 1 connection(s) to peers outside the tree (the process gets an error and reconnects): "
                f"TCP 127.0.0.1:") in r.stderr and f"ESTABLISHED to 127.0.0.1:{echo.port}" in r.stderr, r.stderr[-2000:]
        # its first write meets the closed socket (EPIPE), or its read does (ENOTCONN): never a hang, never an EOF
        assert re.search(r"connection closed \((BrokenPipeError|OSError)\) at step \d+; reconnecting", r.stderr), r.stderr[-2000:]
    finally:
        echo.close()


class _DocService:
    """A service outside the tree that answers each connection with one 32 KiB document and closes."""

    DOC = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(1024))

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.makefile("rb").readline()
                conn.sendall(self.DOC)

    def close(self) -> None:
        self.sock.close()


def tcp_close_wait(tmp_path: Path) -> None:
    """A connection whose peer outside had sent everything and closed (CLOSE_WAIT, most of the document
    unread): restored closed, so its next read fails and the client fetches again, where an EOF would have
    ended the document short. The output equals an uninterrupted run's, the whole document read."""
    docs = _DocService()
    try:
        cmd = _py("tcp_slow_reader.py", "--steps", STEPS, "--step-seconds", 0.1, "--port", docs.port)
        reference = _reference(cmd, tmp_path / "ref")
        assert reference.endswith(f" bytes={len(_DocService.DOC)}"), reference
        node = Node(tmp_path, "close-wait", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
        ms = node.checkpoints_after_first_step(2)
        node.lose(ms)
        r = _resume(tmp_path, "close-wait", cmd, _env(tmp_path, "node-b"), tmp_path / "job")
        _assert_continued(r, "close-wait", reference)
        assert "CLOSE_WAIT to 127.0.0.1:" in r.stderr, r.stderr[-2000:]  # what the restore closed
        assert re.search(r"connection closed \(OSError\) at byte \d+; fetching again", r.stderr), r.stderr[-2000:]
    finally:
        docs.close()


def tcp_pair(tmp_path: Path) -> None:
    """A connection with both ends in the tree (a parent and its child, as torchrun's ranks and store):
    carried whole, so neither end notices the restore (no reconnect, the same answers)."""
    cmd = _py("tcp_pair.py", "--steps", STEPS, "--step-seconds", 0.1)
    reference = _reference(cmd, tmp_path / "ref")
    node = Node(tmp_path, "pair", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    node.lose(ms)
    r = _resume(tmp_path, "pair", cmd, _env(tmp_path, "node-b"), tmp_path / "job")
    _assert_continued(r, "pair", reference)
    assert "restore closes" not in r.stderr


def tcp_ipv6(tmp_path: Path) -> None:
    """IPv6 listeners on ``[::]``, one IPv6-only and one dual-stack, restored on a node where a process holds
    the IPv6-only one's port on IPv4 (which does not conflict with it, and must not be taken for a port in
    the way): each answers after the restore, the dual-stack one over IPv4 too."""
    v6only, dual = _free_port(), _free_port()
    cmd = _py("tcp_ipv6.py", "--steps", STEPS, "--step-seconds", 0.1, "--port-v6only", v6only, "--port-dual", dual)
    node = Node(tmp_path, "ipv6", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
    reference = _reference(_py("tcp_ipv6.py", "--steps", STEPS, "--port-v6only", _free_port(), "--port-dual",
                               _free_port()), tmp_path / "ref")
    node.lose(node.checkpoints_after_first_step(2))
    ipv4_holder = socket.create_server(("0.0.0.0", v6only))
    try:
        proc = _resume_serving(tmp_path, "ipv6", cmd)
        answers = []
        for host, port in (("::1", v6only), ("::1", dual), ("127.0.0.1", dual)):
            with socket.create_connection((host, port), timeout=10) as c:
                answers.append(c.makefile().readline())
        assert proc.wait(timeout=60) == 0
    finally:
        ipv4_holder.close()
    assert [re.fullmatch(r"at step \d+ (\w+)\n", a).group(1) for a in answers] == ["v6only", "dual", "dual"], answers
    _ended_as_uninterrupted(proc, tmp_path, "ipv6", reference)


def udp_serve(tmp_path: Path) -> None:
    """A bound UDP socket (a serving worker's health or metrics endpoint): bound again on the same port
    after the restore, and a datagram sent to it then is answered by the restored process."""
    port = _free_port()
    cmd = _py("udp_serve.py", "--steps", STEPS, "--step-seconds", 0.1, "--port", port)
    node = Node(tmp_path, "udp-serve", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
    reference = _reference(_py("udp_serve.py", "--steps", STEPS, "--port", _free_port()), tmp_path / "ref")
    node.lose(node.checkpoints_after_first_step(2))
    proc = _resume_serving(tmp_path, "udp-serve", cmd)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
        c.settimeout(5)
        c.sendto(b"?", ("127.0.0.1", port))
        answer = c.recv(64).decode()
    assert re.fullmatch(r"at step \d+", answer), answer
    out = _ended_as_uninterrupted(proc, tmp_path, "udp-serve", reference)
    assert f"step {answer.split()[-1]}/{STEPS}" in out  # it answered from the restored run's steps


def udp_client(tmp_path: Path) -> None:
    """A connected UDP socket to a service outside the tree (a resolver, a collector): restored with its
    addresses, it sends from the same port, and the answers reach it; nothing to reconnect."""
    echo = UdpEcho()
    try:
        cmd = _py("udp_client.py", "--steps", STEPS, "--step-seconds", 0.1, "--port", echo.port)
        reference = _reference(cmd, tmp_path / "ref")
        node = Node(tmp_path, "udp-client", cmd, _env(tmp_path, "node-a"), tmp_path / "job")
        node.lose(node.checkpoints_after_first_step(2))
        r = _resume(tmp_path, "udp-client", cmd, _env(tmp_path, "node-b"), tmp_path / "job")
        _assert_continued(r, "udp-client", reference)
        # A datagram in flight when the tree froze is lost, as UDP loses any (the answer reached the
        # old process): one resend, of the exchange the restored process resumes in, and no other.
        lost = [int(s) for s in re.findall(r"no answer \(\w+\) at step (\d+)", r.stderr)]
        first = int(re.search(r"^step (\d+)/", r.stdout, re.M).group(1))
        assert lost in ([], [first]) and "restore closes" not in r.stderr, r.stderr[-2000:]
    finally:
        echo.close()


def env_credential(tmp_path: Path) -> None:
    """A credential the job was given in its environment is still there after the restore; the store's
    own credential never reaches the workload (nor its checkpoint images)."""
    token, store_secret = f"tok-{secrets.token_hex(12)}", f"store-{secrets.token_hex(12)}"
    creds = {"MY_API_TOKEN": token, "AWS_SECRET_ACCESS_KEY": store_secret, "AWS_ACCESS_KEY_ID": "AKIDSHAPES"}
    cmd = _py("env_token.py", "--steps", STEPS, "--step-seconds", 0.1)
    reference = subprocess.run([*cmd, "--step-seconds", "0"], capture_output=True, text=True, check=True,
                               env={**os.environ, "MY_API_TOKEN": token}).stdout.splitlines()
    node = Node(tmp_path, "envtok", cmd, _env(tmp_path, "node-a", **creds), tmp_path / "job")
    ms = node.checkpoints_after_first_step(2)
    environ = Path(f"/proc/{ms[-1]['process']['pid']}/environ").read_bytes().split(b"\0")
    assert f"MY_API_TOKEN={token}".encode() in environ
    assert not any(v.startswith((b"AWS_SECRET_ACCESS_KEY=", b"AWS_ACCESS_KEY_ID=")) for v in environ)
    node.lose(ms)
    assert "store secret visible: False" in node.out
    images = _image_bytes(tmp_path, ms[-1])
    assert token.encode() in images and store_secret.encode() not in images  # the job's token is in the store
    # node-b's supervisor has the store's credentials too, but not the job's token: the job keeps its own
    env_b = _env(tmp_path, "node-b", AWS_SECRET_ACCESS_KEY=store_secret, AWS_ACCESS_KEY_ID="AKIDSHAPES")
    r = _resume(tmp_path, "envtok", cmd, env_b, tmp_path / "job")
    out = _assert_continued(r, "envtok", reference[-1])
    assert out[-3:-1] == reference[-3:-1]  # the same token, and the store secret still not visible
    assert out[-2] == "store secret visible: False"


SHAPE_CASES = [
    pytest.param(torch_dataloader, id="torch-dataloader-signed"),
    pytest.param(mp_pool_fork, id="mp-pool-fork"),
    pytest.param(posix_shm, id="posix-shm-signed"),
    pytest.param(np_memmap, id="np-memmap-signed"),
    pytest.param(sqlite_signed, id="sqlite-signed"),
    pytest.param(shell_pipeline, id="shell-pipeline"),
    pytest.param(tcp_listen, id="tcp-listen"),
    pytest.param(tcp_established, id="tcp-established"),
    pytest.param(tcp_pair, id="tcp-pair"),
    pytest.param(tcp_close_wait, id="tcp-close-wait"),
    pytest.param(tcp_port_taken, id="tcp-port-taken"),
    pytest.param(tcp_ipv6, id="tcp-ipv6"),
    pytest.param(udp_serve, id="udp-serve"),
    pytest.param(udp_client, id="udp-client"),
    pytest.param(env_credential, id="env-credential"),
]


@pytest.mark.parametrize("shape", SHAPE_CASES)
def test_workload_shape(shape: Callable[[Path], None], tmp_path: Path) -> None:
    try:
        shape(tmp_path)
    finally:
        _stop_started()


def _stop_started() -> None:
    """A supervisor killed here takes its workload with it (its watchdog)."""
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def test_narrowed_roots_first_heartbeat_names_what_a_restore_would_refuse(tmp_path: Path) -> None:
    try:
        _narrowed_first_heartbeat(tmp_path)
    finally:
        _stop_started()


def _narrowed_first_heartbeat(tmp_path: Path) -> None:
    """Signed by the node key, on a node whose restore_roots leave the database out: its first heartbeat
    says so; a node with the default roots restores it where it was."""
    (tmp_path / "data").mkdir()
    db = tmp_path / "data" / "steps.db"
    cmd = _py("sqlite_loop.py", "--steps", STEPS, "--step-seconds", 0.1, "--db", db)
    node = Node(tmp_path, "unsigned", cmd, _env(tmp_path, "node-a", CEDANA_RESTORE_ROOTS=str(tmp_path / "job")),
                tmp_path / "job")
    ms = node.checkpoints_after_first_step(1)
    # the heartbeat's last line: everything it had to say about this checkpoint is said by then
    node.wait_for(lambda: f"checkpoint seq={ms[-1]['seq']}: " in node.err, "the heartbeat's log")
    node.lose(ms)
    assert str(db) in [c["path"] for c in ms[-1]["captured"]]
    first = node.err
    assert "would refuse" in first and str(db) in first and "restore_roots" in first, first[-3000:]
