"""A job that spans nodes, checkpointed as one (docs/jobs.md).

Each node's part of the job runs under its own supervisor, every one under the job's checkpoint ID with
its own ``job_part`` (0 to ``job_parts`` - 1). They agree through the store they already share, so no
port is opened between nodes and nothing new needs to be trusted. At each heartbeat:

1. Part 0, the coordinator, opens a round: ``<id>/rounds/<seq>.json``, create-only, naming the seq, its
   try and the moment every part freezes (``freeze_at``: a lead ahead, so that how often a part looks
   does not set the skew; only the nodes' clocks and their wake-ups do).
2. Every part freezes at that moment (CRIU, ``--leave-running``). Once its images are written, still
   frozen, it marks ``frozen-<part>`` and holds until every part has (:meth:`Job.hold`). A part only
   marks once frozen, and no part lets go before it has seen every mark, so the last freeze comes before
   the first thaw: the connections between the parts are dumped in one cut (what one part sent and the
   other had not read is in one image or the other, never in neither and never twice). Past
   ``job_barrier_seconds`` a part lets go without the others: its dump fails, nothing of it is staged.
3. Each part stores its chunks and stages its manifest (``part-<part>.json``, signed by its node). A
   staged part is no checkpoint: nothing lists or restores it.
4. The coordinator waits for every staged part (or a ``failed-<part>`` mark), verifies each with its
   node key and writes the seq's manifest with all of them inside (block ``job``): that create-only
   write is the commit. A part that failed, a coordinator that died before the write: no manifest, the
   previous seq stays the latest, and the staged parts' chunks are garbage for gc.

A restore of part r restores part r of the newest committed seq and never an older one on its own
(parts of two seqs do not fit together): where it cannot, its try fails, in one line. Its connections to
the other parts are restored whole, so the node it resumes on needs the address its part had (the job's
network namespace, a pod IP that moves with the pod); until every part is up, each drops the traffic
to and from the others (:class:`RestoreGate`), so that no part's kernel answers a resumed peer with a
reset before its own sockets are back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

from .. import __version__
from ..config import Settings
from ..errors import CedanaError, CorruptCheckpoint
from ..format import layout
from ..format.manifest import (JOB_ENGINE, MARKED_BLOCKS_VERSION, JobMember, JobState, Manifest, parse_manifest)
from ..format.signing import sign
from ..store.base import Store

__all__ = ["Job", "JobRoundFailed", "JobSpec", "RestoreGate", "Round", "node_addresses"]

log = logging.getLogger(__name__)

#: How far ahead of its opening a round's freeze is appointed: every part has seen it by then.
LEAD_SECONDS = 1.0
#: How often a frozen part looks for the others' marks (it is frozen meanwhile: often).
HOLD_POLL_SECONDS = 0.02
#: How often a part looks for a new round between heartbeats.
WATCH_POLL_SECONDS = 0.25
#: How long the coordinator waits for the other parts' uploads, at least and at most: beyond the least, as
#: long as its own upload took times ``COMMIT_WAIT_FACTOR`` (the parts of one job are about one size). A part
#: whose node died after the freeze marks nothing: this bound is what ends the wait for it.
COMMIT_WAIT_SECONDS = (60.0, 1800.0)  # the most: half of gc's grace, which keeps the staged chunks
COMMIT_WAIT_FACTOR = 20.0


class JobRoundFailed(CedanaError):
    """A round of a job's checkpoint did not commit: the previous seq stays the latest."""


@dataclass(frozen=True)
class JobSpec:
    parts: int
    part: int
    barrier_seconds: float

    @classmethod
    def of(cls, settings: Settings) -> JobSpec | None:
        """The job ``settings`` name, or None for a job on one node."""
        if settings.job_parts <= 1:
            return None
        return cls(settings.job_parts, settings.job_part, settings.job_barrier_seconds)

    @property
    def coordinator(self) -> bool:
        return self.part == 0


@dataclass(frozen=True)
class Round:
    seq: int
    try_number: int
    freeze_at: float  # unix time: the same moment on every node, as far as their clocks agree
    deadline: float  # unix time: past it nobody holds for the others
    node: str  # the coordinator's

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Round:
        d = json.loads(raw)
        return cls(int(d["seq"]), int(d["try_number"]), float(d["freeze_at"]), float(d["deadline"]), str(d["node"]))


