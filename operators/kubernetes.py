"""CedanaKubernetesPodOperator: a KubernetesPodOperator that asks for checkpointing with one line.

Pods go to opted-in nodes; a retry's pod avoids the node where the previous try ran (recorded by the
pod-starting callback in the task state record, cedana_airflow.airflow.task_state) and is always a
new pod, never a reattach to the failed one. Which route (a Cedana cluster, or our CLI wrapped
around the command) is configuration: ``[cedana] k8s_route``. The pod spec itself is built by cedana_airflow.airflow.kube.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowFailException
from kubernetes.client import models as k8s

from cedana_airflow.airflow.config import airflow_options
from cedana_airflow.airflow.kube import Route, apply_route, pod_scope, uses_gpu
from cedana_airflow.airflow.task_state import TaskState, airflow_task
from cedana_airflow.errors import ConfigError
from cedana_airflow.ids import derive_checkpoint_id, validate_checkpoint_id

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["CedanaKubernetesPodOperator"]


class _RecordNode(KubernetesPodOperatorCallback):
    """Remember where each try's pod runs (the task state record), so the next try's pod can avoid that node."""

    @staticmethod
    def on_pod_starting(*, pod: k8s.V1Pod, operator: Any, context: Any, **kwargs: Any) -> None:
        node = getattr(pod.spec, "node_name", None)
        if not node or not context or context.get("task_state_store") is None:
            return
        TaskState.of(context, operator.log).add_try(context["ti"].try_number, node)


class CedanaKubernetesPodOperator(KubernetesPodOperator):
    """``KubernetesPodOperator`` plus checkpointing: everything it takes, and

    :param checkpoint_id: templated; default derived from dag_id, task_id, map_index and run_id.
    :param heartbeat: time between checkpoints (default [cedana] heartbeat_seconds, else 10 minutes:
        ``POD_HEARTBEAT_FALLBACK_SECONDS``).
    :param route: ``cedana`` or ``wrap`` (default [cedana] k8s_route, else ``cedana``).
    :param store_secret: wrap route: a Secret with the store's credentials (keys AWS_ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY; optional AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION), mounted
        read-only as files that only cedana-airflow reads: never in the workload's environment.
    """

    template_fields: Sequence[str] = (*KubernetesPodOperator.template_fields, "checkpoint_id")

    def __init__(self, *, checkpoint_id: str | None = None, heartbeat: timedelta | None = None,
                 route: str | None = None, store_secret: str | None = None, **kwargs: Any) -> None:
        callbacks = kwargs.pop("callbacks", None) or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        kwargs["durable"] = False  # a retry gets a new pod on another node, never the failed one
        super().__init__(callbacks=[*callbacks, _RecordNode], **kwargs)
        self.checkpoint_id, self.heartbeat, self.store_secret = checkpoint_id, heartbeat, store_secret
        if route and route not in ("cedana", "wrap"):
            raise ValueError(f"{self.task_id}: route {route!r} is unknown; use 'cedana' or 'wrap'.")
        self.route = route or airflow_options("k8s_route").k8s_route

    def build_pod_request_obj(self, context: Context | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        pod = super().build_pod_request_obj(context, dry_run=dry_run)
        if context is None:
            return pod
        try:
            return self._checkpointed(pod, context)
        except ConfigError as e:
            raise AirflowFailException(f"cedana: {e}") from None

    def _checkpointed(self, pod: k8s.V1Pod, context: Context) -> k8s.V1Pod:
        ti = context["ti"]
        overrides = {"heartbeat_seconds": self.heartbeat.total_seconds()} if self.heartbeat else {}
        scope = pod_scope(ti.dag_id, ti.task_id, self.queue, self.pool or "", overrides)
        for line in scope.decision.explain().splitlines():
            self.log.info("cedana: %s", line.strip())
        if not scope.decision.in_scope:
            if uses_gpu(pod):
                self.log.warning("cedana: this pod asks for a GPU but is out of scope: it runs unprotected")
            return pod
        cid = (validate_checkpoint_id(self.checkpoint_id) if self.checkpoint_id
               else derive_checkpoint_id(ti.dag_id, ti.task_id, context["run_id"], map_index=ti.map_index))
        earlier = TaskState.of(context, self.log).earlier_nodes(ti.try_number)
        if earlier:
            self.log.info("cedana: this retry's pod avoids node(s) %s, where earlier tries ran", ", ".join(earlier))
        route = Route(kind=self.route, checkpoint_id=cid,  # type: ignore[arg-type]
                      heartbeat_seconds=scope.heartbeat_seconds, node_label=scope.node_label,
                      avoid_nodes=earlier, runtime_class=scope.runtime_class,
                      store=scope.settings.store, store_secret=self.store_secret or "", try_number=ti.try_number,
                      airflow=airflow_task(context))
        return apply_route(pod, route)
