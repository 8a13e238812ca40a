"""The Slurm route's core without a cluster: the job's options and script, Slurm's answers, and the
in-job decision. The tests ending in _recorded_answers feed it answers as Slurm 22.05 gave them (a
controller that cannot be reached, a requeued job's states), which the local cluster does not produce
on demand; the real cluster runs in tests/integration/test_slurm_route.py."""

import subprocess

import pytest

from cedana_airflow.compat import JOB_FLOOR
from cedana_airflow.errors import ConfigError, SlurmError, SlurmRefused
from cedana_airflow.slurm.batch import JobSpec, batch_script, sbatch_argv, shell_command
from cedana_airflow.slurm.client import SlurmClient
from cedana_airflow.slurm.in_job import protection
from cedana_airflow.slurm.jobs import JobEnd, parse_show_job

SPEC = dict(name="airflow.d.t", command=("python", "train.py", "--lr", "0.1; rm -rf /"), partition="cedana",
            checkpoint_id="d.t.run1", output="/shared/jobs/x.%j.out", enable=True, try_number=2, heartbeat_seconds=30,
            store="s3://bucket/ckpt", optin_file="/etc/cedana/optin.toml", env={"HF_HOME": "/data/hf"},
            airflow_task=("d", "t", "manual__2026", -1))


def test_the_job_carries_cedana_enable_only_when_in_scope_and_never_the_workers_environment():
    argv = sbatch_argv(JobSpec(**SPEC))
    assert "--export=CEDANA_ENABLE=1" in argv and "--requeue" in argv and "--partition=cedana" in argv
    assert "--open-mode=append" in argv  # a requeued run appends to the same output
    assert any(a.startswith("--signal=B:TERM@") for a in argv)
    assert "--export=NONE" in sbatch_argv(JobSpec(**{**SPEC, "enable": False}))
    assert "--gres=gpu:2" in sbatch_argv(JobSpec(**{**SPEC, "gres": "gpu:2"}))


def test_the_script_runs_the_command_unchanged_under_slurm_job_with_every_argument_quoted(tmp_path):
    script = batch_script(JobSpec(**SPEC))
    assert "AWS_" not in script and "AIRFLOW" not in script  # no credentials, no Airflow settings
    # what bash makes of the exec line: our CLI's argv, the command's arguments intact
    fake = tmp_path / "cedana-airflow"
    fake.write_text("#!/bin/bash\nprintf '%s\\n' \"$@\"\nprintf 'env %s\\n' \"$CEDANA_STORE\" \"$HF_HOME\" \"$CEDANA_OPTIN_FILE\"\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", "-c", script.replace("exec cedana-airflow", f"exec {fake}")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:9] == ["slurm-job", "--id", "d.t.run1", "--try-number", "2", "--heartbeat", "30", "--dag-id", "d"]
    assert out[out.index("--") + 1:out.index("--") + 5] == ["python", "train.py", "--lr", "0.1; rm -rf /"]
    assert out[-3:] == ["env s3://bucket/ckpt", "env /data/hf", "env /etc/cedana/optin.toml"]
    assert "export CEDANA_MIN_SUPERVISOR=" in script  # the node's CLI may be older: it refuses in one line (compat.py)


def test_a_job_on_several_nodes_runs_one_part_per_node_only_when_asked_and_each_part_knows_its_place():
    from cedana_airflow.cli import _slurm_step_part

    once = batch_script(JobSpec(**{**SPEC, "nodes": 2})).splitlines()[-1]
    assert once.startswith("exec cedana-airflow slurm-job")  # as before 0.12.0: the batch host runs it once
    script = batch_script(JobSpec(**{**SPEC, "nodes": 2, "one_part_per_node": True}))
    per_node = script.splitlines()[-1]
    assert per_node.startswith("exec srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL "
                               "cedana-airflow slurm-job")
    # a node whose CLI predates jobs refuses its part in one line, instead of running it as a job of its own
    assert f"export CEDANA_MIN_SUPERVISOR={JOB_FLOOR}\n" in script
    assert f"export CEDANA_MIN_SUPERVISOR={JOB_FLOOR}" not in batch_script(JobSpec(**{**SPEC, "nodes": 2}))
    assert _slurm_step_part({"SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1"}) == (1, 2)
    assert _slurm_step_part({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}) is None  # the batch script, no step
    assert _slurm_step_part({"SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0"}) is None


