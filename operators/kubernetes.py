"""CedanaKubernetesPodOperator: a KubernetesPodOperator that asks for checkpointing with one line; and
CedanaKubernetesJobOperator: a job of several pods (one part per pod), checkpointed and resumed as one.

Pods go to opted-in nodes; a retry's pod avoids the node where the previous try ran (recorded by the
pod-starting callback in the task state record, cedana_airflow.airflow.task_state) and is always a
new pod, never a reattach to the failed one. Which route (a Cedana cluster, or our CLI wrapped
around the command) is configuration: ``[cedana] k8s_route``. The pod spec itself is built by cedana_airflow.airflow.kube.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from cedana_airflow.airflow.config import airflow_options
from cedana_airflow.airflow_compat import AirflowException, AirflowFailException
from cedana_airflow.airflow.kube import (CHECKPOINT_ID_LABEL, JOB_LABEL, TASK_LABEL, TRY_LABEL, Route, apply_job_route,
                                         apply_route, node_label_of, restore_rules_env, route_heartbeat, uses_gpu,
                                         with_env)
from cedana_airflow.airflow.logsink import prefixed
from cedana_airflow.airflow.task import CEDANA_TEMPLATE_FIELDS, CedanaTask, Placement, TaskSetup, airflow_errors
from cedana_airflow.airflow.task_state import TaskState, airflow_task
from cedana_airflow.config import Settings
from cedana_airflow.keys import node_trust
from cedana_airflow.run.restore_gap import judge_settings
from cedana_airflow.scope.optin import OptInList

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["CedanaKubernetesJobOperator", "CedanaKubernetesPodOperator"]


class _RecordNode(KubernetesPodOperatorCallback):
    """Remember where each try's pod runs (the task state record), so the next try's pod can avoid that node."""

    @staticmethod
    def on_pod_starting(*, pod: k8s.V1Pod, operator: Any, context: Any, **kwargs: Any) -> None:
        node = getattr(pod.spec, "node_name", None)
        if not node or not context or context.get("task_state_store") is None:
            return
        TaskState.of(context, operator.log).add_try(context["ti"].try_number, node)


def _placement(task: CedanaTask, pod: k8s.V1Pod) -> Callable[[OptInList | None, Settings], Placement]:
    """Where the pod runs, for the opt-in list: the scheduler picks the node later, so the node scope is met
    by pinning the pod to the list's label."""
    def placement(optin: OptInList | None, settings: Settings) -> Placement:
        label = node_label_of(optin)
        return Placement(f"(a node labelled {label[0]}={label[1]})", dict([label]), gpu=task.gpu or uses_gpu(pod))
    return placement


def _route(task: CedanaTask, setup: TaskSetup, context: Context, kind: str, store_secret: str | None,
           **more: Any) -> Route:
    """The route either operator writes its pods with: what every pod of the task carries (the ID, the
    heartbeat, the opt-in node label, the store and its Secret, the try, the node key's Secret); ``more``: the
    operator's own fields."""
    options = airflow_options("k8s_heartbeat_seconds", "k8s_key_secret")
    settings = setup.settings
    return Route(kind=kind, checkpoint_id=setup.checkpoint_id,  # type: ignore[arg-type]
                 heartbeat_seconds=route_heartbeat(settings, kind, options.k8s_heartbeat_seconds),
                 node_label=next(iter(setup.placement.node_labels.items())), store=settings.store or "",
                 store_secret=store_secret or "", try_number=context["ti"].try_number, airflow=airflow_task(context),
                 env={**task.cedana_env(None), **restore_rules_env(settings)}, key_secret=options.k8s_key_secret,
                 **more)


def _unprotected(task: CedanaTask, pod: k8s.V1Pod, gpu_note: str) -> k8s.V1Pod:
    """An out-of-scope pod: as given, but for CEDANA_IDEMPOTENCY_KEY (the key holds for an unprotected run
    too); a GPU pod says it runs unprotected."""
    if uses_gpu(pod):
        task.log.warning("cedana: %s but is out of scope: it runs unprotected", gpu_note)
    return with_env(pod, task.cedana_env(None))


