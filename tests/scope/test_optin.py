"""The opt-in list (optin.py), the DAG tags (tags.py) and `cedana-airflow explain`: decisions and their reasons."""

from __future__ import annotations

import json

import pytest

from cedana_airflow.errors import ConfigError
from cedana_airflow.scope.optin import OptInList, Where, decide, load_optin
from cedana_airflow.scope.tags import DagTags, TaskDecl, check_dag, parse_tags
from conftest import cli, cli_env

FIRST_WEEK = """
[node]
hostnames = ["gpu-test-01"]
labels = { "cedana.ai/enabled" = "true" }
defaults = { heartbeat_seconds = 300 }

[queue]
queues = ["cedana"]
pools = ["gpu_pool"]

[workload]
dags = ["train_*"]
tasks = ["nightly.finetune"]
defaults = { heartbeat_seconds = 600, keep_checkpoints = 2 }
"""


@pytest.fixture
def first_week(tmp_path):
    p = tmp_path / "optin.toml"
    p.write_text(FIRST_WEEK)
    return p


@pytest.mark.parametrize("where, in_scope, says", [
    (Where("train_llm", "fit", "gpu-test-01", {}, "cedana"), True, "node: gpu-test-01 admitted by hostname pattern 'gpu-test-01'"),
    (Where("train_llm", "fit", "k8s-node-9", {"cedana.ai/enabled": "true"}, "cedana"), True, "admitted by its labels cedana.ai/enabled=true"),
    (Where("nightly", "finetune", "gpu-test-01", {}, "default", "gpu_pool"), True, "task nightly.finetune admitted by task pattern"),
    (Where("nightly", "report", "gpu-test-01", {}, "cedana"), False, "workload: nightly.report refused"),
    (Where("train_llm", "fit", "gpu-prod-07", {"cedana.ai/enabled": "false"}, "cedana"), False, "node: gpu-prod-07 refused"),
    (Where("train_llm", "fit", "gpu-test-01", {}, "default", "default_pool"), False, "queue: queue default / pool default_pool refused"),
])
def test_a_task_is_in_scope_only_when_node_queue_and_workload_all_admit_it(first_week, where, in_scope, says):
    d = decide(load_optin(first_week), where)
    assert d.in_scope is in_scope
    assert len(d.reasons) == 3 and any(says in r for r in d.reasons), d.reasons


def test_scope_defaults_merge_node_then_queue_then_workload(first_week):
    d = decide(load_optin(first_week), Where("train_x", "t", "gpu-test-01", {}, "cedana"))
    assert d.defaults == {"heartbeat_seconds": 600, "keep_checkpoints": 2}


def test_an_empty_or_missing_list_admits_nothing_and_a_missing_scope_refuses(tmp_path):
    assert not decide(load_optin(None), Where("d", "t", "n")).in_scope
    assert "nothing is checkpointed" in decide(OptInList(), Where("d", "t")).reasons[0]
    p = tmp_path / "optin.toml"
    p.write_text('[node]\nhostnames = ["*"]\n[workload]\ndags = ["*"]\n')
    d = decide(load_optin(p), Where("d", "t", "any", {}, "q"))
    assert not d.in_scope and "the list has no [queue] scope" in d.reasons[1]


def test_a_yaml_list_reads_the_same(tmp_path):
    p = tmp_path / "optin.yaml"
    p.write_text("node: {hostnames: ['gpu-*']}\nqueue: {queues: [cedana]}\nworkload: {dags: [train]}\n")
    assert decide(load_optin(p), Where("train", "t", "gpu-3", {}, "cedana")).in_scope


