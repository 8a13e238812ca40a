"""A job's checkpoint as one (run/job.py), on a real file store and the S3 server: the round, the parts'
marks, the coordinator's commit and the restore's choice, without CRIU (tests/integration/test_jobs.py
runs them with it). Each writer "dies" here by not doing its next step: what the store then holds is what
a reader sees."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from cedana_airflow.errors import CorruptCheckpoint
from cedana_airflow.format import layout
from cedana_airflow.format.manifest import JOB_ENGINE, Manifest, ProcessInfo, parse_manifest
from cedana_airflow.format.signing import sign
from cedana_airflow.format.trust import Trust
from cedana_airflow.run.job import Job, JobRoundFailed, JobSpec
from cedana_airflow.store.gc import _digests_in, collect_garbage
from cedana_airflow.store.transfer import CheckpointMeta, fetch_checkpoint, load_manifests, save_checkpoint

KEY = b"k" * 32
TRUST = Trust(KEY, (), False, None, None)
PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")


@pytest.fixture
def store(file_or_s3_store):
    return file_or_s3_store


def _jobs(s, parts: int = 2, barrier: float = 5.0, try_number: int = 1) -> list[Job]:
    return [Job(s, "job", JobSpec(parts, p, barrier), node=f"node-{p}", try_number=try_number, key=KEY)
            for p in range(parts)]


def _part(store, tmp_path: Path, job: Job, rnd, key: bytes = KEY) -> Manifest:
    """One part's checkpoint in ``rnd``: its images stored, its manifest staged (never committed by itself)."""
    s, cfg = store
    d = tmp_path / f"img-{rnd.seq}-{job.spec.part}-{os.urandom(3).hex()}"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(150_000))
    meta = CheckpointMeta("job", job.node, "4.2.1", PROC, job_part=job.part_block(rnd))
    return save_checkpoint(s, cfg, meta, d, signing_key=key,
                           stage=(rnd.seq, lambda m, data: job.stage(rnd, m, data)))


def _round(store, tmp_path, jobs: list[Job]) -> Manifest:
    coordinator = jobs[0]
    rnd = coordinator.open_round()
    for j in jobs[1:]:
        assert j.next_round(5.0) == rnd  # every part sees the round part 0 opened
    own = _part(store, tmp_path, coordinator, rnd)
    for j in jobs[1:]:
        _part(store, tmp_path, j, rnd)
    return coordinator.commit(rnd, own, refusal=TRUST.refusal, key=KEY, wait=5.0)


