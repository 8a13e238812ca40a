"""docs/first-dag.md, followed as written: its opt-in list and `explain` admit its DAG; its DAG, on the
test run's Airflow stack, runs its job, which the page's `pkill` kills after a checkpoint; the retry
resumes it and ends as an uninterrupted run; the checkpoint is in the UI's pages and its JSON API, and
in the CLI's listing. Only names change: the DAG ID (the stack's tests must not share one), the job's
path and the store's (the stack's)."""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import REPO
from shared_stack import SharedStack

from cedana_airflow.config import Settings
from cedana_airflow.ids import derive_checkpoint_id

pytestmark = pytest.mark.integration

PAGE = REPO / "docs" / "first-dag.md"
DAG_ID, TASK_ID, JOB = "my_first_checkpointed_dag", "count", "/opt/jobs/count.py"
STORE = "file:///var/lib/cedana-airflow/store"


def blocks() -> dict[str, str]:
    """The page's marked blocks: ``<!-- file: NAME -->`` or ``<!-- run: NAME -->`` before a fenced block."""
    found = re.findall(r"<!-- (?:file|run): (\S+) -->\n```\w*\n(.*?)```", PAGE.read_text(), re.S)
    return dict(found)


def _said(page: str, after: str) -> str:
    """The page's ```text block that follows ``after``."""
    return re.search(re.escape(after) + r".*?```text\n(.*?)```", page, re.S).group(1)  # type: ignore[union-attr]


