"""Real PyTorch jobs, as people write them, through Airflow's scheduler with retries (the test run's shared
Airflow stack; each test's DAGs are its own: tests/stack_dags/dags_torch.py).

Transparent, DEFAULT settings: DataLoader(num_workers=2) workers reading a dataset directory, a log and a
checkpoint directory outside the working directory, a progress bar on stderr. Try 1 is killed after a few
heartbeats, try 2 runs under another node name on a /tmp without try 1's multiprocessing directories, and the
trained parameters equal an uninterrupted run's. No restore_roots, no signing key: the defaults must be enough.

Cooperative (issue 35): two-rank DDP under torchrun writes its own checkpoints (cedana_airflow.coop.torch);
killed, its retry on another node resumes and ends with an uninterrupted run's parameters. On a worker
without CRIU, mode auto protects a cooperative workload and mode transparent runs unprotected, saying why.

heartbeat = "auto" (issue 36): a task killed twice chooses its interval in each try from its measured cost and
the failures Airflow's API reports for its queue, and the last try resumes to an uninterrupted run's output."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import OPTIN_ALL, REPO, descendants, drop_pymp, pymp_dirs_held, wait_gone
from shared_stack import SharedStack, give_to_nobody

pytestmark = pytest.mark.integration

SHAPE = REPO / "tests" / "integration" / "shapes" / "torch_loader.py"
#: 36 steps of 0.4 s: a heartbeat of the whole torch tree lands once the log is open and well before the end,
#: on a machine busy with other tests too (the shapes test's torch job steps at 0.4 s for the same reason)
ARGS = ["--epochs", "3", "--step-seconds", "0.4"]
#: Long enough that no try ends before the test has seen its two checkpoints, however loaded the machine
#: (a try that restores late must not find the work done); the interval's bounds are the DAG's: 1 s to 6 s.
#: Try 3 (the second restore) goes on without the sleeps: only its digest is checked.
AUTO_ARGS = ["--mb", "20", "--steps", "400", "--step-seconds", "0.1", "--fast-after-restores", "2"]
AUTO_MAX = 6


def _dataset(root: Path, n: int = 192) -> None:
    rng = np.random.default_rng(7)
    root.mkdir(parents=True)
    for i in range(n):
        x = rng.standard_normal(16).astype(np.float32)
        np.save(root / f"{i:04d}.npy", np.append(x, np.float32(x[:4].sum() - x[4:8].mean())))


def _uninterrupted(root: Path) -> str:
    out = subprocess.run([sys.executable, str(SHAPE), "--data", str(root / "data"), "--log", str(root / "ref.log"),
                          "--ckpt", str(root / "ref-ckpts"), "--epochs", "3", "--step-seconds", "0"],
                         capture_output=True, text=True, check=True, cwd=root).stdout
    return re.findall(r"done digest=\w+", out)[-1]


def test_a_pytorch_dataloader_job_resumes_on_another_node_with_default_settings(airflow_stack, tmp_path):
    """As uid nobody (Airflow's run_as_user): each try's workload is its node's agent's (issue 49); the
    retry's node has none of try 1's pymp-* folders, and the agent makes them, as nobody's."""
    stack = airflow_stack
    root = stack.user_dir("torch")
    _dataset(root / "data")
    for d in ("job", "logs"):
        (root / d).mkdir(parents=True)
    (root / "node").write_text("node-a\n")
    give_to_nobody(root)
    dag_id = stack.add_dag("torch", "dags_torch:torch_dag", root=str(root), store=f"file://{tmp_path / 'store'}",
                           args=ARGS, agents=stack.agents)
    run_id = stack.trigger(dag_id)
    # Killed once a heartbeat has caught it training (its log open): a checkpoint from before the log
    # existed would leave try 1's lines in it (a file created after a checkpoint is not rolled back).
    deadline = time.monotonic() + 240
    while not (ms := [m for p in sorted(stack.agent_store.glob(f"{dag_id}.train.*/*/manifest.json"))
                      if (m := json.loads(p.read_text()))["captured"]]):
        assert time.monotonic() < deadline, stack.logs()
        assert stack.task_instance(dag_id, run_id, "train")["state"] != "failed", stack.logs()
        time.sleep(0.2)
    pid = ms[0]["process"]["pid"]
    assert [c["path"] for c in ms[0]["captured"]] == [str(root / "logs" / "train.log")]  # outside the cwd
    (root / "node").write_text("node-b\n")  # the retry parses the DAG file again: another node
    held = pymp_dirs_held(descendants(pid))  # the workload's own multiprocessing dirs, read while it lives
    os.kill(pid, signal.SIGKILL)  # the node dies under try 1
    assert wait_gone(pid, 10)
    drop_pymp(held)  # the new node's /tmp is fresh

    deadline = time.monotonic() + 300
    while (ti := stack.task_instance(dag_id, run_id, "train"))["state"] not in ("success", "failed"):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(1)
    log1 = stack.task_log(dag_id, run_id, "train", 1)
    log2 = stack.task_log(dag_id, run_id, "train", 2)
    assert ti["state"] == "success" and ti["try_number"] == 2, log2[-4000:]

    assert re.search(r"cedana \(node agent\): restored seq \d+ of try 1 \(node node-a\) on node node-b: gap [\d.]+ s, "
                     rf"restore [\d.]+ s, checkpoint_id={dag_id}\.train\.[^\s,]+, mode ", log2), log2[-4000:]
    assert "store=the node agent's (" in log1 and "store=the node agent's (" in log2
    assert "checkpoint refused" not in log2, log2[-4000:]  # the newest restored: not one put aside for a folder
    assert "start-up" in log1 and "start-up" not in log2  # try 2 did not import torch or build its loader again
    assert "a restore would refuse" not in log1 + log2 and "refused" not in log2
    # The parameters trained across the kill equal an uninterrupted run's, and every step was logged once.
    assert re.findall(r"done digest=\w+", log2) == [_uninterrupted(root)]
    steps = [ln.split(" loss")[0] for ln in (root / "logs" / "train.log").read_text().splitlines()]
    assert steps == [ln.split(" loss")[0] for ln in (root / "ref.log").read_text().splitlines()]
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == ["epoch-0.pt", "epoch-1.pt", "epoch-2.pt"]


def _coop_manifests(store: Path, dag_id: str, task: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(store.glob(f"{dag_id}.{task}.*/*/manifest.json"))]


def test_cooperative_ddp_training_resumes_on_another_node_and_auto_protects_a_worker_without_criu(airflow_stack,
                                                                                                 tmp_path):
    """train_ddp runs as nobody (Airflow's run_as_user) through each node's agent (0.8.4): its ranks write their
    state into folders of nobody's, the agent stores it for nobody, and the retry's agent puts it back as
    nobody's and starts torchrun again as nobody."""
    stack, store = airflow_stack, tmp_path / "store"
    coop = stack.user_dir("coop")  # nobody's: the nobody task parses the DAG file again, which reads node
    (coop / "node").write_text("node-a\n")
    dag_id = stack.add_dag("coop", "dags_torch:coop_dag", root=str(coop), store=f"file://{store}", agents=stack.agents)

    def stored(task: str) -> Path:
        return stack.agent_store if task == "train_ddp" else store
    run_id = stack.trigger(dag_id)
    deadline = time.monotonic() + 240
    running = ["train_ddp", "auto_no_criu"]
    while running:  # each is killed once two of its checkpoints are in: the node dies under it
        assert time.monotonic() < deadline, stack.logs()
        for task in list(running):
            assert stack.task_instance(dag_id, run_id, task)["state"] not in ("failed", "success"), stack.logs()
            if len(ms := _coop_manifests(stored(task), dag_id, task)) >= 2:
                if task == "train_ddp":  # (not before: its try 1, slower to start as nobody, would read it too)
                    (coop / "node").write_text("node-b\n")  # its retry parses the DAG file again: another node
                pid = ms[-1]["process"]["pid"]
                os.kill(pid, signal.SIGKILL)  # the tree's init: every rank goes with it
                assert wait_gone(pid, 10)
                running.remove(task)
        time.sleep(0.2)

    deadline = time.monotonic() + 300
    tis = {}
    for task in ("train_ddp", "auto_no_criu", "transparent_no_criu"):
        while (ti := stack.task_instance(dag_id, run_id, task))["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(1)
        tis[task] = ti
    logs = {(task, n): stack.task_log(dag_id, run_id, task, n)
            for task, ti in tis.items() for n in range(1, ti["try_number"] + 1)}

    # Two ranks under torchrun: each wrote its part, committed together; the retry on node-b resumed from
    # the latest and trained to the parameters of an uninterrupted run.
    ddp = logs["train_ddp", 2]
    assert tis["train_ddp"]["state"] == "success" and tis["train_ddp"]["try_number"] == 2, ddp[-4000:]
    assert re.search(r"cedana[^:]*: restored seq \d+ of try 1 \(node node-a\) on node node-b", ddp), ddp[:6000]
    assert re.search(r"resumed at step [1-9]\d*", ddp), ddp[-4000:]
    assert "cedana (node agent): restored seq " in ddp and "store=the node agent's (" in logs["train_ddp", 1], ddp[-4000:]
    ms = _coop_manifests(stored("train_ddp"), dag_id, "train_ddp")
    assert {m["engine"] for m in ms} == {"cooperative"} and {m["format_version"] for m in ms} == {4}
    assert {m["caller"]["uid"] for m in ms} == {65534}  # nobody's, taken by the agent
    assert all(m["cooperative"]["ranks"] == 2 and [f["path"] for f in m["cooperative"]["files"]]
               == ["rank-0.pt", "rank-1.pt"] and m["files"] == [] for m in ms)
    reference = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                str(REPO / "tests" / "workloads" / "ddp_coop.py"), "--steps", "80", "--step-seconds",
                                "0"], capture_output=True, text=True, check=True, timeout=300).stdout
    assert re.findall(r"done digest=\w+", ddp) == re.findall(r"done digest=\w+", reference), ddp[-4000:]

    # mode auto, no CRIU on the worker: cooperative checkpoints (the workload declared it can), resumed.
    auto1, auto2 = logs["auto_no_criu", 1], logs["auto_no_criu", 2]
    assert "CRIU cannot run here (CRIU not found at /nonexistent/criu" in auto1, auto1[-4000:]
    assert "cooperative checkpoints, as the workload declared it can write them" in auto1, auto1[-4000:]
    assert tis["auto_no_criu"]["state"] == "success" and re.search(r"rank 0 resumed at step [1-9]", auto2), auto2[-4000:]
    counter = subprocess.run([sys.executable, str(REPO / "tests" / "workloads" / "coop_counter.py"), "--steps", "150",
                              "--step-seconds", "0"], capture_output=True, text=True, check=True).stdout
    assert re.findall(r"done total=\d+", auto2) == re.findall(r"done total=\d+", counter)

    # mode transparent on that worker: it runs, unprotected, and one line says why.
    plain = logs["transparent_no_criu", 1]
    assert tis["transparent_no_criu"]["state"] == "success" and "ran to its end" in plain, plain[-4000:]
    assert plain.count("this task runs unprotected (mode = transparent): CRIU not found at /nonexistent/criu") == 1
    assert not list(store.glob(f"{dag_id}.transparent_no_criu.*"))


