"""The stand-in for the cluster around the pod route (scripts/pod_runtime.py), on the operator's own pods:
placement by the pod's node affinity, and the translation for podman changing only what podman cannot
take. No podman is needed here; tests/integration/test_k8s_pods.py plays the pods."""

from __future__ import annotations

import json
import stat
import types
from datetime import timedelta

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")
from kubernetes.client import models as k8s  # noqa: E402

from cedana_airflow.operators import CedanaKubernetesPodOperator  # noqa: E402
from pod_runtime import Node, PodError, fits, place, pod_dict, translate  # noqa: E402

OPTIN = '[node]\nlabels = { "cedana.ai/enabled" = "true" }\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
NODES = [Node("cpu-0"), Node("gpu-a", {"cedana.ai/enabled": "true"}), Node("gpu-b", {"cedana.ai/enabled": "true"})]
SECRETS = {"ckpt-s3": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "s3cr3t/+=="}}


class _State(dict):
    def set(self, key, value):
        self[key] = value


@pytest.fixture
def optin(tmp_path, monkeypatch):
    p = tmp_path / "optin.toml"
    p.write_text(OPTIN)
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))
    monkeypatch.setenv("AIRFLOW__CEDANA__STORE", "s3://ckpt/k8s")


def _pod(route="wrap", try_number=1, earlier=()):
    state = _State({"cedana": {"tries": [{"try_number": i + 1, "node": n} for i, n in enumerate(earlier)]}})
    ti = types.SimpleNamespace(dag_id="train", task_id="fit", try_number=try_number, map_index=-1)
    ctx = {"ti": ti, "dag": types.SimpleNamespace(dag_id="train"), "run_id": "manual__1", "task_state_store": state}
    op = CedanaKubernetesPodOperator(task_id="fit", name="fit", namespace="ml", image="ml:1", route=route,
                                     store_secret="ckpt-s3" if route == "wrap" else None, cmds=["python3", "fit.py"],
                                     heartbeat=timedelta(seconds=5))
    return pod_dict(op.build_pod_request_obj(ctx, dry_run=True))


def test_placement_follows_the_opt_in_label_and_a_retry_avoids_the_earlier_node(optin):
    first = _pod()
    assert not fits(first, NODES[0]) and place(first, NODES).name == "gpu-a"  # the unlabelled node is never picked
    retry = _pod(try_number=2, earlier=["gpu-a"])
    assert place(retry, NODES).name == "gpu-b"
    with pytest.raises(PodError, match="no node fits .*cpu-0, gpu-a"):
        place(_pod(try_number=3, earlier=["gpu-a", "gpu-b"]), NODES)


def test_translation_changes_only_what_podman_cannot_take_and_says_so(optin, tmp_path):
    pod = _pod()
    before = json.dumps(pod, sort_keys=True)
    out, notes = translate(pod, NODES[1], SECRETS, tmp_path / "secrets")
    assert json.dumps(pod, sort_keys=True) == before  # the operator's pod is not touched
    main, orig = out["spec"]["containers"][0], pod["spec"]["containers"][0]
    assert main["command"] == orig["command"] and main["securityContext"] == {"privileged": True}
    assert {e["name"]: e.get("value") for e in main["env"]}["CEDANA_NODE"] == "gpu-a"
    assert "affinity" not in out["spec"] and out["spec"]["nodeName"] == "gpu-a" and main["imagePullPolicy"] == "Never"
    [vol] = [v for v in out["spec"]["volumes"] if v["name"] == "cedana-store-credentials"]
    where = tmp_path / "secrets" / "ckpt-s3"
    assert vol == {"name": "cedana-store-credentials", "hostPath": {"path": str(where), "type": "Directory"}}
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    for key, value in SECRETS["ckpt-s3"].items():  # the values themselves (podman 4.3 wrote them base64-encoded)
        assert (where / key).read_text() == value and stat.S_IMODE((where / key).stat().st_mode) == 0o400
    # two Secret volumes: the store's, and the node key's (optional: absent here, mounted empty as the kubelet does)
    assert len(notes) == 4 and any("spec.nodeName" in n for n in notes) and sum("Secret volume" in n for n in notes) == 2
    # everything else arrives as the operator built it
    drop = lambda d: {k: v for k, v in d.items() if k not in ("affinity", "nodeSelector", "tolerations", "nodeName", "volumes", "containers")}  # noqa: E731
    assert drop(out["spec"]) == drop(pod["spec"]) and out["metadata"] == pod["metadata"]


def test_translation_of_the_cedana_route_notes_the_runtime_class_it_cannot_run(optin, tmp_path):
    out, notes = translate(_pod(route="cedana"), NODES[2], {}, tmp_path)
    assert "runtimeClassName" not in out["spec"] and "runtimeClassName 'cedana' ignored" in notes[0]


def test_a_pod_whose_secret_does_not_exist_is_refused_by_name(optin, tmp_path):
    with pytest.raises(PodError, match="mounts Secret 'ckpt-s3', which does not exist"):
        translate(_pod(), NODES[1], {}, tmp_path)
