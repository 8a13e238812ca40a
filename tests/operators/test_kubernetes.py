"""The Kubernetes route as pod and Job specs: there is no Kubernetes API server here, so these are spec tests.
The pod comes from the operator's own build_pod_request_obj(dry_run=True) (a job's V1Job from
CedanaKubernetesJobOperator's build_job_request_obj with a try's context) and is checked field by field,
then round-tripped through the installed kubernetes client's OpenAPI models. The wrap route's pods run
for real, in podman, in tests/integration/test_k8s_pods.py (a job's two pods in its "job" case)."""

from __future__ import annotations

import types
from datetime import timedelta

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")
from kubernetes.client import ApiClient  # noqa: E402
from kubernetes.client import models as k8s  # noqa: E402

from cedana_airflow.airflow.kube import COMPLETION_INDEX_ANNOTATION, CREDENTIALS_MOUNT, HEARTBEAT_LABEL, KEY_MOUNT  # noqa: E402
from cedana_airflow.compat import JOB_FLOOR, supervisor_refusal  # noqa: E402
from cedana_airflow.operators import CedanaKubernetesJobOperator, CedanaKubernetesPodOperator  # noqa: E402
from pod_jobs import KUBECONFIG  # noqa: E402  (scripts/: a kube config whose API server is never called)

OPTIN = '[node]\nlabels = { "cedana.ai/enabled" = "true" }\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'


class _StateStore(dict):
    """Stands in for context["task_state_store"] (the real one talks to the API server of a running task)."""

    def set(self, key, value):
        self[key] = value


def _context(try_number=1, state=None):
    ti = types.SimpleNamespace(dag_id="train_llm", task_id="finetune", try_number=try_number, map_index=-1)
    return {"ti": ti, "dag": types.SimpleNamespace(dag_id="train_llm"), "run_id": "scheduled__2026-11-29T00:00:00+00:00",
            "task_state_store": state or _StateStore()}


@pytest.fixture
def optin(tmp_path, monkeypatch):
    p = tmp_path / "optin.toml"
    p.write_text(OPTIN)
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))
    monkeypatch.setenv("AIRFLOW__CEDANA__STORE", "s3://ckpt/airflow")
    return p


def _op(**kw):
    kw.setdefault("cmds", ["python", "train.py"])
    kw.setdefault("arguments", ["--epochs", "3"])
    return CedanaKubernetesPodOperator(task_id="finetune", name="finetune", namespace="ml", image="ml/train:1",
                                       container_resources=k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}),
                                       **{"heartbeat": timedelta(minutes=5), **kw})


def _roundtrip(pod):
    api = ApiClient()
    data = api.sanitize_for_serialization(pod)
    again = api._ApiClient__deserialize(data, "V1Pod")  # every model validates its required fields
    assert api.sanitize_for_serialization(again) == data
    return data


def _node_terms(pod):
    return pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms


def test_spec_cedana_route_runtime_class_env_label_and_affinity(optin):
    pod = _op().build_pod_request_obj(_context(), dry_run=True)
    _roundtrip(pod)
    assert pod.spec.runtime_class_name == "cedana"
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["CEDANA_CHECKPOINT"].startswith("train_llm.finetune.scheduled__2026-11-29T00_00_00+00_00-")
    assert pod.metadata.labels[HEARTBEAT_LABEL] == "300"
    [term] = _node_terms(pod)
    assert [(e.key, e.operator, e.values) for e in term.match_expressions] == [("cedana.ai/enabled", "In", ["true"])]
    assert pod.spec.containers[0].command == ["python", "train.py"]  # untouched on a Cedana cluster


def test_spec_a_retry_avoids_the_node_of_the_previous_try_and_never_reattaches(optin):
    op = _op()
    assert op.reattach_on_restart is False
    state = _StateStore({"cedana": {"tries": [{"try_number": 1, "node": "gpu-node-7"}]}})
    pod = op.build_pod_request_obj(_context(try_number=2, state=state), dry_run=True)
    [term] = _node_terms(pod)
    assert ("kubernetes.io/hostname", "NotIn", ["gpu-node-7"]) in [(e.key, e.operator, e.values) for e in term.match_expressions]
    # the pod-starting callback records where this try's pod runs
    started = k8s.V1Pod(spec=k8s.V1PodSpec(containers=[], node_name="gpu-node-9"))
    [cb for cb in op.callbacks if cb.__name__ == "_RecordNode"][0].on_pod_starting(
        pod=started, client=None, mode="sync", operator=op, context=_context(try_number=2, state=state))
    assert {k: state["cedana"]["tries"][-1][k] for k in ("try_number", "node")} == {"try_number": 2, "node": "gpu-node-9"}


