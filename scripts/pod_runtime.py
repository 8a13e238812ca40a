"""A node's container runtime for the Kubernetes route: the operator's V1Pod, played by Debian's podman.

No Kubernetes API server can run on these machines, but a real container runtime can run a pod
manifest (``podman kube play``). What stands in for the cluster, and nothing more:

- ``place``: the scheduler's one decision we check, the pod's required node affinity against the
  labels of the nodes we pretend to have. It picks the node; it does not rank, bind or preempt.
- ``translate``: the pod as the kubelet of that node would run it, changing only what podman 4.3
  cannot take, each change logged as a note: the runtime class (podman runs runc; a cluster's
  handler is not exercised), node affinity, selectors and tolerations (placement is ``place``'s),
  ``spec.nodeName`` through the downward API (podman refuses that fieldPath: the value is the node
  we placed it on, as the kubelet would fill it), and Secret volumes (podman 4.3 crashes on one
  without ``optional``, and writes ``data`` base64-encoded, ignoring ``defaultMode``: the Secret's
  files are written to a root-only host directory and mounted from there, as the kubelet does).
- ``PodRuntime``: podman with a private configuration and storage under one directory, so the
  machine's own containers.conf, storage and images are never touched. Two quirks of these VMs are
  set there: no CAP_SYS_RESOURCE (explicit nofile/nproc ulimits) and hybrid cgroups, which crun
  refuses (runtime runc).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


CONTAINERS_CONF = """\
# cedana-airflow's pod runtime (scripts/pod_runtime.py): a private configuration, never the machine's.
[containers]
# These VMs lack CAP_SYS_RESOURCE: a container may not raise its limits above the host's defaults.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
# Hybrid cgroups (v1 controllers): crun refuses them, runc runs.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_config_dir = "{root}/networks"
"""


class PodError(RuntimeError):
    """A pod could not be placed, played or observed; the message names the cause."""


@dataclass(frozen=True)
class Node:
    """A node we pretend to have: a name and its labels (kubernetes.io/hostname is the name)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def all_labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.name, **self.labels}


