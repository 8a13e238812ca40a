"""The demo (README's first command): an Airflow task loses its workload mid-run and its retry resumes.

Embedded defaults: an Airflow home with SQLite in .cedana/airflow and a file:// store in .cedana/demo,
both inside this repo. Airflow's own components run it (airflow_stack.py: api-server, scheduler,
dag-processor, triggerer; LocalExecutor), so every try has its task log and the run looks in the UI
as it would in production. Steps:
  1. the cedana_demo_training DAG (dags/) is triggered through the REST API: its task runs a
     training-style job under CheckpointedCommandOperator with a 5 s heartbeat;
  2. after three checkpoints the workload is SIGKILLed (a lost node, an OOM kill, a GPU Xid) and the
     task's work directory is deleted: try 1 fails;
  3. Airflow retries; try 2 restores from the latest checkpoint in the store and finishes the job;
  4. once the scheduler has closed the DAG run (success), the final digest is compared with an
     uninterrupted run's, a summary is printed with the page to open (`make ui` serves the same
     Airflow home afterwards), and every process started is stopped.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from airflow_stack import AIRFLOW, AirflowStack, StackError  # noqa: E402

from cedana_airflow.ids import derive_checkpoint_id  # noqa: E402
from cedana_airflow.units import binary_size  # noqa: E402

DAG_ID, TASK_ID = "cedana_demo_training", "train"
TRAIN = [sys.executable, str(REPO / "tests" / "workloads" / "train.py")]
#: The DAG's workload (dags/cedana_demo_training.py reads CEDANA_DEMO_TRAIN_ARGS; the tests pass a smaller one).
TRAIN_ARGS = ["--mb", "300", "--steps", "90", "--step-seconds", "0.5", "--change-fraction", "0.004"]
SHOW = re.compile(r"(step \d+/\d+|cedana: (?!IN SCOPE|node:|queue:|workload:)|done digest)")


@dataclass(frozen=True)
class Demo:
    """Where the demo lives: the Airflow home, and the store, work dir and opt-in list beside it."""

    home: Path
    root: Path
    train_args: tuple[str, ...] = tuple(TRAIN_ARGS)

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def work(self) -> Path:
        return self.root / "work"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CEDANA_"))}
        env.update(AIRFLOW_HOME=str(self.home), AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
                   AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CEDANA__STORE=f"file://{self.store}",
                   AIRFLOW__CEDANA__WORK_DIR=str(self.work),
                   AIRFLOW__CEDANA__KEEP_CHECKPOINTS="1000",  # the demo counts every checkpoint (default: keep 3)
                   AIRFLOW__CEDANA__OPTIN_FILE=str(self.root / "optin.toml"),
                   CEDANA_DEMO_TRAIN_ARGS=" ".join(self.train_args), PYTHONUNBUFFERED="1")
        return env

    def prepare(self, airflow_db: Path | None = None) -> None:
        """A fresh store and opt-in list; the Airflow database migrated (or copied from ``airflow_db``)."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.home.mkdir(parents=True, exist_ok=True)
        # The operator's opt-in list, as a first week would have it: this machine, the default queue, one DAG.
        (self.root / "optin.toml").write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["default"]\n'
                                              f'[workload]\ndags = ["{DAG_ID}"]\n')
        if airflow_db is not None:
            shutil.copy(airflow_db, self.home / "airflow.db")
            return
        r = subprocess.run([*AIRFLOW, "db", "migrate"], env=self.env(), capture_output=True, text=True)
        if r.returncode:
            raise StackError(f"airflow db migrate failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")

    def manifests(self, run_id: str) -> list[dict[str, Any]]:
        cid = derive_checkpoint_id(DAG_ID, TASK_ID, run_id)
        return [json.loads(p.read_text()) for p in sorted(self.store.glob(f"{cid}/*/manifest.json"))]

    def task_log_file(self, run_id: str, try_number: int) -> Path:
        return self.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / f"task_id={TASK_ID}" / f"attempt={try_number}.log"


