"""``cedana-airflow``: every core capability without a scheduler.

Exit codes: 0 ok; 1 the operation failed; 2 bad usage or configuration. ``run`` and ``restore``
return the workload's own exit code. Errors are one ``ClassName: message`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import signal
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .config import Settings, load_settings
from .errors import AgentUnavailable, CedanaError, ConfigError
from .signal_safe import SignalSafeEvent
from .units import binary_size

if TYPE_CHECKING:
    from .store.base import Store

__all__ = ["main"]

log = logging.getLogger("cedana_airflow.cli")

#: ``gc --wait``: long enough for the saves under way when gc takes its lock (seconds each here, about a
#: minute for a few GiB of new chunks), short enough that writers do not skip heartbeats for long.
GC_WAIT_SECONDS = 60.0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="file:///DIR or s3://bucket/prefix (default: CEDANA_STORE, else ./.cedana/store)")
    p.add_argument("--node", help="this node's name (default: CEDANA_NODE, else the hostname)")
    p.add_argument("--work-dir", help="local work directory (default: CEDANA_WORK_DIR, else a temp dir)")


class _Parser(argparse.ArgumentParser):
    """An error is one line naming the command and what is wrong, and where help is: not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def _duration(text: str) -> float:
    """A duration flag: seconds (90) or with a unit (30s, 10m, 1h, 2d)."""
    from .units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="cedana-airflow", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--version", action="version", version=f"cedana-airflow {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run COMMAND managed, checkpointing on a heartbeat")
    run.add_argument("--resume", action="store_true", help="restore the latest checkpoint of ID if there is one")
    _supervised(run, when_none_left="start fresh")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    rs = sub.add_parser("restore", help="restore the latest complete checkpoint of ID and supervise it")
    _supervised(rs, when_none_left="exit 1")

    sj = sub.add_parser("slurm-job", help="inside a Slurm batch job: `run --resume` when the job is protected "
                        "(checkpoint partition and CEDANA_ENABLE=1), else the command unchanged")
    _supervised(sj, when_none_left="start fresh")
    sj.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    ls = sub.add_parser("checkpoints", help="list checkpoints (all IDs, or one)")
    ls.add_argument("id", nargs="?")
    ls.add_argument("--json", action="store_true", help="print a JSON array, one object per checkpoint ID")
    ls.add_argument("--exact", action="store_true", help="read every manifest instead of the listing index (slow on big stores)")
    _common(ls)

    gc = sub.add_parser("gc", help="remove chunks no checkpoint names (older than the grace period)")
    gc.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    gc.add_argument("--grace", type=_duration, default=None, metavar="DURATION",
                    help="how long an unreferenced chunk is spared: seconds, or 30m, 1h, 2d (default 1h)")
    gc.add_argument("--wait", type=_duration, default=None, metavar="DURATION",
                    help="how long to wait for checkpoints being written to finish; new ones skip their heartbeat "
                         f"meanwhile (default {GC_WAIT_SECONDS:g}s; 0: fail at once)")
    gc.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _common(gc)

    ck = sub.add_parser("check", help="is every checkpoint restorable? (exit 0 clean, 1 problems found, 2 bad input)")
    reading = ck.add_mutually_exclusive_group()
    reading.add_argument("--read-data", action="store_true", help="also read and verify every chunk")
    reading.add_argument("--read-data-subset", metavar="N%", help="read and verify a random N%% of the chunks")
    ck.add_argument("--repair", action="store_true", help="set missing and bad chunks aside, so that the next "
                    "heartbeat of a writer that has them uploads them again")
    ck.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _common(ck)

    ex = sub.add_parser("explain", help="is a task in scope of the opt-in list, and why (not)?")
    ex.add_argument("dag_id")
    ex.add_argument("task_id")
    ex.add_argument("--node", help="the worker (default: this host, or CEDANA_NODE)")
    ex.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="a Kubernetes node label (repeatable)")
    ex.add_argument("--queue", help="the task's Airflow queue (default: from the DAG, else default)")
    ex.add_argument("--pool", help="the task's Airflow pool (default: from the DAG, else default_pool)")
    ex.add_argument("--partition", help="the Slurm partition the task's job goes to (the Slurm route)")
    ex.add_argument("--tag", action="append", default=None, help="a DAG tag (repeatable; default: from the DAG)")
    ex.add_argument("--expected-seconds", type=_duration, metavar="DURATION",
                    help="the task's expected duration, seconds or 30m, 2h (rule short-task)")
    ex.add_argument("--job-server", action="store_true", default=None, help="the task drives a third-party job server")
    ex.add_argument("--gpu", action="store_true", default=None, help="the task uses a GPU")
    ex.add_argument("--no-nvidia", action="store_true", help="the node has no NVIDIA driver (rule gpu)")
    ex.add_argument("--dags-folder", help="read queue, pool, tags and the task's arguments from this DAG folder "
                                          "through Airflow (needs the airflow extra)")
    ex.add_argument("--optin-file", help="the opt-in list (default: CEDANA_OPTIN_FILE / [cedana] optin_file)")
    ex.add_argument("--json", action="store_true", help="print the decision as one JSON object")

    dr = sub.add_parser("drill", help="run a fleet drill here and print its report (exit 0 pass, 1 fail)")
    dr.add_argument("mode", choices=("verify", "canary", "live"),  # drill.run.MODES
                    help="verify: read and check the latest checkpoint of sampled IDs; canary: kill and restore a "
                    "canary workload here and compare its output; live: only inside Airflow (the cedana_fleet_drill DAG)")
    dr.add_argument("--ids", default="*", metavar="PATTERN", help="verify: checkpoint IDs to sample from (a glob)")
    dr.add_argument("--sample", type=int, default=10, metavar="N", help="verify: how many IDs (default 10)")
    dr.add_argument("--mb", type=int, default=64, help="canary: memory it holds, MiB (default 64)")
    dr.add_argument("--steps", type=int, default=60, help="canary: steps it runs (default 60)")
    dr.add_argument("--step-seconds", type=_duration, default=0.1, metavar="DURATION",
                    help="canary: time per step (default 0.1s)")
    dr.add_argument("--heartbeat", type=_duration, default=1.0, metavar="DURATION",
                    help="canary: time between checkpoints (default 1s)")
    dr.add_argument("--heartbeats", type=int, default=2, help="canary: checkpoints before the kill (default 2)")
    dr.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _common(dr)

    drs = sub.add_parser("drills", help="list the drill reports kept in the store")
    drs.add_argument("--json", action="store_true", help="print the reports and their trends as one JSON object")
    _common(drs)

    doc = sub.add_parser("doctor", help="check that checkpointing can work here")
    doc.add_argument("--json", action="store_true", help="print the checks as a JSON array")
    doc.add_argument("--probe-store", action="store_true", help="also check that the store can be written: creates "
                     "store.json where absent and, on a file store, writes and removes a probe file (without it, "
                     "doctor writes nothing)")
    _common(doc)

    key = sub.add_parser("key", help="the node key that signs and verifies checkpoints (docs/security.md)")
    key.add_argument("action", choices=("init", "show"), help="init: create it (never replaces one); show: where "
                     "it is and its public key ID (never the key)")
    key.add_argument("--file", type=Path, default=None, help="the key file (default: signing_key_file, else "
                     "/etc/cedana-airflow/node.key)")
    key.add_argument("--json", action="store_true", help="print the key's file and ID as one JSON object")

    from .agent.__main__ import add_arguments as agent_arguments

    agent = sub.add_parser("agent", help="run the node agent in the foreground (root): it checkpoints unprivileged "
                           "callers' workloads (docs/agent.md)")
    agent_arguments(agent)
    return ap


