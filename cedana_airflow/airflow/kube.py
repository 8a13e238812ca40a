"""The Kubernetes route: what a pod needs to be checkpointed, applied to a V1Pod (an Airflow adapter).

Two routes (``[cedana] k8s_route``):

- ``cedana`` (default): a cluster running Cedana. The pod gets the runtime class (``cedana``), the
  checkpoint ID in ``CEDANA_CHECKPOINT`` so a restore picks the latest checkpoint under it, and the
  heartbeat label ``cedana.ai/heartbeat-checkpoint: "<seconds>"``.
- ``wrap``: a cluster without Cedana. The container's command is wrapped by our own CLI
  (``cedana-airflow run --resume --id ID -- CMD``), the store's credentials come from a Kubernetes
  Secret mounted as files that only our CLI reads (never the workload's environment, which every
  checkpoint image holds), and the node name from the downward API; the in-pod engine checkpoints
  to S3 and a retry's pod restores from it. CRIU needs a privileged container.

Both pin the pod to opted-in nodes (a node label, by default ``cedana.ai/enabled=true``) and, on a
retry, keep it off the node where the previous try ran (a job's pods do not: a lost node is NotReady).

A job of several pods (CedanaKubernetesJobOperator: ``torchrun --nnodes N`` and the like) takes the wrap
route as an Indexed Job (:func:`apply_job_route`): each pod runs one part of the job (its completion index),
one pod per node, and the first pod that fails fails the Job, so that Airflow's retry starts every part
again from the same seq (docs/jobs.md).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kubernetes.client import models as k8s

from ..compat import handshake_env
from ..config import HEARTBEAT_AUTO_SETTINGS, NODE_SETTINGS, Settings, env_text, env_var
from ..errors import ConfigError
from ..format.manifest import AirflowTask
from ..ids import validate_checkpoint_id
from ..run.cadence import FREEZE_SECONDS_PER_GIB, Cadence
from ..scope.optin import DEFAULT_NODE_LABEL, OptInList

__all__ = ["HEARTBEAT_LABEL", "CHECKPOINT_ENV", "CHECKPOINT_ID_LABEL", "COMPLETION_INDEX_ANNOTATION", "CREDENTIALS_MOUNT",
           "JOB_LABEL", "KEY_MOUNT", "NODE_LOST_TAINTS", "NOT_READY_TAINT", "Route", "TASK_LABEL", "TRY_LABEL",
           "apply_job_route", "apply_route", "job_label_value", "route_heartbeat",
           "kubernetes_executor_route", "node_label_of", "restore_rules_env", "uses_gpu", "with_env"]

HEARTBEAT_LABEL = "cedana.ai/heartbeat-checkpoint"
CHECKPOINT_ENV = "CEDANA_CHECKPOINT"
NOT_READY_TAINT = "cedana.ai/not-ready"
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: What the Job controller writes on each pod of an Indexed Job (and reads JOB_COMPLETION_INDEX from).
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: Our labels on a job's pods (its Job's name: the one-per-node rule, its pods found) and on every try's
#: Job of one checkpoint ID (an earlier try's Job found and deleted before the next starts).
JOB_LABEL = "cedana.ai/job"
CHECKPOINT_ID_LABEL = "cedana.ai/checkpoint-id"
#: ... and whose task instance and try each Job is: only an earlier try of the same one is deleted.
TASK_LABEL = "cedana.ai/task"
TRY_LABEL = "cedana.ai/try-number"
#: Where the wrap route mounts the store Secret (read-only, root only) for the CLI's store_credentials_dir.
CREDENTIALS_MOUNT = "/var/run/secrets/cedana/store"
_CREDENTIALS_VOLUME = "cedana-store-credentials"
#: Where the wrap route mounts the node key Secret (read-only, 0400) for the in-pod supervisor.
KEY_MOUNT = "/var/run/secrets/cedana/key"
_KEY_VOLUME = "cedana-node-key"
#: What a workload container's own env may not set: the node settings, and a config file that could.
_NODE_ENV = frozenset({*(env_var(n) for n in NODE_SETTINGS), "CEDANA_CONFIG"})
#: The settings the wrap route's in-pod CLI needs to judge a restore as the worker would.
_RESTORE_RULES = ("max_restore_gap_seconds", "lease_seconds", "lease_renew_command")
#: ... and how it checkpoints, when that is not the default (docs/cooperative.md).
_MODE = ("mode", "cooperative_signal", "cooperative_timeout_seconds", "cooperative_verify_command")


@dataclass(frozen=True)
class Route:
    kind: Literal["cedana", "wrap"]
    checkpoint_id: str
    heartbeat_seconds: int | Literal["auto"]  # auto: the wrap route's in-pod CLI chooses (cedana: resolved first)
    node_label: tuple[str, str] = DEFAULT_NODE_LABEL
    avoid_nodes: tuple[str, ...] = ()  # where earlier tries ran
    runtime_class: str = "cedana"
    store: str = ""  # wrap: the store URL the in-pod CLI writes to
    store_secret: str = ""  # wrap: a Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and more), as files
    try_number: int = 0
    cli: Sequence[str] = ("cedana-airflow",)
    airflow: AirflowTask | None = None  # wrap: the task instance, recorded in its manifests
    env: Mapping[str, str] = field(default_factory=dict)  # more for the workload's container (ours: CEDANA_*)
    resume: bool = True  # False: the pod starts fresh (cedana route: no CEDANA_CHECKPOINT to restore from)
    key_secret: str = "cedana-node-key"  # wrap: the Secret holding node.key, the workers' node key
    job_parts: int = 1  # wrap: above 1, the pod runs one part of a job (its Indexed Job completion index)
    node_lost_seconds: int = 60  # a job's pods: how long they tolerate a lost node before they are evicted


def uses_gpu(pod: k8s.V1Pod) -> bool:
    for c in pod.spec.containers or []:
        res = c.resources
        for group in (getattr(res, "limits", None) or {}, getattr(res, "requests", None) or {}):
            if any(k.startswith("nvidia.com/") for k in group):
                return True
    return False


def _affinity(pod: k8s.V1Pod, route: Route) -> None:
    exprs = [k8s.V1NodeSelectorRequirement(key=route.node_label[0], operator="In", values=[route.node_label[1]])]
    if route.avoid_nodes:
        exprs.append(k8s.V1NodeSelectorRequirement(key=HOSTNAME_LABEL, operator="NotIn", values=list(route.avoid_nodes)))
    spec = pod.spec
    spec.affinity = spec.affinity or k8s.V1Affinity()
    na = spec.affinity.node_affinity = spec.affinity.node_affinity or k8s.V1NodeAffinity()
    req = na.required_during_scheduling_ignored_during_execution
    if req is None or not req.node_selector_terms:
        na.required_during_scheduling_ignored_during_execution = k8s.V1NodeSelector(
            node_selector_terms=[k8s.V1NodeSelectorTerm(match_expressions=exprs)])
    else:  # terms are ORed: our requirements go into each one, so every way in is an opted-in node
        for term in req.node_selector_terms:
            term.match_expressions = [*(term.match_expressions or []), *copy.deepcopy(exprs)]


def _env(container: k8s.V1Container, name: str, value: str | None = None,
         source: k8s.V1EnvVarSource | None = None) -> None:
    container.env = [e for e in (container.env or []) if e.name != name]
    container.env.append(k8s.V1EnvVar(name=name, value=value, value_from=source))


def with_env(pod: k8s.V1Pod, env: Mapping[str, str]) -> k8s.V1Pod:
    """A copy of ``pod`` whose workload container (the first) has ``env`` too; ``pod`` itself when empty."""
    if not env:
        return pod
    pod = copy.deepcopy(pod)
    for name, value in env.items():
        _env(pod.spec.containers[0], name, value)
    return pod


#: Kubernetes' default terminationGracePeriodSeconds: SIGTERM, then SIGKILL this long after.
POD_GRACE_SECONDS = 30


def apply_route(pod: k8s.V1Pod, route: Route) -> k8s.V1Pod:
    """Return a copy of ``pod`` that takes the route (the first container is the workload)."""
    validate_checkpoint_id(route.checkpoint_id)
    pod = with_env(copy.deepcopy(pod), route.env)
    pod.metadata.labels = {**(pod.metadata.labels or {}), HEARTBEAT_LABEL: str(route.heartbeat_seconds)}
    _affinity(pod, route)
    main = pod.spec.containers[0]
    if route.kind == "wrap" and (named := sorted(e.name for e in main.env or [] if e.name in _NODE_ENV)):
        raise ConfigError(f"the pod's env sets {', '.join(named)}: node settings (the key that signs and verifies "
                          f"checkpoints) come from the deployment's Secret {route.key_secret!r}, never from a DAG. "
                          "Remove them.")
    if route.resume or route.kind == "wrap":  # wrap: the in-pod CLI judges the restore itself
        _env(main, CHECKPOINT_ENV, route.checkpoint_id)
    if route.kind == "cedana":
        pod.spec.runtime_class_name = route.runtime_class
        return pod
    # wrap: our CLI supervises the original entrypoint inside the container
    original = [*(main.command or []), *(main.args or [])]
    if not original:
        raise ValueError("the wrap route needs the container's command (cmds/arguments): the image's own "
                         "entrypoint is unknown here. Set cmds= on the operator.")
    task = (["--dag-id", route.airflow.dag_id, "--task-id", route.airflow.task_id, "--run-id", route.airflow.run_id,
             "--map-index", str(route.airflow.map_index)] if route.airflow else [])
    main.command = [*route.cli, "run", "--resume", "--id", route.checkpoint_id, "--heartbeat",
                    str(route.heartbeat_seconds), "--try-number", str(route.try_number), *task, "--", *original]
    main.args = None
    handshake = handshake_env(route.env, heartbeat_auto=route.heartbeat_seconds == "auto", job=route.job_parts > 1)
    for name, value in handshake.items():  # the image's CLI may be older than this operator
        _env(main, name, value)
    if route.job_parts > 1:  # which part: the pod's completion index, as the Job controller writes it
        if any(e.name == "JOB_COMPLETION_INDEX" for e in main.env or []):
            raise ConfigError("the pod's env sets JOB_COMPLETION_INDEX: the Job controller sets it to each pod's "
                              "index (the part this pod runs; the controller keeps a value already there). Remove it.")
        _env(main, "CEDANA_JOB_PARTS", str(route.job_parts))
        _env(main, "CEDANA_JOB_PART", source=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(
            field_path=f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']")))
        # this try's Job's name, for a command to name part 0's pod: $(CEDANA_JOB_NAME)-0.<subdomain>
        _env(main, "CEDANA_JOB_NAME", source=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(
            field_path=f"metadata.labels['{JOB_LABEL}']")))
    if route.store:
        _env(main, "CEDANA_STORE", route.store)
    _env(main, "CEDANA_NODE", source=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName")))
    if not any(e.name == "CEDANA_STOP_WINDOW_SECONDS" for e in main.env or []):
        # What a pod deletion leaves the final checkpoint: its grace period, then the kubelet's SIGKILL.
        grace = pod.spec.termination_grace_period_seconds
        _env(main, "CEDANA_STOP_WINDOW_SECONDS", str(POD_GRACE_SECONDS if grace is None else grace))
    if route.store_secret:
        # Files for the CLI, not envFrom: the workload's environment is in every image it is checkpointed into.
        pod.spec.volumes = [*(v for v in pod.spec.volumes or [] if v.name != _CREDENTIALS_VOLUME), k8s.V1Volume(
            name=_CREDENTIALS_VOLUME, secret=k8s.V1SecretVolumeSource(secret_name=route.store_secret, default_mode=0o400))]
        main.volume_mounts = [*(m for m in main.volume_mounts or [] if m.name != _CREDENTIALS_VOLUME),
                              k8s.V1VolumeMount(name=_CREDENTIALS_VOLUME, mount_path=CREDENTIALS_MOUNT, read_only=True)]
        _env(main, "CEDANA_STORE_CREDENTIALS_DIR", CREDENTIALS_MOUNT)
    # The node key, as files for the CLI: optional, so that a missing Secret fails the supervisor in one
    # line naming it (keys.py) instead of leaving the pod pending.
    pod.spec.volumes = [*(v for v in pod.spec.volumes or [] if v.name != _KEY_VOLUME), k8s.V1Volume(
        name=_KEY_VOLUME, secret=k8s.V1SecretVolumeSource(secret_name=route.key_secret, default_mode=0o400, optional=True))]
    main.volume_mounts = [*(m for m in main.volume_mounts or [] if m.name != _KEY_VOLUME),
                          k8s.V1VolumeMount(name=_KEY_VOLUME, mount_path=KEY_MOUNT, read_only=True)]
    _env(main, "CEDANA_SIGNING_KEY_FILE", f"{KEY_MOUNT}/node.key")
    for name in sorted(_NODE_ENV - {"CEDANA_SIGNING_KEY_FILE"}):  # env wins over envFrom: a ConfigMap cannot set them
        _env(main, name, "false" if name == "CEDANA_ALLOW_UNSIGNED" else "")
    main.security_context = main.security_context or k8s.V1SecurityContext()
    main.security_context.privileged = True  # CRIU: ptrace, namespaces, /proc/sys writes
    return pod


#: What a job's own spec may not set: each would let the Job controller recreate a part within one attempt
#: (podFailurePolicy Ignore, a per-index backoff), keep a part on a lost node from ever counting as failed
#: (podReplacementPolicy Failed, or any podFailurePolicy: the controller then waits for a phase such a pod never
#: reaches), end the Job while parts run (successPolicy), or drop the labels a part is found by.
_JOB_FIELDS_REFUSED = {"pod_failure_policy": "podFailurePolicy", "backoff_limit_per_index": "backoffLimitPerIndex",
                       "max_failed_indexes": "maxFailedIndexes", "success_policy": "successPolicy",
                       "managed_by": "managedBy"}
#: Taints a lost node gets: its pods are evicted (and so count as failed) after their toleration of them.
NODE_LOST_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def job_label_value(*parts: object) -> str:
    """A label value for a checkpoint ID or a task instance (longer than a label's 63 characters)."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def apply_job_route(job: k8s.V1Job, route: Route) -> k8s.V1Job:
    """Return a copy of ``job`` whose pods each run one part of it on the wrap route: an Indexed Job of
    ``route.job_parts`` pods, all at once, one per node (a required pod anti-affinity on our own label), none
    restarted or recreated (restartPolicy Never, backoffLimit 0): a part that fails fails the Job, whose other
    pods the Job controller then stops, and Airflow's retry runs every part again from the newest seq that holds
    them all. A part on a lost node counts as failed once it is evicted: after ``route.node_lost_seconds``
    (its toleration of the lost node's taints; Kubernetes' default is 300 s). Not on the ``cedana`` route:
    Cedana's runtime checkpoints each pod on its own."""
    if route.kind != "wrap" or route.job_parts < 2:
        raise ConfigError(f"a job of several pods is checkpointed on the wrap route with 2 or more parts "
                          f"(route {route.kind!r}, {route.job_parts} part(s)): set route='wrap' and parts=N")
    spec = job.spec
    refused = [name for attr, name in _JOB_FIELDS_REFUSED.items() if getattr(spec, attr, None) is not None]
    refused += ["manualSelector"] * bool(spec.manual_selector) + ["suspend"] * bool(spec.suspend)
    refused += ["podReplacementPolicy"] * (getattr(spec, "pod_replacement_policy", None) not in (None, "TerminatingOrFailed"))
    if refused:
        raise ConfigError(f"the job's spec sets {', '.join(refused)}: a checkpointed job fails as one and is "
                          "resumed by Airflow's retry (docs/jobs.md, Kubernetes). Remove them from full_job_spec or "
                          "job_template_file.")
    job = copy.deepcopy(job)
    template = job.spec.template
    pod = apply_route(k8s.V1Pod(metadata=template.metadata or k8s.V1ObjectMeta(), spec=template.spec), route)
    pod.spec.restart_policy = "Never"  # a restarted container would be a part of no attempt
    ours = {JOB_LABEL: job.metadata.name, CHECKPOINT_ID_LABEL: job_label_value(route.checkpoint_id)}
    pod.metadata.labels = {**(pod.metadata.labels or {}), **ours}
    task = route.airflow
    job.metadata.labels = {**(job.metadata.labels or {}), CHECKPOINT_ID_LABEL: ours[CHECKPOINT_ID_LABEL],
                           TASK_LABEL: job_label_value(*((task.dag_id, task.task_id, task.run_id, task.map_index)
                                                         if task else (route.checkpoint_id,))),
                           TRY_LABEL: str(route.try_number)}
    # one part per node: two parts on one node would be lost together and share its address
    term = k8s.V1PodAffinityTerm(label_selector=k8s.V1LabelSelector(match_labels={JOB_LABEL: job.metadata.name}),
                                 topology_key=HOSTNAME_LABEL)
    anti = pod.spec.affinity.pod_anti_affinity = pod.spec.affinity.pod_anti_affinity or k8s.V1PodAntiAffinity()
    anti.required_during_scheduling_ignored_during_execution = [
        *(anti.required_during_scheduling_ignored_during_execution or []), term]
    # First: the taint manager takes the first toleration that matches each taint, so a DAG's own (a blanket
    # `operator: Exists` among them) must not decide how long a part outlives its node (node_lost_seconds does)
    pod.spec.tolerations = [*(k8s.V1Toleration(key=key, operator="Exists", effect="NoExecute",
                                               toleration_seconds=route.node_lost_seconds) for key in NODE_LOST_TAINTS),
                            *(pod.spec.tolerations or [])]
    job.spec.template = k8s.V1PodTemplateSpec(metadata=pod.metadata, spec=pod.spec)
    job.spec.completion_mode = "Indexed"
    job.spec.completions = job.spec.parallelism = route.job_parts
    # 0, and no podFailurePolicy or podReplacementPolicy Failed (refused above): the first failed or evicted
    # pod fails the Job (its FailureTarget condition at once; Failed once every pod has terminated)
    job.spec.backoff_limit = 0
    return job


def node_label_of(optin: OptInList | None) -> tuple[str, str]:
    """The node label a pod is pinned to: the opt-in list's first node label, else ``cedana.ai/enabled=true``."""
    return next(iter(optin.node.labels.items()), DEFAULT_NODE_LABEL) if optin and optin.node else DEFAULT_NODE_LABEL


def restore_rules_env(settings: Settings) -> dict[str, str]:
    """max_restore_gap, the lease and the mode as the CEDANA_* variables the in-pod CLI reads (it restores and
    checkpoints there); the mode's settings only where they differ from the default."""
    rules = {env_var(name): env_text(name, getattr(settings, name)) for name in _RESTORE_RULES
             if getattr(settings, name) is not None}
    defaults = Settings()
    carried = _MODE + (HEARTBEAT_AUTO_SETTINGS if settings.heartbeat_auto else ())  # docs/heartbeat.md
    return rules | {env_var(name): env_text(name, getattr(settings, name)) for name in carried
                    if getattr(settings, name) != getattr(defaults, name)}


def route_heartbeat(settings: Settings, kind: str, fallback_seconds: int) -> int | Literal["auto"]:
    """The pod's heartbeat: the task's (its operator's, the list's, or a heartbeat_seconds the deployment set;
    not that setting's default), else [cedana] k8s_heartbeat_seconds. auto stays auto on the wrap route
    (our CLI in the pod measures and chooses); Cedana's runtime takes a number, so there auto is chosen now,
    from this history and a reference cost (1 GiB at the reference freeze rate): it cannot follow the cost."""
    if not settings.heartbeat_auto:
        given = float(settings.heartbeat_seconds) if settings.given("heartbeat_seconds") else 0.0
        return int(given or fallback_seconds)
    if kind == "wrap":
        return "auto"
    cadence = Cadence(settings, first_cost=FREEZE_SECONDS_PER_GIB, cost_source="estimated: 1 GiB at the reference rate")
    return max(1, round(cadence.interval()))


def kubernetes_executor_route(pod: k8s.V1Pod, annotations: dict[str, str]) -> k8s.V1Pod | None:
    """The ``cedana`` route for a KubernetesExecutor worker pod whose task the opt-in list admits, else None.

    Only the ``cedana`` route: wrapping the worker's own command would checkpoint Airflow's task
    runner along with the workload, and restore a process that talks to the API server of another time.
    """
    from ..ids import derive_checkpoint_id
    from ..scope.optin import Where
    from .config import airflow_options, task_settings, with_scope_defaults
    from .task import scope_decision

    dag_id, task_id = annotations["dag_id"], annotations["task_id"]
    settings, _ = task_settings()
    labels: list[tuple[str, str]] = []

    def where(optin: OptInList | None) -> Where:
        labels.append(node_label_of(optin))
        return Where(dag_id, task_id, f"(a node labelled {labels[-1][0]}={labels[-1][1]})", dict(labels[-1:]),
                     annotations.get("queue") or "kubernetes", annotations.get("pool", ""))

    decision = scope_decision(settings.optin_file, where)
    if not decision.in_scope:
        return None
    settings = with_scope_defaults(settings, decision.defaults, {})
    options = airflow_options("k8s_runtime_class", "k8s_heartbeat_seconds")
    map_index = int(annotations.get("map_index", "-1") or -1)
    cid = derive_checkpoint_id(dag_id, task_id, annotations["run_id"], map_index=map_index)
    route = Route(kind="cedana", checkpoint_id=cid,
                  heartbeat_seconds=route_heartbeat(settings, "cedana", options.k8s_heartbeat_seconds),
                  node_label=labels[-1], runtime_class=options.k8s_runtime_class,
                  try_number=int(annotations.get("try_number", "0") or 0))
    return apply_route(pod, route)
