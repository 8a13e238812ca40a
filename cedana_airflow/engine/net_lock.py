"""CRIU's network lock for dumps with ``--tcp-established``, and what a killed dump leaves of it.

While it dumps a connection, CRIU drops the connection's packets (so nothing the kernel sends or
receives changes the state it copies) and lets them through again when the dump ends. A ``criu dump``
killed in between (its supervisor died: the parent-death signal; a stop gave up on a final checkpoint)
never lets them through: its rules stay, and a later connection that reuses the address pair (the
same ephemeral port to the same database) hangs until it times out, whoever makes it.

- :func:`lock_flags`: nftables where CRIU can use it (one table per dump, ``inet CRIU-<run id>``,
  set up in-process by libnftables: about 0.15 s for 16 sockets where iptables' four processes per
  socket took 0.8 s, on every heartbeat), else CRIU's default, iptables. The engine asks for it only
  for a tree that holds connections: the table costs 12 ms of freeze even with nothing to lock.
- :func:`recorded` / :func:`sweep`: each dump records, while it runs, its criu's pid and its tree's
  connections (``/run/cedana-airflow/net-locks``). A record whose criu is gone names a dead dump's
  lock: its table ``inet CRIU-*`` (the one holding those address pairs) and its iptables rules
  (marked ``0xc114``, CRIU's SOCCR_MARK, on those pairs) are removed. Whether the connections still
  look alive cannot tell: the lock itself dropped the dead tree's FIN, so a peer on this node still
  holds its end. Locks of dumps under way, or of other tools, are never touched. Run before each dump
  and each restore (any supervisor's on the node: a restore here would otherwise put the tree's
  connections back into a dead dump's lock), after one is killed, and after a final dump, whose lock
  CRIU keeps on purpose (exactly its table, by the run id in its images, and its rules). A lock
  whose pairs a live dump's record holds too is left for that dump: two trees on this node connected
  to each other lock the same pair, and iptables rules are told apart by their direction. Needs
  ``nft`` / ``iptables``, skips what is missing, and goes on where one fails or hangs (said once). Not
  covered: a connection that appeared between the scan and the freeze of a dump that is then killed
  with its tree (a dead supervisor, a stop's abort) leaves its lock unrecorded (a window of
  milliseconds).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .fds import net_rows, open_links
from .images import image_messages, message_values
from .inet_image import read_inet_sockets

__all__ = ["RECORDS", "image_pairs", "lock_flags", "recorded", "run_table", "sweep", "tree_pairs"]

log = logging.getLogger(__name__)

#: CRIU's mark on its own packets (soccr.h, SOCCR_MARK): what its iptables lock rules let through.
_MARK = "0xc114"
_IPT_RULE = re.compile(r"^-A (INPUT|OUTPUT) -s (\S+?)(?:/\d+)? -d (\S+?)(?:/\d+)? -p tcp -m mark ! --mark 0xc114 "
                       r"-m tcp --sport (\d+) --dport (\d+) -j DROP$")


@functools.cache
def lock_flags(criu_path: str) -> tuple[str, ...]:
    """``--network-lock nftables`` where this CRIU supports it (``criu check``), else nothing (iptables)."""
    try:
        r = subprocess.run([criu_path, "check", "--feature", "network_lock_nftables"], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return ("--network-lock", "nftables") if r.returncode == 0 else ()


#: A record per criu dump under way on this node: its pid and its tree's connections (address pairs, each
#: from the tree's end: local, then remote). Node-wide and in memory (a reboot takes the locks too); a
#: record whose criu is gone names the lock it left.
RECORDS = Path("/run/cedana-airflow/net-locks")

#: A connection from one end: local address and port, remote address and port. Its other end, in another
#: tree on this node, is another pair (and another dump's lock).
Pair = tuple[str, int, str, int]

_INVENTORY_RUN_ID = 13  # inventory.proto: dump_criu_run_id
_TOOL_SECONDS = 10  # what a sweep waits for nft or iptables


def tree_pairs(pids: Iterable[int]) -> set[Pair]:
    """The tree's TCP connections, each from its end, as CRIU's lock names them."""
    wanted = {int(link[8:-1]) for pid in pids for _, link in open_links(pid) if link.startswith("socket:[")}
    out: set[Pair] = set()
    for r in net_rows(os.getpid(), ("tcp", "tcp6")) if wanted else ():
        if r.inode in wanted and r.state != 10:  # not listeners
            (la, lp), (ra, rp) = (_v4(r.local), _v4(r.remote))
            out.add((la, lp, ra, rp))
    return out


def image_pairs(image_dir: Path) -> set[Pair]:
    """The TCP connections in a dump's images, each from the tree's end: what a dump whose tree is gone had
    locked."""
    return {(*s.src, *s.dst) for s in read_inet_sockets(image_dir) if s.connection}  # IPv4 peers already as IPv4


def run_table(image_dir: Path) -> str | None:
    """The nftables table of the dump that wrote ``image_dir`` (``CRIU-<its run id>``, from inventory.img:
    netfilter.c names it so), or None where the images do not say."""
    try:
        entries = image_messages(image_dir / "inventory.img")
        run_id = message_values(entries[0]).get(_INVENTORY_RUN_ID, []) if entries else []
    except (OSError, ValueError, IndexError):
        return None
    return f"CRIU-{run_id[-1].decode()}" if run_id and isinstance(run_id[-1], bytes) else None


def _both(pairs: Iterable[Pair]) -> set[Pair]:
    """Each pair and its reverse: what a connection's nftables set holds (netfilter.c adds both)."""
    return {q for a, b, c, d in pairs for q in ((a, b, c, d), (c, d, a, b))}


