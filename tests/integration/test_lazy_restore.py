"""Lazy restore with real CRIU: the restored process runs while its pages stream in from the store,
every page from a verified chunk; a failure mid-stream kills it before it can run on a missing page."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cedana_airflow.config import Settings
from cedana_airflow.engine.page_file import fuse_available
from cedana_airflow.errors import StoreUnavailable
from cedana_airflow.run.runner import run_workload
from conftest import (TRAIN, cli, cli_env, kill_node, manifests, ours, restore_as_the_s3_store_goes_away, start_cli,
                      uninterrupted_digest, wait_for_checkpoint_after, wait_for_checkpoints)

pytestmark = pytest.mark.integration

#: Our own daemon, and both ways pages reach CRIU's (page files need /dev/fuse).
VIAS = ["ours", pytest.param("file", marks=pytest.mark.skipif(not fuse_available()[0], reason="no usable /dev/fuse")), "socket"]


def _train(*extra: str) -> list[str]:
    return [sys.executable, str(TRAIN), *extra]


def _checkpointed_and_lost(tmp_path: Path, cid: str, args: list[str], n: int, **env: str) -> list[dict]:
    proc = start_cli("run", "--id", cid, "--heartbeat", "1", "--", *_train(*args),
                     env=cli_env(tmp_path, "node-a", "work-a", **env), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", cid, n, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    shutil.rmtree(tmp_path / "work-a")
    return manifests(tmp_path / "store", cid)


@pytest.mark.parametrize("via", VIAS)
def test_lazy_restore_on_another_node_ends_with_the_uninterrupted_digest(tmp_path, via):
    # 10 s of steps: after the loss, the restored tree still has time for a heartbeat once its pages are in
    args = ["--mb", "200", "--steps", "100", "--step-seconds", "0.1"]
    _checkpointed_and_lost(tmp_path, "lazy-1", args, 1)
    r = cli("restore", "--id", "lazy-1", "--heartbeat", "1",
            env=cli_env(tmp_path, "node-b", "work-b", CEDANA_LAZY_PAGES_VIA=via))
    assert r.returncode == 0, r.stderr
    assert re.search(rf"lazy restore complete seq=1: every page in [\d.]+ s via {via},", r.stderr)  # every page came in
    assert "(node node-a) on node node-b: " in r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*args)
    # after the pages were in, heartbeats went on from the restored tree
    assert any(m["node"] == "node-b" for m in manifests(tmp_path / "store", "lazy-1"))

    full = cli("restore", "--id", "lazy-1", env=cli_env(tmp_path, "node-c", "work-c", CEDANA_RESTORE_MODE="full"))
    assert full.returncode == 0 and "lazy restore" not in full.stderr, full.stderr


@pytest.mark.parametrize("via", VIAS)
def test_a_corrupt_chunk_met_mid_stream_kills_the_tree_and_the_fallback_says_why(tmp_path, via):
    # Steps enough that the restored tree outlives the stream: a tree that ends before the stream reaches the
    # bad chunk never needs it (once in CI, under load, the run ended first and nothing was met).
    args = ["--mb", "120", "--steps", "120", "--step-seconds", "0.1"]
    # Both checkpoints of a workload past its start-up: under load, the first heartbeat froze train.py while
    # it was still filling its array, and the two shared none of it (CI run 68).
    proc = start_cli("run", "--id", "lazy-bad", "--heartbeat", "1", "--", *_train(*args),
                     env=cli_env(tmp_path, "node-a", "work-a"), out=tmp_path / "a")
    ms = wait_for_checkpoint_after(tmp_path / "store", "lazy-bad", tmp_path / "a.out", "step 1/", proc, n=2)
    kill_node(proc, ms[0]["process"]["pid"])
    shutil.rmtree(tmp_path / "work-a")
    ms = manifests(tmp_path / "store", "lazy-bad")
    newest, older = ms[-1], ms[-2]
    # A chunk both checkpoints share, as far as can be from what the newest wrote anew: memory that
    # streams in behind the running process (what it wrote last is restored up front, and checked then).
    # Only chunks that hold train.py's array, which its steps had not reached yet: anonymous memory, which
    # CRIU always serves lazily. (A chunk that also held a page CRIU restores up front, as the layout of the
    # process sometimes had it, was met before the tree ran: refused, never met mid-stream; CI run 59.)
    [pages] = [f for f in newest["files"] if f["name"].startswith("pages-")]
    older_digests = {c["digest"] for f in older["files"] for c in f["chunks"]}
    new_at = [i for i, c in enumerate(pages["chunks"]) if c["digest"] not in older_digests]
    untouched = _array_tail(args)
    shared = [i for i, c in enumerate(pages["chunks"]) if c["digest"] in older_digests
              and _decoded(tmp_path, c) in untouched]
    assert shared, "no chunk of the array's untouched half was shared by the two checkpoints"
    at = max(shared, key=lambda i: min(abs(i - j) for j in new_at))
    victim = pages["chunks"][at]["digest"]
    path = tmp_path / "store" / "chunks" / victim[:2] / victim
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))

    r = cli("run", "--id", "lazy-bad", "--resume", "--", *_train(*args),
            env=cli_env(tmp_path, "node-b", "work-b", CEDANA_LAZY_PAGES_VIA=via))
    assert r.returncode == 0, r.stderr
    # the stream met it: the tree was killed, and the run restored again in full ...
    assert f"lazy restore failed checkpoint_id=lazy-bad seq={newest['seq']}" in r.stderr
    assert f"chunk {victim}" in r.stderr and "restoring again in full" in r.stderr
    # ... where the older checkpoint, holding the same chunk, was refused too: the command started fresh
    assert f"checkpoint refused checkpoint_id=lazy-bad seq={older['seq']}" in r.stderr
    assert "starting fresh" in r.stderr
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*args)
    assert not ours("criu lazy-pages") and not ours(str(TRAIN)) and str(tmp_path) not in Path("/proc/self/mountinfo").read_text()


def _array_tail(args: list[str]) -> bytes:
    """The second half of train.py's state as it starts: its steps rewrite it from the start, a slice a step."""
    import numpy as np

    n = int(args[args.index("--mb") + 1]) * (1 << 20) // 8
    return np.random.default_rng(1234).standard_normal(n).tobytes()[n * 8 // 2:]


def _decoded(tmp_path: Path, chunk: dict) -> bytes:
    from cedana_airflow.format import chunking

    digest = chunk["digest"]
    return chunking.decode((tmp_path / "store" / "chunks" / digest[:2] / digest).read_bytes(), digest, chunk["size"])


POOL = Path(__file__).resolve().parent.parent / "workloads" / "pool_sum.py"


@pytest.mark.parametrize("via", VIAS)
def test_shared_memory_comes_back_whole_from_a_lazy_restore(tmp_path, via):
    """A parent and its forked pool share seeded bytes in shared anonymous memory (mmap(-1)). CRIU's
    lazy-pages daemon serves private memory only: the shared memory's pages image must be filled
    before ``criu restore`` reads it (it came back as zeros, and the run diverged without a word)."""
    args = ["--seed", "11", "--steps", "60", "--step-seconds", "0.05"]
    proc = start_cli("run", "--id", "lazy-shm", "--heartbeat", "1", "--", sys.executable, str(POOL), *args,
                     env=cli_env(tmp_path, "node-a", "work-a"), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "lazy-shm", 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    assert any(f["name"].startswith("pagemap-shmem-") for f in ms[0]["files"])  # the shared memory's own image
    r = cli("restore", "--id", "lazy-shm", env=cli_env(tmp_path, "node-b", "work-b", CEDANA_LAZY_PAGES_VIA=via))
    assert r.returncode == 0, r.stderr
    assert ", mode lazy" in r.stderr and "start-up" not in r.stdout
    expected = subprocess.run([sys.executable, str(POOL), *args[:-1], "0"], capture_output=True, text=True, check=True)
    assert r.stdout.splitlines()[-1] == expected.stdout.splitlines()[-1]


COW = Path(__file__).resolve().parent.parent / "workloads" / "cow_mapped.py"


def test_a_non_lazy_run_of_more_chunks_than_one_write_takes_is_restored_lazily(tmp_path):
    """Copy-on-write pages of a private file mapping are never lazy: a lazy restore writes them all
    first. With 64 KiB chunks, 96 MiB of them is about 1,500 chunks, more than the 1,024 buffers one
    pwritev takes: that write failed with EINVAL, and the checkpoint was refused."""
    args = ["--mb", "96", "--steps", "200", "--step-seconds", "0.05"]
    env = cli_env(tmp_path, "node-a", "work-a", CEDANA_CHUNK_AVG_BYTES=str(64 << 10))
    proc = start_cli("run", "--id", "cow", "--heartbeat", "1", "--", sys.executable, str(COW), *args, env=env,
                     out=tmp_path / "a", cwd=tmp_path)  # the mapped file lies in tmp_path
    deadline = time.monotonic() + 120
    while b"step 2/" not in (tmp_path / "a.out").read_bytes():  # in its loop: every page written
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "a.err").read_text()[-2000:]
        time.sleep(0.1)
    n = len(manifests(tmp_path / "store", "cow"))
    ms = wait_for_checkpoints(tmp_path / "store", "cow", n + 1, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    r = cli("restore", "--id", "cow", env=cli_env(tmp_path, "node-b", "work-b"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"restored seq {ms[-1]['seq']} " in r.stderr and "checkpoint_id=cow, mode lazy" in r.stderr, r.stderr
    (tmp_path / "ref").mkdir()
    expected = subprocess.run([sys.executable, str(COW), *args[:-1], "0"], capture_output=True, text=True,
                              check=True, cwd=tmp_path / "ref")
    assert r.stdout.splitlines()[-1] == expected.stdout.splitlines()[-1]


def test_a_lazy_path_failure_retries_the_same_checkpoint_in_full(tmp_path, monkeypatch, caplog):
    """An OSError of the lazy machinery (here: the EINVAL a write of more than IOV_MAX buffers got)
    is not the checkpoint's fault: the same checkpoint is restored in full, saying why, and no older
    one is tried."""
    from cedana_airflow.run import lazy_restore

    args = ["--mb", "60", "--steps", "40", "--step-seconds", "0.1"]
    ms = _checkpointed_and_lost(tmp_path, "lazy-retry", args, 2)

    def fill(self):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(lazy_restore.LazyFeed, "fill", fill)
    settings = Settings(store=f"file://{tmp_path / 'store'}", node="node-b", work_dir=tmp_path / "work-b",
                        heartbeat_seconds=0)
    out = tmp_path / "b.out"
    with caplog.at_level("WARNING", logger="cedana_airflow"), open(out, "wb") as sink:
        result = run_workload(settings, "lazy-retry", None, resume=True, handle_signals=False, stdout=sink)
    assert result.exit_code == 0
    assert result.restored_from is not None and result.restored_from.seq == ms[-1]["seq"]  # the newest, not an older one
    assert f"lazy restore failed checkpoint_id=lazy-retry seq={ms[-1]['seq']}: OSError: [Errno 22] Invalid argument; " \
           "retried in full" in caplog.text
    assert "checkpoint refused" not in caplog.text
    assert out.read_text().splitlines()[-1] == uninterrupted_digest(*args)


def test_the_store_going_away_mid_stream_kills_the_tree_and_says_why(tmp_path, monkeypatch):
    # the S3 server stops once our lazy-pages daemon listens (the eager pages are in: every read from then
    # on is a lazy one, and the prefetch, which a 120 MB image outruns the restore with, is still going)
    failed = restore_as_the_s3_store_goes_away(tmp_path, monkeypatch,
                                               reading=lambda: any((tmp_path / "work-b").rglob("lazy-pages.socket")))
    assert len(failed) == 1 and isinstance(failed[0], StoreUnavailable), failed
    assert "\n" not in str(failed[0]) and "s3://gone/ckpt" in str(failed[0])
    assert not ours("criu lazy-pages") and not ours(str(TRAIN))  # nothing left running


def test_ten_rounds_of_checkpoint_kill_lazy_restore_end_with_the_uninterrupted_digest(tmp_path):
    # 40 s of steps: ten rounds (each a lazy restore and a checkpoint of the restored tree) fit, on a busy machine too
    args = ["--mb", "40", "--steps", "400", "--step-seconds", "0.1"]
    proc = start_cli("run", "--id", "rounds", "--heartbeat", "0.5", "--", *_train(*args),
                     env=cli_env(tmp_path, "node-0", "work-0"), out=tmp_path / "r0")
    wait_for_checkpoints(tmp_path / "store", "rounds", 1, proc)
    for i in range(1, 11):
        kill_node(proc, manifests(tmp_path / "store", "rounds")[-1]["process"]["pid"])
        proc = start_cli("restore", "--id", "rounds", "--heartbeat", "0.5",
                         env=cli_env(tmp_path, f"node-{i}", f"work-{i}"), out=tmp_path / f"r{i}")
        # a checkpoint of the restored tree: taken only once every page streamed in
        deadline = time.monotonic() + 60
        while not any(m["node"] == f"node-{i}" for m in manifests(tmp_path / "store", "rounds")):
            assert proc.poll() is None, (tmp_path / f"r{i}.err").read_text()[-2000:]
            assert time.monotonic() < deadline, f"round {i}: the restored tree took no checkpoint"
            time.sleep(0.1)
        assert "lazy restore complete" in (tmp_path / f"r{i}.err").read_text()
    assert proc.wait(timeout=120) == 0, (tmp_path / "r10.err").read_text()[-2000:]
    assert (tmp_path / "r10.out").read_text().splitlines()[-1] == uninterrupted_digest(*args)
    # each killed supervisor had every page in: its page files were unmounted then, none is left behind
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()


MAP_CHURN = Path(__file__).resolve().parent.parent / "workloads" / "map_churn.c"


@pytest.mark.skipif(shutil.which("gcc") is None or not fuse_available()[0], reason="needs gcc and a usable /dev/fuse")
def test_the_same_images_restored_through_our_daemon_and_criu_s_give_the_same_memory(tmp_path):
    """The differential check: a process that changes its mappings as allocators and runtimes do
    (mprotect islands, forks that read the heap, purged and unmapped slices; tests/workloads/map_churn.c),
    checkpointed, lost with its node, and the same checkpoint restored on three nodes: lazily through
    our lazy-pages daemon, lazily through CRIU's, and in full (CRIU reads every page itself). The
    workload folds every byte it holds into its digest at the end: each must print the uninterrupted
    run's. 512 MiB, so that the churn meets pages still streaming in (with 0.7.0's daemon: "no longer
    mapped, dropped", or a tree killed over UFFDIO_UNREGISTER's EINVAL)."""
    exe = tmp_path / "map_churn"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(MAP_CHURN)], check=True)
    args = ["--mb", "512", "--steps", "150", "--seed", "46", "--step-seconds", "0.05"]
    expected = subprocess.run([str(exe), *args[:-1], "0"], capture_output=True, text=True, check=True).stdout
    proc = start_cli("run", "--id", "diff", "--heartbeat", "1", "--", str(exe), *args,
                     env=cli_env(tmp_path, "node-a", "work-a"), out=tmp_path / "a")
    ms = wait_for_checkpoints(tmp_path / "store", "diff", 2, proc)
    kill_node(proc, ms[0]["process"]["pid"])
    seq = manifests(tmp_path / "store", "diff")[-1]["seq"]
    digests = {}
    for node, how in (("node-b", {"CEDANA_LAZY_PAGES_VIA": "ours"}), ("node-c", {"CEDANA_LAZY_PAGES_VIA": "file"}),
                      ("node-d", {"CEDANA_RESTORE_MODE": "full"})):
        # no heartbeat of their own: each restores the same checkpoint
        r = cli("restore", "--id", "diff", "--heartbeat", "3600", env=cli_env(tmp_path, node, f"work-{node}", **how))
        assert r.returncode == 0, r.stderr
        assert re.search(rf"restored seq {seq} \(node node-a\) on node {node}: .*checkpoint_id=diff,", r.stderr), r.stderr
        assert "start-up" not in r.stdout
        via = how.get("CEDANA_LAZY_PAGES_VIA", "full")
        if via == "ours":
            assert re.search(rf"lazy restore complete seq={seq}: every page in [\d.]+ s via ours,", r.stderr), r.stderr
            assert "lazy restore failed" not in r.stderr and "dropped" not in r.stderr
        elif via == "file" and not re.search(rf"lazy restore complete seq={seq}: every page in [\d.]+ s via file,",
                                             r.stderr):
            # CRIU 4.1's own daemon fails on a purge then unmap of the same range (criu/uffd.c:
            # "Failed to unregister ... Invalid argument") and the restore is retried in full
            assert "restoring again in full" in r.stderr, r.stderr
        digests[via] = r.stdout.splitlines()[-1]
    want = expected.splitlines()[-1]
    assert digests == {"ours": want, "file": want, "full": want}
