"""A stack DAG's task as uid nobody (tests/shared_stack.py): Airflow's own impersonation (``run_as_user``)
runs the task process as nobody, and with the default ``[cedana] agent = auto`` its workload goes through
the node agent it names; the agent's node name is the task's."""

from typing import Any


def nobody_task(agent: dict[str, str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The operator's arguments and ``[cedana]`` settings of a task that runs as nobody through ``agent``
    (``{"node": ..., "socket": ...}``, SharedStack.agent()); nothing to add for a task that runs as the
    stack does (root)."""
    if not agent:
        return {}, {}
    return {"run_as_user": "nobody"}, {"node": agent["node"], "agent_socket": agent["socket"]}