def _matches(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise PodError(f"node affinity operator {op!r} is not understood by this stand-in scheduler")


def _repelled(pod: Mapping[str, Any], node: Node, running: Mapping[str, list[Mapping[str, str]]]) -> bool:
    """Does a required pod anti-affinity term keep the pod off ``node``, given the labels of the pods
    ``running`` on each node? Only what our Jobs use: matchLabels, per node (topologyKey hostname)."""
    anti = ((pod["spec"].get("affinity") or {}).get("podAntiAffinity") or {})
    for term in anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
        if term.get("topologyKey") != "kubernetes.io/hostname" or set(term.get("labelSelector") or {}) - {"matchLabels"}:
            raise PodError(f"pod anti-affinity {term!r} is not understood by this stand-in scheduler")
        want = term["labelSelector"]["matchLabels"]
        if any(all(labels.get(k) == v for k, v in want.items()) for labels in running.get(node.name, [])):
            return True
    return False


def fits(pod: Mapping[str, Any], node: Node, running: Mapping[str, list[Mapping[str, str]]] | None = None) -> bool:
    """Does the node meet the pod's nodeSelector, required node affinity (terms ORed, expressions ANDed)
    and required pod anti-affinity against the pods ``running`` there (node name -> their labels)?"""
    spec, labels = pod["spec"], node.all_labels()
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    if _repelled(pod, node, running or {}):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(all(_matches(e, labels) for e in t.get("matchExpressions") or []) for t in terms)


def place(pod: Mapping[str, Any], nodes: list[Node], running: Mapping[str, list[Mapping[str, str]]] | None = None) -> Node:
    """The first node the pod may run on, as the scheduler's filter would find it."""
    for node in nodes:
        if fits(pod, node, running):
            return node
    raise PodError(f"no node fits pod {pod['metadata']['name']}: its node affinity rules out "
                   + ", ".join(n.name for n in nodes))


def pod_dict(pod: Any) -> dict[str, Any]:
    """A V1Pod as the API server would receive it (camelCase, no nulls)."""
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(pod)  # type: ignore[no-any-return]


def translate(pod: Mapping[str, Any], node: Node, secrets: Mapping[str, Mapping[str, str]],
              secrets_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The pod as podman runs it on ``node``, and a note for each thing changed (see module docstring).

    ``secrets`` are the cluster's Secrets by name (key -> value); a Secret volume's files are written
    under ``secrets_dir`` (0700 directory, 0400 files unless the volume says otherwise)."""
    out: dict[str, Any] = json.loads(json.dumps(pod))
    spec, notes = out["spec"], []
    if spec.pop("runtimeClassName", None):
        notes.append(f"runtimeClassName {pod['spec']['runtimeClassName']!r} ignored: podman runs runc "
                     "(a cluster's runtime class handler is not exercised here)")
    for key in ("affinity", "nodeSelector"):
        if spec.pop(key, None):
            notes.append(f"{key} taken by the stand-in scheduler (placed on {node.name}), not by podman")
    if spec.pop("tolerations", None):
        notes.append("tolerations ignored: the pretend nodes have no taints")
    spec["nodeName"] = node.name
    for c in spec.get("containers", []):
        c["imagePullPolicy"] = "Never"  # no registry: the image is local
        for e in c.get("env") or []:
            ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if ref == "spec.nodeName":
                e.pop("valueFrom")
                e["value"] = node.name
                notes.append(f"env {e['name']}: fieldRef spec.nodeName resolved to {node.name!r} "
                             "(podman does not support that fieldPath)")
            elif ref and (m := re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", ref)):
                found = pod["metadata"].get(m.group(1)) or {}
                if m.group(2) not in found:
                    raise PodError(f"pod {pod['metadata']['name']}: env {e['name']} reads {m.group(1)[:-1]} "
                                   f"{m.group(2)}, which the pod does not have")
                e.pop("valueFrom")
                e["value"] = found[m.group(2)]
                notes.append(f"env {e['name']}: fieldRef {ref} resolved to {e['value']!r} (the kubelet's downward "
                             "API, written here)")
    for v in spec.get("volumes") or []:
        secret = v.get("secret")
        if secret is None:
            continue
        name = secret["secretName"]
        if name not in secrets and secret.get("optional"):  # the kubelet mounts an empty volume
            secrets = {**secrets, name: {}}
        if name not in secrets:
            raise PodError(f"pod {pod['metadata']['name']} mounts Secret {name!r}, which does not exist here")
        where = secrets_dir / name
        where.mkdir(parents=True, exist_ok=True)
        os.chmod(where, 0o700)
        for key, value in secrets[name].items():
            f = where / key
            f.write_text(value)
            os.chmod(f, secret.get("defaultMode", 0o644))
        del v["secret"]
        v["hostPath"] = {"path": str(where), "type": "Directory"}
        notes.append(f"Secret volume {v['name']!r} ({name}) mounted from a root-only host directory, as the "
                     "kubelet does (podman 4.3 cannot mount a Secret's files faithfully)")
    return out, notes


class PodRuntime:
    """podman with its configuration and storage under ``root``; pods it plays are removed on close."""

    def __init__(self, root: Path) -> None:
        if shutil.which("podman") is None:
            raise PodError("podman is not installed: run `make pods` (Debian's podman, runc and mmdebstrap)")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "containers.conf").write_text(CONTAINERS_CONF.format(root=root))
        (root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{root / "storage"}"\nrunroot = "{root / "run"}"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(root / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
                    "CONTAINERS_REGISTRIES_CONF": str(root / "registries.conf")}
        (root / "registries.conf").write_text("unqualified-search-registries = []\n")
        self.pods: list[str] = []
        self.networks: list[str] = []

    def podman(self, *args: str, timeout: float = 300, check: bool = True,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                           input=input)
        if check and r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise PodError(f"podman {args[0]} {args[1] if len(args) > 1 else ''} failed: {last}")
        return r

    def play(self, manifest: Mapping[str, Any], *, network: str = "", ip: str = "") -> str:
        """Start the pod (podman kube play takes JSON, a subset of YAML) on ``network`` (podman's default
        when empty) at ``ip`` (any free address when empty); return its name."""
        name = str(manifest["metadata"]["name"])
        path = self.root / f"{name}.json"
        path.write_text(json.dumps(manifest, indent=1))
        self.pods.append(name)
        self.podman("kube", "play", *(["--network", network] if network else []), *(["--ip", ip] if ip else []),
                    str(path))
        return name

    def network(self, name: str, subnet: str) -> str:
        """A bridge network of its own (pods on it reach each other and, through NAT, this machine)."""
        self.podman("network", "create", "--subnet", subnet, name)
        self.networks.append(name)
        return name

    def container(self, pod: str) -> str:
        """The pod's first (workload) container, by podman's naming: <pod>-<container name>."""
        r = self.podman("pod", "inspect", pod)
        data = json.loads(r.stdout)
        data = data[0] if isinstance(data, list) else data
        infra = data.get("InfraContainerID")
        for c in data.get("Containers", []):
            if c["Id"] != infra:
                return str(c["Name"])
        raise PodError(f"pod {pod} has no workload container")

    def state(self, container: str) -> tuple[str, int]:
        """(status, exit code) of a container: running, exited, ..."""
        r = self.podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container)
        status, code = r.stdout.split()
        return status, int(code)

    def wait(self, container: str, timeout: float) -> int:
        """Its exit code, once it has exited."""
        deadline = time.monotonic() + timeout
        while True:
            status, code = self.state(container)
            if status in ("exited", "stopped"):
                return code
            if time.monotonic() > deadline:
                raise PodError(f"{container} still {status} after {timeout:.0f} s")
            time.sleep(0.2)

    def logs(self, container: str) -> tuple[str, str]:
        """(stdout, stderr) of a container so far."""
        r = self.podman("logs", container, check=False)
        return r.stdout, r.stderr

    def lose_node(self, pod: str) -> None:
        """The node goes away: every process of the pod gets SIGKILL at once, nothing runs after."""
        self.podman("pod", "kill", "--signal", "KILL", pod)

    def drain(self, pod: str, grace_seconds: int) -> None:
        """A node drain's pod deletion, as the kubelet does it: SIGTERM to the workload container, SIGKILL
        after the grace period, while the pod's sandbox (its network) stays up until the container has
        exited. Not ``podman pod stop``: that stops the infra container too, and the network goes with it
        at once (seen here: a final checkpoint failed with the store unreachable)."""
        self.podman("stop", "--time", str(grace_seconds), self.container(pod), timeout=grace_seconds + 60)

    def remove(self, pod: str) -> None:
        self.podman("pod", "rm", "--force", pod, check=False, timeout=120)

    def close(self) -> None:
        for pod in self.pods:
            self.remove(pod)
        for net in self.networks:
            self.podman("network", "rm", "--force", net, check=False, timeout=120)
        # Unmounts the private storage's layers, so the directory can be removed.
        self.podman("system", "reset", "--force", check=False, timeout=120)