class _Tail:
    """Echo the interesting lines of a try's log file as the worker writes them (JSON lines)."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.pos: dict[Path, int] = {}

    def __call__(self, path: Path) -> None:
        try:
            with open(path) as f:
                f.seek(self.pos.get(path, 0))
                text = f.read()
        except OSError:
            return
        done = text.rfind("\n") + 1
        self.pos[path] = self.pos.get(path, 0) + done
        for line in text[:done].splitlines():
            with_event = line
            try:
                with_event = str(json.loads(line).get("event", ""))
            except ValueError:
                pass
            m = SHOW.search(with_event)
            if m:
                self.echo("    " + with_event[m.start():])


def lose_the_node(stack: AirflowStack, demo: Demo, *, checkpoints: int = 3, timeout: float = 600,
                  echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Trigger the DAG; after ``checkpoints`` checkpoints kill the workload and delete its work directory,
    as a lost node would; follow the retry to the end, and the DAG run until the scheduler has closed it
    (stopping the scheduler sooner leaves the run "running" in the UI for good). Returns what happened,
    both tries' logs and the run's state included."""
    t0 = time.monotonic()
    # an earlier demo stopped half-way may have left a run queued in this home: it must not run alongside
    for old in stack.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?state=queued&state=running")["dag_runs"]:
        stack.call("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(old['dag_run_id'])}", {"state": "failed"})
    run_id = stack.trigger(DAG_ID)
    tail, killed = _Tail(echo), False
    deadline = time.monotonic() + timeout
    while True:
        ti = stack.task_instance(DAG_ID, run_id, TASK_ID)
        for n in range(1, int(ti.get("try_number") or 1) + 1):
            tail(demo.task_log_file(run_id, n))
        if ti["state"] in ("success", "failed") and (killed or ti["state"] == "success"):
            break
        if not killed and len(demo.manifests(run_id)) >= checkpoints:
            time.sleep(1.5)  # a little progress after the last checkpoint, which the retry redoes
            pid = demo.manifests(run_id)[-1]["process"]["pid"]
            echo(f"\n== {time.monotonic() - t0:.0f} s in: the workload is SIGKILLed (a lost node, a GPU Xid) and the "
                 "work directory is deleted; the retry reads only the store\n")
            os.kill(pid, signal.SIGKILL)
            shutil.rmtree(demo.work, ignore_errors=True)
            killed = True
        if time.monotonic() > deadline:
            raise StackError(f"the demo run did not finish within {timeout:.0f} s (task {ti['state']}); "
                             f"logs: {demo.home / 'logs'}")
        time.sleep(0.5)
    while (run_state := stack.dag_run(DAG_ID, run_id)["state"]) not in ("success", "failed"):
        if time.monotonic() > deadline:
            raise StackError(f"the scheduler did not close the demo's DAG run within {timeout:.0f} s (task "
                             f"{ti['state']}, run {run_state}); log: {demo.home / 'scheduler.log'}")
        time.sleep(0.5)
    tries = int(ti["try_number"])
    return {"run_id": run_id, "state": ti["state"], "run_state": run_state, "tries": tries, "hostname": ti.get("hostname"),
            "logs": {n: stack.task_log(DAG_ID, run_id, TASK_ID, n) for n in range(1, tries + 1)},
            "restore": stack.xcom(DAG_ID, run_id, TASK_ID, "cedana_restore"),
            "manifests": demo.manifests(run_id), "seconds": round(time.monotonic() - t0, 1)}


def uninterrupted(train_args: tuple[str, ...]) -> str:
    out = subprocess.run([*TRAIN, *train_args, "--step-seconds", "0"], capture_output=True, text=True, check=True)
    return "done " + out.stdout.split()[-1]


