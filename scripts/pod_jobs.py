"""A job of several pods on the Kubernetes wrap route, played by podman (demo_k8s.py's "job" case).

CedanaKubernetesJobOperator builds each try's V1Job through its own code path (build_job_request_obj
with the try's task context). What stands in for the cluster, beyond demo_k8s.py's stand-ins:

- the Job controller's part: the Indexed Job's pods, one per completion index, made from the template
  as the controller makes them (the index in the ``batch.kubernetes.io/job-completion-index`` annotation
  and ``JOB_COMPLETION_INDEX``, the ``job-name`` label, the hostname ``<job>-<index>``), and its reaction to a failed pod with
  ``backoffLimit: 0``: the Job fails and its other pods are deleted (SIGTERM, SIGKILL after the grace
  period). Airflow's retry is the next try's Job, built by the operator for that try number.
- the scheduler's filter, as for one pod, plus the Job's required pod anti-affinity (one part per node);
  the lost node is left out, as a NotReady node is. On a cluster the lost node's pod counts as failed once
  evicted (the operator's ``node_lost_seconds``), and stays Terminating until the node is gone; here it is
  gone at once. The provider's own execute (its wait for the Job, its pod discovery) needs an API server:
  tests/operators/test_kubernetes.py runs it against a fake one.
- each part's address: pods on a podman network of their own, each at the address its completion index
  was given the first time. A transparent job's connections between its pods come back only where the
  cluster's CNI pins an address per index (docs/jobs.md, "Kubernetes"); this stands in for that CNI.

The workload is tests/workloads/job_pingpong.py, part 0 serving and part 1 talking to it over one TCP
connection between the pods, with no checkpoint code: its digests equal an uninterrupted run's only if
every message crossed the restore exactly once.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PINGPONG = REPO / "tests" / "workloads" / "job_pingpong.py"
PINGPONG_ARGS = ["--steps", "200", "--step-seconds", "0.1"]
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: The job's network, and the address each completion index keeps (the stand-in for a pinning CNI).
SUBNET, ADDRESSES = "10.89.70.0/24", ("10.89.70.10", "10.89.70.11")
PORT = 7000
#: A kube config whose API server is never called: KubernetesPodOperator's build_pod_request_obj asks its
#: hook whether it runs in a cluster, which reads one (the spec is built locally; no Job is created from it).
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: u, user: {token: unused}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
"""


def operator(cluster: Any, prefix: str) -> Any:
    """The DAG author's task: two pods, one part each; part 0 serves at its address, part 1 connects."""
    from kubernetes.client import models as k8s

    from cedana_airflow.operators import CedanaKubernetesJobOperator

    code = k8s.V1Volume(name="workload", host_path=k8s.V1HostPathVolumeSource(path=str(PINGPONG.parent)))
    role = f'$([ "$JOB_COMPLETION_INDEX" = 0 ] && echo --serve || echo --connect) {ADDRESSES[0]}:{PORT}'
    config = cluster.root / "kubeconfig"
    config.write_text(KUBECONFIG)
    return CedanaKubernetesJobOperator(
        task_id="pretrain", name=f"{prefix}-pretrain", namespace="ml", image=cluster.image, route="wrap", parts=2,
        store_secret="ckpt-s3", cmds=["sh", "-c", f"exec python3 /workload/{PINGPONG.name} {' '.join(PINGPONG_ARGS)} {role}"],
        heartbeat=timedelta(seconds=2), volumes=[code], config_file=str(config), termination_grace_period=20,
        volume_mounts=[k8s.V1VolumeMount(name="workload", mount_path="/workload", read_only=True)],
        env_vars={"PYTHONUNBUFFERED": "1"})