def _cmd_key(args: argparse.Namespace) -> int:
    from .keys import DEFAULT_KEY_FILE, init_key, node_key, read_key_file
    from .format.signing import key_id

    settings = load_settings()
    path = args.file or settings.signing_key_file or DEFAULT_KEY_FILE
    if args.action == "init":
        made = init_key(path)
        out = {"file": str(path), "key_id": made.key_id, "created": True}
    elif args.file is not None:
        out = {"file": str(path), "key_id": key_id(read_key_file(path, "node key", "--file")), "created": False}
    else:
        if settings.signing_key_file is None and settings.signing_key is None and not path.exists():
            raise ConfigError(f"no node key at {path} (the default). Create it with 'cedana-airflow key init' as root, "
                              "or copy the key of the other nodes of this store there.")
        k = node_key(settings)
        out = {"file": k.where, "key_id": k.key_id, "created": False}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"node key {out['file']}: key {out['key_id']}" + (" (created now: copy it to every node of this store)"
                                                                 if out["created"] else ""))
    return 0


def _heartbeat(text: str) -> float | str:
    """--heartbeat: a duration (90, 30s, 10m), or auto (Settings judges the number)."""
    if text.strip().lower() == "auto":
        return "auto"
    from .units import parse_duration

    try:
        return parse_duration(text.lstrip("-")) * (-1 if text.strip().startswith("-") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a duration (90, 30s, 10m) nor auto") from None


def _job_part(text: str) -> tuple[int, int]:
    part, sep, parts = text.partition("/")
    if not (sep and part.strip().isdigit() and parts.strip().isdigit() and int(part) < int(parts)):
        raise argparse.ArgumentTypeError(f"{text!r} is not PART/PARTS with 0 <= PART < PARTS (e.g. 1/2)")
    return int(part), int(parts)


def _supervised(p: argparse.ArgumentParser, *, when_none_left: str) -> None:
    """The options `run` and `restore` share: both supervise a workload under one checkpoint ID."""
    p.add_argument("--id", required=True, help="checkpoint ID")
    p.add_argument("--heartbeat", type=_heartbeat, metavar="DURATION|auto",
                   help="time between checkpoints: seconds or 30s, 10m (default: CEDANA_HEARTBEAT_SECONDS, else 10m; "
                   "0 = none), or auto: chosen from the measured checkpoint cost and the failure rate "
                   "(heartbeat_min_seconds .. heartbeat_max_seconds, mtbf_hours)")
    p.add_argument("--try-number", type=int, default=0,
                   help="which try this is: a higher one takes the ID's writer lease over from a lower one")
    p.add_argument("--max-restore-gap", type=_duration, metavar="DURATION",
                   help=f"never restore a checkpoint older than this; with none left, {when_none_left}")
    p.add_argument("--gpu", choices=("auto", "off", "require"),
                   help="GPU state: auto (default), require (refuse to start where it cannot be checkpointed), off")
    p.add_argument("--mode", dest="checkpoint_mode", choices=("transparent", "cooperative", "auto"),
                   help="how checkpoints are taken: transparent (CRIU; default), cooperative (the workload writes its "
                        "state into $CEDANA_CHECKPOINT_DIR when asked), auto (transparent where CRIU can run)")
    p.add_argument("--job-part", type=_job_part, metavar="PART/PARTS",
                   help="this is part PART (0 to PARTS-1, the same on every try) of a job on PARTS nodes, each part "
                        "run by its own `run --job-part` under the same --id: the parts checkpoint together and resume "
                        "together from the same seq (docs/jobs.md; default: CEDANA_JOB_PART and CEDANA_JOB_PARTS, "
                        "else 0/1, a job on one node)")
    p.add_argument("--json", action="store_true",
                   help="at the end, print a JSON summary as the last line of stdout (after the workload's output)")
    p.add_argument("--json-file", metavar="FILE", help="at the end, write the JSON summary to FILE")
    p.add_argument("--timings", action="store_true",
                   help="after a restore, print where its time went to stderr (once the workload printed its first "
                        "output and, when lazy, every page is in)")
    _airflow_task(p)
    _common(p)


def _airflow_task(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the Airflow task instance this run is (recorded in manifests; the UI filters by it)")
    g.add_argument("--dag-id")
    g.add_argument("--task-id")
    g.add_argument("--run-id")
    g.add_argument("--map-index", type=int, default=-1)


def _task_of(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from .format.manifest import AirflowTask

    given = [args.dag_id, args.task_id, args.run_id]
    if not any(given):
        return None
    try:
        return AirflowTask(dag_id=args.dag_id or "", task_id=args.task_id or "", run_id=args.run_id or "",
                           map_index=args.map_index)
    except ValidationError:
        raise ConfigError("--dag-id, --task-id and --run-id go together (and --map-index is -1 or more). "
                          "Pass all three, or none.") from None


#: The flag that sets each setting, as the user typed it (an error names the flag, not the setting).
_FLAGS = {"store": "--store", "node": "--node", "work_dir": "--work-dir", "heartbeat_seconds": "--heartbeat",
          "max_restore_gap_seconds": "--max-restore-gap", "gpu": "--gpu", "mode": "--mode", "job_part": "--job-part",
          "job_parts": "--job-part"}


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings({
        "store": args.store, "node": args.node, "work_dir": args.work_dir,
        "heartbeat_seconds": getattr(args, "heartbeat", None),
        "max_restore_gap_seconds": getattr(args, "max_restore_gap", None),
        "gpu": getattr(args, "gpu", None),
        "mode": getattr(args, "checkpoint_mode", None),  # (`drill`'s positional is args.mode)
        "job_part": job[0] if (job := getattr(args, "job_part", None)) else None,
        "job_parts": job[1] if job else None,
    }, overrides_source=lambda k: _FLAGS.get(k, f"--{k.replace('_', '-')}"))


def _existing_store(settings: Settings) -> Store:
    """The store the settings name, which must exist already (the commands that only read or tidy it)."""
    from .store import open_store

    store = open_store(settings.resolved_store(), settings)
    store.open(create=False, chunk_avg_bytes=settings.chunk_avg_bytes)
    return store


def _cmd_run(args: argparse.Namespace, restore_only: bool) -> int:
    from .run.runner import run_workload

    command = None
    if not restore_only:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            print("usage: cedana-airflow run --id ID [...] -- COMMAND [ARGS...]", file=sys.stderr)
            return 2
    with _Summary(args) as summary:
        settings = _settings(args)
        summary.node = settings.resolved_node()
        if _through_agent(settings):  # `restore` too: the agent restores it, as this caller
            return _run_through_agent(args, settings, command, summary)
        timings = _Timings() if args.timings else None
        result = run_workload(settings, args.id, command, resume=restore_only or args.resume,
                              try_number=args.try_number, airflow=_task_of(args),
                              on_restore=timings.restored if timings is not None else None)
        if timings is not None:
            timings.print_now()
        summary.report(result)
    return result.exit_code


def _no_agent(settings: Any) -> str | None:
    """Why no agent answers at ``agent_socket`` (its one line), or None: it does. Asked before anything
    starts, so that a job it cannot protect runs unprotected rather than not at all (agent = auto)."""
    from .agent.client import AgentClient

    try:
        with AgentClient.connect(settings.agent_socket) as client:
            client.hello()
    except AgentUnavailable as e:
        return str(e)
    return None


def _through_agent(settings: Any) -> bool:
    from .agent.route import through_agent

    return through_agent(settings)


def _run_through_agent(args: argparse.Namespace, settings: Any, command: list[str] | None, summary: _Summary) -> int:
    """``run`` as a caller of the node agent ([cedana] agent: require, or auto and not root): the workload
    runs as us, checkpointed by the agent; SIGTERM and SIGINT stop it with a final checkpoint, as they
    stop an in-process run; the summary is the agent's run's."""
    from .agent.route import fresh_line, run_via_agent
    from .run.runner import restored_line
    from .run.environment import workload_env

    stop = SignalSafeEvent()  # set in a signal handler, perhaps inside another's (signal_safe.py)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.timings:
        print("cedana: --timings is not shown through the node agent (its log has the restore's)", file=sys.stderr)
    task = _task_of(args)

    def said_restore(r: dict[str, Any]) -> None:  # an agent older than 0.8.2: it says no lines of its own
        line = restored_line(r["seq"], r["try_number"], r["node"], r.get("restored_on", "?"), r["gap_seconds"],
                             r["restore_seconds"], args.id)
        print(f"cedana: {line} (through the node agent)", file=sys.stderr, flush=True)

    result = run_via_agent(settings.agent_socket, args.id, command or [], cwd=os.getcwd(),
                           env=workload_env(dict(os.environ), settings.keep_env), try_number=args.try_number,
                           settings=settings, claim=task.model_dump(mode="json") if task else None,
                           stdout=_Out(sys.stdout), stderr=_Out(sys.stderr), stop=stop,
                           on_restore=said_restore,
                           on_fresh=lambda why: print(fresh_line(why, args.id), file=sys.stderr),
                           restore_only=command is None, resume=getattr(args, "resume", True))
    summary.emit(result)
    return int(result["exit_code"])


class _Out:
    """A workload's output, passed on to one of our streams as it comes (a Sink)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, data: bytes) -> int:
        self.stream.buffer.write(data)
        self.stream.flush()
        return len(data)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        self.stream.flush()


class _Timings:
    """``--timings``: the restore's timeline on stderr, once complete (or when the run ends first)."""

    def __init__(self) -> None:
        self._timeline: Any = None
        self._printed = threading.Lock()
        self._done = False

    def restored(self, result: Any) -> None:
        self._timeline = result.restore_timeline
        if self._timeline is not None:
            threading.Thread(target=self._when_complete, name="cedana-timings", daemon=True).start()

    def _when_complete(self) -> None:
        self._timeline.wait(600)
        self.print_now()

    def print_now(self) -> None:
        with self._printed:
            if self._timeline is None or self._done:
                return
            self._done = True
            print(self._timeline.render(), file=sys.stderr, flush=True)


class _Summary:
    """``--json`` / ``--json-file``: the run's summary (run/summary.py), also when it ends in an error
    (bad configuration included: then ``node`` is what --node said, if anything)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.node = args, args.node or ""

    def __enter__(self) -> _Summary:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        if isinstance(e, CedanaError):
            from .run.summary import error_summary

            self.emit(error_summary(self.args.id, self.node, e.exit_code, f"{type(e).__name__}: {e}"))

    def report(self, result: Any) -> None:
        from .run.summary import run_summary

        self.emit(run_summary(result, self.args.id, self.node))

    def emit(self, obj: dict[str, Any]) -> None:
        text = json.dumps(obj)
        if self.args.json_file:
            tmp = f"{self.args.json_file}.tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, self.args.json_file)  # a reader never sees half of it
        if self.args.json:
            sys.stdout.flush()
            print(text, flush=True)


def _slurm_step_part(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(part, parts) of a job step on several nodes (srun, one task per node), None elsewhere: the batch
    script alone runs on the first node only, with no step."""
    try:
        parts, part = int(environ["SLURM_STEP_NUM_NODES"]), int(environ["SLURM_NODEID"])
    except (KeyError, ValueError):
        return None
    return (part, parts) if parts > 1 and 0 <= part < parts else None


def _cmd_slurm_job(args: argparse.Namespace) -> int:
    """The command of a Slurm route job (slurm/batch.py writes it into the batch script)."""
    from .run.runner import run_workload
    from .scope.optin import load_optin
    from .slurm.in_job import protection

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("usage: cedana-airflow slurm-job --id ID [...] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    node = os.environ.get("SLURMD_NODENAME")
    if node and not args.node:
        args.node = node  # the Slurm node's name, not the host's: two slurmd may share a host
    if args.job_part is None and (step := _slurm_step_part(os.environ)):
        args.job_part = step  # one task per node of a multi-node job step: this node's part (docs/jobs.md)
    settings = _settings(args)
    try:
        optin = load_optin(settings.optin_file)
        protected, why = protection(os.environ, optin.node.partitions if optin.node else ())
    except ConfigError as e:  # a broken list never fails a job: it runs unprotected and says why
        protected, why = False, f"the opt-in list cannot be used here: {e} This job runs unprotected"
    if node and "%n" in str(settings.agent_socket):  # several slurmd on one host: one agent each
        settings = settings.model_copy(update={"agent_socket": Path(str(settings.agent_socket).replace("%n", node))})
    via_agent = protected and _through_agent(settings)  # a job of a user other than root: the node's agent's
    if via_agent and settings.agent == "auto" and (missing := _no_agent(settings)):
        protected, why = False, f"this job runs unprotected (agent = auto, not root): {missing}"
    print(f"cedana: {why}", flush=True)
    if not protected:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CEDANA_")}
        try:
            os.execvpe(command[0], command, env)
        except OSError as e:
            print(f"cedana: cannot run {command[0]!r}: {e.strerror or e}", file=sys.stderr)
            return 127
    if via_agent:
        with _Summary(args) as summary:
            summary.node = settings.resolved_node()
            return _run_through_agent(args, settings, command, summary)
    with _Summary(args) as summary:
        summary.node = settings.resolved_node()
        timings = _Timings() if args.timings else None
        result = run_workload(settings, args.id, command, resume=True, try_number=args.try_number,
                              airflow=_task_of(args), on_restore=timings.restored if timings is not None else None,
                              # a requeue runs the same try again: its parts are a new attempt all the same
                              job_attempt=f"{args.try_number}.{os.environ.get('SLURM_RESTART_COUNT') or 0}")
        if timings is not None:
            timings.print_now()
        summary.report(result)
    return result.exit_code


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    from .store.listing import as_json, list_store

    settings = _settings(args)
    store = _existing_store(settings)
    listed = list_store(store, args.id, exact=args.exact)
    missing = 1 if args.id and not listed else 0  # an ID named and not there: the lookup failed (scripts test it)
    if args.json:
        # Indented only for a person: with indent, json falls back to its pure-Python encoder (0.8 s for 10,000 rows).
        print(json.dumps([as_json(x) for x in listed], indent=1 if sys.stdout.isatty() else None))
        return missing
    if not listed:
        print(f"no checkpoints in {store.url}" + (f" under {args.id}" if args.id else ""),
              file=sys.stderr if missing else sys.stdout)
        return missing
    # whole IDs and nodes, whatever their length: what a person pastes into `restore --id`
    wid = max(2, *(len(x.checkpoint_id) for x in listed))
    wnode = max(4, *(len(r.node) for x in listed for r in x.checkpoints))
    print(f"{'ID':<{wid}} {'SEQ':>4} {'TRY':>3} {'NODE':<{wnode}} {'CREATED':<20} {'IMAGE':>10} {'STORED':>10}")
    for x in listed:
        for r in x.checkpoints:
            print(f"{x.checkpoint_id:<{wid}} {r.seq:>4} {r.try_number:>3} {r.node:<{wnode}} "
                  f"{r.created_at.isoformat()[:19]:<20} {binary_size(r.image_bytes):>10} {binary_size(r.stored_bytes):>10}")
    for x in listed:
        if x.skipped_heartbeats:
            print(f"{x.checkpoint_id}: {x.skipped_heartbeats} heartbeat(s) skipped as too large; last: {x.last_skip}")
        if x.failed_heartbeats:
            print(f"{x.checkpoint_id}: {x.failed_heartbeats} heartbeat(s) failed; last: {x.last_failure}")
        if x.restore_warning:
            print(f"{x.checkpoint_id}: {x.restore_warning}")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from .store.gc import DEFAULT_GRACE_SECONDS, collect_garbage

    # --grace and --wait are durations (_duration): never negative, nan or inf, which would spare nothing
    grace = DEFAULT_GRACE_SECONDS if args.grace is None else args.grace
    wait = GC_WAIT_SECONDS if args.wait is None else args.wait
    settings = _settings(args)
    store = _existing_store(settings)
    report = collect_garbage(store, grace_seconds=grace, dry_run=args.dry_run, wait_seconds=wait)
    if args.json:
        print(json.dumps(report.__dict__))
    else:
        verb = "would remove" if report.dry_run else "removed"
        print(f"{verb} {report.chunks_removed} chunk(s), {binary_size(report.bytes_removed)}, and "
              f"{report.temp_removed} temporary file(s); kept {report.chunks_kept} chunk(s) named by "
              f"{report.manifests} checkpoint(s), {report.young_unreferenced} younger than {grace:g} s")
        expired = report.leases_removed + report.quarantine_removed + report.sidecars_removed
        if expired:
            print(f"{verb} {report.leases_removed} expired writer lease(s), {report.quarantine_removed} settled "
                  f"quarantine record(s) and {report.sidecars_removed} unused lock file(s)")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .store.check import check_store

    fraction = 1.0 if args.read_data else 0.0
    if args.read_data_subset is not None:
        text = args.read_data_subset.strip().rstrip("%")
        try:
            fraction = float(text) / 100
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            print(f"usage: --read-data-subset {args.read_data_subset} is not a share; give e.g. --read-data-subset 10%",
                  file=sys.stderr)
            return 2
    settings = _settings(args)
    store = _existing_store(settings)
    report = check_store(store, read_fraction=fraction, repair=args.repair, reader=settings.resolved_node())
    if args.json:
        print(json.dumps(report.to_json(), default=str))
        return 0 if report.clean else 1
    print(f"store {report.store}: {report.ids} checkpoint ID(s), {report.checkpoints} checkpoint(s), {report.chunks} "
          f"chunk(s) named; {report.read} read and verified")
    for d, why in {**report.missing, **report.bad}.items():
        print(f"chunk {d}: {why}" + ("; set aside: the next heartbeat of a writer that has it uploads it again"
                                     if d in report.set_aside else ""))
    for cid, seqs in sorted(report.unusable.items()):
        print(f"unusable{' until a writer uploads its chunks again' if args.repair else ''}: {cid} seq "
              + ", ".join(map(str, seqs)))
    u = report.unreferenced
    if u.get("chunks") or u.get("expired_leases") or u.get("settled_quarantine") or u.get("lock_files") or u.get("temp"):
        print(f"unreferenced (gc removes them): {u['chunks']} chunk(s) ({binary_size(u['chunk_bytes'])}), "
              f"{u['expired_leases']} expired writer lease(s), {u['settled_quarantine']} settled quarantine record(s), "
              f"{u['lock_files']} unused lock file(s), {u['temp']} temporary file(s)")
    if report.clean:
        print("clean")
    else:
        print(f"problems: {len(report.missing)} missing chunk(s), {len(report.bad)} bad chunk(s)"
              + ("" if args.repair else "; --repair sets them aside so that writers upload them again"))
    return 0 if report.clean else 1


def _cmd_explain(args: argparse.Namespace) -> int:
    from .scope.optin import Where, decide, load_optin, parse_labels

    settings = load_settings({"node": args.node, "optin_file": args.optin_file})
    facts: dict[str, Any] = {"queue": "default", "pool": "default_pool", "tags": (), "expected_seconds": None,
                             "job_server": False, "gpu": False}
    if args.dags_folder:
        from .airflow.explain import task_facts  # Airflow only when asked: the core CLI runs without it

        facts.update(task_facts(args.dag_id, args.task_id, args.dags_folder))
        if not facts.pop("checkpointed"):
            print(f"note: {args.dag_id}.{args.task_id} is not a checkpointed operator; the list would not be asked")
    given = {"queue": args.queue, "pool": args.pool, "partition": args.partition, "tags": tuple(args.tag) if args.tag else None,
             "expected_seconds": args.expected_seconds, "job_server": args.job_server, "gpu": args.gpu}
    facts.update({k: v for k, v in given.items() if v is not None})
    task_mode = facts.pop("mode", None)  # the operator's argument: above the list's defaults and [cedana]
    task_heartbeat = facts.pop("heartbeat", None)  # the same
    optin = load_optin(settings.optin_file)
    if args.dags_folder and facts["expected_seconds"] is None and optin.rules.min_expected_seconds:
        # as the task would: its past durations, from Airflow's history (airflow/history.py)
        from .airflow.history import AirflowHistory

        facts["expected_seconds"], facts["expected_source"] = AirflowHistory(log).duration(args.dag_id, args.task_id)
    where = Where(args.dag_id, args.task_id, settings.resolved_node(), parse_labels(",".join(args.label)),
                  nvidia=False if args.no_nvidia else None, **facts)
    decision = decide(optin, where)
    warnings = _restore_warnings(settings, where.dag_id, where.task_id)
    mode = task_mode or decision.defaults.get("mode") or settings.mode
    how = _how_checkpointed(settings, mode) if decision.in_scope else ""
    beat = _heartbeat_in_force(settings, decision.defaults, task_heartbeat) if decision.in_scope else None
    if args.json:
        print(json.dumps({"dag_id": where.dag_id, "task_id": where.task_id, "node": where.node, "queue": where.queue,
                          "pool": where.pool, "in_scope": decision.in_scope, "reasons": list(decision.reasons),
                          "defaults": decision.defaults, "restore_warnings": warnings,
                          "mode": mode, "mode_here": how, "expected_seconds": where.expected_seconds,
                          "heartbeat_seconds": beat.heartbeat_seconds if beat else None,
                          "heartbeat": beat.heartbeat_text() if beat else "",
                          "expected_source": where.expected_source if where.expected_seconds is not None else ""},
                         default=str))
    else:
        print(f"{where.dag_id}.{where.task_id} on node {where.node}, queue {where.queue}, pool {where.pool}: "
              + decision.explain())
        if decision.defaults:
            print("  settings from the list: " + ", ".join(f"{k}={v}" for k, v in sorted(decision.defaults.items())))
        if how:
            print(f"  checkpoints: {how}")
        if beat:
            print(f"  heartbeat: {beat.heartbeat_text()}")
        for w in warnings:
            print(f"  its checkpoints: {w}")
    return 0 if decision.in_scope else 1  # docs/opt-in.md#explain: a script can test it


def _heartbeat_in_force(settings: Settings, defaults: dict[str, Any], task: float | str | None) -> Settings:
    """The settings whose heartbeat the task would run with: the operator's argument, else the list's
    default for its scope, else the node's configuration (its environment and CEDANA_CONFIG here: airflow.cfg's
    [cedana] is read by the task, not by this command), else the default."""
    for value, where in ((task, "the operator's heartbeat argument"),
                         (defaults.get("heartbeat_seconds"), "the opt-in list's defaults")):
        if value is not None:
            return Settings(**{**settings.model_dump(), "heartbeat_seconds": value}).with_sources(
                {**settings.sources(), "heartbeat_seconds": where})
    return settings


def _how_checkpointed(settings: Settings, mode: str) -> str:
    """How an in-scope task's heartbeats are taken in ``mode``, judged on this machine (CRIU usable or not)."""
    from .errors import EngineUnavailable
    from .run.runner import engine_for

    try:
        engine, why = engine_for(settings.model_copy(update={"mode": "auto"}))
    except EngineUnavailable as e:
        engine, why = None, str(e)
    if mode == "cooperative":
        return "mode cooperative: the workload writes its own state when asked (docs/cooperative.md)"
    if mode == "transparent":
        return "mode transparent: CRIU" + ("" if engine else f"; on this machine the task would run unprotected ({why})")
    return "mode auto: on this machine " + ("transparent (CRIU can run)" if engine else
                                            f"cooperative once the workload declares it can, else unprotected ({why})")


def _restore_warnings(settings: Settings, dag_id: str, task_id: str) -> list[str]:
    """What the store says a restore would refuse of this task's checkpoints (their first heartbeats
    recorded it); none when no store is configured or it cannot be read: explain must answer anyway."""
    from .store import open_store
    from .store.listing import list_store

    if not settings.store:
        return []
    try:
        store = open_store(settings.resolved_store(), settings)
        listed = list_store(store)
    except CedanaError:
        return []
    return [f"{x.checkpoint_id}: {x.restore_warning}" for x in listed if x.restore_warning and x.airflow is not None
            and (x.airflow.dag_id, x.airflow.task_id) == (dag_id, task_id)]


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .agent.doctor import agent_check
    from .node.doctor import run_checks

    settings = _settings(args)
    checks = [*run_checks(settings, probe_store=args.probe_store), agent_check(settings.agent_socket)]
    if args.json:
        print(json.dumps([{k: v for k, v in c.__dict__.items() if k != "gpu" or v is not None} for c in checks], indent=1))
    else:
        for c in checks:
            line = f"{c.status.upper():<5} {c.name}: {c.detail}"
            print(line + (f" -> fix: {c.fix}" if c.fix and c.status != "ok" else ""))
    return 1 if any(c.blocking for c in checks) else 0


def _cmd_drill(args: argparse.Namespace) -> int:
    from .drill.run import LIVE_NEEDS_AIRFLOW, run_drill
    from .store import open_store

    if args.mode == "live":
        raise ConfigError(LIVE_NEEDS_AIRFLOW)
    if args.sample < 1 or args.mb < 1 or args.steps < 1 or args.heartbeats < 1:
        raise ConfigError("--sample, --mb, --steps and --heartbeats must be 1 or more.")
    if not (0 < args.heartbeat < 3600 and 0 <= args.step_seconds < 3600):
        raise ConfigError("--heartbeat must be above 0 and --step-seconds 0 or more (both under an hour).")
    settings = _settings(args)
    params: dict[str, Any] = (
        dict(mb=args.mb, steps=args.steps, step_seconds=args.step_seconds, heartbeat=args.heartbeat,
             heartbeats=args.heartbeats) if args.mode == "canary" else dict(ids=args.ids, sample=args.sample))
    report = None
    if _through_agent(settings) and not getattr(args, "store", None):  # not root: the node agent runs it
        from .agent.client import AgentClient
        from .drill.report import DrillReport

        try:
            with AgentClient.connect(settings.agent_socket) as agent:
                report = DrillReport.model_validate(agent.drill(args.mode, params)["report"])
        except AgentUnavailable as e:
            if settings.agent != "auto":
                raise
            print(f"cedana: {e}; the drill reads the store itself", file=sys.stderr)  # as before 0.8.4
    if report is None:
        store = open_store(settings.resolved_store(), settings)
        # a canary writes checkpoints (it may create the store); verify only reads one
        cfg = store.open(create=args.mode == "canary", chunk_avg_bytes=settings.chunk_avg_bytes)
        report = run_drill(args.mode, store, cfg, settings, **params)
    if args.json:
        print(report.model_dump_json(indent=1))
    elif report.mode == "canary":
        print(f"canary {report.checkpoint_id}: killed on {report.from_node} after seq {report.restored_seq}, restored "
              f"on {report.to_node}; lost work {report.lost_work_seconds} s, restore {report.restore_seconds} s, "
              f"RTO {report.rto_seconds} s, output {'matches' if report.digest_match else 'DIFFERS from'} an uninterrupted run")
        print(f"drill {report.drill_id}: {'passed' if report.ok else 'FAILED'}" + "".join(f"\n  {p}" for p in report.problems))
    else:
        for c in report.checked:
            print(f"{'OK  ' if c.ok else 'FAIL'} {c.checkpoint_id} seq {c.seq}: "
                  + (f"{binary_size(c.bytes_fetched)} verified in {c.fetch_seconds:.2f} s" if c.ok else c.problem)
                  + (f"; {c.note}" if c.note else ""))
        per_id = {f"{c.checkpoint_id}: {c.problem}" for c in report.checked if not c.ok}
        print(f"drill {report.drill_id}: {'passed' if report.ok else 'FAILED'}"
              + "".join(f"\n  {p}" for p in report.problems if p not in per_id))
    return 0 if report.ok else 1


def _cmd_drills(args: argparse.Namespace) -> int:
    from .drill.report import list_reports
    from .drill.run import drills_json
    from .drill.trends import trends

    settings = _settings(args)
    store = _existing_store(settings)
    reports = list_reports(store)
    if args.json:
        print(json.dumps(drills_json(reports), indent=1 if sys.stdout.isatty() else None))
        return 0
    for r in reports:
        print(f"{r.drill_id}  {r.mode:<7} {'pass' if r.ok else 'FAIL'}  on {r.node}"
              + (f"  {r.problems[0]}" if r.problems else ""))
    for mode, t in trends(reports).items():
        print(f"{mode}: {t['passed']} of {t['drills']} passed; RTO p50 {t['rto_seconds']['p50']} s, "
              f"p95 {t['rto_seconds']['p95']} s; lost work p50 {t['lost_work_seconds']['p50']} s")
    if not reports:
        print(f"no drill reports in {store.url}")
    return 0


class _Lines(logging.Formatter):
    """``cedana:`` on our lines only: a library's (Airflow's, loading a DAG for `explain`) says whose it is."""

    def format(self, record: logging.LogRecord) -> str:
        ours = record.name.startswith("cedana_airflow.")
        return f"{'cedana' if ours else record.name}: {super().format(record)}"


def main(argv: Sequence[str] | None = None) -> int:
    from .compat import supervisor_refusal

    refusal = supervisor_refusal(os.environ)  # before the arguments: a newer operator's flags may be unknown here
    if refusal is not None:
        print(f"ConfigError: {refusal}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="cedana: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_Lines())
    # Not ours to print, and botocore's DEBUG lines carry request headers (access key ID, signatures):
    # kept at WARNING even with --verbose, so no credential reaches a log.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.verb == "run":
            return _cmd_run(args, restore_only=False)
        if args.verb == "restore":
            return _cmd_run(args, restore_only=True)
        if args.verb == "slurm-job":
            return _cmd_slurm_job(args)
        if args.verb == "checkpoints":
            return _cmd_checkpoints(args)
        if args.verb == "gc":
            return _cmd_gc(args)
        if args.verb == "check":
            return _cmd_check(args)
        if args.verb == "explain":
            return _cmd_explain(args)
        if args.verb == "doctor":
            return _cmd_doctor(args)
        if args.verb == "drill":
            return _cmd_drill(args)
        if args.verb == "drills":
            return _cmd_drills(args)
        if args.verb == "key":
            return _cmd_key(args)
        if args.verb == "agent":
            from .agent.__main__ import serve

            return serve(args)
    except CedanaError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