def test_the_page_s_settings_are_real_options_and_its_list_and_explain_admit_its_dag(tmp_path):
    b = blocks()
    assert set(b) == {"airflow.cfg", "optin.toml", "count.py", "dag.py", "explain", "fail", "checkpoints"}
    cfg = configparser.ConfigParser()
    cfg.read_string(b["airflow.cfg"])
    assert set(cfg["cedana"]) <= set(Settings.model_fields) | {"optin_file"}, cfg["cedana"]
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{DAG_ID}.py").write_text(b["dag.py"])
    (tmp_path / "optin.toml").write_text(b["optin.toml"])
    argv = shlex.split(b["explain"].replace("~/airflow/dags", str(dags))
                       .replace("/etc/cedana-airflow/optin.toml", str(tmp_path / "optin.toml")))
    assert argv[0] == "cedana-airflow"
    r = subprocess.run([sys.executable, "-m", "cedana_airflow", *argv[1:], "--node", "gpu-1"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == _said(PAGE.read_text(), "<!-- run: explain -->"), r.stdout  # what the page says it prints


def _uninterrupted(job: Path) -> str:
    """The job's last line run straight through, its sleeps skipped."""
    code = f"import time; time.sleep = lambda s: None; exec(open({str(job)!r}).read())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()[-1]


def _page_html(stack: SharedStack, path: str) -> str:
    req = urllib.request.Request(stack.base + path, headers={"Authorization": f"Bearer {stack.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def test_a_newcomer_s_first_dag_fails_resumes_and_shows_its_checkpoint(tmp_path, airflow_stack):
    b, page, stack = blocks(), PAGE.read_text(), airflow_stack
    job = tmp_path / "jobs" / "count.py"
    job.parent.mkdir()
    job.write_text(b["count.py"])
    dag_id = f"first_dag_{re.sub(r'[^a-z0-9]', '', tmp_path.name)}_{int(time.time() * 1000) % 10**8}"
    dag_file = stack.dags / f"{dag_id}.py"
    text = b["dag.py"].replace(f'"{DAG_ID}"', f'"{dag_id}"').replace(JOB, str(job))
    assert text.count(dag_id) == 1 and str(job) in text
    dag_file.with_suffix(".tmp").write_text(text)
    dag_file.with_suffix(".tmp").rename(dag_file)
    stack.serve(dag_id, dag_file)
    store = Path(stack.env["AIRFLOW__CEDANA__STORE"].removeprefix("file://"))

    run_id = stack.trigger(dag_id)
    cid = derive_checkpoint_id(dag_id, TASK_ID, run_id)
    deadline = time.monotonic() + 180
    while not list(store.glob(f"{cid}/*/manifest.json")):  # "once a checkpoint line is there"
        ti = stack.task_instance(dag_id, run_id, TASK_ID)
        assert ti["state"] not in ("failed", "success") and time.monotonic() < deadline, (ti, stack.logs())
        time.sleep(0.5)
    log1 = stack.task_log(dag_id, run_id, TASK_ID, 1)
    assert re.search(r"^cedana: checkpoint seq=1: froze [\d.]+ s; image .* stored \(\d+ of \d+ chunks new\) in [\d.]+ s$",
                     log1, re.M), log1[-3000:]
    assert "heartbeat every 10s (from the operator's heartbeat argument)" in log1, log1[-3000:]
    # every line we write carries one prefix (the job's own output aside)
    ours = [x for x in log1.splitlines() if "checkpoint_id=" in x or x.startswith(("workload ", "checkpoint seq"))]
    assert ours and all(x.startswith("cedana: ") for x in ours), ours

    fail = shlex.split(b["fail"].replace(JOB, str(job)))
    assert fail[:3] == ["pkill", "-KILL", "-f"]
    subprocess.run(fail, check=True, timeout=30)

    deadline = time.monotonic() + 240
    while (ti := stack.task_instance(dag_id, run_id, TASK_ID))["state"] not in ("success", "failed") or \
            ti["try_number"] < 2:
        assert time.monotonic() < deadline, (ti, stack.logs())
        time.sleep(1)
    log2 = stack.task_log(dag_id, run_id, TASK_ID, 2)
    assert ti["state"] == "success" and ti["try_number"] == 2, log2[-3000:]
    assert "the workload was killed by SIGKILL" in stack.task_log(dag_id, run_id, TASK_ID, 1)
    said = _said(page, "<!-- run: fail -->")
    line = (r"cedana: restored seq \d+ of try 1 \(node \S+\) on node \S+: gap [\d.]+ s, restore [\d.]+ s, "
            r"checkpoint_id=(\S+), mode \w+")
    assert re.fullmatch(line, said.splitlines()[0])  # the page's restore line has the log's shape
    assert re.findall(rf"^{line}$", log2, re.M) == [cid], log2[-3000:]  # said once, naming this run's ID
    assert "starting from step 1" not in log2  # it went on from where it was
    first_step = int(re.search(r"^step (\d+) total", log2, re.M).group(1))  # type: ignore[union-attr]
    assert first_step > 1
    assert said.splitlines()[-1] == _uninterrupted(job)  # the page's "done total 9455" is the uninterrupted run's
    assert re.findall(r"^done total \d+$", log2, re.M) == [_uninterrupted(job)]

    # Browse > Checkpoints: the ID on the fleet page, its page with its checkpoints and the restore
    fleet = _page_html(stack, f"/cedana/?q={quote(dag_id)}")
    assert f"ids/{cid}" in fleet.replace("%2B", "+"), fleet[-2000:]
    detail = stack.call("GET", f"/cedana/api/v1/checkpoints/{quote(cid, safe='')}")
    assert detail["checkpoints"] and detail["restore_count"] == 1, detail
    assert detail["heartbeat"]["in_force"] == "every 10s (from the operator's heartbeat argument)", detail["heartbeat"]
    html = _page_html(stack, f"/cedana/ids/{quote(cid, safe='')}")
    assert "In force: every 10s (from the operator&#39;s heartbeat argument)." in html or \
        "In force: every 10s (from the operator's heartbeat argument)." in html, html[:3000]

    # the CLI reads the same store
    *assigned, command, verb = shlex.split(b["checkpoints"].replace(STORE, f"file://{store}"))
    assert command == "cedana-airflow" and verb == "checkpoints"
    env = {k: v for k, v in stack.env.items() if not k.startswith("CEDANA_")}
    env.update(a.split("=", 1) for a in assigned)
    listing = subprocess.run([sys.executable, "-m", "cedana_airflow", verb], env=env, capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0 and cid in listing.stdout, listing.stderr[-2000:]
