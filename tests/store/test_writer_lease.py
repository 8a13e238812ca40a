"""The writer lease (store/writer_lease.py): one supervisor writes a checkpoint ID; a newer try takes
over and fences the old one; a dead holder is taken over, a live one refuses the newcomer. On the
file store and on S3 (moto over HTTP, whose If-Match/If-None-Match is the compare-and-swap)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.errors import WriterFenced, WriterLeaseHeld
from cedana_airflow.store import open_store
from cedana_airflow.store.writer_lease import WriterLease, _machine, lease_key

CID = "job-1"


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    url = f"file://{tmp_path / 'store'}" if request.param == "file" else f"s3://{request.getfixturevalue('bucket')}/wl"
    s = open_store(url, load_settings(environ={}))
    s.open(create=True, chunk_avg_bytes=64 << 10)
    return s


def _lease(store, node: str, try_number: int = 0, ttl: float = 1.0) -> WriterLease:
    return WriterLease(store, CID, node=node, try_number=try_number, ttl_seconds=ttl)


def _record(store) -> dict:
    raw = store.get(lease_key(CID))
    return json.loads(raw) if raw else {}


def _plant(store, **fields) -> None:
    """A lease written by a holder that is not in this process (another node, or a dead one)."""
    rec = {"holder": "f" * 32, "node": "node-x", "try_number": 0, "host": "elsewhere", "boot_id": "another-boot",
           "pid_ns": "pid:[1]", "pid": 1, "pid_start": 1, "ttl_seconds": 1.0, "acquired_at": time.time(),
           "renewed_at": time.time()}
    rec.update(fields)
    store.put_if_version(lease_key(CID), json.dumps(rec).encode(), store.get_versioned(lease_key(CID))[1])


def test_a_held_lease_is_renewed_and_released(store):
    a = _lease(store, "node-a", ttl=0.6)
    with a.held():
        first = _record(store)
        assert first["holder"] == a.holder and first["node"] == "node-a"
        deadline = time.monotonic() + 30  # it renews every ttl/3: seen within a few, however busy the machine
        while _record(store)["renewed_at"] == first["renewed_at"]:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        assert _record(store)["holder"] == a.holder
    assert _record(store) == {}  # released: the next supervisor need not wait


def test_a_live_holder_of_the_same_try_refuses_a_second_supervisor(store):
    a = _lease(store, "node-a")
    with a.held():
        with pytest.raises(WriterLeaseHeld) as e:
            _lease(store, "node-b").acquire()
        msg = str(e.value)
        assert "node-a" in msg and "try 0" in msg and "--try-number" in msg and "\n" not in msg
        assert a.fenced is None
        a.confirm()  # still ours


def test_a_newer_try_takes_over_at_once_and_fences_the_old_writer(store):
    old = _lease(store, "node-a", try_number=1, ttl=30)
    with old.held():
        t0 = time.monotonic()
        new = _lease(store, "node-b", try_number=2, ttl=30)
        new.acquire()
        assert time.monotonic() - t0 < 5  # no waiting for the old one's TTL
        with pytest.raises(WriterFenced, match="taken over by node node-b"):
            old.confirm()  # its next commit is refused
        old.renew()  # and its renewals no longer touch the lease
        assert _record(store)["holder"] == new.holder
    assert _record(store)["holder"] == new.holder  # the old one's release left the new lease alone
    new.release()


def test_an_older_try_is_refused_while_a_newer_one_holds_the_lease(store):
    with _lease(store, "node-b", try_number=2).held():
        with pytest.raises(WriterLeaseHeld, match="newer try"):
            _lease(store, "node-a", try_number=1).acquire()


def test_a_dead_holder_on_this_machine_is_taken_over_at_once(store):
    p = subprocess.Popen(["sleep", "0"])
    p.wait()  # its pid now names no process
    _plant(store, boot_id=_machine()[0], pid_ns=os.readlink("/proc/self/ns/pid"),
           pid=p.pid, pid_start=123, ttl_seconds=600)
    t0 = time.monotonic()
    _lease(store, "node-b").acquire()
    assert time.monotonic() - t0 < 5
    assert _record(store)["node"] == "node-b"


def test_a_holder_elsewhere_that_stops_renewing_is_taken_over_after_its_ttl(store):
    _plant(store, ttl_seconds=1.0)
    t0 = time.monotonic()
    _lease(store, "node-b").acquire()
    waited = time.monotonic() - t0
    assert 0.9 < waited < 10  # observed for one TTL first: it might have been alive
    assert _record(store)["node"] == "node-b"


def test_a_lease_that_lapsed_long_ago_is_taken_at_once(store):
    _plant(store, ttl_seconds=60.0, renewed_at=time.time() - 600)
    t0 = time.monotonic()
    _lease(store, "node-b").acquire()
    assert time.monotonic() - t0 < 5


def test_leases_are_not_listed_as_checkpoint_ids(store):
    with _lease(store, "node-a").held():
        assert store.list_ids() == []


def test_a_damaged_lease_protects_nobody_and_is_replaced(store):
    store.put_if_absent(lease_key(CID), b"{not json")
    _lease(store, "node-b").acquire()
    assert _record(store)["node"] == "node-b"


def test_a_newer_try_of_another_task_never_fences_the_owner_and_a_forged_ttl_holds_nobody_long(store):
    """Review of issue 48: a task of another DAG naming the same ID with a higher try took the lease over
    and fenced the running owner; a lease record with a TTL of years held every newcomer forever."""
    owner = WriterLease(store, CID, node="node-a", try_number=1, ttl_seconds=30, owner="dag_a/train/-1")
    with owner.held():
        intruder = WriterLease(store, CID, node="node-b", try_number=2, ttl_seconds=30, owner="dag_b/steal/-1")
        with pytest.raises(WriterLeaseHeld, match=r"held for another task \(dag_a/train/-1\), not this one"):
            intruder.acquire()
        owner.confirm()  # still the owner's: not fenced
        retry = WriterLease(store, CID, node="node-c", try_number=2, ttl_seconds=30, owner="dag_a/train/-1")
        retry.acquire()  # the owner's own retry takes over at once, as before
        retry.release()
    _plant(store, ttl_seconds=1e9)
    t0 = time.monotonic()
    _lease(store, "node-b", ttl=0.5).acquire()
    assert time.monotonic() - t0 < 10  # waited 4 x its own TTL at most, not the record's
