"""heartbeat = auto's arithmetic (run/cadence.py): Young/Daly, the failure rate with its prior, the bounds,
and when a new interval is taken and said."""

from __future__ import annotations

import math

import pytest

from cedana_airflow.config import FailureHistory, Settings
from cedana_airflow.run.cadence import (Cadence, duration_text, estimated_cost, mean_time_between_failures,
                                        young_daly)

HOUR = 3600.0


def test_young_daly_is_youngs_sqrt_2cm_for_a_small_cost_and_daly_above_it() -> None:
    c, m = 3.0, 10 * HOUR
    young = math.sqrt(2 * c * m)
    tau = young_daly(c, m)
    assert young * 0.99 < tau < young * 1.01  # C << M: Young's first order
    # Daly's correction raises the interval when C is not small, before subtracting C
    c = 600.0
    x = c / (2 * HOUR)
    assert young_daly(c, HOUR) == pytest.approx(math.sqrt(2 * c * HOUR) * (1 + math.sqrt(x) / 3 + x / 9) - c)
    assert young_daly(3 * HOUR, HOUR) == HOUR  # C >= 2M: checkpoint once per M
    assert young_daly(0.0, HOUR) == 0.0 and young_daly(1.0, 0.0) == 0.0


def test_the_interval_grows_with_the_cost_and_with_the_mean_time_between_failures() -> None:
    assert young_daly(1, HOUR) < young_daly(4, HOUR) < young_daly(16, HOUR)
    assert young_daly(2, HOUR) < young_daly(2, 4 * HOUR) < young_daly(2, 16 * HOUR)
    assert young_daly(2, 4 * HOUR) == pytest.approx(2 * young_daly(2, HOUR), rel=0.05)  # sqrt(M)


def test_mtbf_from_history_alone_from_the_prior_alone_and_both() -> None:
    seen = FailureHistory(failures=3, exposure_seconds=30 * HOUR, tries=40, scope="queue gpu")
    assert mean_time_between_failures(seen, None) == pytest.approx(10 * HOUR)
    assert mean_time_between_failures(None, 24) == pytest.approx(24 * HOUR)
    # the prior counts as one failure in mtbf_hours: (24 h + 30 h) / (1 + 3)
    assert mean_time_between_failures(seen, 24) == pytest.approx(54 * HOUR / 4)
    # no failure seen: the prior alone, stretched by the run time that saw none
    quiet = FailureHistory(failures=0, exposure_seconds=100 * HOUR, tries=50)
    assert mean_time_between_failures(quiet, 24) == pytest.approx(124 * HOUR)


def test_no_failure_seen_and_no_prior_goes_to_heartbeat_max() -> None:
    s = Settings(heartbeat_seconds="auto", heartbeat_max_seconds=1800,
                 failure_history=FailureHistory(failures=0, exposure_seconds=500 * HOUR, tries=200, scope="queue gpu"))
    c = Cadence(s, first_cost=5.0, cost_source="measured")
    assert c.interval() == 1800 and c.choice.bound == "heartbeat_max_seconds" and c.mtbf is None
    assert "no failures seen (0 failures in 200 tries" in c.choice.line()
    assert Cadence(Settings(heartbeat_seconds="auto"), first_cost=5.0, cost_source="x").interval() == 3600  # default max


def test_the_bounds_hold_both_ways() -> None:
    flaky = FailureHistory(failures=50, exposure_seconds=5 * HOUR, tries=60, scope="queue spot")  # one per 6 min
    s = Settings(heartbeat_seconds="auto", heartbeat_min_seconds=120, heartbeat_max_seconds=900, failure_history=flaky)
    low = Cadence(s, first_cost=0.05, cost_source="measured")
    assert young_daly(0.05, low.mtbf or 0) < 120 and low.interval() == 120 and low.choice.bound == "heartbeat_min_seconds"
    steady = Settings(heartbeat_seconds="auto", heartbeat_min_seconds=120, heartbeat_max_seconds=900, mtbf_hours=1000)
    high = Cadence(steady, first_cost=30, cost_source="measured")
    assert high.interval() == 900 and high.choice.bound == "heartbeat_max_seconds"
    mid = Cadence(Settings(heartbeat_seconds="auto", mtbf_hours=10), first_cost=3.0, cost_source="measured")
    assert 60 < mid.interval() < 3600 and mid.choice.bound == ""
    assert mid.interval() == pytest.approx(young_daly(3.0, 10 * HOUR))


def test_observe_takes_a_new_interval_only_on_a_real_change_and_uses_the_median_cost() -> None:
    s = Settings(heartbeat_seconds="auto", mtbf_hours=10, heartbeat_min_seconds=1)
    c = Cadence(s, first_cost=0.01, cost_source="estimated")
    first = c.observe(2.0, 5.0)
    assert first is not None and first.cost_source == "measured on 1 checkpoint"  # the first measurement is said
    assert c.interval() == pytest.approx(young_daly(2.0, 10 * HOUR))
    assert c.observe(2.1, 5.0) is None  # within 10 %: same interval, figures updated quietly
    assert c.interval() == pytest.approx(young_daly(2.0, 10 * HOUR))
    assert c.choice.cost_seconds == pytest.approx(2.05)
    assert c.observe(30.0, 40.0) is None  # one slow checkpoint: the median (2.1) barely moves
    changed = [c.observe(30.0, 40.0), c.observe(30.0, 40.0)]
    assert changed[-1] is not None or changed[0] is not None  # three of five are slow now: the median follows
    assert c.interval() == pytest.approx(young_daly(30.0, 10 * HOUR), rel=0.11)
    assert c.choice.expected_loss_seconds == pytest.approx(c.interval() / 2 + c.choice.commit_seconds)


