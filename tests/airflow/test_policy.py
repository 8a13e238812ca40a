"""The cluster policy through Airflow's own DagBag: cedana: tag rules become import errors naming the rule,
the task and the fix; DAGs without cedana: tags load untouched, even with a broken opt-in file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

# one worker runs this module's tests, in order: its module fixture is made once (tests/harness.py)
pytestmark = pytest.mark.xdist_group("policy")

pytest.importorskip("airflow")

FOLDER = REPO / "tests" / "dags_policy"
PARSE = ("import json\nfrom airflow.dag_processing.dagbag import DagBag\n"
         "b = DagBag(dag_folder=%r)\n"
         "print(json.dumps({'dags': sorted(b.dags), 'errors': {k.rsplit('/', 1)[-1]: v for k, v in b.import_errors.items()}}))")


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-policy")
    bad = home / "optin.toml"
    bad.write_text("[node\nthis is not toml")  # must not matter to any DAG here
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CEDANA__OPTIN_FILE=str(bad))
    r = subprocess.run([sys.executable, "-c", PARSE % str(FOLDER)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_compliant_and_untagged_dags_load(parsed):
    assert parsed["dags"] == ["compliant", "every_route_ok", "realtime_ok", "untagged"]


@pytest.mark.parametrize("file, says", [
    ("no_effects.py", "DAG no_effects has cedana:opt-in but no cedana:effects tag. Add cedana:effects=none"),
    ("external_no_key.py", "task external_no_key.train: the DAG declares cedana:effects=external, so a restored task "
                           "may repeat an effect. Give it idempotency_key="),
    ("unknown_tag.py", "unknown tag 'cedana:optin'. Did you mean 'cedana:opt-in'?"),
    ("realtime_no_gap.py", "task realtime_no_gap.train: the DAG declares cedana:realtime, so state restored after a long "
                           "gap is stale. Give it max_restore_gap="),
])
def test_each_broken_rule_is_the_dags_import_error(parsed, file, says):
    assert says in parsed["errors"][file], parsed["errors"]
    assert len(parsed["errors"]) == 5


@pytest.mark.parametrize("task_id", ["on_a_worker", "in_a_pod", "as_a_slurm_job", "as_a_function"])
@pytest.mark.parametrize("rule", ["cedana:effects=external, so a restored task may repeat an effect",
                                  "cedana:realtime, so state restored after a long gap is stale",
                                  "cedana:license=matlab, so a restore after the lease expired holds a dead license"])
def test_every_route_is_held_to_the_dag_tag_rules(parsed, task_id, rule):
    """The command operator, the Kubernetes pod operator, the Slurm operator and @task.checkpointed alike."""
    assert f"task every_route.{task_id}: the DAG declares {rule}" in parsed["errors"]["every_route.py"]
