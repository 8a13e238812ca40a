"""DAGs for the Slurm route tests (tests/integration/test_slurm_route.py) and `make demo-slurm`.

The local cluster (scripts/slurm_cluster.py) runs its jobs on this machine, so the jobs run our CLI
from this interpreter; a real cluster's nodes have cedana-airflow on their PATH (the default cli).
"""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CedanaSlurmOperator

TRAIN = str(Path(__file__).resolve().parent.parent / "workloads" / "train.py")
ARGS = os.environ.get("CEDANA_SLURM_TRAIN_ARGS", "--mb 32 --steps 100 --step-seconds 0.2").split()
CLI = (sys.executable, "-m", "cedana_airflow")
# deferrable: followed in the triggerer (Airflow's [operators] default_deferrable is False here)
FAST = {"cli": CLI, "poll_interval": timedelta(seconds=1), "heartbeat": timedelta(seconds=1),
        "env": {"PYTHONUNBUFFERED": "1"}, "deferrable": True}
START = datetime(2026, 1, 1)

# The node-loss scenario: in a checkpoint partition and in scope, so the job carries CEDANA_ENABLE=1.
with DAG("cedana_slurm", schedule=None, start_date=START, catchup=False,
         default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
    CedanaSlurmOperator(task_id="train", command=[sys.executable, TRAIN, *ARGS], partition="cedana",
                        requeue_settle=timedelta(seconds=60), **FAST)

# Unprotected, each for its own reason: another partition; out of the list's workload scope (no CEDANA_ENABLE).
with DAG("cedana_slurm_unprotected", schedule=None, start_date=START, catchup=False):
    CedanaSlurmOperator(task_id="other_partition", command=[sys.executable, TRAIN, "--mb", "8", "--steps", "5"],
                        partition="batch", **FAST)
    CedanaSlurmOperator(task_id="no_enable", command=[sys.executable, TRAIN, "--mb", "8", "--steps", "5"],
                        partition="cedana", **FAST)
    # followed in the worker instead of the triggerer: the job's lines reach the task log as they come
    CedanaSlurmOperator(task_id="followed_in_the_worker", command=[sys.executable, TRAIN, "--mb", "8", "--steps", "5"],
                        partition="batch", **{**FAST, "deferrable": False})

# Bad input: each is one line, and the task fails without using its retries.
with DAG("cedana_slurm_bad", schedule=None, start_date=START, catchup=False,
         default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}):
    CedanaSlurmOperator(task_id="unknown_partition", command="true", partition="nosuch", **FAST)
    CedanaSlurmOperator(task_id="no_ssh_connection", command="true", partition="cedana", ssh_conn_id="nosuch_login",
                        job_dir="/shared/cedana-jobs", **FAST)
    CedanaSlurmOperator(task_id="failing_job", command="echo about to fail; exit 3", partition="batch",
                        retries=0, **FAST)

# Submitted through a login node over SSH: the test starts a throwaway sshd on loopback
# (scripts/ssh_login.py) and gives its connection as AIRFLOW_CONN_CEDANA_LOGIN; the worker has no
# SLURM_CONF, so only the login node can reach the cluster.
JOB_DIR = os.environ.get("CEDANA_SLURM_JOB_DIR", "/shared/cedana-jobs")
with DAG("cedana_slurm_ssh", schedule=None, start_date=START, catchup=False,
         default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
    CedanaSlurmOperator(task_id="train", command=[sys.executable, TRAIN, "--mb", "16", "--steps", "12",
                                                  "--step-seconds", "0.3"],
                        partition="cedana", ssh_conn_id="cedana_login", job_dir=JOB_DIR, **FAST)
    # the same login node, but the connection pins another host key: refused, and not retried
    CedanaSlurmOperator(task_id="wrong_host_key", command="true", partition="cedana",
                        ssh_conn_id="cedana_login_wrong_key", job_dir=JOB_DIR, **FAST)
