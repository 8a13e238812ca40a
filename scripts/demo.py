"""The demo: a training-style job loses its node mid-run and resumes on another from the store.

Runs on the embedded defaults (a file:// store under .cedana/ in this repo). Steps:
  1. node-a runs the job under `cedana-airflow run` with a heartbeat;
  2. after two checkpoints, node-a "dies": supervisor and workload get SIGKILL, its work dir is deleted;
  3. node-b runs `cedana-airflow restore`: the job continues from the latest checkpoint;
  4. the final digest is compared with an uninterrupted run's, and a summary is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / ".cedana" / "demo"
STORE = DEMO / "store"
TRAIN = [sys.executable, str(REPO / "tests" / "workloads" / "train.py"),
         "--mb", "300", "--steps", "60", "--step-seconds", "0.25", "--change-fraction", "0.004"]
ID = "demo-train"


def cli(*args: str, node: str, **kw):
    # Retention off for the demo (default: keep 3), so the summary can count every checkpoint taken.
    env = dict(os.environ, CEDANA_STORE=f"file://{STORE}", CEDANA_NODE=node, CEDANA_KEEP_CHECKPOINTS="1000",
               CEDANA_WORK_DIR=str(DEMO / f"work-{node}"), PYTHONUNBUFFERED="1")
    return [sys.executable, "-m", "cedana_airflow", *args], env


def manifests() -> list[dict]:
    d = STORE / ID
    return [json.loads(p.read_text()) for p in sorted(d.glob("*/manifest.json"))] if d.exists() else []


def main() -> int:
    shutil.rmtree(DEMO, ignore_errors=True)
    DEMO.mkdir(parents=True)
    print("== node-a: start the job with a 3 s heartbeat")
    cmd, env = cli("run", "--id", ID, "--heartbeat", "3", "--", *TRAIN, node="node-a")
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)
    while len(manifests()) < 2:
        if proc.poll() is not None:
            print(f"demo: the job ended before two checkpoints (exit {proc.returncode})")
            return 1
        time.sleep(0.2)
    time.sleep(1.0)  # some progress after the last checkpoint, which the restore will redo
    lost_after = time.monotonic() - t_start
    pid = manifests()[-1]["process"]["pid"]
    print(f"\n== node-a dies after {lost_after:.1f} s: SIGKILL to supervisor and workload, work dir deleted")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        os.kill(pid, signal.SIGKILL)  # its watchdog may have been quicker
    except ProcessLookupError:
        pass
    shutil.rmtree(DEMO / "work-node-a", ignore_errors=True)
    before = manifests()

    print("\n== node-b: cedana-airflow restore (the retry)")
    cmd, env = cli("restore", "--id", ID, "--heartbeat", "3", node="node-b")
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(r.stdout)
    resumed_total = time.monotonic() - t0
    out = r.stdout.splitlines()
    first_step = int(out[0].split()[1].split("/")[0]) if out and out[0].startswith("step") else 1

    expect = subprocess.run([*TRAIN[:-4], "--step-seconds", "0", "--change-fraction", "0.004"],
                            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    ok = r.returncode == 0 and out and out[-1] == expect
    ms = manifests()
    latest = before[-1]
    print("\n== summary")
    print(f"checkpoints taken:   {len(ms)} (node-a: {len(before)}, node-b: {len(ms) - len(before)})")
    print(f"image bytes:         {latest['image_bytes'] / 1e6:,.0f} MB per checkpoint")
    print(f"bytes stored:        {sum(m['stored_bytes'] for m in ms) / 1e6:,.0f} MB in all "
          f"(first {ms[0]['stored_bytes'] / 1e6:,.0f} MB, then {sum(m['stored_bytes'] for m in ms[1:]) / max(1, len(ms) - 1) / 1e6:,.1f} MB each on average)")
    print(f"freeze per heartbeat: {sum(m['freeze_seconds'] for m in ms) / len(ms):.2f} s on average")
    print(f"restored from:       seq {latest['seq']} taken on {latest['node']}; first step after restore: {first_step}")
    print(f"steps saved:         {first_step - 1} of 60 not redone (starting over would redo all of them)")
    print(f"time after restore:  {resumed_total:.1f} s to finish (node-a had run {lost_after:.1f} s)")
    print(f"final output:        {out[-1] if out else '-'}  {'== uninterrupted run' if ok else '!= uninterrupted run: ' + expect}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