def test_spec_wrap_route_wraps_the_command_with_the_cli_and_mounts_the_secret_as_files(optin):
    pod = _op(route="wrap", store_secret="ckpt-s3").build_pod_request_obj(_context(try_number=3), dry_run=True)
    data = _roundtrip(pod)
    main = pod.spec.containers[0]
    assert main.command[:4] == ["cedana-airflow", "run", "--resume", "--id"]
    assert main.command[main.command.index("--") + 1:] == ["python", "train.py", "--epochs", "3"]
    assert main.command[main.command.index("--try-number") + 1] == "3" and not main.args
    env = {e.name: e for e in main.env}
    assert env["CEDANA_STORE"].value == "s3://ckpt/airflow"
    assert env["CEDANA_NODE"].value_from.field_ref.field_path == "spec.nodeName"
    assert env["CEDANA_MIN_SUPERVISOR"].value and env["CEDANA_OPERATOR_VERSION"].value  # the image's CLI may be older
    # The Secret is files for the CLI (read-only, root only), never the workload's environment.
    assert not main.env_from
    [vol] = [v for v in pod.spec.volumes if v.secret is not None and v.secret.secret_name == "ckpt-s3"]
    assert vol.secret.default_mode == 0o400
    [mount] = [m for m in main.volume_mounts if m.name == vol.name]
    assert mount.read_only and env["CEDANA_STORE_CREDENTIALS_DIR"].value == mount.mount_path == CREDENTIALS_MOUNT
    # the node key: the deployment's Secret, read-only and root-only, for the in-pod supervisor (issue 48)
    [key] = [v for v in pod.spec.volumes if v.secret is not None and v.secret.secret_name == "cedana-node-key"]
    assert (key.secret.default_mode, key.secret.optional) == (0o400, True)
    [mount] = [m for m in main.volume_mounts if m.name == key.name]
    assert mount.read_only and env["CEDANA_SIGNING_KEY_FILE"].value == f"{mount.mount_path}/node.key" == f"{KEY_MOUNT}/node.key"
    assert main.security_context.privileged is True and pod.spec.runtime_class_name is None
    assert "AWS_SECRET_ACCESS_KEY" not in str(data)  # credentials only by reference


def test_spec_wrap_route_carries_a_cooperative_mode_and_asks_for_a_supervisor_that_knows_it(optin):
    pod = _op(route="wrap", settings={"mode": "cooperative", "cooperative_timeout_seconds": 60}).build_pod_request_obj(
        _context(), dry_run=True)
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["CEDANA_MODE"] == "cooperative" and env["CEDANA_COOPERATIVE_TIMEOUT_SECONDS"] == "60.0"
    assert env["CEDANA_MIN_SUPERVISOR"] == "0.8.0"  # an older CLI in the image refuses in one line, not on a setting
    plain = {e.name: e.value for e in _op(route="wrap").build_pod_request_obj(_context(), dry_run=True).spec.containers[0].env}
    assert "CEDANA_MODE" not in plain and plain["CEDANA_MIN_SUPERVISOR"] == "0.8.0"  # 0.8.0: signing and the owner check


def test_spec_out_of_scope_pods_are_left_alone_and_a_gpu_pod_says_it_runs_unprotected(tmp_path, monkeypatch, caplog):
    p = tmp_path / "optin.toml"
    p.write_text(OPTIN.replace('queues = ["*"]', 'queues = ["gpu"]'))
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))
    op = _op()
    plain = op.build_pod_request_obj(_context(), dry_run=True)
    assert plain.spec.runtime_class_name is None and HEARTBEAT_LABEL not in (plain.metadata.labels or {})
    assert not any(e.name == "CEDANA_CHECKPOINT" for e in plain.spec.containers[0].env or [])


