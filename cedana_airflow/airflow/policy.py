"""Cluster policy (entry point ``airflow.policy``): the ``cedana:`` DAG tags enforced when DAGs are parsed.

A violation is an AirflowClusterPolicyViolation, which Airflow shows as that DAG file's import error in
the UI, with the rule, the task and the fix in one message. DAGs without ``cedana:`` tags are never
touched, and nothing here reads the opt-in file, so a broken list cannot break parsing.
"""

from __future__ import annotations

from typing import Any

from airflow.exceptions import AirflowClusterPolicyViolation
from airflow.policies import hookimpl

from ..errors import ConfigError
from ..scope.tags import TaskDecl, check_dag, parse_tags

__all__ = ["dag_policy", "pod_mutation_hook"]


def _decl(task: Any) -> TaskDecl:
    def seconds(name: str) -> float | None:
        value = getattr(task, name, None)
        return value.total_seconds() if value is not None else None

    return TaskDecl(task.task_id, getattr(task, "idempotency_key", None), seconds("max_restore_gap"), seconds("lease"))


@hookimpl
def dag_policy(dag: Any) -> None:
    try:
        tags = parse_tags(dag.tags or ())
    except ConfigError as e:
        raise AirflowClusterPolicyViolation(f"cedana: DAG {dag.dag_id}: {e}") from None
    checkpointed = [_decl(t) for t in dag.tasks if getattr(t, "cedana_checkpointed", False)]
    violations = check_dag(dag.dag_id, tags, checkpointed)
    if violations:
        raise AirflowClusterPolicyViolation("cedana: " + " | ".join(str(v) for v in violations))


@hookimpl
def pod_mutation_hook(pod: Any) -> None:
    """KubernetesExecutor: give a worker pod whose task is on the opt-in list the ``cedana`` route.

    Worker pods carry their task in annotations (dag_id, task_id, run_id, try_number); the same spec
    as CedanaKubernetesPodOperator's is applied in place. Pods that already took a route, pods of no
    task, and tasks out of scope are left as they are; a failure here is logged, never raised (it
    would stop the pod from being created).
    """
    import logging

    from .kube import HEARTBEAT_LABEL, kubernetes_executor_route

    meta = getattr(pod, "metadata", None)
    if meta is None:
        return
    annotations = meta.annotations or {}
    if not {"dag_id", "task_id", "run_id"} <= set(annotations) or HEARTBEAT_LABEL in (meta.labels or {}):
        return
    try:
        routed = kubernetes_executor_route(pod, annotations)
    except Exception as e:  # noqa: BLE001 - a hook that raises would stop the pod from being created
        logging.getLogger(__name__).warning("cedana: pod_mutation_hook left the pod as it is: %s", e)
        return
    if routed is not None:
        pod.metadata, pod.spec = routed.metadata, routed.spec
