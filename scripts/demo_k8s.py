"""`make demo-k8s`: the Kubernetes wrap route run for real, in pods played by podman.

CedanaKubernetesPodOperator(route="wrap") builds each try's V1Pod through its own code path
(build_pod_request_obj with the try's task context); pod_runtime.py places it on one of four
pretend nodes by its node affinity and plays it with `podman kube play` in the image that
pod_image.py builds from deploy/Containerfile and our wheel. The store is SeaweedFS, a real S3 server
(moto's before 0.11.0), on this machine, reached from the pods over their network; its credentials are
the Secret the operator mounts as files. The cases, each compared with an uninterrupted run of its workload:

- node loss: after a few heartbeat checkpoints every process of the pod is SIGKILLed; the retry's
  pod (try 2, same checkpoint ID) goes to another node, restores the latest checkpoint and finishes;
- drain: the pod is stopped as a node drain deletes it (SIGTERM, SIGKILL after its grace period);
  the final checkpoint is taken in the grace period and the retry restores that one;
- live drill: the live drill (drill/live.py, as the drill DAG runs it) chooses the running try and
  fails it by deleting its pod; the deletion as the API reports it, and Airflow's retry, stand in
  (pod_fleet.py); the drill follows the retry's pod and measures it;
- version skew: an operator newer than the image's CLI writes the pod; the CLI refuses in one line
  (compat.py), before anything runs;
- job: CedanaKubernetesJobOperator's two pods, one part each of a job talking over TCP between them; a
  node is lost, and the retry's Job resumes both parts from one seq (pod_jobs.py).

Not exercised (no API server here): the API server and kubelet, the scheduler beyond the affinity
filter, the runtime class handler, image pulls.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import pod_jobs  # noqa: E402  (its functions import this module when they run)
from local_parts import seaweed_server  # noqa: E402
from pod_runtime import Node, PodError, PodRuntime, place, pod_dict, translate  # noqa: E402

WORKLOAD = REPO / "tests" / "workloads" / "pool_sum.py"
# 150 steps: three 2 s heartbeats (and their uploads to the store) come well before the end, on a busy machine too
WORKLOAD_ARGS = ["--seed", "5", "--steps", "150", "--workers", "2", "--step-seconds", "0.1"]
BUCKET = "ckpt"
DAG_ID, TASK_ID, RUN_ID = "train_llm", "finetune", "scheduled__2026-12-01T00:00:00+00:00"
OPTIN = '[node]\nlabels = { "cedana.ai/enabled" = "true" }\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["train_llm"]\n'
#: The cluster we pretend to have: one node off the opt-in list, three on it.
NODES = [Node("cpu-node-0"), Node("gpu-node-a", {"cedana.ai/enabled": "true"}),
         Node("gpu-node-b", {"cedana.ai/enabled": "true"}), Node("gpu-node-c", {"cedana.ai/enabled": "true"})]
GRACE_SECONDS = 20


@dataclass
class Try:
    """One try's pod: where it ran, what the translation changed, how it ended, what it printed."""

    try_number: int
    pod: str
    node: str
    notes: list[str]
    affinity: list[tuple[str, str, list[str]]]
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    checkpoints_before_end: int = 0


@dataclass
class Case:
    name: str
    tries: list[Try] = field(default_factory=list)
    expected: str = ""
    images_hold_credentials: bool | None = None
    manifests: list[dict[str, Any]] = field(default_factory=list)  # in the store at the end
    seconds: float = 0.0
    report: Any = None  # the live drill's DrillReport
    newest_before_end: int | None = None  # a job: its newest commit when try 1 ended

    @property
    def digest(self) -> str:
        lines = self.tries[-1].stdout.strip().splitlines() if self.tries else []
        return lines[-1] if lines else ""


def host_address() -> str:
    """This machine's address on its default route: what a pod reaches the host's services at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: this only asks the routing table
        except OSError as e:
            raise PodError(f"no default route, so pods cannot reach this machine's S3 server: {e}") from e
        return str(s.getsockname()[0])


def uninterrupted() -> str:
    import subprocess

    out = subprocess.run([sys.executable, str(WORKLOAD), *WORKLOAD_ARGS, "--step-seconds", "0"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    return out.strip().splitlines()[-1]


class _TaskStateStore(dict):  # type: ignore[type-arg]
    """context["task_state_store"]: in a running task it lives behind Airflow's API server."""

    def set(self, key: str, value: Any) -> None:
        self[key] = value


