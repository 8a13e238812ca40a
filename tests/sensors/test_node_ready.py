"""NodeReadySensor with the real kubernetes client over HTTP, against recorded API answers replayed by a
loopback server (there is no Kubernetes API server on this machine): taint present -> waits, lifted ->
succeeds, 403 -> one clear line."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")
from airflow.sdk.exceptions import AirflowFailException  # noqa: E402

from cedana_airflow.sensors import NodeReadySensor  # noqa: E402
from conftest import send_json  # noqa: E402


def _node(name: str, tainted: bool, ready: str = "True") -> dict:
    return {"metadata": {"name": name, "labels": {"cedana.ai/enabled": "true", "kubernetes.io/hostname": name}},
            "spec": {"taints": [{"key": "cedana.ai/not-ready", "value": "bootstrap", "effect": "NoSchedule"}] if tainted else []},
            "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "KubeletReady",
                                       "lastHeartbeatTime": "2026-11-29T20:00:00Z", "lastTransitionTime": "2026-11-29T19:00:00Z"}]}}


def _list(*nodes: dict) -> dict:
    return {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "4711"}, "items": list(nodes)}


FORBIDDEN = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden", "code": 403,
             "message": 'nodes is forbidden: User "system:serviceaccount:airflow:worker" cannot list resource "nodes" '
                        'in API group "" at the cluster scope'}


class Replay(http.server.BaseHTTPRequestHandler):
    answers: list[tuple[int, dict]] = []
    paths: list[str] = []

    def do_GET(self):  # noqa: N802
        type(self).paths.append(self.path)
        send_json(self, *type(self).answers.pop(0))

    def log_message(self, *args):
        pass


@pytest.fixture
def api(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "t",
                  "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
                  "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
                  "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}
    monkeypatch.setenv("AIRFLOW_CONN_K8S_TEST", json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": json.dumps(kubeconfig)}}))
    Replay.answers, Replay.paths = [], []
    yield Replay
    server.shutdown()


def test_recorded_api_waits_while_the_bootstrap_taint_is_there_and_succeeds_once_it_is_lifted(api):
    api.answers += [(200, _list(_node("gpu-1", tainted=True), _node("gpu-2", tainted=False, ready="False"))),
                    (200, _list(_node("gpu-1", tainted=False), _node("gpu-2", tainted=False)))]
    sensor = NodeReadySensor(task_id="nodes", kubernetes_conn_id="k8s_test", min_nodes=2)
    assert sensor.poke({}) is False
    assert sensor.poke({}) is True
    assert all("labelSelector=cedana.ai%2Fenabled%3Dtrue" in p for p in api.paths)


def test_recorded_api_one_named_node(api):
    api.answers += [(200, _node("gpu-9", tainted=False))]
    assert NodeReadySensor(task_id="n", node_name="gpu-9", kubernetes_conn_id="k8s_test").poke({}) is True
    assert api.paths == ["/api/v1/nodes/gpu-9"]


def test_recorded_api_rbac_denial_is_one_clear_line(api):
    api.answers += [(403, FORBIDDEN)]
    with pytest.raises(AirflowFailException, match=r"refused to list nodes \(403, RBAC\) for connection 'k8s_test'. "
                                                   r"Grant its service account get/list on nodes"):
        NodeReadySensor(task_id="n", kubernetes_conn_id="k8s_test").poke({})
