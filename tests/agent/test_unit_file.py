"""The agent's systemd unit (deploy/cedana-airflow-agent.service), as systemd itself reads it: valid, running
the worker environment's `cedana-airflow agent` where callers look for it, and leaving workloads alone when
the unit stops (their shims outlive the agent; an agent started later takes them up)."""

from __future__ import annotations

import configparser
import subprocess
from pathlib import Path

from cedana_airflow.agent import DEFAULT_SOCKET

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "cedana-airflow-agent.service"


def _unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    cp.read(UNIT)
    return cp


def test_systemd_accepts_the_unit_and_its_command_exists():
    done = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    command = _unit()["Service"]["ExecStart"].split()
    assert Path(command[0]).exists(), f"{command[0]}: run `make worker`"
    assert command[1:2] == ["agent"]


def test_a_stop_of_the_unit_leaves_the_workloads_and_keeps_what_takes_them_up():
    service = _unit()["Service"]
    assert service["KillMode"] == "process"  # the shims (and their trees) are not the unit's to end
    assert service["RuntimeDirectoryPreserve"] == "yes"  # the remembered workloads and the shims' sockets
    assert Path("/run") / service["RuntimeDirectory"] == DEFAULT_SOCKET.parent  # where callers look by default
    assert service["RuntimeDirectoryMode"] == "0755"  # only root may write there (server.py checks it)