def indexed_pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods the Job controller makes of an Indexed Job: one per completion index, from the template."""
    name, template = job["metadata"]["name"], job["spec"]["template"]
    pods = []
    for index in range(job["spec"]["completions"]):
        meta = template.get("metadata") or {}
        labels = {**(meta.get("labels") or {}), "job-name": name, "batch.kubernetes.io/job-name": name,
                  INDEX_ANNOTATION: str(index)}
        annotations = {**(meta.get("annotations") or {}), INDEX_ANNOTATION: str(index)}
        index_env = {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
        spec = {**template["spec"], "hostname": f"{name}-{index}", "containers": [  # a value already there is kept
            {**c, "env": [*(env := c.get("env") or []), *([index_env] if all(e["name"] != "JOB_COMPLETION_INDEX"
                                                                             for e in env) else [])]}
            for c in template["spec"]["containers"]]}
        pods.append({"apiVersion": "v1", "kind": "Pod", "spec": spec, "metadata": {
            **meta, "name": f"{name}-{index}-{secrets.token_hex(3)}", "labels": labels, "annotations": annotations}})
    return pods


def start_job(cluster: Any, op: Any, try_number: int, nodes: list[Any], network: str) -> list[Any]:
    """Build this try's Job with the operator and play each of its pods where the scheduler would put it."""
    import demo_k8s
    from pod_runtime import place, pod_dict, translate

    job = pod_dict(op.build_job_request_obj(demo_k8s.context(try_number, demo_k8s._TaskStateStore())))
    running: dict[str, list[dict[str, str]]] = {}
    tries = []
    for index, pod in enumerate(indexed_pods(job)):
        node = place(pod, nodes, running)
        running.setdefault(node.name, []).append(pod["metadata"]["labels"])
        manifest, notes = translate(pod, node, cluster.secrets, cluster.root / "secrets" / pod["metadata"]["name"])
        name = cluster.rt.play(manifest, network=network, ip=ADDRESSES[index])
        tries.append(demo_k8s.Try(try_number, name, node.name, notes, []))
    return tries


def committed(cluster: Any, prefix: str) -> list[dict[str, Any]]:
    """The job's commits in the store: the manifests that hold every part's (the ``job`` block)."""
    return [m for m in cluster.checkpoints(prefix) if m.get("job")]


def uninterrupted(steps: int = int(PINGPONG_ARGS[1])) -> str:
    """The digest an uninterrupted run of job_pingpong.py's two parts prints (both print the same; a run whose
    parts disagree raises), on loopback, ``steps`` steps unpaced."""
    with socket.socket() as s:  # a free port (the connecting side retries until the server listens)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    steps_args = ["--steps", str(steps)]
    serve = subprocess.Popen([sys.executable, str(PINGPONG), *steps_args, "--serve", address], stdout=subprocess.PIPE,
                             text=True)
    talk = subprocess.run([sys.executable, str(PINGPONG), *steps_args, "--step-seconds", "0", "--connect", address],
                          capture_output=True, text=True, timeout=120, check=True)
    served = serve.communicate(timeout=60)[0].splitlines()[-1]
    if served != talk.stdout.splitlines()[-1]:
        raise RuntimeError(f"the uninterrupted job's parts disagree: {served} and {talk.stdout.splitlines()[-1]}")
    return served


def job_loss(cluster: Any, prefix: str) -> Any:
    """Try 1's parts on nodes a and b; after two commits node b is lost, and the Job fails (its other pod
    deleted); try 2's Job resumes both parts from the newest commit, part 1 on node c at its index's address."""
    import demo_k8s

    case = demo_k8s.Case("job")
    network = cluster.rt.network(f"{prefix}-net", SUBNET)
    op = operator(cluster, prefix)
    nodes = [n for n in demo_k8s.NODES if n.labels]
    first = start_job(cluster, op, 1, nodes, network)
    case.tries.extend(first)
    deadline = time.monotonic() + 180
    while len(committed(cluster, prefix)) < 2:
        for t in first:
            status, code = cluster.rt.state(cluster.rt.container(t.pod))
            if status != "running" or time.monotonic() > deadline:
                _, err = cluster.rt.logs(cluster.rt.container(t.pod))
                raise demo_k8s.PodError(f"{t.pod}: 2 commits not taken (container {status}, exit {code}): {err[-2000:]}")
        time.sleep(0.2)
    commits = committed(cluster, prefix)
    for t in first:
        t.checkpoints_before_end = len(commits)
    case.newest_before_end = max(m["seq"] for m in commits)
    lost = first[1]
    cluster.rt.lose_node(lost.pod)
    cluster.rt.drain(first[0].pod, 20)  # the failed Job's other pod, deleted by the Job controller
    for t in first:
        cluster.finish(t, 60)
        cluster.rt.remove(t.pod)
    retry = start_job(cluster, op, 2, [n for n in nodes if n.name != lost.node], network)
    case.tries.extend(cluster.finish(t, 180) for t in retry)
    return case
