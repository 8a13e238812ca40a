"""What a caller may know of the store through the node agent: its checkpoints' facts, never their bytes.

A caller other than root holds neither the store's credentials nor the node key, so a sensor that waits
for a fresh checkpoint, or a drill that picks a running task to fail, asks the agent. The agent answers
from what its key vouches for (an ID's newest signed checkpoint; an unsigned or forged manifest is
nobody's) and only for IDs the caller may see: its own uid's (the signed ``caller`` block), or every
ID for root and for members of the node's ``agent_readers`` and ``agent_drillers`` groups. A row holds
what ``cedana-airflow checkpoints`` lists (seq, node, time, size, the Airflow task), never a chunk, a
path or a key. A caller that does not see every ID names the IDs it asks about, and one it may not
see answers exactly as one that does not exist; only a caller that sees every ID may list them all.

``detail`` adds, for one named ID, what a live drill follows a retry by: the writer lease's holder, the
restore records and the newest vouched checkpoints' seq, time and size. Neither the lease nor the
records are signed (any store writer can write them); they are the store's word, as they are to a drill
that reads the store itself.

Every reply is bounded in bytes, not rows (a task's names may be 250 characters of anything): what does
not fit is asked for again (``rest``, ``next``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointIdError
from ..format.layout import lease_key
from ..format.manifest import Manifest
from ..format.selection import restore_order
from ..format.trust import Trust
from ..ids import validate_checkpoint_id
from ..store.base import Store
from ..store.restores import list_restores
from ..store.transfer import read_manifest
from ..store.writer_lease import LeaseRecord
from .protocol import MAX_QUERY_IDS, Peer, printable

__all__ = ["MAX_DETAILED", "MAX_IDS", "REPLY_BYTES", "Viewer", "checkpoint_rows", "valid_ids"]

#: The most IDs one request may name (a sensor names one; a drill pages through the rest).
MAX_IDS = MAX_QUERY_IDS
#: What the rows of one reply may take, encoded as the protocol sends them (its limit is 64 KiB).
REPLY_BYTES = 48 << 10
MAX_DETAILED = 1
#: The newest restore records a detailed row keeps (a drill looks for one try's), their reasons cut short.
_RESTORES = 4
_LINE = 160
#: What a lease row says: whose try holds it and whether it is still renewed; never its holder's token,
#: host or pid.
_LEASE_FIELDS = {"node", "try_number", "ttl_seconds", "renewed_at"}
_RESTORE_FIELDS = {"outcome", "seq", "try_number", "from_node", "node", "at", "restore_seconds", "gap_seconds"}
#: The newest vouched checkpoints a detailed row lists (a drill looks up the one a retry restored).
_SEQS = 16
#: Manifests read per step, newest seq first, until one the key vouches for: an ID of many checkpoints
#: costs what its newest cost, not all of them.
_STEP = 8


@dataclass(frozen=True)
class Viewer:
    """Who asks, and whether the node lets it see every ID (root the agent trusts, agent_readers, drillers)."""

    peer: Peer
    sees_all: bool

    def sees(self, m: Manifest) -> bool:
        """``m`` is its ID's newest checkpoint the key vouches for: the ID is the caller's to see."""
        return self.sees_all or (m.caller is not None and m.caller.uid == self.peer.uid)


def valid_ids(ids: Iterable[str]) -> list[str]:
    """The names of a store listing that are checkpoint IDs (a shared bucket's other prefixes are not)."""
    out = []
    for cid in ids:
        try:
            out.append(validate_checkpoint_id(cid))
        except CheckpointIdError:
            continue
    return out


def _vouched(store: Store, trust: Trust, cid: str, want: int) -> tuple[list[Manifest], int]:
    """Up to ``want`` of the ID's newest checkpoints the key vouches for (restore order), and how many it
    holds. Read newest seq first, ``_STEP`` at a time, stopping once ``want`` are found."""
    seqs = sorted(store.list_seqs(cid), reverse=True)
    found: list[Manifest] = []
    for at in range(0, len(seqs), _STEP):
        for seq in seqs[at:at + _STEP]:
            m = read_manifest(store, cid, seq)  # unreadable or misplaced: nobody's, as it is to a restore
            if m is not None and trust.signed_by(m) is not None:
                found.append(m)
        if len(found) >= want:
            break
    return restore_order(found)[:want], len(seqs)


def _row(cid: str, m: Manifest, held: int) -> dict[str, Any]:
    return {"id": cid, "seq": m.seq, "try_number": m.try_number, "node": m.node,
            "created_at": m.created_at.isoformat(), "image_bytes": m.image_bytes,
            "engine": "cooperative" if m.cooperative is not None else "criu",
            "airflow": m.airflow.model_dump() if m.airflow is not None else None,
            "uid": m.caller.uid if m.caller is not None else None, "checkpoints": held}


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
        d["from_node"], d["node"] = printable(r.from_node, _LINE), printable(r.node, _LINE)
        d["reason"] = printable(r.reason, _LINE)
        d["refused"] = [printable(x, _LINE) for x in r.refused[:2]]
        restores.append(d)
    seqs = [{"seq": m.seq, "created_at": m.created_at.isoformat(), "image_bytes": m.image_bytes} for m in vouched]
    return {"lease": lease, "restores": restores, "seqs": seqs}


def _size(row: dict[str, Any]) -> int:
    return len(json.dumps(row, separators=(",", ":"))) + 1  # as protocol.send encodes it (ASCII escapes)


def checkpoint_rows(store: Store, trust: Trust, viewer: Viewer, ids: Iterable[str], *,
                    detail: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per ID of ``ids`` that has a checkpoint the key vouches for and the caller may see, in
    ``ids``' order, from its newest vouched checkpoint (restore order), with how many checkpoints it holds;
    and the IDs not answered yet, once the rows fill :data:`REPLY_BYTES` (the caller asks again)."""
    wanted = list(dict.fromkeys(ids))
    out: list[dict[str, Any]] = []
    used = 0
    for i, cid in enumerate(wanted):
        vouched, held = _vouched(store, trust, cid, _SEQS if detail else 1)
        if not vouched or not viewer.sees(vouched[0]):
            continue
        row = _row(cid, vouched[0], held)
        if detail:
            row.update(_detail(store, cid, vouched))
        if out and used + _size(row) > REPLY_BYTES:
            return out, wanted[i:]
        used += _size(row)
        out.append(row)
    return out, []