def test_spec_pod_mutation_hook_routes_kubernetes_executor_pods_on_the_list(optin, tmp_path, monkeypatch):
    from cedana_airflow.airflow.policy import pod_mutation_hook

    def worker_pod(dag_id: str) -> k8s.V1Pod:  # as the KubernetesExecutor builds one
        return k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="w", labels={"airflow-worker": "1"},
                                      annotations={"dag_id": dag_id, "task_id": "fit", "run_id": "manual__1", "try_number": "1"}),
            spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base", image="airflow:3.3",
                                                           args=["airflow", "tasks", "run", "..."])]))

    pod = worker_pod("train_llm")
    pod_mutation_hook(pod)
    _roundtrip(pod)
    assert pod.spec.runtime_class_name == "cedana" and pod.metadata.labels[HEARTBEAT_LABEL] == "600"
    assert {e.name: e.value for e in pod.spec.containers[0].env}["CEDANA_CHECKPOINT"].startswith("train_llm.fit.manual__1-")
    assert pod.spec.containers[0].args == ["airflow", "tasks", "run", "..."]

    p = tmp_path / "narrow.toml"
    p.write_text(OPTIN.replace('dags = ["*"]', 'dags = ["train_*"]'))
    monkeypatch.setenv("AIRFLOW__CEDANA__OPTIN_FILE", str(p))
    other = worker_pod("etl_daily")
    pod_mutation_hook(other)
    assert other.spec.runtime_class_name is None and HEARTBEAT_LABEL not in other.metadata.labels  # not on the list
    kpo = _op().build_pod_request_obj(_context(), dry_run=True)
    before = ApiClient().sanitize_for_serialization(kpo)
    pod_mutation_hook(kpo)
    assert ApiClient().sanitize_for_serialization(kpo) == before  # a pod that took its route already is left alone


def test_spec_heartbeat_auto_stays_auto_in_the_wrap_routes_pod_and_is_chosen_now_for_cedanas_runtime(optin, monkeypatch):
    import json

    from cedana_airflow.config import load_settings

    monkeypatch.setenv("AIRFLOW__CEDANA__HISTORY_API_URL", "http://127.0.0.1:1")  # no history: auto says so, goes on
    pod = _op(route="wrap", heartbeat="auto", heartbeat_max=timedelta(minutes=20)).build_pod_request_obj(
        _context(), dry_run=True)
    main = pod.spec.containers[0]
    assert main.command[main.command.index("--heartbeat") + 1] == "auto"
    env = {e.name: e.value for e in main.env}
    assert env["CEDANA_MIN_SUPERVISOR"] == "0.8.0" and env["CEDANA_HEARTBEAT_MAX_SECONDS"] == "1200.0"
    history = json.loads(env["CEDANA_FAILURE_HISTORY"])
    assert history["failures"] == 0 and history["note"].startswith("history not read")
    back = load_settings(environ={k: v for k, v in env.items() if k.startswith("CEDANA_") and v})  # the pod's CLI
    assert back.failure_history is not None and back.failure_history.scope == history["scope"]
    cedana = _op(route="cedana", heartbeat="auto", heartbeat_max=timedelta(minutes=20)).build_pod_request_obj(
        _context(), dry_run=True)
    assert cedana.metadata.labels["cedana.ai/heartbeat-checkpoint"] == "1200"  # no failure seen: heartbeat_max


# -- CedanaKubernetesJobOperator: a job of several pods, checkpointed as one (docs/jobs.md) --------------------

@pytest.fixture
def job_op(optin):
    """A CedanaKubernetesJobOperator maker, with the kube config above (written beside the opt-in list)."""
    config = optin.parent / "kubeconfig"
    config.write_text(KUBECONFIG)

    def make(**kw):
        kw.setdefault("cmds", ["torchrun"])
        kw.setdefault("arguments", ["--nnodes", "2", "--node-rank", "$(JOB_COMPLETION_INDEX)", "train.py"])
        return CedanaKubernetesJobOperator(task_id="pretrain", namespace="ml", image="ml/train:1",
                                           route="wrap", store_secret="ckpt-s3", config_file=str(config),
                                           **{"name": "pretrain", "parts": 2, "heartbeat": timedelta(minutes=5), **kw})
    return make


