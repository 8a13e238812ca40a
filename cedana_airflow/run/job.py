"""A job that spans nodes, checkpointed as one (docs/jobs.md).

Each node's part of the job runs under its own supervisor, every one under the job's checkpoint ID with
its own ``job_part`` (0 to ``job_parts`` - 1). They agree through the store they already share, so no
port is opened between nodes and nothing new needs to be trusted. At each heartbeat:

1. Part 0, the coordinator, opens a round: ``<id>/rounds/<seq>.json``, create-only, naming the seq, its
   attempt (the try, and Slurm's restart count), a fresh token and the moment every part freezes
   (``freeze_at``: a lead ahead, so that how often a part looks does not set the skew; only the nodes'
   clocks and their wake-ups do). A seq is never opened twice: the round's document stays until gc.
2. Every part freezes at that moment (CRIU, ``--leave-running``). Once its images are written, still
   frozen, it marks ``frozen-<part>`` and holds until every part has (:meth:`Job.hold`). A part only
   marks once frozen, and no part lets go before it has seen every mark, so the last freeze comes before
   the first thaw: the connections between the parts are dumped in one cut (what one part sent and the
   other had not read is in one image or the other, never in neither and never twice). Past
   ``job_barrier_seconds`` a part lets go without the others: its dump fails, nothing of it is staged.
3. Each part stores its chunks and stages its manifest (``part-<part>.json``, signed by its node, with a
   required ``job_part`` block: its part, the round's token and the endpoints of its TCP sockets). A
   staged part is no checkpoint: nothing lists or restores it.
4. The coordinator waits for every staged part (or a ``failed-<part>`` mark), verifies each with its
   node key (and that it names this round's token and its own part) and writes the seq's manifest with
   all of them inside (block ``job``; its own part from memory): that create-only write is the commit. A part that failed, a coordinator that died before the write: no manifest, the
   previous seq stays the latest, and the staged parts' chunks are garbage for gc.

The round's document and every mark carry an HMAC with the node key (the key every node of the fleet
holds, format/signing.py): a store writer without it can stall a round, never release a frozen part
early or slip a part into a commit.

A restore of part r restores part r of the newest committed seq and never an older one on its own
(parts of two seqs do not fit together): where it cannot, its try fails, in one line. Its connections to
another part's endpoints (as that part's signed block names them) are restored whole, so the node it
resumes on needs the address its part had (the job's network namespace, a pod IP that moves with the
pod); until every part of this attempt is up from the same seq, each drops those connections' packets
(:class:`RestoreGate`), so that no part's kernel answers a resumed peer with a reset before its own
sockets are back. A part whose peers do not come up in time fails its try rather than run on alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from .. import __version__
from ..config import Settings
from ..engine.inet_image import InetSk
from ..errors import CedanaError, CorruptCheckpoint, NodeInTheWay
from ..format import layout
from ..format.manifest import JOB_ENGINE, MARKED_BLOCKS_VERSION, JobMember, JobPart, JobState, Manifest, parse_manifest
from ..format.signing import sign
from ..store.base import Store

__all__ = ["Job", "JobRoundFailed", "JobSpec", "RestoreGate", "Round", "joined", "node_addresses"]

log = logging.getLogger(__name__)

#: How far ahead of its opening a round's freeze is appointed: every part has seen it by then.
LEAD_SECONDS = 1.0
#: How often a frozen part looks for the others' marks (it is frozen meanwhile: often).
HOLD_POLL_SECONDS = 0.02
#: How often a part looks for a new round between heartbeats.
WATCH_POLL_SECONDS = 0.25
#: How long the coordinator waits for the other parts' uploads, at least and at most: beyond the least, as
#: long as its own upload took times ``COMMIT_WAIT_FACTOR`` (the parts of one job are about one size). A part
#: whose node died after the freeze marks nothing: this bound is what ends the wait for it. The most: half of
#: gc's grace, which keeps the staged chunks meanwhile.
COMMIT_WAIT_SECONDS = (60.0, 1800.0)
COMMIT_WAIT_FACTOR = 20.0
#: How long a resumed part waits for every other part of its attempt to be up before it gives up its try.
RESTORE_WAIT_SECONDS = 600.0


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
    attempt: str  # the try (and Slurm's restart count): every part of one attempt joins only its rounds
    token: str  # fresh per round: marks and staged parts name it
    freeze_at: float  # unix time: the same moment on every node, as far as their clocks agree
    deadline: float  # unix time: past it nobody holds for the others
    node: str  # the coordinator's

    def to_json(self, key: bytes) -> bytes:
        doc = asdict(self)
        return json.dumps({**doc, "mac": _mac(key, "round", json.dumps(doc, sort_keys=True))}).encode()

    @classmethod
    def parse(cls, raw: bytes, key: bytes) -> Round | None:
        """The round, or None where it does not parse or no node key of ours wrote it."""
        try:
            d = json.loads(raw)
            mac = d.pop("mac")
            rnd = cls(int(d["seq"]), str(d["attempt"]), str(d["token"]), float(d["freeze_at"]),
                      float(d["deadline"]), str(d["node"]))
        except (ValueError, LookupError, TypeError, AttributeError):
            return None
        ok = isinstance(mac, str) and hmac.compare_digest(mac, _mac(key, "round", json.dumps(asdict(rnd), sort_keys=True)))
        return rnd if ok else None


def _mac(key: bytes, *parts: object) -> str:
    return hmac.new(key, "\0".join(["cedana-airflow job", *map(str, parts)]).encode(), hashlib.sha256).hexdigest()


def node_addresses() -> tuple[str, ...]:
    """This node's own global addresses (``ip -j addr``)."""
    ip = shutil.which("ip")
    if ip is None:
        return ()
    r = subprocess.run([ip, "-j", "addr", "show", "scope", "global"], capture_output=True, text=True, timeout=10)
    try:
        return tuple(sorted({str(a["local"]) for link in json.loads(r.stdout) for a in link.get("addr_info", ())
                             if a.get("local")}))[:64]
    except (ValueError, LookupError, TypeError):
        return ()