def summarize(out: dict[str, Any], expect: str, steps: int) -> tuple[str, bool]:
    """What happened, from try 2's log (as the REST API serves it) and the store; ok when the retry
    restored and finished with the uninterrupted run's output."""
    last = out["logs"].get(out["tries"], "")
    digests = re.findall(r"done digest=\w+", last)
    restored = re.search(r"cedana: restored seq (\d+) of try (\d+) \(node (\S+)\) on node (\S+): gap ([\d.]+) s, "
                         r"restore ([\d.]+) s, checkpoint_id=([^\s,]+)", last)
    # the restore is logged when it happens: the steps after it are the ones try 2 ran
    after = last[restored.end():] if restored else ""
    first_step = re.search(rf"step (\d+)/{steps}", after)
    ms = out["manifests"]
    lines = ["== summary"]
    lines.append(f"tries:               {out['tries']} (try 1 lost its workload; try {out['tries']} {out['state']}; "
                 f"DAG run {out.get('run_state', '-')})")
    if ms:
        stored = [m["stored_bytes"] for m in ms]
        lines.append(f"checkpoints taken:   {len(ms)}; image {image_sizes(ms)}")
        lines.append(f"bytes stored:        {binary_size(sum(stored))} in all (first {binary_size(stored[0])}"
                     + (f", then {binary_size(sum(stored[1:]) / (len(ms) - 1))} each on average)" if len(ms) > 1 else ")"))
        lines.append(f"freeze per heartbeat: {sum(m['freeze_seconds'] for m in ms) / len(ms):.2f} s on average")
    if restored:
        seq, by_try, from_node, node, gap, secs, _ = restored.groups()
        lines.append(f"restore:             seq {seq} (taken by try {by_try} on {from_node}) restored on {node} in {secs} s; "
                     f"gap since that checkpoint {gap} s")
    if first_step:
        lines.append(f"steps saved:         {int(first_step.group(1)) - 1} of {steps} not redone (starting over would "
                     "redo all of them)")
    lines.append(f"final output:        {digests[-1] if digests else '-'}  "
                 f"{'== uninterrupted run' if digests == [expect] else '!= uninterrupted run: ' + expect}")
    ok = (out["state"] == "success" and out.get("run_state") == "success" and restored is not None
          and digests == [expect])
    return "\n".join(lines), ok


def image_sizes(manifests: list[dict[str, Any]]) -> str:
    """Each checkpoint's image size, as the browser shows sizes: runs of seqs with one size together
    ("318 MiB (seq 1-7), 617 MiB (seq 8)"); more than three different runs as a range."""
    runs: list[tuple[str, int, int]] = []  # (size, first seq, last seq)
    for m in manifests:
        size = binary_size(m["image_bytes"])
        if runs and runs[-1][0] == size:
            runs[-1] = (size, runs[-1][1], m["seq"])
        else:
            runs.append((size, m["seq"], m["seq"]))
    if len(runs) == 1:
        return f"{runs[0][0]} each"
    if len(runs) > 3:
        sizes = [m["image_bytes"] for m in manifests]
        return f"{binary_size(min(sizes))} to {binary_size(max(sizes))}"
    return ", ".join(f"{size} (seq {a}{f'-{b}' if b != a else ''})" for size, a, b in runs)


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, through AirflowStack.__exit__, which stops every part."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def main() -> int:
    stop_on_sigterm()
    demo = Demo(home=REPO / ".cedana" / "airflow", root=REPO / ".cedana" / "demo")
    print(f"== Airflow home {demo.home} (SQLite), store file://{demo.store}, opt-in list {demo.root / 'optin.toml'}")
    try:
        demo.prepare()
        print("== starting Airflow: api-server, scheduler, dag-processor, triggerer (LocalExecutor)")
        with AirflowStack(demo.env(), demo.home, DAG_ID) as stack:
            print(f"== triggering {DAG_ID} (try 1: a 5 s heartbeat)")
            out = lose_the_node(stack, demo)
            page = stack.ti_url(DAG_ID, out["run_id"], TASK_ID, out["tries"]).split(stack.base, 1)[1]
    except StackError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    text, ok = summarize(out, uninterrupted(demo.train_args), int(demo.train_args[demo.train_args.index("--steps") + 1]))
    print("\n" + text)
    print(f"run time:            {out['seconds']} s (the Airflow components are stopped)")
    print("\n== see it in the Airflow UI: `make ui`, then open")
    print(f"   {page}   (under the printed address: the two tries; try {out['tries']}'s log has the "
          "'cedana: restored ...' line; its Checkpoints tab lists what each try took)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
