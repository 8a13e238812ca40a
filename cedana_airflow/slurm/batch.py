"""A batch job for the Slurm route: the sbatch options and the script that runs the command.

The script does not run the command itself: it execs ``cedana-airflow slurm-job``, which decides
inside the job whether it is protected (slurm/in_job.py) and then supervises the command, or
execs it unchanged. The script goes to sbatch on its standard input, so nothing needs copying to
a login node.

Environment: sbatch would copy the submitting worker's whole environment into the job (Airflow's
settings and connections among it, and a checkpoint holds the job's memory). Jobs are submitted
with ``--export=NONE`` plus only ``CEDANA_ENABLE`` when the task is in scope; the script sets the
rest (PATH, the store URL, the opt-in file) explicitly. Store credentials are the compute node's
own configuration (``store_credentials_dir``), never part of the job.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..compat import handshake_env
from ..config import NODE_SETTINGS, Settings, env_text, env_var
from ..errors import ConfigError
from ..ids import validate_checkpoint_id

__all__ = ["ENABLE_ENV", "JobSpec", "batch_script", "job_settings_env", "sbatch_argv", "shell_command"]

#: The per-job opt-in, as Cedana documents it: only jobs carrying it are checkpointed.
ENABLE_ENV = "CEDANA_ENABLE"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: sbatch options the route sets itself: given again in extra_args they would undo the opt-in
#: (--export=ALL brings the worker's environment, Airflow's connections among it, into the job and its
#: checkpoints), the resume (--no-requeue), or where the task log reads the job's output.
_OURS = ("--export", "--get-user-env", "--output", "-o", "--error", "-e", "--open-mode", "--no-requeue", "--requeue",
         "--signal", "--partition", "-p", "--parsable", "--wrap")


@dataclass(frozen=True)
class JobSpec:
    """One submission. ``command`` is an argv; a shell line is ``("bash", "-c", line)``."""

    name: str
    command: tuple[str, ...]
    partition: str
    checkpoint_id: str
    output: str  # a path the login node and the compute nodes both see; %j is the job ID
    enable: bool  # in scope: the job carries CEDANA_ENABLE=1
    try_number: int = 0
    heartbeat_seconds: float | str = 0  # or "auto"
    nodes: int = 1
    # Run the command once per node (srun), each node's run one part of the job, checkpointed as one
    # (docs/jobs.md). Without it the batch script runs the command once, on the batch host.
    one_part_per_node: bool = False
    gres: str = ""  # e.g. gpu:1
    time_limit: str = ""  # sbatch --time, e.g. 02:00:00
    cpus_per_task: int = 0
    mem: str = ""
    signal_seconds: int = 120  # SIGTERM to our supervisor this long before the time limit: a final checkpoint
    extra_args: tuple[str, ...] = ()  # more sbatch options, passed as given
    cli: tuple[str, ...] = ("cedana-airflow",)  # how a compute node runs our CLI
    store: str = ""  # the store URL (no credentials)
    optin_file: str = ""  # the opt-in list the job reads to judge its partition
    work_dir: str = ""
    settings_env: Mapping[str, str] = field(default_factory=dict)  # the task's other settings, as CEDANA_* (no secrets)
    cedana_env: Mapping[str, str] = field(default_factory=dict)  # what the workload reads of ours (CEDANA_IDEMPOTENCY_KEY)
    env: Mapping[str, str] = field(default_factory=dict)  # the workload's own variables
    airflow_task: tuple[str, str, str, int] | None = None  # dag_id, task_id, run_id, map_index

    def __post_init__(self) -> None:
        validate_checkpoint_id(self.checkpoint_id)
        if not self.command:
            raise ConfigError("the Slurm job has no command. Pass command= (a shell line or an argv list).")
        if not self.partition:
            raise ConfigError("the Slurm job has no partition. Pass partition= (e.g. 'cedana').")
        bad = [k for k in self.env if not _ENV_NAME.fullmatch(k)]
        if bad:
            raise ConfigError(f"environment variable name(s) {', '.join(map(repr, bad))} are not valid. Fix env=.")
        ours = [k for k in self.env if k.startswith("CEDANA_")]
        if ours:
            raise ConfigError(f"env= sets {', '.join(ours)}: the route sets CEDANA_* itself (CEDANA_ENABLE only when the "
                              "opt-in list admits the task). Remove them; opt a task in through the list.")
        taken = [a for a in self.extra_args if a.split("=", 1)[0] in _OURS]
        if taken:
            raise ConfigError(f"sbatch_args {', '.join(taken)}: the Slurm route sets these itself. Use the operator's "
                              "arguments (partition=, job_dir=) or remove them.")


#: slurm.conf's KillWait default: a cancelled or preempted job gets SIGTERM, then SIGKILL this long after.
SLURM_KILL_WAIT_SECONDS = 30


def sbatch_argv(spec: JobSpec) -> list[str]:
    """``sbatch`` and its options; the script comes on standard input."""
    argv = ["sbatch", "--parsable", f"--job-name={spec.name}", f"--partition={spec.partition}",
            f"--nodes={spec.nodes}", f"--output={spec.output}", "--open-mode=append",
            # a requeued job (node failure, preemption) runs the same script again: it resumes
            "--requeue", f"--export={ENABLE_ENV}=1" if spec.enable else "--export=NONE"]
    if spec.enable:  # the supervisor's final checkpoint before the time limit; an unprotected job runs unchanged
        argv.append(f"--signal=B:TERM@{spec.signal_seconds}")
    if spec.gres:
        argv.append(f"--gres={spec.gres}")
    if spec.time_limit:
        argv.append(f"--time={spec.time_limit}")
    if spec.cpus_per_task:
        argv.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.mem:
        argv.append(f"--mem={spec.mem}")
    return [*argv, *spec.extra_args]


def batch_script(spec: JobSpec) -> str:
    q = shlex.quote
    env = {"PATH": _DEFAULT_PATH, **spec.env}
    # The stop window: --signal's lead before the time limit, and at most Slurm's KillWait after a scancel.
    window = {"CEDANA_STOP_WINDOW_SECONDS": str(min(spec.signal_seconds, SLURM_KILL_WAIT_SECONDS))}
    cedana = {**window, **spec.settings_env, **spec.cedana_env, "CEDANA_CHECKPOINT_ID": spec.checkpoint_id, "CEDANA_STORE": spec.store,
              "CEDANA_OPTIN_FILE": spec.optin_file, "CEDANA_WORK_DIR": spec.work_dir,
              **handshake_env(spec.settings_env, heartbeat_auto=spec.heartbeat_seconds == "auto",
                             job=spec.enable and spec.nodes > 1 and spec.one_part_per_node)}  # the compute node's CLI may be older than this operator
    lines = ["#!/bin/bash", f"# cedana-airflow Slurm route: checkpoint ID {spec.checkpoint_id}, try {spec.try_number}"]
    lines += [f"export {k}={q(v)}" for k, v in env.items()]  # an empty value is a value (CUDA_VISIBLE_DEVICES=)
    lines += [f"export {k}={q(v)}" for k, v in cedana.items() if v]
    task: list[str] = []
    if spec.airflow_task:
        dag_id, task_id, run_id, map_index = spec.airflow_task
        task = ["--dag-id", dag_id, "--task-id", task_id, "--run-id", run_id, "--map-index", str(map_index)]
    argv = [*spec.cli, "slurm-job", "--id", spec.checkpoint_id, "--try-number", str(spec.try_number),
            "--heartbeat", heartbeat_arg(spec.heartbeat_seconds), *task, "--", *spec.command]
    if spec.nodes > 1 and spec.one_part_per_node:
        # One supervisor per node, each one part of the job (slurm-job reads SLURM_NODEID, SLURM_STEP_NUM_NODES:
        # run/job.py); a part that fails ends the step, so the job fails and is requeued as one.
        argv = ["srun", f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1", "--export=ALL", *argv]  # (sbatch's --export=NONE would reach srun too)
    lines.append("exec " + " ".join(q(a) for a in argv))
    return "\n".join(lines) + "\n"


def heartbeat_arg(seconds: float | str) -> str:
    """--heartbeat's value: seconds as %g, or auto."""
    return seconds if isinstance(seconds, str) else f"{seconds:g}"


def shell_command(command: str | Sequence[str]) -> tuple[str, ...]:
    """A shell line runs under bash; a list is the argv itself."""
    if isinstance(command, str):
        return ("bash", "-c", command)
    return tuple(command)


#: Set by the script itself, or meaningless on another machine.
#: The node settings (the key) never are: each compute node holds its own (keys.py).
_NOT_CARRIED = frozenset({"store", "node", "work_dir", "optin_file", "heartbeat_seconds", "progress", *NODE_SETTINGS})


def job_settings_env(settings: Settings, node_config: str = "") -> dict[str, str]:
    """The task's settings that differ from the defaults, as the CEDANA_* variables a compute node's CLI
    reads, plus ``CEDANA_CONFIG`` (a config file on the compute nodes) when given. Paths are carried as
    paths (store_credentials_dir: the nodes hold those files); a secret never is, nor the node key's
    settings: each compute node signs with its own /etc/cedana-airflow/node.key (or its node config's)."""
    out = {"CEDANA_CONFIG": node_config} if node_config else {}
    defaults = Settings()
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if name not in _NOT_CARRIED and value != getattr(defaults, name) and value is not None:
            out[env_var(name)] = env_text(name, value)
    return out