def endpoints_of(sockets: Sequence[InetSk]) -> tuple[tuple[str, int], ...]:
    """The (address, port) of each TCP socket of a part's image, listeners and connections, that another part
    could be connected to (bound to a port, not loopback: loopback never reaches another node)."""
    out = set()
    for s in sockets:
        if s.proto == 6 and s.src[1] and not ipaddress.ip_address(s.src[0]).is_loopback:
            out.add((str(ipaddress.ip_address(s.src[0])), s.src[1]))
    return tuple(sorted(out))


def _member(m: Manifest, doc: dict[str, object]) -> JobMember:
    """A part's entry in the commit: ``m`` (stored as ``doc``), and what its node signed of when it froze."""
    return JobMember(part=m.job_part.part if m.job_part else 0, node=m.node,
                     froze_after_seconds=m.job_part.froze_after_seconds if m.job_part else 0.0,
                     held_seconds=m.freeze_seconds, manifest=doc)


class Job:
    """One part's view of its job: the rounds it joins or opens, its marks, and the coordinator's commit."""

    def __init__(self, store: Store, checkpoint_id: str, spec: JobSpec, *, node: str, try_number: int, key: bytes,
                 attempt: str = "") -> None:
        self.store, self.checkpoint_id, self.spec = store, checkpoint_id, spec
        self.node, self.try_number, self._key = node, try_number, key
        self.attempt = attempt or str(try_number)
        self._seen = 0  # the newest round this part has looked at
        self.peers: frozenset[tuple[str, int]] = frozenset()  # the other parts' endpoints, from the restored commit

    # -- rounds ---------------------------------------------------------------------------------------
    def _round_seqs(self) -> list[int]:
        prefix = layout.rounds_prefix(self.checkpoint_id)
        found = (layout.parse_round_key(self.checkpoint_id, o.key) for o in self.store.list_objects(prefix))
        return sorted(s for s in found if s is not None)

    def open_round(self) -> Round:
        """The coordinator's: the next seq's round, appointed ``LEAD_SECONDS`` ahead. A seq whose round was
        ever opened is never opened again (its document stays until gc), so no stale mark meets a new round."""
        seqs = self.store.list_seqs(self.checkpoint_id)
        seq = max([0, self._seen, *seqs[-1:], *self._round_seqs()[-1:]]) + 1
        while True:
            now = time.time()
            rnd = Round(seq, self.attempt, secrets.token_hex(16), now + LEAD_SECONDS,
                        now + LEAD_SECONDS + self.spec.barrier_seconds, self.node)
            if self.store.put_if_absent(layout.round_key(self.checkpoint_id, seq), rnd.to_json(self._key)):
                self._seen = seq
                return rnd
            seq += 1

    def next_round(self, wait: float) -> Round | None:
        """The next round of this attempt that is still open, waited for up to ``wait`` seconds; None without one."""
        until = time.monotonic() + wait
        while True:
            for seq in self._round_seqs():
                if seq <= self._seen:
                    continue
                self._seen = seq
                raw = self.store.get(layout.round_key(self.checkpoint_id, seq))
                rnd = Round.parse(raw, self._key) if raw is not None else None
                if rnd is None:
                    log.warning("job round seq %d of checkpoint_id=%s is not one a node of this job opened (it does "
                                "not parse, or no node key of ours signed it); not joined", seq, self.checkpoint_id)
                    continue
                # Another attempt's (a coordinator of a try that is gone) never holds this one frozen.
                if rnd.seq == seq and rnd.attempt == self.attempt and rnd.deadline > time.time():
                    return rnd
            if time.monotonic() >= until:
                return None
            time.sleep(WATCH_POLL_SECONDS)

    def wait_for(self, rnd: Round) -> None:
        """Sleep until the round's appointed freeze."""
        delay = rnd.freeze_at - time.time()
        if delay > 0:
            time.sleep(delay)

    def _signed(self, seq: int, context: str, kind: str, verified: dict[str, bool] | None = None) -> dict[int, str]:
        """Part -> key of each ``<kind>-<part>`` mark of ``seq`` that a node of ours signed for ``context`` (a
        round's token, or an attempt). ``verified``: the keys already judged, so that a poll reads a mark once."""
        prefix = layout.round_prefix(self.checkpoint_id, seq)
        out: dict[int, str] = {}
        for o in self.store.list_objects(prefix):  # (a file store lists folders, not name prefixes)
            name = o.key[len(prefix):]
            part = name[len(kind) + 1:] if name.startswith(f"{kind}-") else ""
            if not (part.isdigit() and int(part) < self.spec.parts):
                continue
            if verified is None or o.key not in verified:
                ok = hmac.compare_digest((self.store.get(o.key) or b"")[:64], self._mark_mac(seq, context, name).encode())
                if verified is not None:
                    verified[o.key] = ok
            else:
                ok = verified[o.key]
            if ok:
                out[int(part)] = o.key
        return out

    def _mark_mac(self, seq: int, context: str, name: str) -> str:
        return _mac(self._key, self.checkpoint_id, seq, context, name)

    def _mark(self, seq: int, context: str, kind: str, body: bytes = b"") -> None:
        """This part's ``<kind>-<part>`` mark of ``seq``: its HMAC for ``context``, then ``body``."""
        name = f"{kind}-{self.spec.part}"
        self.store.put_if_absent(f"{layout.round_prefix(self.checkpoint_id, seq)}{name}",
                                 self._mark_mac(seq, context, name).encode() + body)

    def _staged(self, rnd: Round) -> dict[int, str]:
        """Part -> key of each staged manifest of the round (judged by its own signature at the commit)."""
        prefix = layout.round_prefix(self.checkpoint_id, rnd.seq)
        out: dict[int, str] = {}
        for o in self.store.list_objects(prefix):
            part = o.key[len(prefix):].removeprefix("part-").removesuffix(".json")
            if o.key[len(prefix):] == f"part-{part}.json" and part.isdigit() and int(part) < self.spec.parts:
                out[int(part)] = o.key
        return out

    def hold(self, rnd: Round) -> str | None:
        """Called frozen, images written: mark this part frozen and wait for every part's mark. None once every
        part is frozen; past the round's deadline, or once a part failed, the line that fails this dump."""
        self._mark(rnd.seq, rnd.token, "frozen")
        seen: dict[str, bool] = {}
        while True:
            if failed := self._signed(rnd.seq, rnd.token, "failed", seen):
                return f"job round seq {rnd.seq}: part {min(failed)} failed, so no part's checkpoint is kept"
            have = self._signed(rnd.seq, rnd.token, "frozen", seen)
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
            self._mark(rnd.seq, rnd.token, "failed", why.encode()[:2000])
        except CedanaError as e:
            log.debug("job round seq %d: marking part %d failed: %s", rnd.seq, self.spec.part, e)

    def part_block(self, rnd: Round, sockets: Sequence[InetSk] = (), froze_at: float = 0.0) -> JobPart:
        """What this part's manifest says of its place in the round (signed with it)."""
        after = max(-86400.0, min(86400.0, round(froze_at - rnd.freeze_at, 6))) if froze_at else 0.0
        return JobPart(part=self.spec.part, parts=self.spec.parts, token=rnd.token, endpoints=endpoints_of(sockets),
                       froze_after_seconds=after)

    def stage(self, rnd: Round, m: Manifest, data: bytes) -> None:
        """This part's manifest ``m`` (stored as ``data``), staged for the coordinator's commit (the coordinator's
        own stays in memory)."""
        if self.spec.coordinator:
            return
        key = f"{layout.round_prefix(self.checkpoint_id, rnd.seq)}part-{self.spec.part}.json"
        if not self.store.put_if_absent(key, _member(m, json.loads(data)).model_dump_json().encode()):
            raise JobRoundFailed(f"job round seq {rnd.seq}: part {self.spec.part} was staged already (two supervisors "
                                 "run this part: give each node its own job_part)")

    # -- the coordinator's commit ---------------------------------------------------------------------
    def commit(self, rnd: Round, own: Manifest, *, refusal: Callable[[Manifest], str | None], key: bytes | None,
               before_commit: Callable[[], None] | None = None, own_seconds: float = 0.0,
               wait: float | None = None) -> Manifest:
        """Wait for every other part's staged manifest, verify each, and write the seq's manifest holding them
        all. ``own``: this part's, stored in ``own_seconds`` (the commit takes its process, task and engine
        version). Raises JobRoundFailed, and then clears the round."""
        mine = _member(own, json.loads(own.to_json()))
        try:
            return self._commit(rnd, own, mine, refusal, key, before_commit, wait if wait is not None else
                                min(max(COMMIT_WAIT_SECONDS[0], COMMIT_WAIT_FACTOR * own_seconds), COMMIT_WAIT_SECONDS[1]))
        except JobRoundFailed:
            self.clear(rnd.seq)  # what a slow part stages later is gc's (its rounds folder, after the grace)
            raise

    def _commit(self, rnd: Round, own: Manifest, mine: JobMember, refusal: Callable[[Manifest], str | None],
                key: bytes | None, before_commit: Callable[[], None] | None, wait: float) -> Manifest:
        until = time.monotonic() + wait
        others = set(range(1, self.spec.parts))
        seen: dict[str, bool] = {}
        while True:
            if failed := self._signed(rnd.seq, rnd.token, "failed", seen):
                part = min(failed)
                why = (self.store.get(failed[part]) or b"")[64:].decode(errors="replace").strip()
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part} failed ({why or 'no reason given'}); "
                                     "the previous seq stays the latest")
            staged = self._staged(rnd)
            if others <= set(staged):
                break
            if time.monotonic() > until:
                missing = sorted(others - set(staged))
                raise JobRoundFailed(f"job round seq {rnd.seq}: part(s) {', '.join(map(str, missing[:8]))} stored "
                                     f"nothing within {wait:g} s; the previous seq stays the latest")
            time.sleep(0.1)
        members = [(mine, own)]
        for part in sorted(others):
            raw = self.store.get(staged[part]) or b""
            try:
                member = JobMember.model_validate_json(raw)
                m = parse_manifest(json.dumps(member.manifest))
            except (ValueError, CorruptCheckpoint) as e:
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part}'s staged manifest does not parse "
                                     f"({str(e).splitlines()[0]})") from None
            if (refused := refusal(m)) is not None:  # a store writer without the key cannot slip a part in
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part}'s staged manifest is refused: {refused}")
            # Its own signed block says which part of which round it is, not the name of the key it lies under.
            if (m.checkpoint_id != self.checkpoint_id or m.seq != rnd.seq or m.job_part is None
                    or m.job_part.part != part or m.job_part.parts != self.spec.parts or m.job_part.token != rnd.token
                    or member.part != part):
                raise JobRoundFailed(f"job round seq {rnd.seq}: part {part}'s staged manifest is not this round's part "
                                     f"{part}")
            # What the commit says of it comes from what its node signed, not from the staged wrapper.
            members.append((_member(m, member.manifest), m))
        if len({m.engine for _, m in members}) != 1:  # a cut of frozen trees and a step the workload chose: no
            raise JobRoundFailed(f"job round seq {rnd.seq}: its parts were taken in different modes "
                                 f"({', '.join(sorted({m.engine for _, m in members}))}); set one mode for the job")
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
        """Remove a round's marks and staged parts (best effort: gc's grace covers what is left). Its document
        stays, so that its seq is never opened again."""
        with contextlib.suppress(CedanaError):
            for o in list(self.store.list_objects(layout.round_prefix(self.checkpoint_id, seq))):
                if not o.key.rsplit("/", 1)[-1].startswith("up-"):
                    self.store.delete(o.key)

    def committed(self, seq: int, digests: set[str]) -> bool:
        """Whether this part's staged chunks ``digests`` were committed at ``seq`` (a part learns it at the next
        round: run/checkpointer.py): a job's commit there names this part with exactly those chunks."""
        try:
            raw = self.store.get(layout.manifest_key(self.checkpoint_id, seq))
            m = parse_manifest(raw) if raw is not None else None
            return m is not None and m.job is not None and m.job.member(self.spec.part).chunk_digests() == digests
        except (ValueError, CorruptCheckpoint, StopIteration):
            return False

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
        parts: dict[int, Manifest] = {}
        for member in newest.job.members:
            try:
                m = newest.job.member(member.part)
            except (ValueError, CorruptCheckpoint) as e:
                raise CorruptCheckpoint(f"checkpoint {cid} seq={seq}: part {member.part}'s manifest does not parse "
                                        f"({str(e).splitlines()[0]})") from None
            block = m.job_part
            if (m.checkpoint_id != cid or m.seq != seq or block is None or block.part != member.part
                    or block.parts != self.spec.parts):
                raise CorruptCheckpoint(f"checkpoint {cid} seq={seq}: part {member.part}'s manifest is not part "
                                        f"{member.part} of this commit's round")
            parts[member.part] = m
        if len({m.job_part.token for m in parts.values() if m.job_part is not None}) != 1:
            raise CorruptCheckpoint(f"checkpoint {cid} seq={seq}: its parts were taken in different rounds")
        mine = parts[self.spec.part]
        # (the others' signatures are judged here too: their endpoints choose which connections stay whole)
        for part, m in parts.items():
            if part != self.spec.part and (why := refusal(m)) is not None:
                raise CorruptCheckpoint(f"checkpoint {cid} seq={seq}: part {part}'s manifest is refused: {why}")
        self.peers = frozenset(e for p, m in parts.items() if p != self.spec.part and m.job_part is not None
                               for e in m.job_part.endpoints)
        return mine

    def gate(self, seq: int, connections: Sequence[InetSk]) -> RestoreGate:
        return RestoreGate(self, seq, connections)

    def resumed(self, seq: int, kind: str, seen: dict[str, bool] | None = None) -> dict[int, str]:
        """The parts of this attempt with a signed ``kind`` mark (``up``, ``down``) for ``seq``: each attempt
        marks under names of its own, so a later attempt never meets an earlier one's (put_if_absent)."""
        return self._signed(seq, self.attempt, f"{kind}-{self.attempt}", seen)

    def up(self, seq: int) -> None:
        self._mark(seq, self.attempt, f"up-{self.attempt}")

    def was_up(self, seq: int) -> bool:
        """Whether this part already resumed ``seq`` in this attempt: its own up mark is there."""
        return self.spec.part in self.resumed(seq, "up")

    def down(self, seq: int) -> None:
        """This part's resumption of ``seq`` failed: the parts waiting for it at their gates give up at once
        (best effort: a failure to say so leaves them their wait)."""
        try:
            self._mark(seq, self.attempt, f"down-{self.attempt}")
        except CedanaError as e:
            log.debug("job seq %d: marking part %d down: %s", seq, self.spec.part, e)


