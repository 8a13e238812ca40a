"""`make demo-fleet`: a node dies under a running task; Airflow retries it on another worker, which resumes
from the checkpoint the dead one took.

A real CeleryExecutor deployment on this machine (fleet_stack.py: PostgreSQL, Redis, SeaweedFS's S3 as the
store, api-server, scheduler, dag processor, two Celery workers standing for nodes worker-a and
worker-b). The cedana_failover DAG's task lands on one worker; after a few heartbeat checkpoints that
worker dies with everything under it (SIGKILL: a node loss, not a polite stop); Airflow notices the
missing task heartbeat, marks the try failed and schedules the retry; the other worker, the only one
left, runs it, restores from the store and finishes. The summary gives the recovery's timings and
compares the final output with an uninterrupted run's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fleet_stack import FleetStack  # noqa: E402

from cedana_airflow.airflow.live_fleet import ApiFleet  # noqa: E402
from cedana_airflow.config import load_settings  # noqa: E402
from cedana_airflow.drill.fleet import FINISHED, RunningTask, wait  # noqa: E402
from cedana_airflow.drill.facts import StoreFacts  # noqa: E402
from cedana_airflow.drill.follow import follow_retry, seen_failed  # noqa: E402
from cedana_airflow.ids import derive_checkpoint_id  # noqa: E402
from cedana_airflow.store import Store, open_store  # noqa: E402
from cedana_airflow.store.transfer import load_manifests  # noqa: E402

TRAIN = HERE.parent / "tests" / "workloads" / "train.py"
TRAIN_ARGS = ["--mb", "40", "--steps", "150", "--step-seconds", "0.1"]
OPTIN = '[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
HEARTBEAT_TIMEOUT = 10


def uninterrupted(args: list[str]) -> str:
    out = subprocess.run([sys.executable, str(TRAIN), *args, "--step-seconds", "0"], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    return out.strip().splitlines()[-1]


def fleet_store(fleet: FleetStack) -> Store:
    """The deployment's store, read from here with its own client (this process's environment is left alone)."""
    import boto3

    e = fleet.store_env
    client = boto3.client("s3", endpoint_url=e["AWS_ENDPOINT_URL"], aws_access_key_id=e["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"], region_name=e["AWS_DEFAULT_REGION"])
    return open_store(e["CEDANA_STORE"], load_settings(environ={}), s3_client=client)


def _log(fleet: FleetStack, dag_id: str, run_id: str, try_number: int) -> str:
    got = fleet.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/train/logs/{try_number}"
                            "?full_content=true")
    return "\n".join(str(e.get("event", "")) for e in got.get("content") or [] if isinstance(e, dict))


def failover(fleet: FleetStack, *, dag_id: str = "cedana_failover", checkpoints_before_kill: int = 3,
             timeout: float = 300) -> dict[str, Any]:
    """Run ``dag_id`` once, kill the worker running try 1 once ``checkpoints_before_kill`` checkpoints
    exist (0: as soon as the workload prints), follow the retry; the figures and both tries' logs."""
    store = fleet_store(fleet)
    run_id = fleet.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None})["dag_run_id"]
    cid = derive_checkpoint_id(dag_id, "train", run_id)
    api = ApiFleet(fleet.base, None, "", "")
    deadline = time.monotonic() + timeout
    task = RunningTask(dag_id=dag_id, task_id="train", run_id=run_id, try_number=1, max_tries=1)

    def ready() -> str | None:
        now = api.now(task)
        if now.state in FINISHED:  # it never reached the kill point: its log says why
            raise RuntimeError(f"try 1 of {dag_id} ended {now.state} before the kill point:\n"
                               f"{_log(fleet, dag_id, run_id, 1)[-4000:]}")
        if now.state != "running" or not now.hostname:
            return None
        if checkpoints_before_kill:
            return now.hostname if len(store.list_seqs(cid)) >= checkpoints_before_kill else None
        return now.hostname if any(line.startswith("step ") for _, line in api.output(task, 1)) else None

    node_a = wait(ready, deadline, 0.2)
    if node_a is None:
        raise RuntimeError(f"try 1 of {dag_id} did not reach the kill point within {timeout:.0f} s\n{fleet.logs()}")
    before = load_manifests(store, cid)
    killed = fleet.kill_worker(node_a)
    t0, killed_at = time.monotonic(), datetime.fromtimestamp(killed, timezone.utc)
    out: dict[str, Any] = {"run_id": run_id, "checkpoint_id": cid, "node_a": node_a, "killed_at": killed_at,
                           "last_checkpoint_seq": before[0].seq if before else None,
                           "lost_work_seconds": round(killed - before[0].created_at.timestamp(), 3) if before else None}
    out["detect_seconds"] = seen_failed(api, task, t0, deadline, 0.5)
    figures = follow_retry(StoreFacts(store, None), api, task, cid, killed_at, deadline, 0.5)
    figures.pop("lost_work_seconds", None)  # a node loss: from the kill, above (follow_retry counts to the last output)
    out.update(figures)
    wait(lambda: True if api.now(task).state in FINISHED else None, deadline, 0.5)  # a fresh start ends too
    out["state"] = api.now(task).state
    out["log_1"], out["log_2"] = _log(fleet, dag_id, run_id, 1), _log(fleet, dag_id, run_id, 2)
    return out