def context(try_number: int, state: _TaskStateStore) -> dict[str, Any]:
    """The task context a worker hands the operator for this try (the parts the pod is built from)."""
    ti = types.SimpleNamespace(dag_id=DAG_ID, task_id=TASK_ID, try_number=try_number, map_index=-1)
    return {"ti": ti, "dag": types.SimpleNamespace(dag_id=DAG_ID), "run_id": RUN_ID, "task_state_store": state}


class Cluster:
    """Three pretend nodes on one podman, SeaweedFS as the store, and the operator's Secret."""

    def __init__(self, root: Path, image: str, rt: PodRuntime, s3_url: str, canary: str) -> None:
        self.root, self.image, self.rt, self.s3_url = root, image, rt, s3_url
        # The node key Secret every cluster running the wrap route has ([cedana] k8s_key_secret): made as
        # `kubectl create secret generic cedana-node-key --from-file=node.key=...` would make it.
        self.secrets = {"ckpt-s3": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": canary,
                                    "AWS_ENDPOINT_URL": s3_url, "AWS_REGION": "us-east-1"},
                        "cedana-node-key": {"node.key": secrets.token_hex(32) + "\n"}}

    def operator(self, prefix: str) -> Any:
        from kubernetes.client import models as k8s

        from cedana_airflow.operators import CedanaKubernetesPodOperator

        code = k8s.V1Volume(name="workload", host_path=k8s.V1HostPathVolumeSource(path=str(WORKLOAD.parent)))
        return CedanaKubernetesPodOperator(
            task_id=TASK_ID, name=f"{prefix}-finetune", namespace="ml", image=self.image, route="wrap",
            store_secret="ckpt-s3", cmds=["python3", f"/workload/{WORKLOAD.name}"], arguments=WORKLOAD_ARGS,
            heartbeat=timedelta(seconds=2), volumes=[code], termination_grace_period=GRACE_SECONDS,
            volume_mounts=[k8s.V1VolumeMount(name="workload", mount_path="/workload", read_only=True)],
            env_vars={"PYTHONUNBUFFERED": "1"})

    def start(self, op: Any, try_number: int, state: _TaskStateStore) -> Try:
        """Build this try's pod with the operator, place it, play it, and record where it runs."""
        pod = op.build_pod_request_obj(context(try_number, state), dry_run=True)
        data = pod_dict(pod)
        node = place(data, NODES)
        manifest, notes = translate(data, node, self.secrets, self.root / "secrets" / data["metadata"]["name"])
        name = self.rt.play(manifest)
        terms = data["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        exprs = [(e["key"], e["operator"], e["values"]) for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]
        pod.spec.node_name = node.name  # what the API server holds once the pod is bound; the callback records it
        [cb for cb in op.callbacks if cb.__name__ == "_RecordNode"][0].on_pod_starting(
            pod=pod, client=None, mode="sync", operator=op, context=context(try_number, state))
        return Try(try_number, name, node.name, notes, exprs)

    def checkpoints(self, prefix: str) -> list[dict[str, Any]]:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.s3_url, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", [])
                if o["Key"].endswith("manifest.json")]
        return [json.loads(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()) for k in sorted(keys)]

    def wait_checkpoints(self, prefix: str, n: int, t: Try, timeout: float = 120) -> None:
        container = self.rt.container(t.pod)
        deadline = time.monotonic() + timeout
        while len(self.checkpoints(prefix)) < n:
            status, code = self.rt.state(container)
            if status != "running" or time.monotonic() > deadline:
                out, err = self.rt.logs(container)
                raise PodError(f"{t.pod}: {n} checkpoints not taken (container {status}, exit {code}): {err[-2000:]}")
            time.sleep(0.2)

    def finish(self, t: Try, timeout: float = 300) -> Try:
        container = self.rt.container(t.pod)
        t.exit_code = self.rt.wait(container, timeout)
        t.stdout, t.stderr = self.rt.logs(container)
        (self.root / f"{t.pod}.out").write_text(t.stdout)  # the pod goes; its logs stay for a reader
        (self.root / f"{t.pod}.err").write_text(t.stderr)
        return t