def test_a_seq_exists_once_every_part_is_stored_and_each_part_restores_its_own(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    m = _round(store, tmp_path, jobs)
    assert m.engine == JOB_ENGINE and m.required == ("job",) and m.job is not None and m.job.parts == 2
    assert TRUST.refusal(m) is None  # the commit is signed by its writer's node key
    [latest] = load_manifests(s, "job")
    assert latest.seq == m.seq == 1
    parts = [j.part_of(latest, TRUST.refusal) for j in jobs]
    assert [p.node for p in parts] == ["node-0", "node-1"] and all(TRUST.refusal(p) is None for p in parts)
    assert latest.chunk_digests() == parts[0].chunk_digests() | parts[1].chunk_digests()
    for p in parts:  # every part's chunks are there and verify
        fetch_checkpoint(s, p, tmp_path / f"out-{p.node}")
    assert parts[1].job_part is not None and parts[1].job_part.token == parts[0].job_part.token  # one round's
    # what the round left is gone but its document, which keeps its seq from being opened again (gc's, later)
    assert [o.key for o in s.list_objects(layout.rounds_prefix("job"))] == [layout.round_key("job", 1)]


def test_a_part_that_fails_mid_round_leaves_the_previous_seq_the_latest(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    _round(store, tmp_path, jobs)
    rnd = jobs[0].open_round()
    assert jobs[1].next_round(5.0) == rnd
    own = _part(store, tmp_path, jobs[0], rnd)
    jobs[1].fail(rnd, "criu dump failed (exit 1): something")  # its dump failed after the freeze
    with pytest.raises(JobRoundFailed, match=r"part 1 failed \(criu dump failed"):
        jobs[0].commit(rnd, own, refusal=TRUST.refusal, key=KEY, wait=5.0)
    assert [m.seq for m in load_manifests(s, "job")] == [1]
    # the next round goes on past the failed one's seq, and commits
    assert _round(store, tmp_path, jobs).seq == 3


def test_a_part_whose_node_died_after_the_freeze_ends_the_wait_and_commits_nothing(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    rnd = jobs[0].open_round()
    own = _part(store, tmp_path, jobs[0], rnd)  # part 1 never stages, never marks: its node is gone
    with pytest.raises(JobRoundFailed, match=r"part\(s\) 1 stored nothing within 0.5 s"):
        jobs[0].commit(rnd, own, refusal=TRUST.refusal, key=KEY, wait=0.5)
    assert load_manifests(s, "job") == []
    # its stored chunks are nobody's: gc takes them after the grace
    report = collect_garbage(s, grace_seconds=0)
    assert report.chunks_removed == len(own.chunk_digests())


def test_a_coordinator_that_dies_before_its_commit_leaves_no_seq(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    rnd = jobs[0].open_round()
    for j in jobs:
        _part(store, tmp_path, j, rnd)  # every part staged; the coordinator dies before its write
    assert load_manifests(s, "job") == [] and s.list_seqs("job") == []


def test_a_staged_part_a_store_writer_forged_is_refused_at_the_commit(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    rnd = jobs[0].open_round()
    own = _part(store, tmp_path, jobs[0], rnd)
    _part(store, tmp_path, jobs[1], rnd, key=b"x" * 32)  # signed with a key no node of the job holds
    with pytest.raises(JobRoundFailed, match="part 1's staged manifest is refused: it is signed with key"):
        jobs[0].commit(rnd, own, refusal=TRUST.refusal, key=KEY, wait=5.0)
    assert load_manifests(s, "job") == []


def test_a_part_never_restores_a_commit_it_cannot_trust_nor_another_shape_of_job(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    m = _round(store, tmp_path, jobs)
    forged = m.model_copy(update={"seq": 2, "signature": None})
    forged = sign(forged, b"x" * 32)
    with pytest.raises(CorruptCheckpoint, match="never falls back to an older seq on its own"):
        jobs[1].part_of(forged, TRUST.refusal)
    three = Job(s, "job", JobSpec(3, 2, 5.0), node="node-2", try_number=1, key=KEY)
    with pytest.raises(CorruptCheckpoint, match="holds a job of 2 parts, and this run is part 2 of 3"):
        three.part_of(m, TRUST.refusal)
    single = parse_manifest(json.dumps(m.job.members[0].manifest))
    with pytest.raises(CorruptCheckpoint, match="was taken by a run on one node"):
        jobs[0].part_of(single, TRUST.refusal)


def test_a_job_commit_names_every_part_s_chunks_where_an_older_gc_looks_for_them(store, tmp_path):
    """gc before 0.12.0 cannot read the job block and keeps every "digest" a manifest it cannot read names,
    however deep: each part's manifest is inside the commit as JSON, not as a string."""
    s, _ = store
    m = _round(store, tmp_path, _jobs(s))
    assert _digests_in(json.loads(m.to_json())) == m.chunk_digests() != set()


def test_parts_freeze_together_and_none_lets_go_before_every_part_is_frozen(store):
    s, _ = store
    jobs = _jobs(s, parts=3, barrier=10.0)
    rnd = jobs[0].open_round()
    released: dict[int, float] = {}
    marked: dict[int, float] = {}

    def part(j: Job, delay: float) -> None:
        time.sleep(delay)
        marked[j.spec.part] = time.monotonic()
        assert j.hold(rnd) is None
        released[j.spec.part] = time.monotonic()

    threads = [threading.Thread(target=part, args=(j, d)) for j, d in zip(jobs, (0.0, 0.3, 0.6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert min(released.values()) >= max(marked.values())  # the last freeze came before the first thaw


def test_a_part_that_never_freezes_fails_the_round_for_the_others_at_the_barrier(store):
    s, _ = store
    jobs = _jobs(s, barrier=0.5)
    rnd = jobs[0].open_round()
    t0 = time.monotonic()
    why = jobs[0].hold(rnd)
    assert why is not None and "part(s) 1 did not freeze within job_barrier_seconds (0.5 s)" in why
    assert time.monotonic() - t0 < 5


def test_a_store_writer_cannot_release_a_frozen_part_nor_open_a_round_nor_relabel_a_part(store, tmp_path):
    """Marks and rounds carry the node key's HMAC, and a part's place is inside its own signed manifest."""
    s, _ = store
    jobs = _jobs(s, barrier=0.6)
    rnd = jobs[0].open_round()
    forged = layout.round_key("job", rnd.seq + 1)
    s.put_if_absent(forged, json.dumps({"seq": rnd.seq + 1, "attempt": "1", "token": "0" * 32, "freeze_at": time.time(),
                                         "deadline": time.time() + 60, "node": "x", "mac": "0" * 64}).encode())
    assert jobs[1].next_round(0.3) == rnd and jobs[1].next_round(0.3) is None  # the forged one is not joined
    s.put_if_absent(f"{layout.round_prefix('job', rnd.seq)}frozen-1", b"")  # forged: part 1 never froze
    why = jobs[0].hold(rnd)
    assert why is not None and "part(s) 1 did not freeze" in why
    m = _round(store, tmp_path, jobs)
    assert m.seq == rnd.seq + 2  # never the forged round's seq, nor the first round's again
    doc = json.loads(m.to_json())
    doc["job"]["members"][0]["part"], doc["job"]["members"][1]["part"] = 1, 0  # swap the labels (signature aside)
    swapped = parse_manifest(json.dumps(doc))
    with pytest.raises(CorruptCheckpoint):
        jobs[0].part_of(swapped, lambda m: None)


def test_a_part_staged_in_another_round_is_never_committed(store, tmp_path):
    s, _ = store
    jobs = _jobs(s)
    old = jobs[0].open_round()
    new = jobs[0].open_round()
    own = _part(store, tmp_path, jobs[0], new)
    late = _part(store, tmp_path, jobs[1], old)  # staged for the old round...
    key = f"{layout.round_prefix('job', new.seq)}part-1.json"  # ...and copied where the new round looks
    s.put_if_absent(key, s.get(f"{layout.round_prefix('job', old.seq)}part-1.json"))
    with pytest.raises(JobRoundFailed, match="is not this round's part 1"):
        jobs[0].commit(new, own, refusal=TRUST.refusal, key=KEY, wait=5.0)
    assert late.seq == old.seq and load_manifests(s, "job") == []


def test_a_round_of_another_try_is_not_joined(store):
    s, _ = store
    old = _jobs(s, try_number=1)
    new = _jobs(s, try_number=2)
    old[0].open_round()  # a coordinator of the previous try opened it, then died
    assert new[1].next_round(0.3) is None
    rnd = new[0].open_round()
    assert new[1].next_round(2.0) == rnd and rnd.seq == 2


def test_a_commit_of_parts_taken_in_different_modes_is_refused(store, tmp_path):
    """A frozen tree's cut and a step the workload chose are no one cut (mode = auto may take either)."""
    from cedana_airflow.store.transfer import StateSource

    s, cfg = store
    jobs = _jobs(s)
    rnd = jobs[0].open_round()
    own = _part(store, tmp_path, jobs[0], rnd)
    state = tmp_path / "rank-1.pt"
    state.write_bytes(os.urandom(1000))
    meta = CheckpointMeta("job", "node-1", "0.12.0", PROC, job_part=jobs[1].part_block(rnd))
    save_checkpoint(s, cfg, meta, None, state=StateSource(files=(("rank-1.pt", state, 0o600),), request=rnd.seq),
                    signing_key=KEY, stage=(rnd.seq, lambda m, data: jobs[1].stage(rnd, m, data)))
    with pytest.raises(JobRoundFailed, match="taken in different modes"):
        jobs[0].commit(rnd, own, refusal=TRUST.refusal, key=KEY, wait=5.0)


def test_a_part_resumed_twice_in_one_attempt_says_so_instead_of_opening_its_gate_at_once(store):
    from cedana_airflow.errors import NodeInTheWay
    from cedana_airflow.run.job import RestoreGate

    s, _ = store
    jobs = _jobs(s)
    for j in jobs:
        j.up(5)  # the attempt's first resumption of seq 5: every part came up
    with pytest.raises(NodeInTheWay, match="was resumed before by part 1 in this attempt"):
        with RestoreGate(jobs[1], 5, []):
            pass
    later = Job(s, "job", JobSpec(2, 1, 5.0), node="node-1", try_number=2, key=KEY)
    with RestoreGate(later, 5, []) as gate:  # the next try's is its own
        assert gate.open(wait=0.2) is False  # (part 0 of try 2 never came up here)


def test_a_part_whose_resumption_failed_releases_the_others_from_their_gates_at_once(store):
    from cedana_airflow.run.job import RestoreGate

    s, _ = store
    jobs = _jobs(s)
    s.put_if_absent(f"{layout.round_prefix('job', 7)}down-1-1", b"0" * 64)  # forged: releases nobody early...
    with RestoreGate(jobs[0], 7, []) as gate:
        t0 = time.monotonic()
        assert gate.open(wait=0.5) is False and time.monotonic() - t0 >= 0.5  # ...it waited its whole time
    jobs[1].down(8)  # part 1's resumption of seq 8 failed
    with RestoreGate(jobs[0], 8, []) as gate:
        t0 = time.monotonic()
        assert gate.open(wait=30) is False and time.monotonic() - t0 < 5
