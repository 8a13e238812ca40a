"""The live drill (cedana_airflow/drill/live.py, unchanged) against the Kubernetes wrap route's pods.

A :class:`~cedana_airflow.drill.fleet.Fleet` over the pods that demo_k8s.py plays with podman. What is
real: each try's pod as the operator builds it, our CLI in it, CRIU, the store (moto's S3 server), and
the pod's deletion as the kubelet carries it out (SIGTERM to the workload container, SIGKILL after the
grace period, pod_runtime.PodRuntime.drain). What stands in, because there is no API server or Airflow
here: the deletion as the API reports it, and what Airflow and the KubernetesPodOperator make of that:

- ``fail_try`` is the drill's way of failing a try on this route: it deletes the try's pod. The API
  server answers at once and marks the pod (``metadata.deletionTimestamp``,
  ``deletionGracePeriodSeconds``); the kubelet then stops it, and once its container has exited the
  pod is gone (a read answers 404). :meth:`PodFleet.api_pod` is that view.
- ``now`` reports the try as the operator would: running while the pod runs; once the API reports the
  pod gone, the try has failed (``up_for_retry`` while retries are left), as the operator's
  ``read_pod`` raising 404 makes Airflow mark it.
- ``clear`` starts the next try's pod, built by the operator for that try number, as Airflow's retry
  (or the UI's Clear) runs the task again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from cedana_airflow.drill.fleet import RunningTask, TaskNow

__all__ = ["PodFleet"]


@dataclass
class _Pod:
    """One try's pod as the API server holds it: the try's record (demo_k8s.Try: pod name, node, try
    number) and what the drill's view adds."""

    try_: Any
    container: str
    started_at: datetime
    deletion_timestamp: datetime | None = None
    lines: list[tuple[datetime, str]] = field(default_factory=list)  # kept once the pod is gone
    gone: bool = False


def timed_lines(rt: Any, container: str) -> list[tuple[datetime, str]]:
    """The container's output (stdout and stderr) with podman's timestamps, in order."""
    r = rt.podman("logs", "--timestamps", container, check=False)
    out = []
    for line in (r.stdout + r.stderr).splitlines():
        stamp, _, text = line.partition(" ")
        try:
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            continue
        out.append((at.astimezone(timezone.utc), text))
    return sorted(out, key=lambda x: x[0])


class PodFleet:
    """One task (``dag_id.task_id`` of ``run_id``, ``retries`` retries) whose tries run as pods."""

    def __init__(self, cluster: Any, op: Any, state: Any, *, dag_id: str, task_id: str, run_id: str, retries: int,
                 grace_seconds: int) -> None:
        self.cluster, self.op, self.state = cluster, op, state
        self.dag_id, self.task_id, self.run_id, self.retries = dag_id, task_id, run_id, retries
        self.grace_seconds = grace_seconds
        self.pods: list[_Pod] = []
        self._stopping: list[threading.Thread] = []

    # -- what the cluster does -------------------------------------------------------------------------
    @property
    def tries(self) -> list[Any]:
        """demo_k8s.Try of each pod, in order: the case's record."""
        return [p.try_ for p in self.pods]

    def start_try(self, try_number: int) -> Any:
        t = self.cluster.start(self.op, try_number, self.state)
        self.pods.append(_Pod(t, self.cluster.rt.container(t.pod), datetime.now(timezone.utc)))
        return t

    def api_pod(self, pod: _Pod) -> dict[str, Any] | None:
        """The pod as a read from the API server returns it; None once it is gone (404)."""
        if pod.gone:
            return None
        status, code = self.cluster.rt.state(pod.container)
        if pod.deletion_timestamp is not None and status in ("exited", "stopped"):
            pod.lines = timed_lines(self.cluster.rt, pod.container)  # the kubelet's logs go with the pod
            pod.gone = True
            return None
        meta: dict[str, Any] = {"name": pod.try_.pod}
        if pod.deletion_timestamp is not None:
            meta.update(deletionTimestamp=pod.deletion_timestamp.isoformat(), deletionGracePeriodSeconds=self.grace_seconds)
        phase = "Running" if status == "running" else ("Succeeded" if code == 0 else "Failed")
        return {"metadata": meta, "spec": {"nodeName": pod.try_.node}, "status": {"phase": phase}}

    # -- the Fleet protocol ----------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        return None

    def _task(self, pod: _Pod) -> RunningTask:
        return RunningTask(dag_id=self.dag_id, task_id=self.task_id, run_id=self.run_id,
                           try_number=pod.try_.try_number, max_tries=self.retries, pool="default_pool",
                           hostname=pod.try_.node)

    def running_tasks(self) -> list[RunningTask]:
        pod = self.pods[-1] if self.pods else None
        seen = self.api_pod(pod) if pod else None
        return [self._task(pod)] if pod and seen and seen["status"]["phase"] == "Running" else []

    def now(self, task: RunningTask) -> TaskNow:
        pod = self.pods[-1]
        seen = self.api_pod(pod)
        if seen is None:  # deleted: the operator's read_pod gets a 404 and the try fails
            state = "up_for_retry" if pod.try_.try_number <= self.retries else "failed"
        else:
            state = {"Running": "running", "Succeeded": "success"}.get(seen["status"]["phase"], "up_for_retry")
        return TaskNow(state=state, try_number=pod.try_.try_number, start_date=pod.started_at, hostname=pod.try_.node)

    def fail_try(self, task: RunningTask, note: str) -> None:
        """Delete the try's pod: the API marks it at once; the kubelet stops it within the grace period."""
        pod = next(p for p in self.pods if p.try_.try_number == task.try_number)
        pod.deletion_timestamp = datetime.now(timezone.utc)
        stop = threading.Thread(target=self.cluster.rt.drain, args=(pod.try_.pod, self.grace_seconds), daemon=True)
        stop.start()
        self._stopping.append(stop)

    def clear(self, task: RunningTask) -> None:
        for stop in self._stopping:
            stop.join(self.grace_seconds + 60)
        last = self.pods[-1]
        self.cluster.finish(last.try_, 60)
        self.api_pod(last)
        self.cluster.rt.remove(last.try_.pod)
        self.start_try(last.try_.try_number + 1)

    def output(self, task: RunningTask, try_number: int) -> list[tuple[datetime, str]]:
        pod = next((p for p in self.pods if p.try_.try_number == try_number), None)
        if pod is None:
            return []
        return pod.lines if pod.gone else timed_lines(self.cluster.rt, pod.container)