def test_bad_job_specs_are_one_line_each():
    with pytest.raises(ConfigError, match="no partition"):
        JobSpec(**{**SPEC, "partition": ""})
    with pytest.raises(ConfigError, match="not valid"):
        JobSpec(**{**SPEC, "env": {"BAD NAME": "x"}})
    assert shell_command("echo hi && sleep 1") == ("bash", "-c", "echo hi && sleep 1")


SHOW = ("JobId=42 JobName=airflow.d.t UserId=root(0) JobState={state} Reason={reason} Dependency=(null) "
        "Requeue=1 Restarts={restarts} BatchFlag=1 ExitCode={code} RunTime=00:00:05 Partition=cedana NodeList={nodes}")


def test_scontrol_answers_are_read_and_a_requeued_job_is_not_over_until_it_stays_failed_recorded_answers():
    info = parse_show_job(SHOW.format(state="COMPLETED", reason="None", restarts=1, code="0:0", nodes="node2"))
    assert info and info.done and info.succeeded and info.restarts == 1 and info.nodes == "node2"
    failed = parse_show_job(SHOW.format(state="FAILED", reason="NonZeroExitCode", restarts=0, code="3:0", nodes="node1"))
    assert failed and failed.done and not failed.succeeded
    assert failed.describe() == "Slurm job 42 FAILED (exit code 3:0) on node1, reason NonZeroExitCode"
    lost = parse_show_job(SHOW.format(state="NODE_FAIL", reason="None", restarts=0, code="0:0", nodes="node1"))
    assert lost and lost.may_come_back
    end = JobEnd(settle_seconds=30)
    assert not end.over(lost, 100.0) and not end.over(lost, 129.0)
    back = parse_show_job(SHOW.format(state="PENDING", reason="BeginTime", restarts=1, code="0:0", nodes="(null)"))
    assert back and not end.over(back, 131.0)  # it came back: following goes on
    assert not end.over(lost, 140.0) and end.over(lost, 171.0)  # NODE_FAIL that stays: over
    assert parse_show_job("slurm_load_jobs error: Invalid job id specified") is None


def _client(rc, out="", err=""):
    def run(argv, stdin, timeout):
        if rc == "missing":
            raise FileNotFoundError(argv[0])
        return rc, out, err
    return SlurmClient(run)


def test_sbatch_answers_become_a_job_id_or_one_line_that_says_whether_a_retry_can_help_recorded_answers():
    spec = JobSpec(**SPEC)
    assert _client(0, "1234\n").submit(spec) == "1234"
    assert _client(0, "1234;cluster\n").submit(spec) == "1234"
    with pytest.raises(SlurmRefused, match="Invalid partition name specified.*sinfo -s"):
        _client(1, err="sbatch: error: Batch job submission failed: Invalid partition name specified\n").submit(spec)
    with pytest.raises(SlurmRefused, match="sbatch is not installed on this worker"):
        _client("missing").submit(spec)
    with pytest.raises(SlurmError, match="Unable to contact slurm controller") as e:
        _client(1, err="sbatch: error: Batch job submission failed: Unable to contact slurm controller\n").submit(spec)
    assert not isinstance(e.value, SlurmRefused)  # a controller outage may pass: the try may be retried


ENV = {"SLURM_JOB_PARTITION": "cedana", "CEDANA_ENABLE": "1", "SLURMD_NODENAME": "node2", "SLURM_RESTART_COUNT": "1",
       "SLURM_JOB_ID": "42"}