@pytest.mark.parametrize("text, says", [
    ("[node\nhostnames = 1", "is not valid TOML"),
    ('[nodes]\nhostnames = ["x"]', "nodes: Extra inputs are not permitted"),
    ('[workload]\ndefaults = { heartbeat = 5 }', "unknown setting(s) heartbeat in defaults"),
])
def test_a_malformed_list_is_one_line_naming_the_file_and_the_fix(tmp_path, text, says):
    p = tmp_path / "optin.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_optin(p)
    assert says in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_unknown_cedana_tags_are_refused_with_a_did_you_mean():
    assert parse_tags(["team:ml", "cedana:opt-in", "cedana:effects=none"]) == DagTags(opt_in=True, effects="none")
    with pytest.raises(ConfigError, match="unknown tag 'cedana:optin'. Did you mean 'cedana:opt-in'?"):
        parse_tags(["cedana:optin"])
    with pytest.raises(ConfigError, match="contradict"):
        parse_tags(["cedana:effects=none", "cedana:effects=external"])
    assert parse_tags(["cedana:license=matlab"]).licenses == ("matlab",)


def test_dag_rules_name_the_task_and_the_fix():
    assert check_dag("d", DagTags(), [TaskDecl("t")]) == []  # not opted in: untouched
    [v] = check_dag("d", DagTags(opt_in=True), [])
    assert v.rule == "effects-declared" and "Add cedana:effects=none" in v.message
    tasks = [TaskDecl("ok", idempotency_key="{{ run_id }}", max_restore_gap_seconds=60, lease_seconds=3600), TaskDecl("bare")]
    rules = {(v.rule, v.task_id) for v in check_dag("d", DagTags(True, "external", True, ("matlab",)), tasks)}
    assert rules == {("idempotency-key", "bare"), ("realtime-gap", "bare"), ("license-lease", "bare")}


def test_explain_prints_the_decision_and_every_reason(tmp_path, first_week):
    env = cli_env(tmp_path, "gpu-test-01", "w", CEDANA_OPTIN_FILE=str(first_week))
    r = cli("explain", "train_llm", "fit", "--queue", "cedana", env=env)
    assert r.returncode == 0, r.stderr
    assert "train_llm.fit on node gpu-test-01, queue cedana, pool default_pool: IN SCOPE: checkpointed" in r.stdout
    assert "settings from the list: heartbeat_seconds=600, keep_checkpoints=2" in r.stdout
    assert "  heartbeat: every 10m (from the opt-in list's defaults)" in r.stdout.splitlines()  # issue 51
    beat = json.loads(cli("explain", "train_llm", "fit", "--queue", "cedana", "--json", env=env).stdout)
    assert (beat["heartbeat_seconds"], beat["heartbeat"]) == (600, "every 10m (from the opt-in list's defaults)")
    # out of scope: exit 1, so a script can test it (0.10.0); nothing said of a heartbeat it will not have
    out_of_scope = cli("explain", "train_llm", "fit", "--node", "cpu-1", "--json", env=env)
    out = json.loads(out_of_scope.stdout)
    assert out_of_scope.returncode == 1 and out["heartbeat"] == "" and out["heartbeat_seconds"] is None
    assert out["in_scope"] is False and out["reasons"][0].startswith("node: cpu-1 refused")
    assert "queue: queue default / pool default_pool refused" in out["reasons"][1]
    bad = cli("explain", "d", "t", "--optin-file", str(tmp_path / "nope.toml"), env=env)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("ConfigError: opt-in file") and "does not exist" in bad.stderr


def test_policies_apply_by_filter_after_the_scope_defaults(tmp_path, first_week):
    p = tmp_path / "optin.toml"
    p.write_text(first_week.read_text() + """
[[policies]]
name = "big-memory"
trigger = { memory_above_bytes = 8000000000 }
filter = { dags = ["train_*"], tags = ["team:ml"] }

[[policies]]
name = "drain"
trigger = { signal = "SIGTERM" }
action = "none"

[[policies]]
name = "hourly"
trigger = { schedule_seconds = 3600 }
filter = { queues = ["other"] }
""")
    optin = load_optin(p)
    d = decide(optin, Where("train_llm", "fit", "gpu-test-01", {}, "cedana", tags=("team:ml",)))
    assert d.in_scope and d.defaults == {"heartbeat_seconds": 600, "keep_checkpoints": 2,
                                         "checkpoint_above_bytes": 8000000000, "checkpoint_on_term": False}
    assert any("policy 'big-memory' applies" in r for r in d.reasons)
    untagged = decide(optin, Where("train_llm", "fit", "gpu-test-01", {}, "cedana"))
    assert "checkpoint_above_bytes" not in untagged.defaults
    bad = tmp_path / "bad.toml"
    bad.write_text('[[policies]]\nname = "x"\ntrigger = { memory_above_bytes = 1, schedule_seconds = 2 }\n')
    with pytest.raises(ConfigError, match="a trigger is exactly one of"):
        load_optin(bad)


