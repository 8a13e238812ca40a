"""`make demo-slurm`: a Slurm node dies under a checkpointed job; Slurm requeues the job on the other
node, which resumes from the dead one's checkpoint.

A real Slurm cluster on this machine (slurm_cluster.py: munge, slurmctld, two slurmd standing for nodes
node1 and node2, a `cedana` checkpoint partition and a `batch` one). `airflow dags test cedana_slurm`
runs CedanaSlurmOperator, which submits the training workload to the `cedana` partition with
CEDANA_ENABLE=1 (the opt-in list admits it); inside the job our supervisor checkpoints it every
second into a file:// store both nodes see. After a few checkpoints the job's node is SIGKILLed with
its slurmd and every process of the job (a node loss); Slurm notices, requeues the job, runs it on
the other node, and the job restores from the store and finishes. The summary compares the final
output with an uninterrupted run's.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from local_parts import AIRFLOW, WORKER_ENV  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

from cedana_airflow.config import load_settings  # noqa: E402
from cedana_airflow.store import open_store  # noqa: E402
from cedana_airflow.store.transfer import load_manifests  # noqa: E402
TRAIN = REPO / "tests" / "workloads" / "train.py"
TRAIN_ARGS = ["--mb", "32", "--steps", "150", "--step-seconds", "0.2"]
#: Slurm partitions are the node scope; the workload scope admits the node-loss DAG and one unprotected
#: DAG's task (whose partition is not a checkpoint partition), and not the other (no CEDANA_ENABLE).
OPTIN = """[node]
partitions = ["cedana"]
[queue]
queues = ["*"]
[workload]
dags = ["cedana_slurm", "cedana_slurm_ssh"]
tasks = ["cedana_slurm_unprotected.other_partition", "cedana_slurm_bad.*"]
"""


def uninterrupted(args: list[str]) -> str:
    out = subprocess.run([sys.executable, str(TRAIN), *args, "--step-seconds", "0"], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    return out.strip().splitlines()[-1]


def airflow_env(root: Path, cluster: SlurmCluster, airflow_db: Path | None = None, user: str | None = None,
                **extra: str) -> dict[str, str]:
    """An Airflow home in ``root`` (a copy of ``airflow_db``, else migrated here) that submits to ``cluster``.

    ``user``: the Airflow worker (and so every job it submits) runs as that user, from the worker
    environment, with a home of its own under ``root`` (which that user must be able to enter); each
    node's agent (root, started here) checkpoints its jobs into the store, which only the agents write."""
    home = root / f"home-{user}" if user else root
    (home / "airflow").mkdir(parents=True, exist_ok=True)
    (root / "optin.toml").write_text(OPTIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AIRFLOW", "AWS_"))}
    env.update(AIRFLOW_HOME=str(home / "airflow"), AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "tests" / "dags_slurm"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CEDANA__STORE=f"file://{root / 'store'}",
               AIRFLOW__CEDANA__WORK_DIR=str(home / "work"), AIRFLOW__CEDANA__OPTIN_FILE=str(root / "optin.toml"),
               SLURM_CONF=str(cluster.conf), CEDANA_SLURM_TRAIN_ARGS=" ".join(TRAIN_ARGS), PYTHONUNBUFFERED="1")
    if user:
        if not (WORKER_ENV / "bin" / "airflow").exists():
            raise RuntimeError(f"no worker environment in {WORKER_ENV}: run `make worker`")
        agents = {k: v for k, v in env.items() if not k.startswith("AIRFLOW")}
        agents.update(CEDANA_STORE=f"file://{root / 'store'}")
        for node in cluster.nodes:
            cluster.start_agent(node, {**agents, "CEDANA_WORK_DIR": str(root / f"agent-work-{node}")})
        env.pop("AIRFLOW__CEDANA__STORE")  # the agents'
        env.update(HOME=str(home), AIRFLOW__CEDANA__AGENT_SOCKET=str(cluster.agent_sockets),
                   PATH=os.pathsep.join([str(WORKER_ENV / "bin"), "/usr/bin", "/bin"]))
    env.update(extra)
    if airflow_db is not None:
        shutil.copy(airflow_db, home / "airflow" / "airflow.db")
    else:
        subprocess.run([*AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    if user:
        ids = pwd.getpwnam(user)
        for path in (home, *home.rglob("*")):
            os.chown(path, ids.pw_uid, ids.pw_gid)
        home.chmod(0o700)
    return env


def _wait(what: str, check: Any, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"airflow dags test ended before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"no {what} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def node_loss(cluster: SlurmCluster, env: dict[str, str], root: Path, checkpoints_before_kill: int = 3,
              timeout: float = 300, user: str | None = None) -> dict[str, Any]:
    """Run cedana_slurm under `airflow dags test` (as ``user``, from the worker environment: see
    airflow_env); kill the node of its job after a few checkpoints; follow."""
    store = open_store(f"file://{root / 'store'}", load_settings(environ={}))
    log = root / "dags-test.log"
    out: dict[str, Any] = {}
    as_user: dict[str, Any] = {}
    argv = [*AIRFLOW, "dags", "test", "cedana_slurm"]
    if user:
        ids = pwd.getpwnam(user)
        as_user = {"user": ids.pw_uid, "group": ids.pw_gid, "extra_groups": [], "cwd": env["HOME"]}
        argv = [str(WORKER_ENV / "bin" / "airflow"), "dags", "test", "cedana_slurm"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, **as_user)
        try:
            cid = _wait("checkpoint ID", lambda: next((i for i in store.list_ids() if i.startswith("cedana_slurm.train.")),
                                                       None), 120, proc, log)
            _wait(f"{checkpoints_before_kill} checkpoints", lambda: len(store.list_seqs(cid)) >= checkpoints_before_kill,
                  120, proc, log)
            job_id = _wait("running job", lambda: next(iter(cluster.job_ids()), None), 30, proc, log)
            node_a = cluster.job(job_id)["NodeList"]
            before = load_manifests(store, cid)[0]
            killed = cluster.kill_node(node_a)
            t0 = time.monotonic()
            out.update(checkpoint_id=cid, job_id=job_id, node_a=node_a, last_seq=before.seq, taken_on=before.node,
                       lost_work_seconds=round(killed - before.created_at.timestamp(), 2))

            def state() -> dict[str, str]:
                return cluster.job(job_id)

            def seen(cond: Any) -> float:
                _wait("the job to move on", cond, timeout, proc, log)
                return round(time.monotonic() - t0, 1)

            out["node_down_seconds"] = seen(lambda: "down" in cluster.node_state(node_a))
            out["requeued_seconds"] = seen(lambda: int(state().get("Restarts", "0") or 0) >= 1)
            out["running_again_seconds"] = seen(lambda: state().get("JobState") == "RUNNING")
            out["node_b"] = state().get("NodeList", "")
            out["exit_code"] = proc.wait(timeout=timeout)
            out["done_seconds"] = round(time.monotonic() - t0, 1)
        finally:
            if proc.poll() is None:
                proc.kill()
    out["log"] = log.read_text(errors="replace")
    after = load_manifests(store, out["checkpoint_id"])
    out["nodes_in_store"] = sorted({m.node for m in after})
    cluster.start_node(out["node_a"])  # the node comes back (ReturnToService=2) for whatever runs next
    cluster.wait_node(out["node_a"])
    return out


def summary(out: dict[str, Any], expect: str) -> str:
    final = re.findall(r"done digest=\w+", out.get("log", ""))
    got = final[-1] if final else "(no final output)"
    restored = re.search(r"cedana: (?:node agent: )?restored seq (\d+)(?: of try \d+)? \(node (\S+)\) on node (\S+): gap \S+ s, "
                         r"restore (\S+) s", out.get("log", ""))
    lines = [
        f"checkpoint ID {out.get('checkpoint_id')} (Slurm job {out.get('job_id')}, partition cedana, CEDANA_ENABLE=1)",
        f"node lost: {out.get('node_a')} SIGKILLed with its slurmd and the job after checkpoint seq {out.get('last_seq')}",
        f"  Slurm marked the node down after   {out.get('node_down_seconds')} s (SlurmdTimeout)",
        f"  the job was requeued after          {out.get('requeued_seconds')} s",
        f"  it ran again on {out.get('node_b') or '?'} after          {out.get('running_again_seconds')} s",
        f"  the DAG run ended after             {out.get('done_seconds')} s (airflow dags test exit {out.get('exit_code')})",
        ("  restored seq {} (taken on {}) on {} in {} s".format(*restored.groups()) if restored
         else "  nothing was restored"),
        f"  lost work                           {out.get('lost_work_seconds')} s (kill time minus the last checkpoint's)",
        f"final output: {got} {'==' if got == expect else '!='} uninterrupted run" + ("" if got == expect else f" ({expect})"),
    ]
    return "\n".join(lines)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="cedana-slurm-"))
    root.chmod(0o755)  # the worker's user (nobody) enters it: its home, the cluster's config and munge socket
    print(f"starting a Slurm cluster in {root} (munge, slurmctld, slurmd node1 and node2, each node's agent)...",
          flush=True)
    expect = uninterrupted(TRAIN_ARGS)
    with SlurmCluster(root / "slurm") as cluster:
        env = airflow_env(root, cluster, user="nobody")
        print("up; `airflow dags test cedana_slurm` as nobody, killing the job's node after 3 checkpoints...",
              flush=True)
        out = node_loss(cluster, env, root, user="nobody")
    print(summary(out, expect))
    print(f"logs: {root}")
    ok = out.get("exit_code") == 0 and out["log"].count("done digest=") >= 1 and expect in out["log"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
