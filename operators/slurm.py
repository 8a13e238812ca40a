"""CedanaSlurmOperator: submit a batch job to Slurm and follow it to the end; a job in a checkpoint
partition that the opt-in list admits runs under our supervisor and resumes from its latest
checkpoint when Slurm requeues it (a node failure, a preemption) or an Airflow retry submits it again.

Thin by design: the opt-in list's decision, a JobSpec (cedana_airflow.slurm.batch), one sbatch, then
the SlurmJobTrigger (or a polling loop) and the outcome. What runs inside the job is
``cedana-airflow slurm-job`` (cedana_airflow.slurm.in_job decides there whether it is protected).
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from airflow.sdk import BaseOperator

from cedana_airflow.airflow.config import default_deferrable
from cedana_airflow.airflow.task import CEDANA_TEMPLATE_FIELDS, CedanaTask, Placement, airflow_errors
from cedana_airflow.airflow.logsink import prefixed
from cedana_airflow.airflow.task_state import airflow_task
from cedana_airflow.airflow_compat import AirflowException, AirflowFailException
from cedana_airflow.config import Settings
from cedana_airflow.errors import CedanaError, ConfigError, SlurmError, SlurmRefused
from cedana_airflow.hooks.slurm import slurm_client
from cedana_airflow.scope.optin import Decision, OptInList
from cedana_airflow.slurm.batch import JobSpec, job_settings_env, shell_command
from cedana_airflow.slurm.client import OUTPUT_READ_BYTES, SlurmClient
from cedana_airflow.slurm.jobs import GIVE_UP_SECONDS, JobEnd, JobInfo
from cedana_airflow.triggers.slurm import SlurmJobTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["CedanaSlurmOperator"]

#: XCom key of the submitted job's ID.
XCOM_JOB_KEY = "slurm_job_id"


class CedanaSlurmOperator(CedanaTask, BaseOperator):
    """Run ``command`` as a Slurm batch job; checkpointed when its partition and task are in scope.

    :param command: a shell line (run by bash) or an argv list. Templated.
    :param partition: the Slurm partition. Jobs in a checkpoint partition of the opt-in list
        (``[node] partitions``) whose task the list admits carry ``CEDANA_ENABLE=1`` and are
        checkpointed; any other job runs unprotected and says why. Templated.
    :param nodes: / :param gpus: / :param gres: / :param time_limit: / :param cpus_per_task: /
        :param mem: the usual sbatch resources (``gpus=N`` is ``--gres=gpu:N``).
    :param sbatch_args: more sbatch options, passed as given.
    :param env: the job's own environment variables (the worker's are not passed on). Templated.
    :param store: store URL as the compute nodes see it (default [cedana] store); its credentials
        are the nodes' own configuration, never part of the job.
    :param job_dir: a directory the submit side and the compute nodes share, for the job's output.
    :param cli: how a compute node runs cedana-airflow (default ``cedana-airflow`` on its PATH).
    :param node_config: a cedana-airflow config file on the compute nodes (``CEDANA_CONFIG`` in the job):
        the nodes' own settings, e.g. ``store_credentials_dir`` or ``signing_key_file``. The task's
        settings that differ from the defaults are carried into the job as well (never a secret).
    :param ssh_conn_id: submit on the login node of this SSH connection instead of this worker.
    :param deferrable: follow the job in the triggerer, holding no worker slot (default: Airflow's
        ``[operators] default_deferrable``, False unless set; before 0.9.0 True).
    :param poll_interval: how often Slurm is asked about the job.
    :param signal_before_end: SIGTERM to the job's supervisor this long before its time limit,
        so it takes a final checkpoint before Slurm kills it.
    :param one_part_per_node: with ``nodes`` above 1, run ``command`` once on every node (``srun``, one task
        per node; e.g. ``torchrun --nnodes`` with ``--node-rank $SLURM_NODEID``), each node's run one part
        of the job: checkpointed together and resumed together from one seq (docs/jobs.md, 0.12.0).
        Without it a job on several nodes runs ``command`` once, on the batch host, unprotected.
    """

    template_fields: Sequence[str] = ("command", "partition", "env", "job_dir", *CEDANA_TEMPLATE_FIELDS)

    def __init__(self, *, command: str | Sequence[str], partition: str, nodes: int = 1, gpus: int = 0,
                 gres: str | None = None, time_limit: str | timedelta | None = None, cpus_per_task: int = 0,
                 mem: str | None = None, sbatch_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 job_dir: str | None = None, cli: Sequence[str] = ("cedana-airflow",), node_config: str | None = None,
                 ssh_conn_id: str | None = None,
                 deferrable: bool | None = None, poll_interval: timedelta = timedelta(seconds=10),
                 requeue_settle: timedelta = timedelta(seconds=30),
                 signal_before_end: timedelta = timedelta(minutes=2), checkpoint_id: str | None = None,
                 heartbeat: timedelta | Literal["auto"] | None = None,
                 heartbeat_min: timedelta | None = None, heartbeat_max: timedelta | None = None,
                 mtbf: timedelta | None = None, store: str | None = None, settings: dict[str, Any] | None = None,
                 idempotency_key: str | None = None, max_restore_gap: timedelta | None = None,
                 lease: timedelta | None = None, lease_renew_command: str | Sequence[str] | None = None,
                 expected_duration: timedelta | None = None, job_server: bool = False, gpu: bool = False,
                 one_part_per_node: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if gpus and gres:
            raise ValueError(f"{self.task_id}: give gpus= or gres=, not both.")
        self.command, self.partition, self.nodes = command, partition, nodes
        self.one_part_per_node = one_part_per_node
        self.gres = gres or (f"gpu:{gpus}" if gpus else "")
        self.time_limit = _sbatch_time(time_limit)
        self.cpus_per_task, self.mem, self.sbatch_args = cpus_per_task, mem or "", tuple(sbatch_args)
        self.env = dict(env or {})
        self.job_dir = job_dir
        self.cli, self.ssh_conn_id, self.deferrable = tuple(cli), ssh_conn_id, default_deferrable(deferrable)
        self.node_config = node_config or ""
        self.poll_seconds = poll_interval.total_seconds()
        self.settle_seconds = requeue_settle.total_seconds()
        self.signal_seconds = int(signal_before_end.total_seconds())
        # aws_conn_id is not taken: the compute nodes reach the store with their own credentials
        self.init_cedana(checkpoint_id=checkpoint_id, heartbeat=heartbeat, heartbeat_min=heartbeat_min,
                         heartbeat_max=heartbeat_max, mtbf=mtbf, store=store, settings=settings,
                         idempotency_key=idempotency_key, max_restore_gap=max_restore_gap, lease=lease,
                         lease_renew_command=lease_renew_command, expected_duration=expected_duration,
                         job_server=job_server, gpu=gpu or bool(self.gres.startswith("gpu")))

    # -- submission ----------------------------------------------------------------------------------
    def _placement(self, optin: OptInList | None, settings: Settings) -> Placement:
        """A node of the partition: the list's [node] partitions judge it."""
        return Placement(f"(a node of Slurm partition {self.partition})", partition=self.partition, gpu=self.gpu)

    def _spec(self, context: Context) -> JobSpec:
        ti = context["ti"]
        setup = self.cedana_setup(context, self._placement)
        decision, settings = setup.decision, setup.settings
        if decision.in_scope and self.nodes > 1 and not self.one_part_per_node:
            self.log.info("cedana: a job on %d nodes runs unprotected: only the batch host's processes could be "
                          "checkpointed, not the other nodes' steps (one_part_per_node=True runs the command on every "
                          "node, checkpointed as one job: docs/jobs.md)", self.nodes)
            decision = Decision(False, (*decision.reasons, f"nodes={self.nodes}: multi-node jobs are not checkpointed"))
        if not self.job_dir and self.ssh_conn_id:
            raise ConfigError("submitting through a login node needs job_dir=: a directory the login node and the "
                              "compute nodes share, for the job's output")
        cid = setup.checkpoint_id
        job_dir = self.job_dir or str(Path(settings.work_dir or tempfile.gettempdir()) / "cedana-slurm-jobs")
        task = airflow_task(context)
        return JobSpec(
            name=f"airflow.{ti.dag_id}.{ti.task_id}"[:120], command=shell_command(self.command),
            partition=self.partition, checkpoint_id=cid,
            output=f"{job_dir}/{cid}.try{ti.try_number}.%j.out", enable=decision.in_scope,
            try_number=ti.try_number, heartbeat_seconds=settings.heartbeat_seconds, nodes=self.nodes,
            one_part_per_node=self.one_part_per_node,
            gres=self.gres, time_limit=self.time_limit, cpus_per_task=self.cpus_per_task, mem=self.mem,
            signal_seconds=self.signal_seconds, extra_args=self.sbatch_args, cli=self.cli, store=settings.store,
            optin_file=str(settings.optin_file or ""), work_dir=str(settings.work_dir or ""), env=self.env,
            settings_env=job_settings_env(settings, self.node_config) if decision.in_scope else {},
            cedana_env=self.cedana_env(None), airflow_task=(task.dag_id, task.task_id, task.run_id, task.map_index))

    @prefixed
    def execute(self, context: Context) -> Any:
        with airflow_errors():
            spec = self._spec(context)
            client = slurm_client(self.ssh_conn_id)
        with client:  # one login for the submit and, in the worker, every poll; closed however this ends
            with airflow_errors():
                client.mkdir(spec.output.rsplit("/", 1)[0])
                job_id = client.submit(spec)
            output = spec.output.replace("%j", job_id)
            self.log.info("cedana: submitted Slurm job %s to partition %s (%s); checkpoint_id=%s output %s", job_id,
                          spec.partition, "CEDANA_ENABLE=1" if spec.enable else "without CEDANA_ENABLE: unprotected",
                          spec.checkpoint_id, output)
            context["ti"].xcom_push(key=XCOM_JOB_KEY, value=job_id)
            self._job_id = job_id
            if self.deferrable:  # the trigger logs in for itself
                self.defer(trigger=SlurmJobTrigger(job_id, self.ssh_conn_id, self.poll_seconds, self.settle_seconds,
                                                   output), method_name="execute_complete")
            return self._follow(client, job_id, output)

    # -- following -----------------------------------------------------------------------------------
    def _follow(self, client: SlurmClient, job_id: str, output: str) -> Any:
        """Not deferrable: poll here, printing the job's new output lines as they come. Slurm may fail to
        answer for GIVE_UP_SECONDS, as in the triggerer; past that, or on a refusal, the job is cancelled
        before the try fails, so that the retry's job does not run beside it."""
        end, pos, seen, failing_since = JobEnd(self.settle_seconds), 0, None, None
        exited: list[str] = []  # the supervisors' last lines: the XCom's heartbeat counts
        try:
            while True:
                try:
                    info = client.job(job_id)
                    if (info.state, info.restarts) != seen:
                        seen = (info.state, info.restarts)
                        self.log.info("cedana: %s", info.describe())
                    over = end.over(info, time.monotonic())
                    while True:  # whole lines only while it runs; at the end, the rest
                        data = client.read_from(output, pos)
                        taken = data if over else data[: data.rfind(b"\n") + 1]
                        for line in taken.decode(errors="replace").splitlines():
                            self.log.info("slurm job %s: %s", job_id, line)
                            if _EXITED.match(line):
                                exited.append(line)
                        pos += len(taken)
                        if not taken or len(data) < OUTPUT_READ_BYTES:
                            break
                except SlurmRefused:
                    raise
                except SlurmError as e:  # a controller restart, a dropped login: the job may well be fine
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since >= GIVE_UP_SECONDS:
                        raise
                    self.log.warning("cedana: Slurm did not answer about job %s (%s); asking again", job_id, e)
                    time.sleep(self.poll_seconds)
                    continue
                failing_since = None
                if over:
                    return self._outcome(info, None, heartbeat_counts("\n".join(exited)))
                time.sleep(self.poll_seconds)
        except CedanaError:
            self.on_kill()  # no longer followed: it must not run on beside the retry's job
            with airflow_errors():
                raise

    @prefixed
    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        if event.get("status") != "done":
            if event.get("job_id"):  # no longer followed: it must not run on beside the retry's job
                self._job_id = str(event["job_id"])
                self.on_kill()
            cls = AirflowException if event.get("retryable", True) else AirflowFailException
            raise cls(f"cedana: {event.get('message', event)}")
        info, output = JobInfo(**event["job"]), event.get("output", "")
        text = ""
        try:
            if output:
                with slurm_client(self.ssh_conn_id) as client:
                    text = client.read(output)
        except CedanaError as e:
            self.log.warning("cedana: the job's output %s cannot be read: %s", output, e)
        return self._outcome(info, text)

    def _outcome(self, info: JobInfo, text: str | None, counts: dict[str, int] | None = None) -> Any:
        """The try's end from the job's; ``text``: its output, to log (None: logged as it came, and
        ``counts`` are its heartbeat counts)."""
        if text is not None:
            for line in text.splitlines():
                self.log.info("slurm job %s: %s", info.job_id, line)
        if info.succeeded:
            self.log.info("cedana: %s", info.describe())
            return {"job_id": info.job_id, "state": info.state, "exit_code": info.exit_code, "nodes": info.nodes,
                    "restarts": info.restarts, **(counts if counts is not None else heartbeat_counts(text or ""))}
        raise AirflowException(f"cedana: {info.describe()}")

    def on_kill(self) -> None:
        job_id = getattr(self, "_job_id", None)
        if job_id:  # the job's supervisor takes a final checkpoint on the SIGTERM Slurm sends first
            try:
                with slurm_client(self.ssh_conn_id) as client:
                    client.cancel(job_id)
                self.log.info("cedana: cancelled Slurm job %s", job_id)
            except CedanaError as e:
                self.log.warning("cedana: could not cancel Slurm job %s: %s", job_id, e)


