"""What a node accepts from the store: one place that judges a manifest before anything of it is used.

A manifest is trusted when its signature holds with the node key (or, after a migration, a
verify-only legacy key), and, for a caller that is an Airflow task, when it was written by that same
task (its DAG, task and map index: the ``airflow`` block is inside the signed bytes), and, for the node
agent's caller other than root, when it was taken for that caller's uid (the ``caller`` block). An unsigned
manifest is refused unless the node's operator set ``allow_unsigned``; it is never trusted either way
(captured files of an unsigned manifest stay under restore_roots and the working directory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .manifest import AirflowTask, Manifest
from .signing import key_id, signature_problem

__all__ = ["Trust", "owner_text"]


def owner_text(a: AirflowTask) -> str:
    return f"DAG {a.dag_id!r} task {a.task_id!r} (map index {a.map_index})"


@dataclass(frozen=True)
class Trust:
    key: bytes = field(repr=False)  # never in a log line or an error report
    legacy: tuple[bytes, ...] = field(default=(), repr=False)
    allow_unsigned: bool = False
    owner: AirflowTask | None = None  # the restoring task; None: a restore by hand (the node's operator)
    uid: int | None = None  # the node agent's caller (None: a supervisor running as itself; 0: root, any ID)

    def signed_by(self, m: Manifest) -> str | None:
        """'node' or 'legacy' when ``m``'s signature holds with one of this node's keys, else None."""
        if m.signature is None:
            return None
        if signature_problem(m, self.key) is None:
            return "node"
        return "legacy" if any(signature_problem(m, k) is None for k in self.legacy) else None

    def signature_refusal(self, m: Manifest) -> str | None:
        if m.signature is None:
            return None if self.allow_unsigned else (
                "it is not signed, and this node refuses unsigned manifests (allow_unsigned = false)")
        if self.signed_by(m):
            return None
        legacy = next((k for k in self.legacy if m.signature.key_id == key_id(k)), None)
        return signature_problem(m, legacy if legacy is not None else self.key)

    def owner_refusal(self, m: Manifest) -> str | None:
        if not self.uid and m.cooperative is not None and m.caller is not None and m.caller.uid != 0:
            # Restoring a cooperative checkpoint starts a command with the state another uid wrote: as root, or as
            # whoever restores in its own process, that would run that uid's doing with more than it has.
            return (f"it was written by uid {m.caller.uid}'s workload, whose command runs only as uid "
                    f"{m.caller.uid}: restore it as that uid (through the node agent)")
        if self.uid:  # a caller other than root: only its own uid's IDs (the caller block is signed)
            if m.caller is None:
                return (f"it was written without a caller's uid (by a supervisor running as root, or an agent before "
                        f"0.8.2), not for uid {self.uid}; give this task its own checkpoint_id")
            if m.caller.uid != self.uid:
                return f"it belongs to another uid, not to uid {self.uid}; give this task its own checkpoint_id"
        if self.owner is None:
            return None
        mine = owner_text(self.owner)
        if m.airflow is None:
            return f"it was written outside Airflow, not by this task ({mine}); give this task its own checkpoint_id"
        theirs = m.airflow
        if (theirs.dag_id, theirs.task_id, theirs.map_index) != (self.owner.dag_id, self.owner.task_id,
                                                                self.owner.map_index):
            return f"it belongs to {owner_text(theirs)}, not to this task ({mine}); give this task its own checkpoint_id"
        return None

    def refusal(self, m: Manifest) -> str | None:
        """Why ``m`` must not be restored here, or None: the signature first, then the owner."""
        return self.signature_refusal(m) or self.owner_refusal(m)
