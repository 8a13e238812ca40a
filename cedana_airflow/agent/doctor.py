"""``cedana-airflow doctor``'s look at the node agent: does one answer here, which, and may we use it."""

from __future__ import annotations

from pathlib import Path

from .. import __version__, errors
from ..node.doctor import Check
from .client import AgentClient

__all__ = ["agent_check"]


def agent_check(path: Path) -> Check:
    """One line: the agent at ``path`` answers (its version, node, and that it protects our workloads),
    none answers (nothing needs one yet: docs/agent.md), or it refuses us, or it is another version."""
    try:
        with AgentClient.connect(path) as client:
            hello = client.hello()
    except errors.AgentUnavailable:
        return Check("agent", "skip", f"no agent answers at {path}; nothing needs one yet",
                     "start `cedana-airflow agent` as root to have it checkpoint unprivileged callers (docs/agent.md)")
    except errors.CedanaError as e:  # it answered, and refused us (another namespace, a filter, a limit)
        return Check("agent", "warn", f"the agent at {path} refuses this process: {e}", "see docs/agent.md")
    detail = (f"{path}: agent {hello.get('agent')} on node {hello.get('node')}; it checkpoints this uid's "
              f"({hello.get('you', {}).get('uid')}) workloads")
    if hello.get("agent") != __version__:
        return Check("agent", "warn", f"{detail}, but it is version {hello.get('agent')} and this is {__version__}",
                     "restart the agent after an upgrade (its workloads run on and it takes them up again)")
    return Check("agent", "ok", detail)
