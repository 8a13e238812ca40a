"""A store that heals, with real CRIU on file:// and on moto's S3: a chunk shared by the latest
checkpoints goes bad in the store; a reader (`check --read-data --repair`, or a drill's verify that is
refused) sets it aside; the running workload's next heartbeat uploads it again; the newest
checkpoint then restores with the uninterrupted run's digest."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.format import chunking
from cedana_airflow.store import open_store
from cedana_airflow.store.base import chunk_key
from cedana_airflow.store.transfer import load_manifests
from conftest import TRAIN, cli, cli_env, kill_node, start_cli, uninterrupted_digest

pytestmark = pytest.mark.integration

# almost no state rewritten per step: the chunk made bad stays in every later checkpoint until it is healed
# 30 s of steps: two heartbeats, a repair, two more heartbeats and the loss all come before the end, on a busy machine
# too; the restored run needs none of that time and goes on without its sleeps
ARGS = ["--mb", "40", "--steps", "300", "--step-seconds", "0.1", "--change-fraction", "0.0001",
        "--fast-after-restores", "1"]


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    bucket = request.getfixturevalue("bucket")  # named after the test, cut to 50 characters: shared by the cases
    return f"s3://{bucket}/heal-{os.urandom(4).hex()}"


def _never_rewritten() -> bytes:
    """The second half of train.py's state under ARGS: its steps rewrite the array from the start, a few
    KB each, never reaching it. (The first shared chunk in file order could be Python's heap, gone from
    the next checkpoint, and then nothing would upload it again.)"""
    import numpy as np

    n = int(ARGS[ARGS.index("--mb") + 1]) * (1 << 20) // 8
    return np.random.default_rng(1234).standard_normal(n).tobytes()[n * 8 // 2:]


def _wait(what, cond, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the supervisor exited early ({proc.returncode}) waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


@pytest.mark.parametrize("reader", ["check", "refused-verify"])
def test_a_bad_shared_chunk_is_set_aside_uploaded_again_by_the_next_heartbeat_and_the_newest_restores(
        tmp_path, store_url, reader):
    env = cli_env(tmp_path, "node-a", "work-a", CEDANA_STORE=store_url)
    store = open_store(store_url, load_settings(environ={}))
    proc = start_cli("run", "--id", "heal", "--heartbeat", "1", "--", sys.executable, str(TRAIN), *ARGS, env=env,
                     out=tmp_path / "a")
    try:
        _wait("two checkpoints", lambda: len(store.list_seqs("heal")) >= 2, proc)
        newest, older = load_manifests(store, "heal")[:2]
        shared = {c.digest for f in older.files for c in f.chunks}
        stable = _never_rewritten()  # a chunk that only holds these bytes is in every later checkpoint too
        victim, size = next((c.digest, c.size) for f in newest.files if f.name.startswith("pages-") for c in f.chunks
                            if c.digest in shared and chunking.decode(store.get_chunk(c.digest), c.digest, c.size) in stable)
        blob = bytearray(store.get_chunk(victim))
        blob[len(blob) // 2] ^= 0xFF  # bit rot in the store
        store.delete(chunk_key(victim))
        store.put_if_absent(chunk_key(victim), bytes(blob))

        if reader == "check":
            r = cli("check", "--read-data", "--repair", "--json", env=env)
            assert r.returncode == 1, r.stderr
            report = json.loads(r.stdout)
            assert list(report["bad"]) == [victim] and report["set_aside"] == [victim]
            assert newest.seq in report["unusable"]["heal"] and older.seq in report["unusable"]["heal"]
        else:
            r = cli("drill", "verify", "--ids", "heal", "--sample", "1", "--json", env=env)
            assert r.returncode == 1 and victim in r.stdout + r.stderr, r.stdout + r.stderr
        record = json.loads(store.get(f"quarantine/{victim}.json") or b"{}")
        assert record["digest"] == victim and record["why"]

        # the running workload's next heartbeat uploads it again, from its memory. Counted from the set-aside,
        # not from `newest`: under load the reader outlasts a few heartbeats, and the one in flight now may have
        # looked at the quarantine before the chunk was set aside; the one after it cannot have.
        after = max(store.list_seqs("heal"))
        _wait("a heartbeat after the set-aside", lambda: max(store.list_seqs("heal")) > after + 1, proc)
        assert chunking.decode(store.get_chunk(victim), victim, size)  # back, and good
        assert re.search(r"re-uploading 1 chunk\(s\) set aside as bad checkpoint_id=heal: " + victim,
                         (tmp_path / "a.err").read_text())
        kill_node(proc, load_manifests(store, "heal")[0].process.pid)
        assert cli("check", "--read-data", env=env).returncode == 0  # once nothing writes: every chunk read
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    latest = max(store.list_seqs("heal"))
    r = cli("restore", "--id", "heal", env=cli_env(tmp_path, "node-b", "work-b", CEDANA_STORE=store_url))
    assert r.returncode == 0, r.stderr
    assert f"restored seq {latest} " in r.stderr and "checkpoint_id=heal," in r.stderr  # the newest, no fallback
    assert r.stdout.splitlines()[-1] == uninterrupted_digest(*ARGS)


def test_check_says_what_is_wrong_with_its_own_arguments_in_one_line(tmp_path):
    env = cli_env(tmp_path, "node-a", "work-a")
    r = cli("check", "--read-data-subset", "lots", env=env)
    assert r.returncode == 2 and r.stderr.strip() == ("usage: --read-data-subset lots is not a share; give e.g. "
                                                      "--read-data-subset 10%")
    missing = cli("check", env=env, timeout=60)  # no store at CEDANA_STORE yet
    assert missing.returncode == 1 and missing.stderr.strip().startswith("StoreUnavailable: store file://")
    assert "does not exist" in missing.stderr and missing.stdout == ""
