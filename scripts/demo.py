"""The demo (README's first command): an Airflow task loses its workload mid-run and its retry resumes.

Embedded defaults: an Airflow home with SQLite in .cedana/airflow and a file:// store in .cedana/demo,
both inside this repo. Steps:
  1. `airflow dags test cedana_demo_training` (dags/): the task runs a training-style job under
     CheckpointedCommandOperator with a 5 s heartbeat;
  2. after three checkpoints the workload is SIGKILLed (a lost node, an OOM kill, a GPU Xid) and the
     task's work directory is deleted: try 1 fails;
  3. try 2 restores from the latest checkpoint in the store and finishes the job;
  4. the final digest is compared with an uninterrupted run's, and a summary is printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOME = REPO / ".cedana" / "airflow"
DEMO = REPO / ".cedana" / "demo"
STORE = DEMO / "store"
WORK = DEMO / "work"
TRAIN = [sys.executable, str(REPO / "tests" / "workloads" / "train.py"), "--mb", "300", "--steps", "90",
         "--change-fraction", "0.004"]
SHOW = re.compile(r"(step \d+/\d+|cedana:|checkpoint saved|restored checkpoint_id|done digest|Task failed|DagRun Finished|\[DAG TEST\] (starting|end))")


def airflow_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CEDANA_"))}
    env.update(AIRFLOW_HOME=str(HOME), AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CEDANA__STORE=f"file://{STORE}",
               AIRFLOW__CEDANA__WORK_DIR=str(WORK),
               AIRFLOW__CEDANA__KEEP_CHECKPOINTS="1000",  # the demo counts every checkpoint (default: keep 3)
               AIRFLOW__CEDANA__OPTIN_FILE=str(DEMO / "optin.toml"),
               PYTHONUNBUFFERED="1")
    return env


def manifests() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(STORE.glob("cedana_demo_training.train.*/*/manifest.json"))]


def main() -> int:
    shutil.rmtree(DEMO, ignore_errors=True)
    DEMO.mkdir(parents=True)
    env = airflow_env()
    # The operator's opt-in list, as a first week would have it: this machine, the default queue, one DAG.
    (DEMO / "optin.toml").write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["default"]\n'
                                     '[workload]\ndags = ["cedana_demo_training"]\n')
    print(f"== Airflow home {HOME} (SQLite), store file://{STORE}, opt-in list {DEMO / 'optin.toml'}")
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("== airflow dags test cedana_demo_training (try 1: a 5 s heartbeat)")
    log = DEMO / "dags-test.log"
    returncode = run_and_lose_the_node(env, log)
    return summarize(log, returncode)


def run_and_lose_the_node(env: dict[str, str], log: Path) -> int:
    """Run the DAG, echoing the interesting lines; after three checkpoints, kill the workload and delete
    its work directory, as a lost node would. Returns ``airflow dags test``'s exit code."""
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "airflow", "dags", "test", "cedana_demo_training"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed = False
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            line = proc.stdout.readline()
            if line:
                out.write(line)
                m = SHOW.search(line)
                if m:
                    print("   ", line[line.index(m.group(0)):].split(" [airflow.", 1)[0].split(" [cedana_airflow.", 1)[0].rstrip())
                continue
            if proc.poll() is not None:
                return proc.returncode
            if not killed and len(manifests()) >= 3:
                time.sleep(1.5)  # a little progress after the last checkpoint, which the retry redoes
                pid = manifests()[-1]["process"]["pid"]
                print(f"\n== {time.monotonic() - t0:.0f} s in: the workload is SIGKILLed (a lost node, a GPU Xid) and the "
                      "work directory is deleted; the retry reads only the store\n")
                os.kill(pid, signal.SIGKILL)
                shutil.rmtree(WORK, ignore_errors=True)
                killed = True
            time.sleep(0.05)


def summarize(log: Path, returncode: int) -> int:
    """Print what happened, from the log and the store; 0 when the retry restored and finished with the
    uninterrupted run's output."""
    text = log.read_text()
    expect = "done " + subprocess.run([*TRAIN, "--step-seconds", "0"], capture_output=True, text=True,
                                      check=True).stdout.split()[-1]
    digests = re.findall(r"done digest=\w+", text)
    restored = re.search(r"cedana: restored checkpoint_id=\S+ seq=(\d+) \(taken by try (\d+) on node (\S+)\) on node (\S+); "
                         r"gap ([\d.]+) s, restore ([\d.]+) s", text)
    after = text[text.index("restored checkpoint_id"):] if "restored checkpoint_id" in text else ""
    first_step = re.search(r"step (\d+)/90", after)
    saved = re.findall(r"stored_bytes=(\d+)", text)
    ms = manifests()
    print("\n== summary")
    print(f"checkpoints taken:   {len(ms)} ({len(saved)} saves logged); image {ms[-1]['image_bytes'] / 1e6:,.0f} MB each"
          if ms else "checkpoints taken:   none")
    if ms:
        print(f"bytes stored:        {sum(m['stored_bytes'] for m in ms) / 1e6:,.0f} MB in all (first "
              f"{ms[0]['stored_bytes'] / 1e6:,.0f} MB, then {sum(m['stored_bytes'] for m in ms[1:]) / max(1, len(ms) - 1) / 1e6:,.1f} MB each)")
        print(f"freeze per heartbeat: {sum(m['freeze_seconds'] for m in ms) / len(ms):.2f} s on average")
    if restored:
        seq, by_try, from_node, node, gap, secs = restored.groups()
        print(f"restore:             seq {seq} (taken by try {by_try} on {from_node}) restored on {node} in {secs} s; "
              f"gap since that checkpoint {gap} s")
    if first_step:
        print(f"steps saved:         {int(first_step.group(1)) - 1} of 90 not redone (starting over would redo all of them)")
    print(f"final output:        {digests[-1] if digests else '-'}  "
          f"{'== uninterrupted run' if digests == [expect] else '!= uninterrupted run: ' + expect}")
    print(f"full log:            {log}")
    return 0 if returncode == 0 and restored is not None and digests == [expect] else 1


if __name__ == "__main__":
    sys.exit(main())
