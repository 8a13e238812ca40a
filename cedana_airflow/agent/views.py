"""What a caller may know of the store through the node agent: its checkpoints' facts, never their bytes.

A caller other than root holds neither the store's credentials nor the node key, so a sensor that waits
for a fresh checkpoint, or a drill that picks a running task to fail, asks the agent. The agent answers
from what its key vouches for (an ID's newest signed checkpoint; an unsigned or forged manifest is
nobody's) and only for IDs the caller may see: its own uid's (the signed ``caller`` block), or every
ID for root and for members of the node's ``agent_readers`` groups (a drill's user, the triggerer's).
A row holds what ``cedana-airflow checkpoints`` lists (seq, node, time, size, the Airflow task), never
a chunk, a path or a key. An ID the caller may not see is left out exactly as one that does not exist,
so the answer does not tell another uid's IDs from absent ones.

``detail`` adds, for one named ID, what a live drill follows a retry by: the writer lease's holder, the
restore records and the newest vouched checkpoints' seq, time and size. Neither is signed (any store writer can write them); they are the store's word, as
they are to a drill that reads the store itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..format.layout import lease_key
from ..format.manifest import Manifest
from ..format.trust import Trust
from ..store.base import Store
from ..store.restores import list_restores
from ..store.transfer import load_manifests_of
from ..store.writer_lease import LeaseRecord
from .protocol import MAX_QUERY_IDS, Peer, printable

__all__ = ["MAX_DETAILED", "MAX_IDS", "PAGE_IDS", "Viewer", "checkpoint_rows"]

#: The most IDs one request may name (a sensor names one; a drill pages through the rest).
MAX_IDS = MAX_QUERY_IDS
#: The most IDs one page of "every ID" reads (``next`` says where the next page starts). Bounded so that a
#: reply stays under the protocol's message size: a row is at most about 1.3 KiB (an ID, a DAG, a task
#: and a run ID of at most 250 characters each), and a detailed row about 2 KiB more.
PAGE_IDS = 32
MAX_DETAILED = 1
#: The newest restore records a detailed row keeps (a drill looks for one try's).
_RESTORES = 8
#: What a lease row says: whose try holds it and whether it is still renewed; never its holder's token,
#: host or pid.
_LEASE_FIELDS = {"node", "try_number", "ttl_seconds", "renewed_at"}
#: What a restore record says (its reason and refusals cut to _LINE, at most 3 of those).
_RESTORE_FIELDS = {"outcome", "seq", "try_number", "from_node", "node", "at", "restore_seconds", "gap_seconds"}
_LINE = 300
#: The newest vouched checkpoints a detailed row lists (a drill looks up the one a retry restored).
_SEQS = 16


@dataclass(frozen=True)
class Viewer:
    """Who asks, and what the node lets readers see."""

    peer: Peer
    readers: frozenset[int]  # the gids of the node's agent_readers groups

    @property
    def sees_all(self) -> bool:
        return self.peer.uid == 0 or bool(self.readers & {self.peer.gid, *self.peer.groups})

    def sees(self, m: Manifest) -> bool:
        """``m`` is its ID's newest checkpoint the key vouches for: the ID is the caller's to see."""
        return self.sees_all or (m.caller is not None and m.caller.uid == self.peer.uid)


def _row(cid: str, vouched: Sequence[Manifest]) -> dict[str, Any]:
    m = vouched[0]
    return {"id": cid, "seq": m.seq, "try_number": m.try_number, "node": m.node,
            "created_at": m.created_at.isoformat(), "image_bytes": m.image_bytes,
            "engine": "cooperative" if m.cooperative is not None else "criu",
            "airflow": m.airflow.model_dump() if m.airflow is not None else None,
            "uid": m.caller.uid if m.caller is not None else None, "checkpoints": len(vouched)}


def _detail(store: Store, cid: str, vouched: Sequence[Manifest]) -> dict[str, Any]:
    raw = store.get(lease_key(cid))
    try:
        lease = (LeaseRecord.model_validate_json(raw).model_dump(include=_LEASE_FIELDS) if raw is not None
                 else None)
    except ValueError:
        lease = {"unreadable": True}  # a drill treats it as protecting nobody, as it does reading it itself
    restores = []
    for r in list_restores(store, cid)[-_RESTORES:]:
        d = r.model_dump(mode="json", include=_RESTORE_FIELDS)
        d["reason"] = printable(r.reason, _LINE)
        d["refused"] = [printable(x, _LINE) for x in r.refused[:3]]
        restores.append(d)
    seqs = [{"seq": m.seq, "created_at": m.created_at.isoformat(), "image_bytes": m.image_bytes}
            for m in vouched[:_SEQS]]
    return {"lease": lease, "restores": restores, "seqs": seqs}


def checkpoint_rows(store: Store, trust: Trust, viewer: Viewer, ids: Iterable[str], *,
                    detail: bool = False) -> list[dict[str, Any]]:
    """One row per ID of ``ids`` that has a checkpoint the key vouches for and the caller may see, in
    ``ids``' order; each from the ID's newest vouched checkpoint (restore order), with how many it holds."""
    wanted = list(dict.fromkeys(ids))
    by_id = load_manifests_of(store, wanted)
    out = []
    for cid in wanted:
        vouched = [m for m in by_id[cid] if trust.signed_by(m) is not None]
        if not vouched or not viewer.sees(vouched[0]):
            continue
        row = _row(cid, vouched)
        if detail:
            row.update(_detail(store, cid, vouched))
        out.append(row)
    return out
