"""The Slurm route's SSH runner keeps one login for every command of a client (a trigger run polls
through it), logs in again only once the login dropped, and never runs a command twice."""

from __future__ import annotations

import io

import pytest

from cedana_airflow.errors import SlurmError
from cedana_airflow.hooks.slurm import _SshSession


class _Channel:
    def __init__(self, rc: int) -> None:
        self.rc = rc

    def shutdown_write(self) -> None:
        pass

    def recv_exit_status(self) -> int:
        return self.rc


class _Stream(io.BytesIO):
    def __init__(self, data: bytes = b"", rc: int = 0) -> None:
        super().__init__(data)
        self.channel = _Channel(rc)


class _Transport:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


class _Client:
    def __init__(self, fail: bool = False) -> None:
        self.transport, self.commands, self.closed, self.fail = _Transport(), [], False, fail

    def get_transport(self) -> _Transport:
        return self.transport

    def exec_command(self, command: str, timeout: float) -> tuple[_Stream, _Stream, _Stream]:
        self.commands.append(command)
        if self.fail:
            raise EOFError("connection closed by the login node")
        return _Stream(), _Stream(f"ran {command}\n".encode()), _Stream()

    def close(self) -> None:
        self.closed = True


def test_one_login_serves_every_command_and_a_dropped_one_is_made_again():
    clients: list[_Client] = []

    def connect() -> _Client:
        clients.append(_Client())
        return clients[-1]

    session = _SshSession(connect, "the login node", OSError)
    for _ in range(5):
        assert session(["squeue", "-j", "7"], None, 10) == (0, "ran squeue -j 7\n", "")
    assert session.logins == 1 and len(clients[0].commands) == 5
    clients[0].transport.active = False  # the login node dropped it between two polls
    session(["squeue", "-j", "7"], None, 10)
    assert session.logins == 2 and clients[0].closed and len(clients[1].commands) == 1
    session.close()
    assert clients[1].closed


def test_a_login_that_drops_mid_command_is_one_slurm_error_and_the_command_is_not_run_again():
    clients: list[_Client] = []

    def connect() -> _Client:
        clients.append(_Client(fail=not clients))  # the first login drops during its command
        return clients[-1]

    session = _SshSession(connect, "the login node", OSError)
    with pytest.raises(SlurmError, match=r"the SSH session to the login node failed during sbatch: connection closed"):
        session(["sbatch", "--parsable"], "#!/bin/sh\n", 10)
    assert [len(c.commands) for c in clients] == [1] and clients[0].closed  # sbatch ran once, nothing re-sent
    session(["squeue"], None, 10)  # the next command logs in again
    assert session.logins == 2
