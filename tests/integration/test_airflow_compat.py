"""The wheel on the older Airflow minors we support (3.1 and 3.2; the rest of the suite runs 3.3): installed
non-editable into a copy of each minor's venv (`make compat`, from the sets pinned in tests/compat/), away
from the checkout, then what a user does first: every module imports, the shipped DAGs parse, Airflow
lists the provider and the plugin, and one real task (`airflow dags test`) is checkpointed, its workload
killed, and the retry resumes from the checkpoint with the uninterrupted run's result."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, TRAIN_ARGS, airflow_env, link_site_packages
from test_airflow_e2e import assert_resumed, file_manifest, run_dag_killing_try_1

pytestmark = pytest.mark.integration

MINORS = sorted(p.stem.removeprefix("airflow-") for p in (REPO / "tests" / "compat").glob("airflow-*.txt"))
ROOT = Path(os.environ.get("CEDANA_COMPAT_ROOT", "/opt/cedana-airflow"))


@pytest.fixture(scope="module", params=[pytest.param(v, marks=pytest.mark.xdist_group(f"compat-{v}"), id=v)
                                        for v in MINORS])
def compat(request, wheel, tmp_path_factory) -> tuple[Path, dict[str, str], str]:
    """A copy of Airflow ``version``'s venv with the wheel installed: its python, an environment whose
    AIRFLOW_HOME has a migrated SQLite database, and the version."""
    version = request.param
    base = ROOT / f"compat-{version}"
    if not (base / "bin" / "python").exists():
        pytest.skip(f"no Airflow {version} venv at {base}: run `make compat` (make test does)")
    tmp = tmp_path_factory.mktemp(f"compat-{version}")
    venv = tmp / "venv"
    subprocess.run([str(base / "bin" / "python"), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    [site] = (base / "lib").glob("python3.*/site-packages")
    target = venv / "lib" / site.parent.name / "site-packages"
    link_site_packages(site, target)
    python = venv / "bin" / "python"
    env = airflow_env(tmp, None)  # the run's database is 3.3's: this minor migrates its own, below
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        str(wheel)], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(python), "-m", "airflow", "db", "migrate"], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return python, env, version


def _run(compat, *args: str) -> str:
    python, env, version = compat
    r = subprocess.run([str(python), *args], cwd=env["AIRFLOW_HOME"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"Airflow {version}: {args}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_every_module_imports_and_the_shipped_dags_parse(compat):
    code = """
import importlib, json, os, pkgutil, sys, airflow, cedana_airflow as p
from cedana_airflow.airflow_compat import dag_bag
names = [m.name for m in pkgutil.walk_packages(p.__path__, 'cedana_airflow.')
         if not m.name.endswith('__main__') and m.name != 'cedana_airflow.coop.torch']  # needs the workload's torch
for n in names:
    importlib.import_module(n)
bag = dag_bag(dag_folder=sys.argv[1], include_examples=False)
# what the browser reads and writes of Airflow's own tables (browser/app.py: a try's state and times, the
# audit row of a deletion): there is no REST route for the one in the api-server's process, none to write
# the other
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancehistory import TaskInstanceHistory
orm = [f"{m.__name__}.{c}" for m in (TaskInstance, TaskInstanceHistory)
       for c in ("dag_id", "run_id", "task_id", "map_index", "try_number", "state", "start_date", "end_date")
       if not hasattr(m, c)] + [f"Log.{c}" for c in ("event", "owner", "dag_id", "extra") if not hasattr(Log, c)]
print(json.dumps({"airflow": airflow.__version__, "where": p.__file__, "modules": len(names),
                  "dags": sorted(bag.dag_ids), "errors": bag.import_errors, "orm_missing": orm}))
"""
    got = json.loads(_run(compat, "-c", code, str(REPO / "dags")).strip().splitlines()[-1])
    assert got["airflow"] == compat[2] and "site-packages" in got["where"], got
    assert not got["where"].startswith(str(REPO)), got
    assert got["errors"] == {}, got["errors"]
    assert got["orm_missing"] == [], got["orm_missing"]
    assert {p.stem for p in (REPO / "dags").glob("*.py")} <= set(got["dags"]), got


def test_airflow_lists_the_provider_and_the_plugin(compat):
    providers = json.loads(_run(compat, "-m", "airflow", "providers", "list", "-o", "json"))
    assert any(p["package_name"] == "cedana-airflow" for p in providers), providers
    [cedana] = [p for p in json.loads(_run(compat, "-m", "airflow", "plugins", "-o", "json")) if p["name"] == "cedana"]
    assert [a["url_prefix"] for a in cedana["fastapi_apps"]] == ["/cedana"], cedana
    errors = _run(compat, "-c", "from airflow import plugins_manager as m; import json\n"
                                "if hasattr(m, 'get_import_errors'): print(json.dumps(m.get_import_errors()))\n"
                                "else: m.ensure_plugins_loaded(); print(json.dumps(m.import_errors))  # 3.1")
    assert json.loads(errors.strip().splitlines()[-1]) == {}, errors


def test_a_killed_task_resumes_from_its_checkpoint_on_the_retry(compat, tmp_path):
    python, env, version = compat
    env = {**env, "AIRFLOW__CEDANA__STORE": f"file://{tmp_path / 'store'}",
           "AIRFLOW__CEDANA__WORK_DIR": str(tmp_path / "work"), "CEDANA_E2E_TRAIN_ARGS": " ".join(TRAIN_ARGS)}
    text = run_dag_killing_try_1(env, tmp_path, file_manifest(tmp_path / "store", "cedana_e2e.train."),
                                 airflow=[str(python), "-P", "-m", "airflow"])
    assert_resumed(text, tries_known=False)  # 3.1 and 3.2 have no task state store