def test_a_memory_threshold_checkpoints_a_growing_workload_once_as_it_crosses(tmp_path):
    import sys

    from conftest import manifests

    grow = ("import time, numpy as np\n"
            "a = np.ones(20 << 17)\n"                  # 20 MB
            "print('small', flush=True); time.sleep(2)\n"
            "b = np.ones(300 << 17)\n"                 # +300 MB: crosses 150 MB
            "print('big', flush=True); time.sleep(3)\n"
            "print('done', flush=True)\n")
    env = cli_env(tmp_path, "n", "w", CEDANA_CHECKPOINT_ABOVE_BYTES=str(150 << 20))  # no heartbeat at all
    r = cli("run", "--id", "grows", "--", sys.executable, "-c", grow, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["small", "big", "done"], r.stderr
    assert r.stderr.count("memory above threshold") == 1, r.stderr
    [m] = manifests(tmp_path / "store", "grows")
    # taken as the growth crossed the threshold, not before it (the 20 MB phase): the image can be a little under
    # 150 MiB, since resident memory counts shared library pages that a dump does not write (seen: 148 MiB)
    assert m["image_bytes"] > 100 << 20


@pytest.mark.parametrize("where, in_scope, says", [
    (Where("train_x", "t", "gpu-test-01", {}, "cedana", expected_seconds=120), False,
     "rule short-task: expected 120 s (declared) is below min_expected_seconds 600 s"),
    (Where("train_x", "t", "gpu-test-01", {}, "cedana", expected_seconds=7200), True,
     "rule short-task: expected 7200 s (declared), at least min_expected_seconds 600 s"),
    (Where("train_x", "t", "gpu-test-01", {}, "cedana", expected_seconds=90,
           expected_source="learned: the median of its last 4 successful runs"), False,
     "rule short-task: expected 90 s (learned: the median of its last 4 successful runs) is below"),
    (Where("train_x", "t", "gpu-test-01", {}, "cedana"), True, "rule short-task: not applied: no expected_duration"),
    (Where("train_x", "t", "gpu-test-01", {}, "cedana", job_server=True), False,
     "rule job-server: queue cedana is not in job_server_queues ['emr']"),
    (Where("train_x", "t", "gpu-test-01", {}, "emr", job_server=True), True, "is marked for job-server tasks"),
    (Where("train_x", "t", "gpu-test-01", {}, "cedana", gpu=True, nvidia=False), False,
     "rule gpu: node gpu-test-01 has no NVIDIA driver"),
    (Where("train_x", "t", "gpu-test-01", {}, "cedana", gpu=True, nvidia=True), True, None),
])
def test_eligibility_rules_keep_off_what_a_checkpoint_cannot_protect(tmp_path, where, in_scope, says):
    p = tmp_path / "optin.toml"
    p.write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
                 '[rules]\nmin_expected_seconds = 600\njob_server_queues = ["emr"]\n')
    d = decide(load_optin(p), where)
    assert d.in_scope is in_scope, d.reasons
    assert says is None or any(says in r for r in d.reasons), d.reasons