def images_hold(cluster: Cluster, prefix: str, secret: str, into: Path) -> bool:
    """Does any checkpoint image of the case hold ``secret``? (They hold the workload's memory.)"""
    from cedana_airflow.config import load_settings
    from cedana_airflow.format.manifest import Manifest
    from cedana_airflow.store import open_store
    from cedana_airflow.store.transfer import fetch_checkpoint

    store = open_store(f"s3://{BUCKET}/{prefix}", load_settings(environ={}))
    # a job's commit holds no images of its own: each part's manifest, inside it, names that part's
    docs = [d for m in cluster.checkpoints(prefix) for d in ([x["manifest"] for x in m["job"]["members"]] if m.get("job") else [m])]
    for i, m in enumerate(docs):
        fetch_checkpoint(store, Manifest.model_validate(m), into / str(i))
    return any(secret.encode() in p.read_bytes() for p in into.rglob("*") if p.is_file())


def _first_try_ends_then_retry(cluster: Cluster, prefix: str, name: str, checkpoints: int,
                               end: Callable[[str], None]) -> Case:
    """Try 1 runs until ``checkpoints`` are stored, ``end`` ends its pod, and try 2's pod runs to its end."""
    case, state = Case(name), _TaskStateStore()
    op = cluster.operator(prefix)
    first = cluster.start(op, 1, state)
    case.tries.append(first)
    cluster.wait_checkpoints(prefix, checkpoints, first)
    first.checkpoints_before_end = len(cluster.checkpoints(prefix))
    end(first.pod)
    cluster.finish(first, 60)
    cluster.rt.remove(first.pod)
    case.tries.append(cluster.finish(cluster.start(op, 2, state)))
    return case


def node_loss(cluster: Cluster, prefix: str) -> Case:
    # the node is gone: no final checkpoint, nothing more from this pod
    return _first_try_ends_then_retry(cluster, prefix, "node loss", 3, cluster.rt.lose_node)


def drain(cluster: Cluster, prefix: str) -> Case:
    # SIGTERM; the final checkpoint must fit in the grace period
    return _first_try_ends_then_retry(cluster, prefix, "drain", 1, lambda pod: cluster.rt.drain(pod, GRACE_SECONDS))


def live_drill(cluster: Cluster, prefix: str) -> Case:
    """The live drill fails the running try by deleting its pod; the retry's pod restores (pod_fleet.py)."""
    from pod_fleet import PodFleet

    from cedana_airflow.config import load_settings
    from cedana_airflow.drill.facts import StoreFacts
    from cedana_airflow.drill.live import live
    from cedana_airflow.scope.optin import Drills
    from cedana_airflow.store import open_store

    case = Case("live drill")
    fleet = PodFleet(cluster, cluster.operator(prefix), _TaskStateStore(), dag_id=DAG_ID, task_id=TASK_ID,
                     run_id=RUN_ID, retries=1, grace_seconds=GRACE_SECONDS)
    first = fleet.start_try(1)
    cluster.wait_checkpoints(prefix, 1, first)
    first.checkpoints_before_end = len(cluster.checkpoints(prefix))
    store = open_store(f"s3://{BUCKET}/{prefix}", load_settings(environ={}))
    case.report = live(StoreFacts(store, None), fleet, Drills(live=True, follow_seconds=300), node="drill-runner",
                       seed=1, poll=0.5)
    case.tries = fleet.tries
    cluster.finish(case.tries[-1], 120)
    for t in case.tries:
        cluster.rt.remove(t.pod)
    return case


