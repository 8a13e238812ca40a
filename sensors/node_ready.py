"""NodeReadySensor: wait until a node (or at least N nodes with the opt-in label) is Ready and no longer
carries the bootstrap taint ``cedana.ai/not-ready``, through the cncf-kubernetes provider's connection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from airflow.sdk import BaseSensorOperator

from cedana_airflow.airflow.kube import NOT_READY_TAINT
from cedana_airflow.airflow_compat import AirflowException, AirflowFailException
from cedana_airflow.scope.optin import DEFAULT_NODE_LABEL

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["NodeReadySensor", "node_blockers"]


def node_blockers(node: Any, taint: str = NOT_READY_TAINT) -> list[str]:
    """Why a V1Node is not ready for checkpointed work (empty when it is)."""
    name = node.metadata.name
    why = [f"{name} still has the taint {t.key}" for t in (node.spec.taints or []) if t.key == taint]
    ready = next((c for c in (node.status.conditions or []) if c.type == "Ready"), None)
    if ready is None or ready.status != "True":
        why.append(f"{name} is not Ready ({ready.reason if ready is not None else 'no Ready condition'})")
    return why


class NodeReadySensor(BaseSensorOperator):
    """:param node_name: one node by name; else every node matching ``label_selector`` counts.
    :param label_selector: default: the opt-in label, ``cedana.ai/enabled=true``.
    :param min_nodes: how many ready nodes are enough (with a selector).
    :param kubernetes_conn_id: the cncf-kubernetes connection (in-cluster, kube_config, ...).
    """

    template_fields: Sequence[str] = ("node_name", "label_selector")

    def __init__(self, *, node_name: str | None = None, label_selector: str | None = None, min_nodes: int = 1,
                 kubernetes_conn_id: str = "kubernetes_default", taint: str = NOT_READY_TAINT, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.node_name, self.min_nodes, self.kubernetes_conn_id, self.taint = node_name, min_nodes, kubernetes_conn_id, taint
        self.label_selector = label_selector or "=".join(DEFAULT_NODE_LABEL)

    def poke(self, context: Context) -> bool:
        from kubernetes.client.exceptions import ApiException

        api = KubernetesHook(conn_id=self.kubernetes_conn_id).core_v1_client
        try:
            nodes = [api.read_node(self.node_name)] if self.node_name else api.list_node(label_selector=self.label_selector).items
        except ApiException as e:
            if e.status == 403:
                raise AirflowFailException(
                    f"cedana: the Kubernetes API refused to {'read node ' + self.node_name if self.node_name else 'list nodes'} "
                    f"(403, RBAC) for connection {self.kubernetes_conn_id!r}. Grant its service account get/list on "
                    "nodes (a ClusterRole and binding).") from None
            if e.status == 404 and self.node_name:
                self.log.info("cedana: node %s does not exist yet", self.node_name)
                return False
            raise AirflowException(f"cedana: the Kubernetes API answered {e.status} ({e.reason})") from None
        ready = [n for n in nodes if not node_blockers(n, self.taint)]
        for n in nodes:
            for line in node_blockers(n, self.taint):
                self.log.info("cedana: waiting: %s", line)
        want = 1 if self.node_name else self.min_nodes
        self.log.info("cedana: %d of %d node(s) ready (want %d)", len(ready), len(nodes), want)
        return len(ready) >= want