def test_heartbeat_auto_chooses_from_what_it_measured_and_what_airflow_saw_fail(airflow_stack, tmp_path):
    """As uid nobody (Airflow's run_as_user), through node-a's agent: the caller reads Airflow's history, the
    agent measures and checkpoints (issue 49)."""
    stack, store = airflow_stack, airflow_stack.agent_store
    queue = f"auto_gpu_{tmp_path.name}"  # its own queue: no other test's failures in its history
    dag_id = stack.add_dag("auto", "dags_torch:auto_dag", store=f"file://{tmp_path / 'store'}",
                           work_dir=str(stack.user_dir("work")), queue=queue, args=AUTO_ARGS, heartbeat_max=AUTO_MAX,
                           agent=stack.agent("node-a"))
    run_id = stack.trigger(dag_id)
    for try_number in (1, 2):  # the workload is killed (SIGKILL, as the OOM killer does) after two of its checkpoints
        deadline = time.monotonic() + 240
        while len(ms := [m for m in _auto_manifests(store, dag_id) if m["try_number"] == try_number]) < 2:
            assert time.monotonic() < deadline, stack.logs()
            assert stack.task_instance(dag_id, run_id, "train")["state"] not in ("failed", "success"), stack.logs()
            time.sleep(0.2)
        pid = ms[-1]["process"]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone(pid, 10)
    deadline = time.monotonic() + 300
    while (ti := stack.task_instance(dag_id, run_id, "train"))["state"] not in ("success", "failed"):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(1)
    logs = [stack.task_log(dag_id, run_id, "train", n) for n in (1, 2, 3)]
    assert ti["state"] == "success" and ti["try_number"] == 3, logs[2][-4000:]

    def chosen(log: str) -> list[str]:
        return re.findall(r"(heartbeat \S+.*?); expected work lost per failure", log)

    # Try 1: nothing has failed on its queue yet: the longest interval, from an estimate, then measured.
    first = chosen(logs[0])
    assert first and all(c.startswith(f"heartbeat {AUTO_MAX}s (heartbeat_max_seconds)") for c in first), logs[0][-4000:]
    assert "no failures seen (0 failures in 1 tries" in first[0] and "estimated:" in first[0], first
    assert any("measured on 1 checkpoint" in c for c in first), first
    # Tries 2 and 3 read Airflow's history of the queue: one failure, then two (each a SIGKILL the task recorded).
    for log, failures in ((logs[1], "1 failure in 2 tries"), (logs[2], "2 failures in 3 tries")):
        lines = chosen(log)
        assert lines and failures in lines[0] and f"on queue {queue} over 30 days" in lines[0], lines
        got = re.match(r"heartbeat ([\d.]+)s( \(heartbeat_min_seconds\))?: checkpoint costs [\d.]+ s \(measured on "
                       r"\d+ earlier checkpoint\(s\) of this ID\), failures every ~", lines[0])
        assert got and 1 <= float(got.group(1)) < AUTO_MAX, lines  # shorter than with no failure seen, within the bounds
    assert re.search(r"cedana[^:]*: restored seq \d+ of try 2", logs[2]), logs[2][-4000:]
    reference = subprocess.run([sys.executable, str(REPO / "tests" / "workloads" / "train.py"), *AUTO_ARGS, "--step-seconds", "0"],
                               capture_output=True, text=True, check=True).stdout
    assert re.findall(r"done digest=\w+", logs[2]) == re.findall(r"done digest=\w+", reference)
    # The browser's and the CLI's figures: what the last try chose.
    [cid] = {m["checkpoint_id"] for m in _auto_manifests(store, dag_id)}
    env = {**stack.env, "CEDANA_STORE": f"file://{store}", "PYTHONPATH": str(stack.dags)}  # the factories, as Airflow finds them
    listed = json.loads(subprocess.run([sys.executable, "-m", "cedana_airflow", "checkpoints", cid, "--json"], env=env,
                                       capture_output=True, text=True, check=True).stdout)
    hb = (listed if isinstance(listed, list) else listed["ids"])[0]["heartbeat"]
    # Learned durations: no expected_duration declared, so the short-task rule reads the task's past runs
    # from Airflow (all three tries of the one successful run) and refuses it against a 1 h minimum.
    optin = tmp_path / "optin-short.toml"
    optin.write_text(OPTIN_ALL + "[rules]\nmin_expected_seconds = 3600\n")
    explained = subprocess.run([sys.executable, "-m", "cedana_airflow", "explain", dag_id, "train", "--dags-folder",
                                str(stack.dags), "--optin-file", str(optin), "--json"], env=env, capture_output=True,
                               text=True)
    assert explained.returncode == 1, explained.stderr  # out of scope (0.10.0)
    said = json.loads(explained.stdout)
    assert said["expected_source"] == "learned: the median of its last 1 successful run", said
    # the run's own length: tries 1 and 2 each ran past two checkpoints (the first interval is AUTO_MAX), try 3 ran fast
    assert said["expected_seconds"] >= AUTO_MAX and not said["in_scope"]
    assert any(r.startswith("rule short-task: expected ") and "(learned: the median" in r for r in said["reasons"])
    assert hb["auto"] and 1 <= hb["interval_seconds"] < AUTO_MAX and hb["mtbf_seconds"] > 0
    assert hb["expected_loss_seconds"] == pytest.approx(hb["interval_seconds"] / 2 + hb["commit_seconds"], abs=0.01)