def _sbatch_time(t: str | timedelta | None) -> str:
    if t is None:
        return ""
    if isinstance(t, str):
        return t
    minutes = max(1, int(t.total_seconds() + 59) // 60)  # sbatch's unit is a minute
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


#: The supervisor's last line of each run in a job's output (run/runner.py); a requeued job's runs append.
#: The whole line: the workload's own output shares the file (a line of its that quotes one is not counted,
#: one that copies it exactly is; the figures are the XCom's, never a decision's).
_EXITED = re.compile(r"^cedana: (?:node agent: )?workload exited checkpoint_id=\S+ exit_code=-?\d+ checkpoints=(\d+) "
                     r"skipped_heartbeats=(\d+) failed_heartbeats=(\d+)$", re.M)


def heartbeat_counts(output: str) -> dict[str, int]:
    """What the job's supervisors said of their heartbeats, summed over its runs (a requeue starts another):
    the XCom's ``checkpoints``, ``skipped_heartbeats`` and ``failed_heartbeats`` (0.11.0), as the command
    operator's summary has them. Empty where the output holds no such line (it could not be read)."""
    runs = _EXITED.findall(output)
    if not runs:
        return {}
    return {name: sum(int(r[i]) for r in runs)
            for i, name in enumerate(("checkpoints", "skipped_heartbeats", "failed_heartbeats"))}
