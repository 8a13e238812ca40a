"""``python -m cedana_airflow.agent`` (and ``cedana-airflow agent``): the node agent in the foreground,
until SIGTERM or Ctrl-C; its workloads run on (an agent started after it takes them up). Its node
settings come from its environment and CEDANA_CONFIG, as the CLI's do.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from .. import errors
from ..config import load_settings
from . import DEFAULT_SOCKET
from .said import NAMED


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--socket", type=Path, default=None,
                    help=f"where callers connect (default: [cedana] agent_socket, else {DEFAULT_SOCKET})")
    ap.add_argument("--node", help="this node's name (default: [cedana] node, else the hostname)")
    ap.add_argument("--audit", type=Path, help="append one JSON line per request here")


class _RunFormatter(logging.Formatter):
    """The agent's log holds every run of the node: a line that leaves its checkpoint ID to the record (a
    heartbeat's: the ID is said once, where its run starts) names it here, at the end."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        cid = getattr(record, "checkpoint_id", None)
        return line if cid is None or cid in NAMED.findall(line) else f"{line} checkpoint_id={cid}"


def serve(args: argparse.Namespace) -> int:
    """Run the agent until a signal stops it; its exit code (2: it could not start, one line why)."""
    from .server import Agent  # here: `cedana-airflow`'s other verbs do not pay for importing it

    logging.basicConfig(level=logging.INFO, format="cedana agent: %(message)s", force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_RunFormatter("cedana agent: %(message)s"))
    try:
        socket_path = args.socket or load_settings().agent_socket
        agent = Agent(socket_path, environ={**os.environ, **({"CEDANA_NODE": args.node} if args.node else {})},
                      audit=args.audit)
    except errors.CedanaError as e:
        print(f"cedana agent: {e}", file=sys.stderr)
        return e.exit_code
    signal.signal(signal.SIGTERM, lambda *_: agent.close())
    signal.signal(signal.SIGINT, lambda *_: agent.close())
    agent.serve()
    # Now, not after the runs' threads: a stop leaves workloads to their shims (an agent started later takes
    # them up), and an interpreter's exit would wait for their store uploads' worker threads first.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cedana_airflow.agent")
    add_arguments(ap)
    return serve(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