def node_addresses() -> tuple[str, ...]:
    """This node's own global addresses (``ip -j addr``), as a part's connections to the others use them."""
    ip = shutil.which("ip")
    if ip is None:
        return ()
    r = subprocess.run([ip, "-j", "addr", "show", "scope", "global"], capture_output=True, text=True, timeout=10)
    try:
        return tuple(sorted({str(a["local"]) for link in json.loads(r.stdout) for a in link.get("addr_info", ())
                             if a.get("local")}))[:64]
    except (ValueError, LookupError, TypeError):
        return ()


class Job:
    """One part's view of its job: the rounds it joins or opens, its marks, and the coordinator's commit."""

    def __init__(self, store: Store, checkpoint_id: str, spec: JobSpec, *, node: str, try_number: int) -> None:
        self.store, self.checkpoint_id, self.spec = store, checkpoint_id, spec
        self.node, self.try_number = node, try_number
        self._seen = 0  # the newest round this part has looked at
        self.peers: frozenset[str] = frozenset()  # the other parts' addresses, from the restored commit

    # -- rounds ---------------------------------------------------------------------------------------
    def _round_seqs(self) -> list[int]:
        prefix = layout.rounds_prefix(self.checkpoint_id)
        found = (layout.parse_round_key(self.checkpoint_id, o.key) for o in self.store.list_objects(prefix))
        return sorted(s for s in found if s is not None)

    def open_round(self) -> Round:
        """The coordinator's: the next seq's round, appointed ``LEAD_SECONDS`` ahead."""
        seqs = self.store.list_seqs(self.checkpoint_id)
        seq = max([0, self._seen, *seqs[-1:], *self._round_seqs()[-1:]]) + 1
        while True:
            now = time.time()
            rnd = Round(seq, self.try_number, now + LEAD_SECONDS, now + LEAD_SECONDS + self.spec.barrier_seconds,
                        self.node)
            if self.store.put_if_absent(layout.round_key(self.checkpoint_id, seq), rnd.to_json()):
                self._seen = seq
                return rnd
            seq += 1  # a round of an earlier try failed at this seq: ours goes after it

    def next_round(self, wait: float) -> Round | None:
        """The next round of this try that is still open, waited for up to ``wait`` seconds; None without one."""
        until = time.monotonic() + wait
        while True:
            for seq in self._round_seqs():
                if seq <= self._seen:
                    continue
                self._seen = seq
                raw = self.store.get(layout.round_key(self.checkpoint_id, seq))
                try:
                    rnd = Round.parse(raw) if raw is not None else None
                except (ValueError, LookupError, TypeError):
                    log.warning("job round seq %d of checkpoint_id=%s does not parse; skipped", seq, self.checkpoint_id)
                    continue
                # Another try's (a coordinator of a try that is gone) never holds this one frozen.
                if rnd is not None and rnd.try_number == self.try_number and rnd.deadline > time.time():
                    return rnd
            if time.monotonic() >= until:
                return None
            time.sleep(WATCH_POLL_SECONDS)

    def wait_for(self, rnd: Round) -> None:
        """Sleep until the round's appointed freeze."""
        delay = rnd.freeze_at - time.time()
        if delay > 0:
            time.sleep(delay)

    def _marks(self, rnd: Round, what: str) -> dict[int, str]:
        """Part -> key of each ``<what>-<part>`` mark of the round."""
        prefix = layout.round_prefix(self.checkpoint_id, rnd.seq)
        out: dict[int, str] = {}
        for o in self.store.list_objects(prefix):
            name = o.key[len(prefix):]
            if name.startswith(f"{what}-"):
                part = name[len(what) + 1:].removesuffix(".json")
                if part.isdigit() and int(part) < self.spec.parts:
                    out[int(part)] = o.key
        return out

    def _mark(self, rnd: Round, what: str, body: bytes = b"") -> None:
        self.store.put_if_absent(f"{layout.round_prefix(self.checkpoint_id, rnd.seq)}{what}-{self.spec.part}", body)

    def hold(self, rnd: Round) -> str | None:
        """Called frozen, images written: mark this part frozen and wait for every part's mark. None once every
        part is frozen; past the round's deadline, or once a part failed, the line that fails this dump."""
        self._mark(rnd, "frozen")
        while True:
            if failed := self._marks(rnd, "failed"):
                return f"job round seq {rnd.seq}: part {min(failed)} failed, so no part's checkpoint is kept"
            have = self._marks(rnd, "frozen")
            if len(have) == self.spec.parts:
                return None
            if time.time() > rnd.deadline:
                missing = sorted(set(range(self.spec.parts)) - set(have))
                return (f"job round seq {rnd.seq}: part(s) {', '.join(map(str, missing[:8]))} did not freeze within "
                        f"job_barrier_seconds ({self.spec.barrier_seconds:g} s) of the others; this part ran on "
                        "without a checkpoint (a part's node down, or its supervisor not watching this ID?)")
            time.sleep(HOLD_POLL_SECONDS)

    def fail(self, rnd: Round, why: str) -> None:
        """Mark this part failed in ``rnd`` (best effort): the others let go and the coordinator stops waiting."""
        try:
            self._mark(rnd, "failed", why.encode()[:2000])
        except CedanaError as e:
            log.debug("job round seq %d: marking part %d failed: %s", rnd.seq, self.spec.part, e)

    def stage(self, rnd: Round, data: bytes, froze_at: float, held: float) -> None:
        """This part's manifest, staged for the coordinator's commit."""
        member = JobMember(part=self.spec.part, node=self.node, addresses=node_addresses(),
                           froze_after_seconds=round(froze_at - rnd.freeze_at, 6), held_seconds=round(held, 6),
                           manifest=json.loads(data))
        self._mark_json(rnd, member)

    def _mark_json(self, rnd: Round, member: JobMember) -> None:
        key = f"{layout.round_prefix(self.checkpoint_id, rnd.seq)}part-{self.spec.part}.json"
        if not self.store.put_if_absent(key, member.model_dump_json().encode()):
            raise JobRoundFailed(f"job round seq {rnd.seq}: part {self.spec.part} was staged already (two supervisors "
                                 "run this part: give each node its own job_part)")

    # -- the coordinator's commit ---------------------------------------------------------------------
    def commit(self, rnd: Round, own: Manifest, *, refusal: Callable[[Manifest], str | None], key: bytes | None,
               before_commit: Callable[[], None] | None = None, own_seconds: float = 0.0,
               wait: float | None = None) -> Manifest:
        """Wait for every part's staged manifest, verify each, and write the seq's manifest holding them all.
        ``own``: this part's (the commit takes its process, task and engine version), stored in ``own_seconds``.
        Raises JobRoundFailed, and then clears the round."""
        try:
            return self._commit(rnd, own, refusal, key, before_commit, wait if wait is not None else
                                min(max(COMMIT_WAIT_SECONDS[0], COMMIT_WAIT_FACTOR * own_seconds), COMMIT_WAIT_SECONDS[1]))
        except JobRoundFailed:
            self.clear(rnd.seq)  # what a slow part stages later is gc's (its rounds folder, after the grace)
            raise

    def _commit(self, rnd: Round, own: Manifest, refusal: Callable[[Manifest], str | None], key: bytes | None,
                before_commit: Callable[[], None] | None, wait: float) -> Manifest:
        until = time.monotonic() + wait
        while True:
            if failed := self._marks(rnd, "failed"):
                part = min(failed)
                why = (self.store.get(failed[part]) or b"").decode(errors="replace").strip()
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part} failed ({why or 'no reason given'}); "
                                     "the previous seq stays the latest")
            staged = self._marks(rnd, "part")
            if len(staged) == self.spec.parts:
                break
            if time.monotonic() > until:
                missing = sorted(set(range(self.spec.parts)) - set(staged))
                raise JobRoundFailed(f"job round seq {rnd.seq}: part(s) {', '.join(map(str, missing[:8]))} stored "
                                     f"nothing within {wait:g} s; the previous seq stays the latest")
            time.sleep(0.1)
        members = []
        for part in range(self.spec.parts):
            raw = self.store.get(staged[part]) or b""
            try:
                member = JobMember.model_validate_json(raw)
                m = parse_manifest(json.dumps(member.manifest))
            except (ValueError, CorruptCheckpoint) as e:
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part}'s staged manifest does not parse "
                                     f"({str(e).splitlines()[0]})") from None
            if member.part != part or m.checkpoint_id != self.checkpoint_id or m.seq != rnd.seq or m.is_job:
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part}'s staged manifest names another place")
            if (refused := refusal(m)) is not None:  # a store writer without the key cannot slip a part in
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part}'s staged manifest is refused: {refused}")
            members.append((member, m))
        after = [mb.froze_after_seconds for mb, _ in members]
        job = JobState(parts=self.spec.parts, members=tuple(mb for mb, _ in members),
                       freeze_skew_seconds=round(max(after) - min(after), 6))
        manifest = Manifest(
            format_version=MARKED_BLOCKS_VERSION, writer=f"cedana-airflow {__version__}", required=("job",),
            engine=JOB_ENGINE, checkpoint_id=self.checkpoint_id, seq=rnd.seq, try_number=own.try_number,
            node=self.node, created_at=datetime.now(timezone.utc), engine_version=own.engine_version,
            process=own.process, files=(), image_bytes=sum(m.image_bytes for _, m in members),
            stored_bytes=sum(m.stored_bytes for _, m in members), new_chunks=sum(m.new_chunks for _, m in members),
            freeze_seconds=max(mb.held_seconds for mb, _ in members), parent_seq=own.parent_seq,
            airflow=own.airflow, caller=own.caller, job=job)
        if key is not None:
            manifest = sign(manifest, key)
        if before_commit is not None:
            before_commit()
        # The commit point: until this write succeeds, no part of this seq exists.
        if not self.store.put_manifest(self.checkpoint_id, rnd.seq, manifest.to_json()):
            raise JobRoundFailed(f"job round seq {rnd.seq}: another writer committed this seq first")
        self.clear(rnd.seq)
        return manifest

    def clear(self, seq: int) -> None:
        """Remove a round's document and staged parts (best effort: gc's grace covers what is left)."""
        with contextlib.suppress(CedanaError):
            for o in list(self.store.list_objects(layout.round_prefix(self.checkpoint_id, seq))):
                if not o.key.rsplit("/", 1)[-1].startswith("up-"):
                    self.store.delete(o.key)
            self.store.delete(layout.round_key(self.checkpoint_id, seq))

    # -- restoring ------------------------------------------------------------------------------------
    def part_of(self, newest: Manifest, refusal: Callable[[Manifest], str | None]) -> Manifest:
        """This part's manifest in the newest committed seq; CorruptCheckpoint (one line) where there is none
        this part may restore: a job's part never falls back to an older seq on its own."""
        cid, seq = self.checkpoint_id, newest.seq
        if newest.job is None:
            raise CorruptCheckpoint(f"checkpoint {cid} seq={seq} was taken by a run on one node, not by a job of "
                                    f"{self.spec.parts} parts: give the job its own checkpoint ID, or run it "
                                    "without job_parts")
        if newest.job.parts != self.spec.parts:
            raise CorruptCheckpoint(f"checkpoint {cid} seq={seq} holds a job of {newest.job.parts} parts, and this "
                                    f"run is part {self.spec.part} of {self.spec.parts}: run the job on as many nodes "
                                    "as it was checkpointed on")
        if (why := refusal(newest)) is not None:
            raise CorruptCheckpoint(f"{why}; a job's part never falls back to an older seq on its own, so this try "
                                    "fails")
        try:
            mine = newest.job.member(self.spec.part)
        except (ValueError, CorruptCheckpoint) as e:
            raise CorruptCheckpoint(f"checkpoint {cid} seq={seq}: part {self.spec.part}'s manifest does not parse "
                                    f"({str(e).splitlines()[0]})") from None
        if mine.checkpoint_id != cid or mine.seq != seq or mine.is_job:
            raise CorruptCheckpoint(f"checkpoint {cid} seq={seq}: part {self.spec.part}'s manifest names another place")
        self.peers = frozenset(a for mb in newest.job.members if mb.part != self.spec.part for a in mb.addresses)
        return mine

    def gate(self, seq: int) -> RestoreGate:
        return RestoreGate(self, seq)

    def up(self, seq: int) -> None:
        self.store.put_if_absent(f"{layout.round_prefix(self.checkpoint_id, seq)}up-{self.try_number}-"
                                 f"{self.spec.part}", b"")

    def all_up(self, seq: int) -> bool:
        prefix = layout.round_prefix(self.checkpoint_id, seq)
        mine = f"{prefix}up-{self.try_number}-"  # (a file store lists folders, not name prefixes)
        return len({o.key for o in self.store.list_objects(prefix) if o.key.startswith(mine)}) >= self.spec.parts