def _v4(end: tuple[str, int]) -> tuple[str, int]:
    """An IPv4 peer of a dual-stack socket as CRIU's lock names it: without ``::ffff:``."""
    return end[0].removeprefix("::ffff:"), end[1]


@contextlib.contextmanager
def recorded(criu: subprocess.Popen[str], pairs: set[Pair], image_dir: Path, *, final: bool = False,
             now: Callable[[], set[Pair]] = set) -> Iterator[None]:
    """While ``criu`` dumps a tree with ``pairs``: a record :func:`sweep` reads if it is killed. Killed
    under a living supervisor, the sweep runs at once, with the tree's pairs as they are ``now`` (a
    connection made after the scan is locked too; a stop's abort kills the tree first, and then only
    the scan's pairs and what the images hold are known); under a dead one, the next dump or restore on
    this node runs it.

    A ``final`` dump (no ``--leave-running``: a stop's last checkpoint) that succeeded keeps its lock on
    purpose (cr-dump.c: for a ``criu restore`` on this node to take over), and nothing would ever lift
    it: its table (named in ``image_dir``'s inventory) and its rules on its pairs are removed at once, with
    ``now`` read from its images (the tree is gone). The restore closes every connection to a peer outside
    anyway, and carries the tree's own whole without it."""
    path = RECORDS / f"{criu.pid}.json"
    if pairs:
        try:
            RECORDS.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"pairs": sorted(pairs)}))
        except OSError as e:  # a read-only /run: only a killed dump's lock is at stake
            log.debug("network lock record not written: %s", e)
    try:
        yield
    finally:
        code = criu.poll()
        killed = code is not None and code < 0  # by a signal: its lock is left
        if killed or (final and code == 0):
            try:
                more = now()
            except (OSError, ValueError) as e:
                log.debug("the tree's connections not read again: %s", e)
                more = set()
            sweep(pairs | more, quiet=not killed, table=None if killed else run_table(image_dir))
        path.unlink(missing_ok=True)


def _records() -> tuple[set[Pair], set[Pair], list[Path]]:
    """The pairs of dead dumps' records, of live dumps' records, and the dead records' files."""
    dead: set[Pair] = set()
    live: set[Pair] = set()
    paths = []
    for path in RECORDS.glob("*.json") if RECORDS.is_dir() else []:
        alive = path.stem.isdigit() and _is_criu(int(path.stem))
        try:
            pairs = {(str(a), int(b), str(c), int(d)) for a, b, c, d in json.loads(path.read_text())["pairs"]}
        except (OSError, ValueError, KeyError, TypeError):
            pairs = set()
        if alive:
            live |= pairs
        else:
            dead |= pairs
            paths.append(path)
    return dead, live, paths