class RestoreGate:
    """While this part's tree is restored and until every part of its attempt is up from the same seq: the
    packets of its connections to the other parts are dropped (an nftables table of its own, one rule per
    connection, built from the image's parsed addresses), so that a peer's retransmission meets silence,
    not a reset from a node whose sockets are not back yet. TCP sends again once the gate opens. Without
    ``nft`` it only waits."""

    def __init__(self, job: Job, seq: int, connections: Sequence[InetSk]) -> None:
        self.job, self.seq, self.connections = job, seq, list(connections)
        self.table = f"cedana-job-{os.getpid()}-{secrets.token_hex(4)}"  # the node agent restores many at once
        self._nft = shutil.which("nft") if self.connections else None
        self._closed = False

    def _rules(self) -> str:
        ins, outs = [], []
        for s in self.connections:
            (la, lp), (ra, rp) = s.src, s.dst
            fam = "ip6" if ipaddress.ip_address(la).version == 6 else "ip"
            la, ra = str(ipaddress.ip_address(la)), str(ipaddress.ip_address(ra))  # parsed: nothing else reaches nft
            ins.append(f"{fam} saddr {ra} {fam} daddr {la} tcp sport {int(rp)} tcp dport {int(lp)} drop")
            outs.append(f"{fam} saddr {la} {fam} daddr {ra} tcp sport {int(lp)} tcp dport {int(rp)} drop")
        return (f"table inet {self.table} {{\n"
                "  chain input { type filter hook input priority -150; policy accept;\n    "
                + "\n    ".join(ins) + "\n  }\n"
                "  chain output { type filter hook output priority -150; policy accept;\n    "
                + "\n    ".join(outs) + "\n  }\n}\n")

    def __enter__(self) -> RestoreGate:
        if self.job.was_up(self.seq):  # its peers' marks from then would open the gate before they are back
            raise NodeInTheWay(f"checkpoint {self.job.checkpoint_id} seq={self.seq} was resumed before by part "
                               f"{self.job.spec.part} in this attempt ({self.job.attempt}): give every retry of a "
                               "job a higher try number (--try-number; Airflow's and Slurm's routes do); the "
                               "checkpoint stays the latest")
        _sweep_gates()
        if self.connections and self._nft is None:
            log.warning("nft not found: a resumed part's peers may meet a reset before this part is back")
        if self._nft is None:
            return self
        r = subprocess.run([self._nft, "-f", "-"], input=self._rules(), capture_output=True, text=True, timeout=30)
        if r.returncode:
            log.warning("the job's restore gate was not set (nft: %s): a resumed part's peers may meet a reset",
                        r.stderr.strip()[-200:])
            self._nft = None
        return self

    def open(self, wait: float = RESTORE_WAIT_SECONDS) -> bool:
        """This part is up: say so, and wait for every part of this attempt to be up from this seq; then let
        its connections' packets through. False (the gate closes all the same) where they were not within
        ``wait`` seconds: the caller gives its try up, since its peers will not come."""
        job, seen = self.job, dict[str, bool]()
        try:
            job.up(self.seq)
            until = time.monotonic() + wait
            while len(job.resumed(self.seq, "up", seen)) < job.spec.parts:
                if time.monotonic() > until or job.resumed(self.seq, "down", seen):
                    return False  # (a part whose resumption failed said so: no use waiting for it)
                time.sleep(0.05)
            return True
        finally:
            self._remove()

    def _remove(self) -> None:
        if not self._closed and self._nft is not None:
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
        pid = name.removeprefix("cedana-job-").split("-")[0]
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