def _job(op, try_number=1):
    job = op.build_job_request_obj(_context(try_number))
    api = ApiClient()
    data = api.sanitize_for_serialization(job)
    again = api._ApiClient__deserialize(data, "V1Job")  # every model validates its required fields
    assert api.sanitize_for_serialization(again) == data
    return job, data


def test_spec_a_job_of_two_pods_is_an_indexed_job_each_pod_one_part_of_one_checkpoint_id(job_op):
    job, data = _job(job_op())
    spec = data["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    [main] = pod["containers"]
    assert main["command"][:3] == ["cedana-airflow", "run", "--resume"] and "--try-number" in main["command"]
    cid = main["command"][main["command"].index("--id") + 1]
    assert cid.startswith("train_llm.finetune.scheduled__2026-11-29T00_00_00+00_00-")  # one ID for every part
    # the user's command, as given: Kubernetes expands $(JOB_COMPLETION_INDEX) in it
    assert main["command"][main["command"].index("--") + 1:] == ["torchrun", "--nnodes", "2", "--node-rank",
                                                               "$(JOB_COMPLETION_INDEX)", "train.py"]
    env = {e["name"]: e for e in main["env"]}
    assert env["CEDANA_JOB_PARTS"]["value"] == "2"
    assert env["CEDANA_JOB_PART"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
    assert env["CEDANA_SIGNING_KEY_FILE"]["value"] == f"{KEY_MOUNT}/node.key"
    # an image whose CLI predates jobs refuses the pod in one line, instead of running each part as a job of its own
    assert env["CEDANA_MIN_SUPERVISOR"]["value"] == JOB_FLOOR
    assert "0.12.0 or later; this one is 0.11.2" in supervisor_refusal({"CEDANA_MIN_SUPERVISOR": JOB_FLOOR}, "0.11.2")
    # one part per node, on opted-in nodes
    [term] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": {"cedana.ai/job": job.metadata.name}},
                    "topologyKey": "kubernetes.io/hostname"}
    [nodes] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert nodes["matchExpressions"] == [{"key": "cedana.ai/enabled", "operator": "In", "values": ["true"]}]


def test_spec_the_retry_is_a_new_job_whose_parts_resume_as_attempt_two_on_any_opted_in_node(job_op):
    op = job_op()
    first, _ = _job(op, 1)
    retry, data = _job(op, 2)
    assert retry.metadata.name != first.metadata.name  # a new Job, never the failed one
    main = data["spec"]["template"]["spec"]["containers"][0]
    assert main["command"][main["command"].index("--try-number") + 1] == "2"
    # no node is avoided: the lost node is NotReady, and the parts that survived it may run where they ran
    [nodes] = data["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [e["key"] for e in nodes["matchExpressions"]] == ["cedana.ai/enabled"]


def test_spec_what_would_split_the_job_is_refused_when_the_dag_is_parsed(job_op):
    with pytest.raises(ValueError, match=r"parts=1: a job of several pods has 2 or more parts"):
        job_op(parts=1)
    with pytest.raises(ValueError, match=r"pretrain: parallelism=1, backoff_limit=6: a checkpointed job runs its 2 parts at once"):
        job_op(backoff_limit=6, parallelism=1)
    with pytest.raises(ValueError, match=r"on the wrap route only"):
        CedanaKubernetesJobOperator(task_id="t", name="t", image="i", parts=2, route="cedana")
    assert job_op(completion_mode="Indexed", backoff_limit=0).backoff_limit == 0  # the same values are fine


def test_spec_out_of_scope_the_job_runs_as_given(job_op, optin):
    optin.write_text('[workload]\ndags = ["another_dag"]\n')
    _, data = _job(job_op())
    main = data["spec"]["template"]["spec"]["containers"][0]
    assert main["command"] == ["torchrun"] and not any(e["name"].startswith("CEDANA_JOB") for e in main.get("env", []))


def test_spec_a_cooperative_job_carries_its_mode_and_the_jobs_floor(job_op):
    _, data = _job(job_op(settings={"mode": "cooperative"}))
    env = {e["name"]: e.get("value") for e in data["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["CEDANA_MODE"] == "cooperative" and env["CEDANA_MIN_SUPERVISOR"] == JOB_FLOOR


def test_spec_the_pod_template_is_a_valid_pod_for_the_kubelet(job_op):
    job, _ = _job(job_op())
    pod = k8s.V1Pod(metadata=job.spec.template.metadata, spec=job.spec.template.spec)
    assert ApiClient().sanitize_for_serialization(pod)["spec"]["containers"][0]["securityContext"]["privileged"] is True


class _FakeApiServer:
    """Stands in for the Kubernetes API server (none can run here): the calls the provider's job path makes on
    its BatchV1Api and CoreV1Api, answered from what a test sets up, and recorded."""

    def __init__(self, *, earlier_jobs=(), pods_after_lists=0, conditions=(("Complete", "True"),),
                 scheduled=True, gone=()):
        from kubernetes.client import ApiClient

        self.api_client = ApiClient()  # serializes only: it never connects
        self.earlier_jobs, self.pods_after_lists, self.conditions = list(earlier_jobs), pods_after_lists, conditions
        self.scheduled, self.gone = scheduled, set(gone)  # gone: jobs whose delete answers 404
        self.calls: list[tuple[str, dict]] = []
        self.created = None
        self.pod_lists = self.status_reads = 0

    def __getattr__(self, name):  # anything else the provider calls is recorded and answers nothing
        return lambda *a, **kw: self.calls.append((name, kw))

    def list_namespaced_job(self, namespace, label_selector):
        self.calls.append(("list_namespaced_job", {"label_selector": label_selector}))
        return k8s.V1JobList(items=self.earlier_jobs)

    def delete_namespaced_job(self, name, namespace, **kw):
        from kubernetes.client.exceptions import ApiException

        self.calls.append(("delete_namespaced_job", {"name": name, **kw}))
        if name in self.gone:
            raise ApiException(status=404, reason="Not Found")

    def create_namespaced_job(self, body, namespace, **kw):
        self.created = body
        return body

    def read_namespaced_job_status(self, name, namespace, **kw):
        self.status_reads += 1
        if self.status_reads > 50:  # a wait that would never end (it sleeps no time here)
            raise RuntimeError(f"Job {name}: still waited for after 50 reads of its status")
        conditions = [k8s.V1JobCondition(type=t, status=s, reason=f"{t}Reason") for t, s in self.conditions]
        return k8s.V1Job(metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
                         status=k8s.V1JobStatus(conditions=conditions))

    def list_namespaced_pod(self, namespace, label_selector):
        self.pod_lists += 1
        self.calls.append(("list_namespaced_pod", {"label_selector": label_selector}))
        if self.pod_lists <= self.pods_after_lists:
            return k8s.V1PodList(items=[])
        job = self.created["metadata"]["name"]
        scheduled = k8s.V1PodCondition(type="PodScheduled", status="True" if self.scheduled else "False",
                                       message=None if self.scheduled else "0/3 nodes are available: 1 node(s) didn't "
                                       "match pod anti-affinity rules, 2 node(s) didn't match node affinity")
        return k8s.V1PodList(items=[k8s.V1Pod(metadata=k8s.V1ObjectMeta(
            name=f"{job}-{i}-x", namespace=namespace, labels={"try_number": "2", "cedana.ai/job": job}),
            status=k8s.V1PodStatus(phase="Running", conditions=[scheduled])) for i in range(2)])

    def read_namespaced_pod_log(self, name, namespace, **kw):
        from kubernetes.client.exceptions import ApiException

        self.calls.append(("read_namespaced_pod_log", {"name": name, **kw}))
        raise ApiException(status=404, reason=f"pods \"{name}\" not found")  # being deleted, at FailureTarget

    def read_namespaced_pod(self, name, namespace, **kw):
        ended = k8s.V1ContainerStatus(name="base", image="i", image_id="", ready=False, restart_count=0,
                                      state=k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=1)))
        return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
                         spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base")]),
                         status=k8s.V1PodStatus(phase="Failed", container_statuses=[ended]))


class _Clock:
    """time for operators/kubernetes.py: its waits advance it instead of sleeping."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def _earlier(try_number, task=("train_llm", "finetune", "scheduled__2026-11-29T00:00:00+00:00", -1), name=None):
    """A Job an earlier (or another) try left, labelled as the operator labels its own."""
    from cedana_airflow.airflow.kube import job_label_value

    return k8s.V1Job(metadata=k8s.V1ObjectMeta(name=name or f"job-pretrain-try{try_number}", namespace="ml", labels={
        "cedana.ai/task": job_label_value(*task), "cedana.ai/try-number": str(try_number)}))


def _execute(op, api, monkeypatch, try_number=2):
    """The provider's own execute path (create, pod discovery, the wait, the failure check) against ``api``."""
    import sys

    monkeypatch.setattr(sys.modules[type(op).__module__], "time", _Clock())  # the module the class came from
    op.hook.__dict__["batch_v1_client"] = op.hook.__dict__["core_v1_client"] = api
    ctx = _context(try_number)
    ctx["ti"].xcom_push = lambda **kw: None
    return op.execute(ctx)


def test_a_job_that_lost_a_node_fails_its_try_at_failure_target_and_is_deleted_fake_api_server(job_op, monkeypatch):
    """Kubernetes 1.31+: a Job whose pod was lost has FailureTarget at once, but Failed only when every pod
    has terminated, which a pod on an unreachable node never does. The try fails at FailureTarget with the
    Job's reason (the pods' logs, read once and not followed, are not there: said, not raised), and deletes
    its Job so that no part of it runs beside the retry's."""
    from cedana_airflow.airflow_compat import AirflowException

    api = _FakeApiServer(conditions=(("FailureTarget", "True"),))
    op = job_op(on_finish_action="keep_pod", job_poll_interval=0)  # get_logs: the provider's default, on
    with pytest.raises(AirflowException, match=r"is failed with error 'FailureTargetReason \(its pods still stopping\)'"):
        _execute(op, api, monkeypatch)
    name = api.created["metadata"]["name"]
    assert ("delete_namespaced_job", {"name": name, "propagation_policy": "Foreground"}) in api.calls
    assert [kw.get("follow") for n, kw in api.calls if n == "read_namespaced_pod_log"] == [False, False]


def test_each_try_deletes_earlier_tries_jobs_and_waits_for_its_own_pods_fake_api_server(job_op, monkeypatch):
    """A worker that died never deleted its try's Job: the next try deletes it before it starts its own (a
    Job already gone is fine). Its pods, found by its own Job's label only, are waited for (the provider's
    discovery listed 4 times without a pause and failed the try with the Job left running)."""
    api = _FakeApiServer(earlier_jobs=[_earlier(1), _earlier(1, name="job-pretrain-gone")], pods_after_lists=6,
                         gone={"job-pretrain-gone"})
    op = job_op(get_logs=False, on_finish_action="keep_pod", job_poll_interval=0)
    _execute(op, api, monkeypatch)
    created = api.created
    [listed] = [kw for name, kw in api.calls if name == "list_namespaced_job"]
    assert listed["label_selector"] == f"cedana.ai/checkpoint-id={created['metadata']['labels']['cedana.ai/checkpoint-id']}"
    assert ("delete_namespaced_job", {"name": "job-pretrain-try1", "propagation_policy": "Foreground"}) in api.calls
    assert api.pod_lists == 7 and {kw["label_selector"] for name, kw in api.calls if name == "list_namespaced_pod"} == {
        f"cedana.ai/job={created['metadata']['name']}"}
    assert not [c for c in api.calls if c[0] == "delete_namespaced_job" and c[1]["name"] == created["metadata"]["name"]]


def test_another_task_instances_or_a_newer_trys_job_is_never_deleted_fake_api_server(job_op, monkeypatch):
    from cedana_airflow.airflow_compat import AirflowException, AirflowFailException

    other = _earlier(1, task=("train_llm", "finetune", "manual__2026-12-01", -1))  # another run, the same ID
    api = _FakeApiServer(earlier_jobs=[other])
    with pytest.raises(AirflowFailException, match=r"Job job-pretrain-try1 of another task instance .* uses this "
                                                    r"checkpoint ID: give each its own checkpoint_id"):
        _execute(job_op(get_logs=False, job_poll_interval=0), api, monkeypatch)
    api = _FakeApiServer(earlier_jobs=[_earlier(3)])  # a stale try 2 that woke up after try 3 started
    with pytest.raises(AirflowException, match=r"is of try 3, not earlier than this try \(2\): this try is stale"):
        _execute(job_op(get_logs=False, job_poll_interval=0), api, monkeypatch)
    assert not [c for c in api.calls if c[0] == "delete_namespaced_job" and c[1]["name"] == "job-pretrain-try3"]


def test_pods_that_never_schedule_fail_the_try_with_the_schedulers_reason_fake_api_server(job_op, monkeypatch):
    from cedana_airflow.airflow_compat import AirflowException

    api = _FakeApiServer(scheduled=False)
    with pytest.raises(AirflowException, match=r"2 of the 2 pods of Job \S+ not scheduled in 90 s .*didn't match pod "
                                               r"anti-affinity rules"):
        _execute(job_op(get_logs=False, job_poll_interval=0, schedule_timeout_seconds=90), api, monkeypatch)
    assert ("delete_namespaced_job", {"name": api.created["metadata"]["name"], "propagation_policy": "Foreground"}) \
        in api.calls


def test_spec_defaults_from_default_args_or_the_deployment_cannot_let_a_part_run_alone(job_op, monkeypatch):
    for default, why in (({"do_xcom_push": True}, "do_xcom_push=True"),
                         ({"random_name_suffix": False}, "random_name_suffix=False")):
        with pytest.raises(ValueError, match=why):
            job_op(default_args=default)
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "True")
    op = job_op(default_args={"deferrable": True})
    assert op.deferrable is False and op.deferred_asked  # never deferred; said when it runs


