"""The ``verify`` drill: can the latest checkpoint of each sampled ID be restored? Everything short of
running it, and nothing that disturbs a workload.

For each ID: its newest readable manifest (the one a restore tries first), its signature when this
node has a signing key, every chunk fetched and verified, and the image set checked the way CRIU
would read it (engine/image_check.py). Once per drill: ``criu check`` on this node.

A cooperative checkpoint (the workload wrote it: docs/cooperative.md) has no image set: its files are
put back in a scratch directory and a verify command runs there with CEDANA_RESTORE_DIR naming them;
exit 0 is good. It runs with this node's environment less the store's credentials, as a restore would
start it. Which command: this node's own ``cooperative_verify_command`` where it sets one, else the one
the workload recorded in its manifest, but only where this node's key verified that manifest: a
command read from the store is code, and whoever can write the store must not choose what a drill runs
(issue 48). An unverified manifest's command is not run, and the report says so (``note``).
"""

from __future__ import annotations

import fnmatch
import os
import random
import shlex
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from ..config import Settings
from ..coop import ENV_RESTORE
from ..engine.criu import CriuEngine
from ..engine.image_check import image_set_problems
from ..errors import CedanaError
from ..format.chunking import MAX_CHUNK_FACTOR
from ..format.manifest import Manifest
from ..format.trust import Trust
from ..keys import node_trust
from ..run.environment import workload_env
from ..store.base import Store, StoreConfig
from ..store.listing import list_store
from ..store.transfer import fetch_checkpoint, load_manifests
from .report import CheckedId, DrillReport, new_drill_id, scratch_dir

#: How long a workload's verify command may take.
VERIFY_COMMAND_SECONDS = 600.0

__all__ = ["verify"]


def _check_one(store: Store, cfg: StoreConfig, cid: str, trust: Trust, own_command: tuple[str, ...],
               work: Path) -> CheckedId:
    manifests = load_manifests(store, cid)
    if not manifests:
        return CheckedId(checkpoint_id=cid, ok=False, problem="no readable manifest")
    m = manifests[0]
    if why := trust.signature_refusal(m):  # a restore would refuse it: so does the drill
        return CheckedId(checkpoint_id=cid, ok=False, seq=m.seq, node=m.node, problem=f"seq {m.seq}: {why}")
    dest = work / cid
    t0 = time.monotonic()
    note = ""
    try:
        fetch_checkpoint(store, m, dest, max_chunk_bytes=MAX_CHUNK_FACTOR * cfg.chunk_avg_bytes)
        seconds = time.monotonic() - t0
        if m.is_cooperative:
            argv, note = _verify_command(m, verified=trust.signed_by(m) is not None, own=own_command)
            problems = _state_problems(m, dest, argv)
        else:
            problems = image_set_problems(dest)
    except CedanaError as e:  # a chunk missing or wrong: the message names it
        return CheckedId(checkpoint_id=cid, ok=False, seq=m.seq, node=m.node, problem=str(e))
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    if problems:
        return CheckedId(checkpoint_id=cid, ok=False, seq=m.seq, node=m.node, bytes_fetched=m.image_bytes,
                         fetch_seconds=round(seconds, 3), problem=f"seq {m.seq}: " + "; ".join(problems), note=note)
    return CheckedId(checkpoint_id=cid, ok=True, seq=m.seq, node=m.node, bytes_fetched=m.image_bytes,
                     fetch_seconds=round(seconds, 3), note=note)


def _verify_command(m: Manifest, *, verified: bool, own: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """The command that judges a cooperative checkpoint here, and a note when the recorded one is not run."""
    assert m.cooperative is not None
    if own:
        return own, ""
    recorded = tuple(m.cooperative.verify_command)
    if recorded and not verified:
        return (), (f"seq {m.seq}: its recorded verify command was not run: no key on this node verified the "
                    "manifest that names it (it is unsigned: set cooperative_verify_command to run a command of "
                    "this node's own)")
    return recorded, ""


def _state_problems(m: Manifest, dest: Path, argv: tuple[str, ...]) -> list[str]:
    """A cooperative checkpoint's files, judged by ``argv`` (see _verify_command), if any."""
    if not argv:
        return []  # every chunk verified: all that can be said without the workload's help
    if m.caller is not None and m.caller.uid != os.geteuid():
        # Its files are another uid's doing: a command run on them as this process (root, in a drill) could be
        # made to load one (a `json.py` in its working directory). Every chunk was verified; that is all here.
        return []
    env = {**workload_env(os.environ), ENV_RESTORE: str(dest), "CEDANA_CHECKPOINT_ID": m.checkpoint_id}
    try:
        r = subprocess.run(list(argv), cwd=dest, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=VERIFY_COMMAND_SECONDS)
    except FileNotFoundError:
        return [f"the workload's verify command {argv[0]!r} is not on this node"]
    except subprocess.TimeoutExpired:
        return [f"the workload's verify command ran past {VERIFY_COMMAND_SECONDS:.0f} s"]
    if r.returncode != 0:
        said = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["(it printed nothing)"]
        return [f"the workload's verify command exited {r.returncode}: {said[0][:300]}"]
    return []


def verify(store: Store, cfg: StoreConfig, settings: Settings, engine: CriuEngine | None, *, ids: str = "*",
           sample: int = 10, seed: int | None = None) -> DrillReport:
    """Verify the latest checkpoint of up to ``sample`` IDs matching the glob ``ids``.

    ``engine``: this node's CRIU, for ``criu check`` (None: not checked, said in the report).
    """
    started = datetime.now(timezone.utc)
    problems: list[str] = []
    if engine is None:
        problems.append("criu is not available on this node: images were checked, CRIU itself was not")
    else:
        ok, line = engine.check()
        if not ok:
            problems.append(f"criu check failed on this node: {line}")
    candidates = sorted(x.checkpoint_id for x in list_store(store) if x.checkpoints and fnmatch.fnmatchcase(x.checkpoint_id, ids))
    chosen = sorted(random.Random(seed).sample(candidates, min(sample, len(candidates))))
    if not chosen:
        problems.append(f"no checkpoint ID in {store.url} matches {ids!r}: nothing was verified")
    trust = node_trust(settings)
    work = scratch_dir(settings, "cedana-verify-")
    try:
        own = tuple(shlex.split(settings.cooperative_verify_command))
        checked = tuple(_check_one(store, cfg, cid, trust, own, work) for cid in chosen)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    problems += [f"{c.checkpoint_id}: {c.problem}" for c in checked if not c.ok]
    fetched = sum(c.bytes_fetched for c in checked)
    return DrillReport(
        drill_id=new_drill_id("verify", started), mode="verify", ok=not problems and bool(checked),
        problems=tuple(problems), node=settings.resolved_node(), started_at=started,
        finished_at=datetime.now(timezone.utc), checkpoint_id=chosen[0] if chosen else None,
        restored_seq=checked[0].seq if checked else None, from_node=checked[0].node if checked else "",
        bytes_fetched=fetched, fetch_seconds=round(sum(c.fetch_seconds for c in checked), 3), checked=checked,
    )