@pytest.mark.parametrize("env, partitions, protected, why", [
    (ENV, ("cedana",), True, "protected: checkpoint partition cedana, CEDANA_ENABLE=1; node node2, Slurm restart 1"),
    ({**ENV, "CEDANA_ENABLE": ""}, ("cedana",), False, "CEDANA_ENABLE is not set for this job"),
    ({**ENV, "SLURM_JOB_PARTITION": "batch"}, ("cedana",), False, "partition batch is not a checkpoint partition"),
    (ENV, (), False, "names no checkpoint partition"),
    ({"CEDANA_ENABLE": "1"}, ("cedana",), False, "not inside a Slurm batch job"),
])
def test_inside_the_job_only_a_checkpoint_partition_with_cedana_enable_is_protected(env, partitions, protected, why):
    got, reason = protection(env, partitions)
    assert got is protected and why in reason


def test_env_and_sbatch_args_cannot_go_around_the_opt_in_or_bring_the_workers_environment():
    with pytest.raises(ConfigError, match="env= sets CEDANA_ENABLE: the route sets CEDANA_\\* itself"):
        JobSpec(**{**SPEC, "env": {"CEDANA_ENABLE": "1"}})
    for args in (["--export=ALL"], ["--get-user-env"], ["-p", "other"], ["--no-requeue"], ["--output=/tmp/x"]):
        with pytest.raises(ConfigError, match="the Slurm route sets these itself"):
            JobSpec(**{**SPEC, "extra_args": tuple(args)})
    assert "--exclusive" in sbatch_argv(JobSpec(**{**SPEC, "extra_args": ("--exclusive",)}))
    assert "export CUDA_VISIBLE_DEVICES=''" in batch_script(JobSpec(**{**SPEC, "env": {"CUDA_VISIBLE_DEVICES": ""}}))
    assert not any(a.startswith("--signal") for a in sbatch_argv(JobSpec(**{**SPEC, "enable": False})))


def test_the_tasks_settings_reach_the_job_as_cedana_variables_but_never_a_secret(tmp_path):
    from cedana_airflow.config import load_settings
    from cedana_airflow.slurm.batch import job_settings_env

    key = tmp_path / "key"
    settings = load_settings({"keep_checkpoints": 5, "compression": "none", "signing_key_file": str(key),
                              "restore_roots": f"{tmp_path}:/data", "store": "s3://b/p", "node": "worker-1"})
    env = job_settings_env(settings, node_config="/etc/cedana/node.toml")
    # the node key's settings never travel: each compute node signs with its own (issue 48)
    assert env == {"CEDANA_CONFIG": "/etc/cedana/node.toml", "CEDANA_KEEP_CHECKPOINTS": "5", "CEDANA_COMPRESSION": "none",
                   "CEDANA_RESTORE_ROOTS": f"{tmp_path}:/data"}
    node = tmp_path / "node.toml"
    node.write_text("[cedana]\nwork_dir = '/scratch/cedana'\n")
    back = load_settings(environ={**env, "CEDANA_CONFIG": str(node)})  # what the job's CLI reads
    assert (back.keep_checkpoints, back.compression, str(back.work_dir)) == (5, "none", "/scratch/cedana")
    assert job_settings_env(load_settings({"signing_key": "s3cret-0123456789abcdef", "allow_unsigned": True})) == {}
    script = batch_script(JobSpec(**{**SPEC, "settings_env": env}))
    assert "export CEDANA_KEEP_CHECKPOINTS=5" in script and "SIGNING" not in script


def test_heartbeat_auto_reaches_the_job_with_its_history_and_asks_for_a_supervisor_that_knows_it():
    from cedana_airflow.config import FailureHistory, load_settings
    from cedana_airflow.slurm.batch import job_settings_env

    settings = load_settings({"heartbeat_seconds": "auto", "mtbf_hours": 6,
                              "failure_history": FailureHistory(failures=2, exposure_seconds=7200, tries=9,
                                                                scope="queue gpu")})
    env = job_settings_env(settings)
    script = batch_script(JobSpec(**{**SPEC, "heartbeat_seconds": "auto", "settings_env": env}))
    assert "--heartbeat auto" in script and "export CEDANA_MIN_SUPERVISOR=0.8.0" in script
    back = load_settings(environ=env)  # what the job's CLI reads
    assert back.mtbf_hours == 6 and back.failure_history == settings.failure_history