def test_a_retry_counts_the_costs_its_id_measured_before() -> None:
    c = Cadence(Settings(heartbeat_seconds="auto", mtbf_hours=10), first_cost=4.0, cost_source="measured on 3 earlier",
                earlier=(4.0, 4.0, 4.0))
    got = c.observe(0.5, 1.0)  # one cheap checkpoint here does not outvote three measured before
    assert got is not None and got.cost_source == "measured on 4 checkpoints" and got.cost_seconds == 4.0


def test_a_fixed_heartbeat_keeps_its_interval_and_still_reports_its_cost() -> None:
    c = Cadence(Settings(heartbeat_seconds=600), first_cost=0.0, cost_source="not measured yet")
    assert c.interval() == 600 and not c.auto
    got = c.observe(1.5, 4.0)
    assert got is not None and got.interval_seconds == 600 and got.cost_seconds == 1.5
    assert got.expected_loss_seconds == 304.0
    assert got.line() == ("heartbeat 10m (fixed): checkpoint costs 1.5 s (measured on 1 checkpoint); expected work "
                          "lost per failure ~5m04s")
    assert c.observe(1.5, 4.0) is None


def test_the_log_line_names_interval_cost_and_failures() -> None:
    h = FailureHistory(failures=2, exposure_seconds=18.8 * HOUR, tries=31, window_days=30, scope="queue gpu")
    c = Cadence(Settings(heartbeat_seconds="auto", heartbeat_min_seconds=1), first_cost=3.1, cost_source="measured on 5 checkpoints")
    c2 = Cadence(Settings(heartbeat_seconds="auto", failure_history=h), first_cost=3.1, cost_source="measured on 5 checkpoints")
    line = c2.choice.line()
    assert line.startswith(f"heartbeat {duration_text(c2.interval())}: checkpoint costs 3.1 s (measured on 5 checkpoints), "
                           "failures every ~9.4h (2 failures in 31 tries (18.8h run) on queue gpu over 30 days)"), line
    assert "no failures seen" in c.choice.line()


def test_the_first_cost_is_estimated_from_the_size() -> None:
    cost, why = estimated_cost(4 << 30, None)
    assert cost == pytest.approx(2.4) and "the reference 0.6 s/GiB" in why
    cost, why = estimated_cost(2 << 30, 1.5)
    assert cost == pytest.approx(3.0) and "the fleet's 1.5 s/GiB" in why


@pytest.mark.parametrize("seconds,text", [(5, "5s"), (0.5, "0.5s"), (432, "7m12s"), (600, "10m"), (33840, "9.4h"),
                                          (3 * 86400, "3.0d")])
def test_durations_read_short(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


# -- a real run: CRIU, the CLI, the store ------------------------------------------------------------------
_COUNTER = "import time\nfor i in range(50):\n    print(i, flush=True); time.sleep(0.1)\n"


def test_auto_checkpoints_often_where_failures_are_frequent_and_rarely_where_none_were_seen(tmp_path) -> None:
    import json
    import re
    import sys

    from conftest import cli, cli_env, manifests

    # one failure per 0.2 s: the interval is the 1 s minimum whatever a checkpoint costs (on a busy machine too)
    flaky = json.dumps({"failures": 4, "exposure_seconds": 0.8, "tries": 10, "scope": "queue spot"})
    env = cli_env(tmp_path, "n1", "w", CEDANA_HEARTBEAT_MIN_SECONDS="1", CEDANA_HEARTBEAT_MAX_SECONDS="30",
                  CEDANA_KEEP_CHECKPOINTS="20")
    r = cli("run", "--id", "flaky", "--heartbeat", "auto", "--json", "--", sys.executable, "-c", _COUNTER,
            env={**env, "CEDANA_FAILURE_HISTORY": flaky})
    *out, summary = r.stdout.splitlines()
    assert r.returncode == 0 and out == [str(i) for i in range(50)], r.stderr
    assert json.loads(summary)["heartbeat"]["interval_seconds"] == 1.0  # run --json says it too
    lines = [x for x in r.stderr.splitlines() if "heartbeat 1s (heartbeat_min_seconds): checkpoint costs" in x]
    assert lines and re.search(r"failures every ~0\.\d+s \(4 failures in 10 tries \(0\.8s run\) on queue spot", lines[0]), r.stderr
    assert "estimated:" in lines[0] and "measured on 1 checkpoint" in lines[-1], lines
    taken = manifests(tmp_path / "store", "flaky")
    assert len(taken) >= 2 and len(lines) == 2, (len(taken), lines)  # said at start and when measured, not per checkpoint

    quiet = cli("run", "--id", "quiet", "--heartbeat", "auto", "--", sys.executable, "-c", _COUNTER, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "heartbeat 30s (heartbeat_max_seconds): checkpoint costs" in quiet.stderr
    assert "no failures seen (no failure history)" in quiet.stderr
    assert manifests(tmp_path / "store", "quiet") == []  # 5 s of work, a 30 s heartbeat

    listed = json.loads(cli("checkpoints", "flaky", "--json", env=env).stdout)
    [entry] = listed if isinstance(listed, list) else listed["ids"]
    hb = entry["heartbeat"]
    assert hb["auto"] is True and hb["interval_seconds"] == 1.0 and hb["cost_seconds"] > 0
    assert hb["expected_loss_seconds"] == pytest.approx(0.5 + hb["commit_seconds"], abs=0.01)
    assert hb["reason"].startswith("heartbeat 1s (heartbeat_min_seconds)")