class CedanaKubernetesPodOperator(CedanaTask, KubernetesPodOperator):
    """``KubernetesPodOperator`` plus checkpointing: everything it takes, the arguments every route takes
    (:class:`~cedana_airflow.airflow.task.CedanaTask`: checkpoint_id, heartbeat, store, idempotency_key,
    max_restore_gap, lease, ...), and

    :param route: ``cedana`` or ``wrap`` (default [cedana] k8s_route, else ``cedana``).
    :param store_secret: wrap route: a Secret with the store's credentials (keys AWS_ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY; optional AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION), mounted
        read-only as files that only cedana-airflow reads: never in the workload's environment.

    A pod needs a heartbeat: without ``heartbeat`` or [cedana] heartbeat_seconds it is [cedana]
    k8s_heartbeat_seconds. The pod goes to a node with the opt-in list's node label; a task out of
    scope (or with a broken list) gets its pod unchanged but for CEDANA_IDEMPOTENCY_KEY, and runs
    unprotected, as on every route. The wrap route's in-pod CLI applies max_restore_gap and the lease
    where it restores; on the ``cedana`` route Cedana's runtime restores, so a checkpoint beyond either
    limit is judged here, and the pod then starts fresh.
    """

    template_fields: Sequence[str] = (*KubernetesPodOperator.template_fields, *CEDANA_TEMPLATE_FIELDS)

    def __init__(self, *, route: str | None = None, store_secret: str | None = None, checkpoint_id: str | None = None,
                 heartbeat: timedelta | Literal["auto"] | None = None,
                 heartbeat_min: timedelta | None = None, heartbeat_max: timedelta | None = None,
                 mtbf: timedelta | None = None, store: str | None = None, aws_conn_id: str | None = None,
                 settings: dict[str, Any] | None = None, idempotency_key: str | None = None,
                 max_restore_gap: timedelta | None = None, lease: timedelta | None = None,
                 lease_renew_command: str | Sequence[str] | None = None, expected_duration: timedelta | None = None,
                 job_server: bool = False, gpu: bool = False, **kwargs: Any) -> None:
        callbacks = kwargs.pop("callbacks", None) or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        kwargs["durable"] = False  # a retry gets a new pod on another node, never the failed one
        super().__init__(callbacks=[*callbacks, _RecordNode], **kwargs)
        self.store_secret = store_secret
        if route and route not in ("cedana", "wrap"):
            raise ValueError(f"{self.task_id}: route {route!r} is unknown; use 'cedana' or 'wrap'.")
        self.route = route or airflow_options("k8s_route").k8s_route
        self.init_cedana(checkpoint_id=checkpoint_id, heartbeat=heartbeat, heartbeat_min=heartbeat_min,
                         heartbeat_max=heartbeat_max, mtbf=mtbf, store=store, aws_conn_id=aws_conn_id,
                         settings=settings, idempotency_key=idempotency_key, max_restore_gap=max_restore_gap,
                         lease=lease, lease_renew_command=lease_renew_command, expected_duration=expected_duration,
                         job_server=job_server, gpu=gpu)

    @prefixed
    def execute(self, context: Context) -> Any:
        return super().execute(context)  # the pod's; our set-up's lines in the task log carry `cedana:`

    def build_pod_request_obj(self, context: Context | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        pod = super().build_pod_request_obj(context, dry_run=dry_run)
        if context is None:
            return pod
        with airflow_errors():
            return self._checkpointed(pod, context)

    def _checkpointed(self, pod: k8s.V1Pod, context: Context) -> k8s.V1Pod:
        ti = context["ti"]
        setup = self.cedana_setup(context, _placement(self, pod))
        if not setup.in_scope:
            return _unprotected(self, pod, "this pod asks for a GPU")
        earlier = TaskState.of(context, self.log).earlier_nodes(ti.try_number)
        if earlier:
            self.log.info("cedana: this retry's pod avoids node(s) %s, where earlier tries ran", ", ".join(earlier))
        route = _route(self, setup, context, self.route, self.store_secret, avoid_nodes=earlier,
                       runtime_class=airflow_options("k8s_runtime_class").k8s_runtime_class,
                       resume=self.route == "wrap" or self._may_resume(setup, context))
        return apply_route(pod, route)

    def _may_resume(self, setup: TaskSetup, context: Context) -> bool:
        """The ``cedana`` route: Cedana's runtime restores whatever CEDANA_CHECKPOINT names, so the restore
        gap and the lease are judged here, against the store, before the pod exists."""
        s = setup.settings
        if s.max_restore_gap_seconds is None and s.lease_seconds is None:
            return True  # no limit: the store is not read
        # only a checkpoint this worker's key vouches for is judged: a forged old one must not start the pod
        # fresh nor run lease_renew_command
        trust = node_trust(s, airflow_task(context))
        verdict = judge_settings(setup.store(), setup.checkpoint_id, s, include_gap=True,
                                 trusted=lambda m: trust.refusal(m) is None)
        for level, note in verdict.notes:
            self.log.log(level, "cedana: %s", note)
        return verdict.resume


class _JobHook(KubernetesHook):
    """The provider's hook, seeing a Job failed at its FailureTarget condition: from Kubernetes 1.31 ``Failed``
    comes only once every pod has terminated, and a pod on a lost node stays Terminating until the node comes
    back or is deleted, so waiting for ``Failed`` could wait forever and the retry would never start."""

    def is_job_complete(self, job: k8s.V1Job) -> bool:
        return bool(super().is_job_complete(job) or _condition(job, "FailureTarget") or _condition(job, "SuccessCriteriaMet"))

    @staticmethod
    def is_job_failed(job: k8s.V1Job) -> str | bool:
        failed = KubernetesHook.is_job_failed(job)
        if failed or not (target := _condition(job, "FailureTarget")):
            return failed
        return f"{target.reason or 'FailureTarget'} (its pods still stopping)"


def _condition(obj: k8s.V1Job | k8s.V1Pod, kind: str) -> Any:
    """A Job's or a pod's condition of that type when it holds, else None."""
    conditions = (obj.status.conditions if obj.status else None) or []
    return next((c for c in conditions if c.type == kind and c.status in (True, "True")), None)


def _delete(jobs: Any, name: str, namespace: str) -> bool:
    """Delete a Job and its pods; False when it was already gone."""
    try:
        jobs.delete_namespaced_job(name=name, namespace=namespace, propagation_policy="Foreground")
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


#: How long a try waits for its Job's pods to exist (the provider's own wait lists 4 times, without a pause).
POD_DISCOVERY_SECONDS = 300.0
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class CedanaKubernetesJobOperator(CedanaTask, KubernetesJobOperator):
    """``KubernetesJobOperator`` for a job that spans pods (``torchrun --nnodes N``, a sharded server), each
    pod one part of the job, checkpointed and resumed as one (docs/jobs.md). Everything it takes, the
    arguments every route takes (checkpoint_id, heartbeat, store, idempotency_key, ...), and

    :param parts: how many pods (2 or more): an Indexed Job of that many, each running the same command
        with its part in ``JOB_COMPLETION_INDEX`` (e.g. ``torchrun --node-rank $(JOB_COMPLETION_INDEX)``).
    :param store_secret: as CedanaKubernetesPodOperator's: the store's credentials as files for our CLI.
    :param subdomain: the pods' ``subdomain``: with a headless Service of that name selecting them, part 0's
        pod is ``$(CEDANA_JOB_NAME)-0.<subdomain>`` (a rendezvous address that holds across tries).
    :param node_lost_seconds: how long a part's pod tolerates its node being unreachable or not ready
        before it is evicted, which fails the Job (default 60; Kubernetes' own default is 300).

    The wrap route only: our CLI in each pod runs that pod's part (``CEDANA_JOB_PART`` from the completion
    index). One pod per node; no pod is restarted or recreated: the first part that fails fails the Job,
    and Airflow's retry starts a new Job whose parts all resume from the newest seq that holds every part.
    The task follows its Job (``wait_until_job_complete``; not deferrable), fails at the Job's FailureTarget,
    and deletes its Job when it fails; each try first deletes any earlier try's Job. A transparent job's
    connections between its pods come back only where each part's pod gets its address back (a CNI that pins
    an address per completion index); elsewhere use ``mode = cooperative`` (coop.torch.Resumable), whose ranks
    meet again at their new addresses. Out of scope, the Job runs as given, unprotected, as on every route.
    """

    template_fields: Sequence[str] = (*KubernetesJobOperator.template_fields, *CEDANA_TEMPLATE_FIELDS)

    def __init__(self, *, parts: int, route: str | None = None, store_secret: str | None = None,
                 subdomain: str | None = None, node_lost_seconds: int = 60, **kwargs: Any) -> None:
        cedana = self.pop_cedana_args(kwargs)  # checkpoint_id, heartbeat, store, settings, ... (as every route)
        task_id = kwargs.get("task_id", "?")
        if not isinstance(parts, int) or parts < 2:
            raise ValueError(f"{task_id}: parts={parts!r}: a job of several pods has 2 or more parts "
                             "(one pod: CedanaKubernetesPodOperator)")
        # What makes the Job one attempt of every part: the Job's own settings, so none may differ.
        fixed = {"parallelism": parts, "completions": parts, "completion_mode": "Indexed", "backoff_limit": 0}
        if clash := [f"{k}={kwargs[k]!r}" for k, v in fixed.items() if kwargs.get(k) not in (None, v)]:
            raise ValueError(f"{task_id}: {', '.join(clash)}: a checkpointed job runs its {parts} parts at once, "
                             f"indexed, and fails as one (backoff_limit=0, Airflow's retry resumes it); leave them out")
        if (route or airflow_options("k8s_route").k8s_route) != "wrap":
            raise ValueError(f"{task_id}: a job of several pods is checkpointed on the wrap route only (Cedana's "
                             "runtime checkpoints each pod on its own): pass route='wrap'")
        if not isinstance(node_lost_seconds, int) or node_lost_seconds < 0:
            raise ValueError(f"{task_id}: node_lost_seconds={node_lost_seconds!r}: give whole seconds, 0 or more")
        if subdomain is not None and not _DNS_LABEL.fullmatch(subdomain):
            raise ValueError(f"{task_id}: subdomain={subdomain!r} is not a DNS label (a-z, 0-9 and '-', 63 at most)")
        kwargs.setdefault("wait_until_job_complete", True)
        super().__init__(**{**kwargs, **fixed})
        # Read back as set (default_args and [operators] default_deferrable reach them too): what would let a
        # try end while its parts run on, or keep a failed part's pod running (an xcom sidecar never ends)
        unfit = {"wait_until_job_complete": False, "do_xcom_push": True, "random_name_suffix": False}
        if clash := [f"{k}={v!r}" for k, v in unfit.items() if bool(getattr(self, k)) == v]:
            raise ValueError(f"{task_id}: {', '.join(clash)}: a checkpointed job's task follows its Job to the end, "
                             "a failed part's pod must end (no xcom sidecar), and each try's Job has a name of its own")
        # Never deferred (said at execute): the triggerer's wait knows only Failed, which a Job that lost a node
        # reaches once that node's pod is gone, possibly never
        self.deferred_asked, self.deferrable = bool(self.deferrable), False
        # Each pod's log is read once the Job has ended, before the pods go: the provider follows them, which
        # fails (a pod being deleted) or hangs (a lost node's pod still said to be running) after a FailureTarget
        self.read_logs, self.get_logs = bool(self.get_logs), False
        self.parts, self.store_secret, self.route = parts, store_secret, "wrap"
        self.subdomain, self.node_lost_seconds = subdomain, node_lost_seconds
        self.init_cedana(**cedana)

    @cached_property
    def hook(self) -> KubernetesHook:
        return _JobHook(conn_id=self.kubernetes_conn_id, in_cluster=self.in_cluster, config_file=self.config_file,
                        cluster_context=self.cluster_context)

    @prefixed
    def execute(self, context: Context) -> Any:
        if self.deferred_asked:
            self.log.info("cedana: not deferred: the triggerer's wait for a Job would miss one that lost a node")
        try:
            return super().execute(context)  # the Job's; our set-up's lines in the task log carry `cedana:`
        except Exception:
            self._delete_job()  # a failed try leaves no part running beside the retry's
            raise

    def _cleanup_monitoring_pods(self, context: Context) -> None:
        if self.read_logs:  # once, not followed; a pod already gone or on a lost node is said and skipped
            for pod in getattr(self, "pods", None) or []:
                try:
                    self.pod_manager.fetch_requested_container_logs(pod=pod, containers=self.container_logs,
                                                                    follow_logs=False)
                except Exception as e:
                    self.log.warning("cedana: the log of pod %s could not be read: %s", pod.metadata.name,
                                     str(e).splitlines()[0] if str(e) else type(e).__name__)
        super()._cleanup_monitoring_pods(context)

    def _delete_job(self) -> None:
        job = getattr(self, "job", None)
        if job is None:
            return
        try:
            if _delete(self.job_client, job.metadata.name, job.metadata.namespace):
                self.log.info("cedana: deleted Job %s: this try failed, and no part of it may run beside the "
                              "retry's", job.metadata.name)
        except Exception as e:  # the next try deletes it (create_job)
            self.log.warning("cedana: could not delete Job %s (%s); the next try deletes it", job.metadata.name,
                             str(e).splitlines()[0] if str(e) else type(e).__name__)

    def create_job(self, job_request_obj: k8s.V1Job) -> k8s.V1Job:
        """Earlier tries' Jobs of this task instance are deleted first (a worker that died never deleted its
        try's): their pods are stopped, within their grace period; a part on a partitioned node runs on until
        its node is back, fenced by this try's writer lease and rounds. A Job of this checkpoint ID that belongs
        to another task instance is refused, in one line, before anything is deleted."""
        labels = job_request_obj.metadata.labels or {}
        if CHECKPOINT_ID_LABEL not in labels:
            return super().create_job(job_request_obj)  # out of scope: as the provider does
        namespace = job_request_obj.metadata.namespace
        try:
            listed = self.job_client.list_namespaced_job(
                namespace=namespace, label_selector=f"{CHECKPOINT_ID_LABEL}={labels[CHECKPOINT_ID_LABEL]}").items
        except ApiException as e:
            raise AirflowException(f"cedana: Jobs in namespace {namespace} cannot be listed ({e.status} {e.reason}): the "
                                   "worker's Kubernetes role needs jobs get/list/create/delete, pods get/list/delete "
                                   "and pods/log get (docs/jobs.md)") from None
        for old in listed:
            theirs = old.metadata.labels or {}
            if old.metadata.name == job_request_obj.metadata.name:
                continue
            if theirs.get(TASK_LABEL) != labels[TASK_LABEL]:
                raise AirflowFailException(f"cedana: Job {old.metadata.name} of another task instance (another run, "
                                           "task or map index) uses this checkpoint ID: give each its own checkpoint_id")
            if int(theirs.get(TRY_LABEL, "0") or 0) >= int(labels[TRY_LABEL]):
                raise AirflowException(f"cedana: Job {old.metadata.name} is of try {theirs.get(TRY_LABEL)}, not earlier "
                                       f"than this try ({labels[TRY_LABEL]}): this try is stale and starts nothing")
            if _delete(self.job_client, old.metadata.name, namespace):
                self.log.info("cedana: deleted Job %s, try %s's, before this try's", old.metadata.name,
                              theirs.get(TRY_LABEL))
        return super().create_job(job_request_obj)

    def get_pods(self, pod_request_obj: k8s.V1Pod, context: Context, *,
                 exclude_checked: bool = True) -> Sequence[k8s.V1Pod]:
        """This try's Job's pods (by our label, never an earlier try's), waited for until all exist."""
        job = self.job
        assert job is not None  # execute creates it before it looks for its pods
        selector = f"{JOB_LABEL}={job.metadata.name}"
        started = time.monotonic()
        while True:
            pods = self.client.list_namespaced_pod(namespace=job.metadata.namespace, label_selector=selector).items
            waiting = [p for p in pods if not _condition(p, "PodScheduled")]
            if len(pods) >= self.parts and not waiting:
                break
            waited = time.monotonic() - started
            if len(pods) < self.parts and waited > POD_DISCOVERY_SECONDS:
                raise AirflowException(f"cedana: {len(pods)} of the {self.parts} pods of Job {job.metadata.name} were "
                                       f"made in {POD_DISCOVERY_SECONDS:.0f} s: see the Job's events (a pod refused, "
                                       "a quota)")
            if len(pods) >= self.parts and waited > self.schedule_timeout_seconds:
                why = next((c.message for p in waiting for c in (p.status.conditions if p.status else None) or []
                            if c.type == "PodScheduled" and c.message), "no reason given")
                raise AirflowException(f"cedana: {len(waiting)} of the {self.parts} pods of Job {job.metadata.name} "
                                       f"not scheduled in {self.schedule_timeout_seconds} s (one part per node, on "
                                       f"opted-in nodes): {why}")
            time.sleep(2)
        for pod in pods:
            self.log_matching_pod(pod=pod, context=context)
        return list(pods)

    def build_job_request_obj(self, context: Context | None = None) -> k8s.V1Job:
        job = super().build_job_request_obj(context)
        if context is None:
            return job
        with airflow_errors():
            return self._checkpointed(job, context)

    def _checkpointed(self, job: k8s.V1Job, context: Context) -> k8s.V1Job:
        # each pod's hostname is <job>-<index>, a DNS label: the API server refuses a longer Indexed Job's name
        if len(name := job.metadata.name) + 1 + len(str(self.parts - 1)) > 63:
            suffix = name[name.rfind("-"):]
            job.metadata.name = name[:63 - 1 - len(str(self.parts - 1)) - len(suffix)].rstrip("-") + suffix
        template = job.spec.template
        if self.subdomain:
            template.spec.subdomain = self.subdomain
        pod = k8s.V1Pod(metadata=template.metadata, spec=template.spec)
        setup = self.cedana_setup(context, _placement(self, pod))
        if not setup.in_scope:
            pod = _unprotected(self, pod, "this job asks for GPUs")
            job.spec.template = k8s.V1PodTemplateSpec(metadata=pod.metadata, spec=pod.spec)
            return job
        route = _route(self, setup, context, "wrap", self.store_secret, job_parts=self.parts,
                       node_lost_seconds=self.node_lost_seconds)
        self.log.info("cedana: a job of %d pods, one part each, checkpointed as one (checkpoint_id=%s)", self.parts,
                      setup.checkpoint_id)
        return apply_job_route(job, route)
