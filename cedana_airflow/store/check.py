"""``cedana-airflow check``: is every checkpoint in the store restorable? (restic's ``check``, for us.)

Without reading data: every manifest parses and every chunk it names exists (one listing of
``chunks/``). With ``read_fraction`` > 0: that share of the chunks is also read and verified (BLAKE3,
length), a random subset each time, so repeated partial checks cover the store. With ``repair``: a
missing or bad chunk is set aside (store/quarantine.py), so the next heartbeat of a writer that has
it uploads it again; the checkpoints that name it are unusable until then. Also counted, never a
problem: what nothing references and gc will remove (unreferenced chunks, expired leases, settled
quarantine records, lock and temporary files: hygiene.py).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CorruptCheckpoint
from ..format import chunking, layout
from .base import Store
from .gc import DEFAULT_GRACE_SECONDS
from .hygiene import find_stale
from .quarantine import records, set_aside
from .transfer import load_manifests_of

__all__ = ["CheckReport", "check_store"]


@dataclass
class CheckReport:
    store: str
    ids: int = 0
    checkpoints: int = 0
    chunks: int = 0  # referenced by some checkpoint
    read: int = 0  # of those, read and verified
    missing: dict[str, str] = field(default_factory=dict)  # digest -> why
    bad: dict[str, str] = field(default_factory=dict)
    set_aside: list[str] = field(default_factory=list)  # with repair
    unusable: dict[str, list[int]] = field(default_factory=dict)  # checkpoint ID -> seqs naming a missing/bad chunk
    quarantine: list[dict[str, object]] = field(default_factory=list)  # every record, older findings included
    # What nothing references (gc removes it once older than its grace period; never a problem here):
    # chunks (old: gc would remove them now; young: an upload in flight), and hygiene.py's kinds.
    unreferenced: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.missing and not self.bad

    def to_json(self) -> dict[str, object]:
        return {"store": self.store, "clean": self.clean, "ids": self.ids, "checkpoints": self.checkpoints,
                "chunks": self.chunks, "read": self.read, "missing": self.missing, "bad": self.bad,
                "set_aside": self.set_aside, "unusable": self.unusable, "quarantine": self.quarantine,
                "unreferenced": self.unreferenced}


def check_store(store: Store, *, read_fraction: float = 0.0, repair: bool = False, reader: str = "",
                grace_seconds: float = DEFAULT_GRACE_SECONDS) -> CheckReport:
    if not 0.0 <= read_fraction <= 1.0:
        raise ValueError("read_fraction is a share between 0 and 1")
    report = CheckReport(store.url)
    ids = store.list_ids()
    manifests = load_manifests_of(store, ids)
    sizes: dict[str, int] = {}
    users: dict[str, list[tuple[str, int]]] = {}
    for cid, ms in manifests.items():
        for m in ms:
            report.checkpoints += 1
            for c in m.chunk_refs():
                sizes[c.digest] = c.size
                users.setdefault(c.digest, []).append((cid, m.seq))
    report.ids, report.chunks = len(ids), len(sizes)
    listed = [o for o in store.list_objects(layout.CHUNKS)]
    present = {layout.chunk_digest(o.key) for o in listed if not layout.is_temp(o.key)}
    cutoff = time.time() - grace_seconds
    loose = [o for o in listed if not layout.is_temp(o.key) and layout.chunk_digest(o.key) not in sizes]
    stale = find_stale(store, referenced=set(sizes), present=present, cutoff=cutoff)
    report.unreferenced = {
        "chunks": sum(o.mtime < cutoff for o in loose), "chunk_bytes": sum(o.size for o in loose if o.mtime < cutoff),
        "young_chunks": sum(o.mtime >= cutoff for o in loose),
        "temp": sum(layout.is_temp(o.key) and o.mtime < cutoff for o in listed) + len(stale.temp),
        "expired_leases": len(stale.leases), "settled_quarantine": len(stale.quarantine),
        "lock_files": len(stale.sidecars)}
    for d in sizes:
        if d not in present:
            report.missing[d] = "missing from the store"
    readable = sorted(d for d in sizes if d in present)
    if read_fraction >= 1.0:
        chosen = readable
    else:
        chosen = random.sample(readable, round(len(readable) * read_fraction)) if read_fraction else []

    def verify(d: str) -> tuple[str, str]:
        try:
            chunking.decode(store.get_chunk(d), d, sizes[d])
            return d, ""
        except CorruptCheckpoint as e:
            return d, str(e)

    with ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-check") as pool:
        for d, why in pool.map(verify, chosen):
            report.read += 1
            if why:
                report.bad[d] = why
    if repair:
        for d, why in {**report.missing, **report.bad}.items():
            set_aside(store, d, sizes[d], reader, why)
            report.set_aside.append(d)
    for d in {**report.missing, **report.bad}:
        for cid, seq in users[d]:
            report.unusable.setdefault(cid, [])
            if seq not in report.unusable[cid]:
                report.unusable[cid].append(seq)
    for seqs in report.unusable.values():
        seqs.sort()
    report.quarantine = records(store)
    return report