def skew(cluster: Cluster, prefix: str) -> Case:
    """An operator newer than the image's CLI: the pod refuses at once, in one line, and takes nothing."""
    import cedana_airflow.compat as compat

    case, state = Case("version skew"), _TaskStateStore()
    floor, compat.SUPERVISOR_FLOOR = compat.SUPERVISOR_FLOOR, "9.0"  # as an operator of 9.x would write the pod
    try:
        op = cluster.operator(prefix)
        first = cluster.start(op, 1, state)
    finally:
        compat.SUPERVISOR_FLOOR = floor
    case.tries.append(cluster.finish(first, 60))
    cluster.rt.remove(first.pod)
    return case


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``values`` in os.environ for the length of a ``with``, then as they were (a test session goes on)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(root: Path, cache: Path | None = None,
        cases: tuple[str, ...] = ("node loss", "drain", "live drill", "version skew", "job")) -> list[Case]:
    """Build (or load) the image, start the store, and play each case; every pod is gone afterwards."""
    import boto3

    import pod_image

    optin = root / "optin.toml"
    optin.write_text(OPTIN)
    canary = f"canary-{os.urandom(8).hex()}"  # the server takes any key: a secret to look for in the images
    expected = uninterrupted()
    with ExitStack() as stack:
        stack.enter_context(_environ(AIRFLOW_HOME=os.environ.get("AIRFLOW_HOME", str(root / "airflow")),
                                     AIRFLOW__CEDANA__OPTIN_FILE=str(optin)))
        rt = PodRuntime(root / "podman")
        stack.callback(rt.close)
        _, image = pod_image.build(cache or pod_image.DEFAULT_CACHE, rt)
        s3_url = stack.enter_context(seaweed_server(host=host_address()))
        # This process reads the store too (the images, below); the pods get the Secret instead.
        stack.enter_context(_environ(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                                     AWS_ENDPOINT_URL=s3_url, AWS_DEFAULT_REGION="us-east-1"))
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        cluster = Cluster(root, image, rt, s3_url, canary)
        done = []
        plays = (("node loss", node_loss), ("drain", drain), ("live drill", live_drill), ("version skew", skew),
                 ("job", pod_jobs.job_loss))
        for name, play in plays:
            if name in cases:
                prefix = name.replace(" ", "-")
                with _environ(AIRFLOW__CEDANA__STORE=f"s3://{BUCKET}/{prefix}"):
                    t0 = time.monotonic()
                    case = play(cluster, prefix)
                    case.seconds = time.monotonic() - t0
                case.expected = "" if name == "version skew" else pod_jobs.uninterrupted() if name == "job" else expected
                case.manifests = cluster.checkpoints(prefix)
                case.images_hold_credentials = images_hold(cluster, prefix, canary, root / "images" / prefix)
                done.append(case)
        return done


def summary(cases: list[Case]) -> str:
    lines = []
    for case in cases:
        lines.append(f"== {case.name} ({case.seconds:.0f} s)")
        for t in case.tries:
            restored = [line.split("cedana: ", 1)[-1] for line in t.stderr.splitlines() if "restored seq " in line]
            ended = f"; {t.checkpoints_before_end} checkpoint(s) stored before it ended" if t.checkpoints_before_end else ""
            lines.append(f"  try {t.try_number}: pod {t.pod} on {t.node}, exit {t.exit_code}{ended}")
            lines.extend(f"    affinity {k} {op} {v}" for k, op, v in t.affinity)
            lines.extend(f"    {r}" for r in restored)
            lines.extend(f"    {line.split('cedana: ', 1)[-1]}" for line in t.stderr.splitlines() if "stopped by SIG" in line)
            lines.extend(f"    {line}" for line in t.stderr.splitlines() if line.startswith("ConfigError:"))
        if case.report is not None:
            r = case.report
            lines.append(f"  live drill {r.drill_id}: ok={r.ok} restored seq {r.restored_seq} {r.from_node} -> {r.to_node}; "
                         f"detected {r.detect_seconds} s, retry running {r.retry_seconds} s, restore {r.restore_seconds} s, "
                         f"RTO {r.rto_seconds} s, work lost {r.lost_work_seconds} s" + "".join(f"; {p}" for p in r.problems))
        if not case.expected:
            continue
        lines.append(f"  output {case.digest!r}, uninterrupted {case.expected!r}: "
                     + ("equal" if case.digest == case.expected else "DIFFERENT"))
        lines.append(f"  store credentials in the checkpoint images: {'YES' if case.images_hold_credentials else 'no'}")
    if cases and cases[0].tries:
        lines.append("translated for podman (what is not exercised):")
        lines.extend(f"  - {n}" for n in cases[0].tries[0].notes)
    return "\n".join(lines)


def main() -> int:
    os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING")  # the summary says what the operator did
    root = Path(tempfile.mkdtemp(prefix="cedana-k8s-"))
    print(f"playing the wrap route's pods with podman in {root} (image cached in {pod_image.DEFAULT_CACHE})...", flush=True)
    try:
        cases = run(root)
    except PodError as e:
        print(f"demo-k8s: {e}", file=sys.stderr)
        return 1
    print(summary(cases))
    print(f"logs: {root}")
    ok = all(c.digest == c.expected and c.tries[-1].exit_code == 0 and not c.images_hold_credentials
             for c in cases if c.expected) and all(c.tries[0].exit_code == 2 for c in cases if not c.expected) \
        and all(c.report.ok for c in cases if c.report is not None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