def _tool(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    """``argv`` run, or None where it could not run or did not end in 10 s (legacy iptables waits for the
    xtables lock, which firewalld or kube-proxy may hold): a sweep is best-effort, the next one tries again."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_TOOL_SECONDS)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("network lock sweep: %s did not answer (%s); the next dump or restore tries again", argv[0], e)
        return None


def _nft_stale(dead: set[Pair], live: set[Pair], table: str | None) -> tuple[list[str], bool]:
    """The dead dumps' tables removed, and whether one was left for a live dump that shares its pairs.

    One ``list ruleset inet`` reads every table with its sets' elements: a node keeps the tables it
    cannot judge (another tool's, a dump's whose record is gone), and one call per table made every
    dump and restore pay for each of them (21 left on a test node cost 0.09 s a restore)."""
    nft = shutil.which("nft")
    if nft is None or (r := _tool([nft, "-j", "list", "ruleset", "inet"])) is None:
        return [], False
    tables: dict[str, set[Pair]] = {}
    try:
        items = json.loads(r.stdout)["nftables"]
        for item in items:
            if "table" in item and item["table"]["name"].startswith("CRIU-"):
                tables.setdefault(item["table"]["name"], set())
        for item in items:
            if "set" in item and item["set"].get("table") in tables:
                tables[item["set"]["table"]] |= {
                    (str(e["concat"][0]).removeprefix("::ffff:"), int(e["concat"][1]),
                     str(e["concat"][2]).removeprefix("::ffff:"), int(e["concat"][3]))
                    for e in item["set"].get("elem", []) if isinstance(e, dict) and "concat" in e}
    except (ValueError, KeyError, TypeError, IndexError):
        return [], False
    dead, live = _both(dead), _both(live)
    stale, deferred = [], False
    for name, pairs in tables.items():
        if name != table:
            # A dead dump's: its pairs are a dead record's, and no live one's (the other end of a connection
            # between two trees on this node is the same pair: that dump's table, still needed). Or one a dump
            # made and was killed before it filled, harmless but left for good (never one being filled right
            # now: no criu runs).
            deferred |= bool(pairs & dead and pairs & live)
            if not ((pairs and pairs & dead and not pairs & live) or (not pairs and not _criu_running())):
                continue
        if _tool([nft, "delete", "table", "inet", name]) is not None:
            stale.append(name)
    return stale, deferred


def _is_criu(pid: int) -> bool:
    """Whether ``pid`` runs criu: by its command line, not its name, which is the loader's where criu runs
    through one (scripts/install-criu.sh's private prefix: ``ld-linux-x86-64.so.2 ... criu dump``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return any(os.path.basename(a) == b"criu" for a in args)


def _criu_running() -> bool:
    return any(_is_criu(int(pid)) for pid in os.listdir("/proc") if pid.isdigit())


def _iptables_stale(dead: set[Pair]) -> list[str]:
    """The rules of ``dead``'s connections, each from its end (netfilter.c: OUTPUT from the tree's end,
    INPUT towards it): the rules of the other end, another tree's on this node, are the other way round."""
    out = []
    for tool in ("iptables", "ip6tables"):
        path = shutil.which(tool)
        if path is None or not dead or (r := _tool([path, "-w", "-S"])) is None:
            continue
        for line in r.stdout.splitlines():
            m = _IPT_RULE.match(line)
            if m is None:
                continue
            chain, src, dst, sport, dport = m.groups()
            src, dst = src.removeprefix("::ffff:"), dst.removeprefix("::ffff:")
            mine = (src, int(sport), dst, int(dport)) if chain == "OUTPUT" else (dst, int(dport), src, int(sport))
            if mine in dead and _tool([path, "-w", "-D", chain, *line.split()[2:]]) is not None:
                out.append(f"{tool} {chain} {src}:{sport} -> {dst}:{dport}")
    return out


def sweep(ended: Iterable[Pair] = (), *, quiet: bool = False, table: str | None = None) -> int:
    """Remove the network locks of dumps that are gone (see the module doc), and those of a dump this
    supervisor saw end: on the pairs of ``ended``, and its ``table`` where known; how many. Best-effort:
    a tool that fails or hangs is said once and left to the next sweep. ``quiet``: a lock left on
    purpose, said at info."""
    dead, live, records = _records()
    ended = set(ended)
    tables, deferred = _nft_stale(dead | ended, live, table)
    gone = tables + _iptables_stale(dead | ended)
    if deferred:  # a dead table that shares a pair with a live dump: the records stay for a sweep after it
        if ended - dead:
            with contextlib.suppress(OSError):
                RECORDS.mkdir(parents=True, exist_ok=True)
                (RECORDS / f"ended-{os.getpid()}-{time.monotonic_ns()}.json").write_text(
                    json.dumps({"pairs": sorted(ended - dead)}))
    else:
        for path in records:
            path.unlink(missing_ok=True)
    if gone and quiet:
        log.info("removed the network lock a final criu dump keeps for a restore on this node (%d): %s", len(gone),
                 ", ".join(gone[:5]))
    elif gone:
        log.warning("removed %d network lock(s) a killed criu dump left (they dropped new connections on the "
                    "same address pairs): %s", len(gone), ", ".join(gone[:5]))
    return len(gone)