def summary(out: dict[str, Any], expect: str) -> str:
    final = re.findall(r"done digest=\w+", out["log_2"])
    got = final[-1] if final else "(no final output)"
    s = lambda v: "n/a" if v is None else f"{v:.2f} s"  # noqa: E731
    lines = [
        f"checkpoint ID {out['checkpoint_id']}",
        f"taken on node {out['node_a']} (latest seq {out['last_checkpoint_seq']} before the kill)",
        f"restored on node {out.get('to_node') or '(nothing restored)'} (try {out.get('retry_try_number')}, "
        f"worker {out.get('retry_host') or '?'})",
        f"node lost: {out['node_a']} SIGKILLed with its task and workload at {out['killed_at']:%H:%M:%S}",
        f"  Airflow marked try 1 failed after   {s(out.get('detect_seconds'))} (task heartbeat timeout {HEARTBEAT_TIMEOUT} s)",
        f"  the retry started after            {s(out.get('retry_seconds'))}",
        f"  the restore was done after         {s(out.get('restore_done_seconds'))} (it took {s(out.get('restore_seconds'))})",
        f"  first new progress after           {s(out.get('rto_seconds'))} (the RTO)",
        f"  lost work                          {s(out.get('lost_work_seconds'))} (kill time minus the last checkpoint's)",
        f"final output: {got} {'==' if got == expect else '!='} uninterrupted run" + ("" if got == expect else f" ({expect})"),
    ]
    if out.get("problem"):
        lines.append(f"problem: {out['problem']}")
    return "\n".join(lines)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="cedana-fleet-"))
    print(f"starting a two-worker Airflow deployment in {root} (PostgreSQL, Redis, S3, api-server, scheduler, "
          "dag processor, and nodes worker-a and worker-b: each a Celery worker as nobody beside its node agent)...", flush=True)
    expect = uninterrupted(TRAIN_ARGS)
    with FleetStack(root, HERE / "fleet_dags", OPTIN, heartbeat_timeout=HEARTBEAT_TIMEOUT,
                    extra_env={"CEDANA_FLEET_TRAIN_ARGS": " ".join(TRAIN_ARGS)}, worker_user="nobody") as fleet:
        print("up; running cedana_failover and killing the worker that runs it after 3 checkpoints...", flush=True)
        out = failover(fleet)
    print(summary(out, expect))
    print(f"logs of every part: {root}")
    ok = not out.get("problem") and out["log_2"].count("done digest=") == 1 and expect in out["log_2"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