class RestoreGate:
    """While this part's tree is restored and until every part's is: the traffic between this node and
    the other parts' addresses is dropped (an nftables table of its own), so a peer's retransmission
    meets silence, not a reset from a node whose sockets are not back yet. TCP sends again once the gate
    opens. Without ``nft`` (or without peers) it only waits."""

    def __init__(self, job: Job, seq: int) -> None:
        self.job, self.seq = job, seq
        self.table = f"cedana-job-{os.getpid()}"
        self._nft = shutil.which("nft")
        self._closed = False

    def __enter__(self) -> RestoreGate:
        _sweep_gates()
        peers = sorted(self.job.peers)
        if not peers or self._nft is None:
            if peers:
                log.warning("nft not found: a resumed part's peers may meet a reset before this part is back")
            return self
        v4 = [a for a in peers if ":" not in a]
        v6 = [a for a in peers if ":" in a]
        rules = []
        for fam, addrs in (("ip", v4), ("ip6", v6)):
            if addrs:
                rules.append((f"{fam} saddr {{ {', '.join(addrs)} }} drop", f"{fam} daddr {{ {', '.join(addrs)} }} drop"))
        text = (f"table inet {self.table} {{\n"
                f"  chain input {{ type filter hook input priority -150; policy accept; {'; '.join(r[0] for r in rules)}; }}\n"
                f"  chain output {{ type filter hook output priority -150; policy accept; {'; '.join(r[1] for r in rules)}; }}\n"
                "}\n")
        r = subprocess.run([self._nft, "-f", "-"], input=text, capture_output=True, text=True, timeout=10)
        if r.returncode:
            log.warning("the job's restore gate was not set (nft: %s): a resumed part's peers may meet a reset",
                        r.stderr.strip()[-200:])
            self._nft = None
        return self

    def open(self) -> float:
        """This part is up: say so, wait (up to job_barrier_seconds) for every part, then let traffic through.
        The seconds waited."""
        t0 = time.monotonic()
        try:
            self.job.up(self.seq)
            until = t0 + self.job.spec.barrier_seconds
            while not self.job.all_up(self.seq):
                if time.monotonic() > until:
                    log.warning("job checkpoint_id=%s seq=%d: not every part was up within job_barrier_seconds "
                                "(%g s); this part's traffic to them goes through now", self.job.checkpoint_id,
                                self.seq, self.job.spec.barrier_seconds)
                    break
                time.sleep(0.05)
        finally:
            self._remove()
        return time.monotonic() - t0

    def _remove(self) -> None:
        if not self._closed and self._nft is not None and self.job.peers:
            subprocess.run([self._nft, "delete", "table", "inet", self.table], capture_output=True, timeout=10)
        self._closed = True

    def __exit__(self, *exc: object) -> None:
        self._remove()  # a failed restore lets traffic through at once


def _sweep_gates() -> None:
    """Remove the gates of supervisors that died holding one (their pid is gone)."""
    nft = shutil.which("nft")
    if nft is None:
        return
    r = subprocess.run([nft, "list", "tables"], capture_output=True, text=True, timeout=10)
    for line in r.stdout.splitlines():
        name = line.split()[-1] if line.startswith("table inet cedana-job-") else ""
        pid = name.removeprefix("cedana-job-")
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run([nft, "delete", "table", "inet", name], capture_output=True, timeout=10)


@contextlib.contextmanager
def joined(job: Job, rnd: Round) -> Iterator[None]:
    """Around a part's work in a round: whatever stops it marks the part failed, so nobody waits for it."""
    try:
        yield
    except BaseException as e:
        job.fail(rnd, str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise
