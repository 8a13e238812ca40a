"""``python -m cedana_airflow.agent``: the node agent in the foreground (until SIGTERM or Ctrl-C).

Not yet a ``cedana-airflow`` verb: it starts workloads as their callers and checkpoints them, but does
not restore them yet (issue 49, slice 1). Its node settings come from its environment and
CEDANA_CONFIG, as the CLI's do.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from .. import errors
from .server import DEFAULT_SOCKET, Agent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cedana_airflow.agent")
    ap.add_argument("--socket", type=Path, default=DEFAULT_SOCKET,
                    help=f"where callers connect (default {DEFAULT_SOCKET})")
    ap.add_argument("--node", help="this node's name (default: [cedana] node, else the hostname)")
    ap.add_argument("--audit", type=Path, help="append one JSON line per request here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="cedana agent: %(message)s")
    try:
        agent = Agent(args.socket, environ={**os.environ, **({"CEDANA_NODE": args.node} if args.node else {})},
                      audit=args.audit)
    except errors.CedanaError as e:
        print(f"cedana agent: {e}", file=sys.stderr)
        return e.exit_code
    signal.signal(signal.SIGTERM, lambda *_: agent.close())
    signal.signal(signal.SIGINT, lambda *_: agent.close())
    agent.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