def _auto_manifests(store: Path, dag_id: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(store.glob(f"{dag_id}.train.*/*/manifest.json"))]


def test_a_transparent_torchrun_job_and_a_serving_worker_resume_through_airflows_retry(airflow_stack, tmp_path):
    """Issue 47, through Airflow: a two-rank gloo DDP task with no checkpoint code and a serving worker, both
    in transparent mode with default settings, lose their node; Airflow's retries resume them on node-b. The
    job ends with an uninterrupted run's parameters; the server answers with the count it had."""
    import urllib.request

    from conftest import _free_port

    stack, store, root = airflow_stack, tmp_path / "store", tmp_path / "talk"
    root.mkdir()
    (root / "node").write_text("node-a\n")
    port = _free_port()

    def get(path: str = "/") -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode().strip()

    dag_id = stack.add_dag("talk", "dags_torch:talk_dag", root=str(root), store=f"file://{store}", port=port)
    run_id = stack.trigger(dag_id)
    deadline = time.monotonic() + 240
    hits: list[str] = []
    base: dict[str, int] = {}  # checkpoints before it was in its loop: two more are taken after
    running = ["ddp", "serve"]
    while running:
        assert time.monotonic() < deadline, stack.logs()
        for task in list(running):
            assert stack.task_instance(dag_id, run_id, task)["state"] not in ("failed", "success"), stack.logs()
            if task == "serve" and not hits:
                try:
                    hits = [get() for _ in range(3)]
                except OSError:
                    continue  # not listening yet
            if task == "ddp" and not re.search(r"^.*step 3/150", stack.task_log_files(dag_id, 1), re.M):
                continue  # still starting up (torch, rendezvous)
            base.setdefault(task, len(_coop_manifests(store, dag_id, task)))
            ms = _coop_manifests(store, dag_id, task)
            if len(ms) >= base[task] + 2:
                (root / "node").write_text("node-b\n")
                pid = ms[-1]["process"]["pid"]
                os.kill(pid, signal.SIGKILL)  # the node dies under it
                assert wait_gone(pid, 10)
                running.remove(task)
        time.sleep(0.2)
    assert hits == ["hits 1", "hits 2", "hits 3"]

    deadline = time.monotonic() + 300
    while True:  # try 2 of the server restores it: it answers with its count
        assert time.monotonic() < deadline, stack.logs()
        try:
            answer = get()
            break
        except OSError:
            time.sleep(0.5)
    assert answer == "hits 4"
    assert get("/quit") == "bye after 4"
    tis = {}
    for task in ("ddp", "serve"):
        while (ti := stack.task_instance(dag_id, run_id, task))["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(1)
        tis[task] = ti
    ddp, serve = stack.task_log(dag_id, run_id, "ddp", 2), stack.task_log(dag_id, run_id, "serve", 2)
    for task, log in (("ddp", ddp), ("serve", serve)):
        assert tis[task]["state"] == "success" and tis[task]["try_number"] == 2, log[-4000:]
        assert re.search(r"cedana[^:]*: restored seq \d+ of try 1 \(node node-a\) on node node-b", log), log[-4000:]
        assert "heartbeat failed" not in stack.task_log(dag_id, run_id, task, 1)
    assert not re.search(r"\bserving$", serve, re.M) and "served 4" in serve  # restored, not started again
    reference = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                str(REPO / "tests" / "workloads" / "ddp_transparent.py"), "--steps", "150",
                                "--step-seconds", "0"], capture_output=True, text=True, check=True, timeout=300).stdout
    assert re.findall(r"done digest=\w+", ddp) == re.findall(r"done digest=\w+", reference), ddp[-4000:]
    assert not re.search(r"^step 1/150$", ddp, re.M)  # went on from its checkpoint