def test_spec_a_long_name_is_cut_so_every_pods_hostname_is_a_dns_label(job_op):
    job, _ = _job(job_op(name="pretrain-a-large-language-model-on-the-full-corpus-x"))
    assert len(job.metadata.name) + len("-1") <= 63 and job.metadata.name.startswith("job-pretrain-a-large")
    with pytest.raises(ValueError, match=r"subdomain='Pre_train' is not a DNS label"):
        job_op(subdomain="Pre_train")


def test_spec_a_jobs_pods_tolerate_a_lost_node_for_node_lost_seconds_and_name_their_job(job_op):
    # first, before a DAG's own: the taint manager takes the first match, and a blanket one tolerates for ever
    _, data = _job(job_op(node_lost_seconds=45, subdomain="pretrain", tolerations=[k8s.V1Toleration(operator="Exists")]))
    pod = data["spec"]["template"]["spec"]
    assert [(t.get("key"), t.get("effect"), t.get("tolerationSeconds")) for t in pod["tolerations"]] == [
        ("node.kubernetes.io/unreachable", "NoExecute", 45), ("node.kubernetes.io/not-ready", "NoExecute", 45),
        (None, None, None)]
    assert pod["subdomain"] == "pretrain"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["CEDANA_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['cedana.ai/job']"
    assert data["spec"]["template"]["metadata"]["labels"]["cedana.ai/job"] == data["metadata"]["name"]


def test_spec_what_would_let_a_part_run_on_alone_is_refused(job_op):
    from cedana_airflow.airflow_compat import AirflowFailException

    for kw, why in (({"do_xcom_push": True}, "do_xcom_push=True"),
                    ({"wait_until_job_complete": False}, "wait_until_job_complete=False"),
                    ({"random_name_suffix": False}, "random_name_suffix=False")):
        with pytest.raises(ValueError, match=why):
            job_op(**kw)
    assert job_op(deferrable=True).deferrable is False
    spec = k8s.V1Job(spec=k8s.V1JobSpec(template=k8s.V1PodTemplateSpec(), pod_replacement_policy="Failed",
                                        pod_failure_policy=k8s.V1PodFailurePolicy(rules=[])))
    with pytest.raises(AirflowFailException, match=r"sets podFailurePolicy, podReplacementPolicy: a checkpointed job"):
        _job(job_op(full_job_spec=spec))
    with pytest.raises(AirflowFailException, match=r"env sets JOB_COMPLETION_INDEX"):
        _job(job_op(env_vars={"JOB_COMPLETION_INDEX": "1"}))