def test_explain_reads_the_task_from_a_real_dag_folder(tmp_path, first_week):
    pytest.importorskip("airflow")
    from conftest import REPO

    env = cli_env(tmp_path, "gpu-test-01", "w", CEDANA_OPTIN_FILE=str(first_week), AIRFLOW_HOME=str(tmp_path / "af"),
                  AIRFLOW__CORE__LOAD_EXAMPLES="False")
    r = cli("explain", "cedana_demo_training", "train", "--dags-folder", str(REPO / "dags"), env=env)
    assert r.returncode == 1, r.stderr  # out of scope (0.10.0)
    assert "queue default, pool default_pool: OUT OF SCOPE" in r.stdout  # the list admits queue cedana only
    assert "workload: cedana_demo_training.train refused" in r.stdout
    (tmp_path / "all.toml").write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n')
    admitted = cli("explain", "cedana_demo_training", "train", "--dags-folder", str(REPO / "dags"), "--optin-file",
                   str(tmp_path / "all.toml"), env=env)
    assert admitted.returncode == 0, admitted.stderr  # the DAG's own heartbeat, and where it came from
    assert "  heartbeat: every 5s (from the operator's heartbeat argument)" in admitted.stdout.splitlines()
    missing = cli("explain", "nope", "train", "--dags-folder", str(REPO / "dags"), env=env)
    assert missing.returncode == 2 and "DAG 'nope' is not in" in missing.stderr


def test_a_kubernetes_node_with_the_default_label_is_admitted_and_labels_come_from_the_environment(tmp_path):
    from cedana_airflow.scope.optin import parse_labels

    p = tmp_path / "optin.toml"
    p.write_text('[node]\nhostnames = ["gpu-test-01"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n')
    labels = parse_labels("cedana.ai/enabled=true, topology.kubernetes.io/zone=us-east-1a")
    assert decide(load_optin(p), Where("d", "t", "ip-10-0-3-7", labels, "q")).in_scope
    assert not decide(load_optin(p), Where("d", "t", "ip-10-0-3-7", {}, "q")).in_scope  # no labels: hostnames only
    with pytest.raises(ConfigError, match="node label 'zone' is not KEY=VALUE"):
        parse_labels("zone")


def test_require_dag_opt_in_admits_only_dags_whose_author_declared_them(tmp_path):
    p = tmp_path / "optin.toml"
    p.write_text('[node]\nhostnames = ["*"]\n[queue]\nqueues = ["*"]\n[workload]\ndags = ["*"]\n'
                 '[rules]\nrequire_dag_opt_in = true\n')
    optin = load_optin(p)
    tagged = decide(optin, Where("d", "t", "n", {}, "q", tags=("cedana:opt-in", "cedana:effects=none")))
    assert tagged.in_scope and "rule dag-opt-in: the DAG is tagged cedana:opt-in" in tagged.reasons
    untagged = decide(optin, Where("d", "t", "n", {}, "q"))
    assert not untagged.in_scope and any("not tagged cedana:opt-in" in r for r in untagged.reasons)


def test_slurm_partitions_are_a_node_scope_and_explain_says_what_the_job_needs(tmp_path):
    p = tmp_path / "optin.toml"
    p.write_text(FIRST_WEEK.replace('hostnames = ["gpu-test-01"]', 'hostnames = ["gpu-test-01"]\npartitions = ["cedana*"]'))
    optin = load_optin(p)
    inside = decide(optin, Where("train_llm", "fit", queue="cedana", partition="cedana-a100"))
    assert inside.in_scope and "Slurm partition cedana-a100 admitted by partition pattern 'cedana*'" in inside.reasons[0]
    assert "CEDANA_ENABLE=1" in inside.reasons[0]
    other = decide(optin, Where("train_llm", "fit", "gpu-test-01", queue="cedana", partition="batch"))
    assert not other.in_scope and "Slurm partition batch refused" in other.reasons[0]  # a partition, not the host
    env = cli_env(tmp_path, "login-1", "w", CEDANA_OPTIN_FILE=str(p))
    r = cli("explain", "train_llm", "fit", "--queue", "cedana", "--partition", "batch", "--json", env=env)
    assert r.returncode == 1, r.stderr  # out of scope
    assert json.loads(r.stdout)["reasons"][0].startswith("node: Slurm partition batch refused: not in partitions ['cedana*']")
