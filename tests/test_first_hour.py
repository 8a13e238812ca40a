"""What a newcomer meets in the first hour (issue 51): a task in scope is protected by a heartbeat unless it is
turned off on purpose, and a run that still ends with nothing to resume from says so; the CLI's errors name
the flags as typed, in one line; durations take units; a setting's near-miss variable is said; the
`checkpoints` table prints what `restore --id` takes; every `--json` has its help."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import cli, cli_env

SLEEP = [sys.executable, "-c", "import time; time.sleep(1.5); print('done')"]


def _lines(text: str) -> list[str]:
    return text.strip().splitlines()


def test_a_run_given_no_heartbeat_is_protected_every_10_minutes_and_one_that_ends_first_says_so(tmp_path):
    env = cli_env(tmp_path, "n", "w")
    short = cli("run", "--id", "short", "--json", "--", *SLEEP, env=env)
    summary = json.loads(_lines(short.stdout)[-1])
    assert short.returncode == 0 and summary["checkpoints"] == 0, short.stderr
    assert summary["heartbeat_in_force"] == "every 10m (from the default of heartbeat_seconds)"
    assert re.fullmatch(r"it ran [\d.]+s, less than its first heartbeat \(heartbeat every 10m \(from the default of "
                        r"heartbeat_seconds\)\); a failure would have lost all of its work\. A shorter heartbeat "
                        r"protects runs this short", summary["unprotected"]), summary["unprotected"]
    [warning] = [ln for ln in _lines(short.stderr) if "no checkpoint was taken" in ln]
    assert warning == f"cedana: no checkpoint was taken checkpoint_id=short: {summary['unprotected']}"
    # off on purpose: said as such, with where it was turned off
    off = json.loads(_lines(cli("run", "--id", "off", "--heartbeat", "0", "--json", "--", *SLEEP, env=env).stdout)[-1])
    assert off["heartbeat_in_force"].startswith("off (heartbeat_seconds = 0 from --heartbeat)")
    assert off["unprotected"].startswith("heartbeat off (heartbeat_seconds = 0 from --heartbeat)")
    # a heartbeat that fits the run: checkpoints, and nothing to warn about
    beat = cli("run", "--id", "beat", "--heartbeat", "500ms", "--json", "--", *SLEEP,
               env={**env, "CEDANA_HEARTBEAT_SECONDS": "600"})
    fits = json.loads(_lines(beat.stdout)[-1])
    assert fits["checkpoints"] >= 1 and fits["unprotected"] == "" and "no checkpoint was taken" not in beat.stderr
    assert fits["heartbeat_in_force"] == "every 0.5s (from --heartbeat)"  # the flag beats the variable


def test_errors_name_the_flag_as_typed_in_one_line_and_durations_take_units(tmp_path):
    env = cli_env(tmp_path, "n", "w")
    negative = cli("run", "--id", "x", "--heartbeat", "-5", "--", "true", env=env)
    assert negative.returncode == 2 and _lines(negative.stderr) == [
        "ConfigError: setting heartbeat_seconds = -5.0 (from --heartbeat) is invalid: a heartbeat is 0 (none), a "
        "number of seconds, or auto. Fix or remove it."]
    gap = cli("run", "--id", "x", "--max-restore-gap", "1h", "--heartbeat", "ten", "--", "true", env=env)
    assert gap.returncode == 2 and _lines(gap.stderr) == [
        "cedana-airflow run: argument --heartbeat: 'ten' is neither a duration (90, 30s, 10m) nor auto "
        "(see 'cedana-airflow run --help')"]
    grace = cli("gc", "--grace", "soon", env=env)
    assert grace.returncode == 2 and _lines(grace.stderr) == [
        "cedana-airflow gc: argument --grace: 'soon' is not a duration: give seconds (90) or a number with a unit "
        "(30s, 10m, 1h, 2d) (see 'cedana-airflow gc --help')"]
    assert cli("run", "--id", "made", "--heartbeat", "0", "--", "true", env=env).returncode == 0  # the store exists now
    dry = cli("gc", "--grace", "1h30m", "--wait", "0", "--dry-run", env=env)
    assert dry.returncode == 0 and "younger than 5400 s" in dry.stdout, dry.stdout + dry.stderr


def test_a_cedana_variable_one_typo_from_a_setting_is_said_once_and_ours_are_not(tmp_path):
    env = cli_env(tmp_path, "n", "w", CEDANA_STOR="file:///elsewhere", CEDANA_HEARTBEAT="30",
                  CEDANA_CHECKPOINT="x", CEDANA_RESTORE_DIR="/tmp")  # the last two: what our routes hand a pod
    r = cli("checkpoints", env=env)
    said = [ln for ln in _lines(r.stderr) if "is not a setting" in ln]
    assert said == ["cedana: CEDANA_STOR is not a setting and is ignored. Did you mean CEDANA_STORE?",
                    "cedana: CEDANA_HEARTBEAT is not a setting and is ignored. Did you mean CEDANA_HEARTBEAT_SECONDS?"], r.stderr


def test_checkpoints_prints_whole_ids_and_an_id_not_there_exits_1(tmp_path):
    cid = "cedana_demo_training.train.manual__2026-12-06T09_00_00+00_00-56b87a22f3"  # as the operators derive them
    env = cli_env(tmp_path, "a-node-name-longer-than-16", "w")
    assert cli("run", "--id", cid, "--heartbeat", "0.5", "--", *SLEEP, env=env).returncode == 0
    table = _lines(cli("checkpoints", env=env).stdout)
    assert table[0].split() == ["ID", "SEQ", "TRY", "NODE", "CREATED", "IMAGE", "STORED"]
    assert len(table) > 1 and all(row.split()[0] == cid and row.split()[3] == "a-node-name-longer-than-16"
                                  for row in table[1:]), table
    missing = cli("checkpoints", "nosuchid", env=env)
    assert missing.returncode == 1 and _lines(missing.stderr) == [f"no checkpoints in file://{tmp_path}/store under nosuchid"]
    assert cli("checkpoints", "nosuchid", "--json", env=env).returncode == 1


def test_every_json_flag_says_what_it_prints():
    from cedana_airflow.cli import _parser

    parser = _parser()
    [sub] = [a for a in parser._actions if a.dest == "verb"]
    bare = [verb for verb, p in sub.choices.items() for a in p._actions if "--json" in a.option_strings and not a.help]
    assert bare == []


def test_doctor_writes_nothing_unless_asked_and_warns_where_criu_cannot_carry_sockets_fake_binary(tmp_path):
    """A stand-in CRIU 4.1.1 (what Debian's older suites ship): it runs here, but cannot dump a TCP or UDP
    socket on Linux 6.16 and later (criu#2718), so every heartbeat of a workload that holds one would fail."""
    import os
    import platform

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Version: 4.1.1' && exit 0\necho 'Looks good.'\n")
    fake.chmod(0o755)
    env = cli_env(tmp_path, "n", "w", CEDANA_CRIU=str(fake), CEDANA_IO_URING="allow")
    r = cli("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    if release >= (6, 16):
        assert checks["criu sockets"]["status"] == "warn" and "cannot dump a TCP or UDP socket" in \
            checks["criu sockets"]["detail"] and "CRIU 4.2 or later" in checks["criu sockets"]["fix"], checks
    assert checks["io_uring"]["status"] == "warn" and checks["io_uring"]["fix"] == "set io_uring = deny (the default)"
    assert r.returncode == 0  # warnings: it can checkpoint other workloads here
    # read-only: the store that does not exist yet is not made, and says who will make it
    assert checks["store"]["status"] == "ok" and "does not exist yet: the first checkpoint creates it" in \
        checks["store"]["detail"] and not (tmp_path / "store").exists()
    probed = {c["name"]: c for c in json.loads(cli("doctor", "--json", "--probe-store", env=env).stdout)}
    assert "--probe-store: wrote and removed a probe file" in probed["store"]["detail"]
    assert os.listdir(tmp_path / "store") == ["store.json"]  # what it said it would write, and no probe left


def test_doctor_warns_where_nothing_can_hold_a_connection_still_while_it_is_dumped_fake_binary(tmp_path):
    """A stand-in CRIU built without libnftables, on a node without the iptables command: CRIU's network
    lock has nothing to work with, so a workload holding an established TCP connection is never dumped."""
    fake = tmp_path / "bin" / "criu"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Version: 4.2.1' && exit 0\n"
                    "[ \"$2\" = --feature ] && exit 1\necho 'Looks good.'\n")
    fake.chmod(0o755)
    env = cli_env(tmp_path, "n", "w", CEDANA_CRIU=str(fake), PATH=str(fake.parent))
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json", env=env).stdout)}
    lock = checks["network lock"]
    assert lock["status"] == "warn" and "not checkpointed (every heartbeat fails)" in lock["detail"], lock
    assert lock["fix"] == "install iptables (apt-get install iptables), or a CRIU built with libnftables"
    (fake.parent / "iptables").symlink_to("/bin/true")  # one command per address family: CRIU's default lock
    lock = {c["name"]: c for c in json.loads(cli("doctor", "--json", env=env).stdout)}["network lock"]
    assert lock["status"] == "warn" and "but no ip6tables: a workload that holds an established IPv6" in lock["detail"]
    (fake.parent / "ip6tables").symlink_to("/bin/true")
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json", env=env).stdout)}
    assert checks["network lock"]["status"] == "ok" and checks["network lock"]["detail"].startswith("iptables ("), checks


@pytest.mark.parametrize(("size", "said"), [(512, "512 B"), (999, "999 B"), (1000, "1.0 KiB"), (1005 * 1024, "1.0 MiB"),
                                            (999 * 1024, "999 KiB"), (100 * 1024, "100 KiB"), (33_000_000, "31.5 MiB"),
                                            (5 << 30, "5.0 GiB")])
def test_a_size_in_a_log_line_has_at_most_three_digits_before_its_point(size, said):
    """A heartbeat of 1,005 KiB stored said `1,005 KiB` where its neighbour said `1.1 MiB` (CI run 70)."""
    from cedana_airflow.units import binary_size

    assert binary_size(size) == said


def test_a_heartbeat_says_one_line_with_its_figures_and_the_id_is_said_where_the_run_starts(tmp_path):
    """Logs a person reads (0.11.0): a line per checkpoint, its units binary; the long ID at the start and
    the end, not on every heartbeat; a restore said once."""
    env = cli_env(tmp_path, "node-a", "wa")
    job = [sys.executable, "-c", "import time\nfor i in range(12): print('step', i, flush=True); time.sleep(0.25)"]
    r = cli("run", "--id", "one-line-" + "x" * 60, "--heartbeat", "1s", "--", *job, env=env)
    ours = [ln for ln in _lines(r.stderr) if ln.startswith("cedana: ")]
    beats = [ln for ln in ours if " seq=" in ln]
    assert r.returncode == 0 and beats and len(beats) == len({re.search(r"seq=(\d+)", b)[1] for b in beats}), ours
    assert all(re.fullmatch(r"cedana: checkpoint seq=\d+: froze [\d.]+ s; image [\d.]+ [KM]iB, [\d.]+ [KM]iB stored "
                            r"\(\d+ of \d+ chunks new\) in [\d.]+ s", b) for b in beats), beats
    named = [ln for ln in ours if "one-line-" in ln]
    assert [ln.split(" checkpoint_id=")[0] for ln in named] == ["cedana: workload started", "cedana: workload exited"]
    assert all(ln.startswith("cedana: ") or ln.startswith("step ") for ln in _lines(r.stderr) + _lines(r.stdout))
