"""The Slurm route's SSH runner keeps one login for every command of a client (a trigger run polls
through it), logs in again when the login dropped, retries once a channel that could not be opened
(the command was never sent), and never sends a command twice."""

from __future__ import annotations

import io
import threading

import pytest

from cedana_airflow.errors import SlurmError
from cedana_airflow.hooks.slurm import _SshSession


class _Channel:
    def __init__(self, client: _Client) -> None:
        self.client, self.closed, self.sent = client, False, b""
        self.status_event = threading.Event()

    def settimeout(self, timeout: float) -> None:
        pass

    def exec_command(self, command: str) -> None:
        self.client.commands.append(command)
        if self.client.drops_after_send:
            raise EOFError("connection closed by the login node")
        self.status_event.set()

    def sendall(self, data: bytes) -> None:
        self.sent += data

    def shutdown_write(self) -> None:
        pass

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(f"ran {self.client.commands[-1]}\n".encode())

    def makefile_stderr(self, mode: str) -> io.BytesIO:
        return io.BytesIO(b"")

    def recv_exit_status(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class _Transport:
    def __init__(self, client: _Client) -> None:
        self.client, self.active = client, True

    def is_active(self) -> bool:
        return self.active

    def open_session(self, timeout: float) -> _Channel:
        if self.client.half_open:  # looks active, but nothing gets through
            raise OSError("Timeout opening channel.")
        return _Channel(self.client)


class _Client:
    def __init__(self, half_open: bool = False, drops_after_send: bool = False) -> None:
        self.half_open, self.drops_after_send = half_open, drops_after_send
        self.transport, self.commands, self.closed = _Transport(self), [], False

    def get_transport(self) -> _Transport:
        return self.transport

    def close(self) -> None:
        self.closed = True


def _session(*clients: _Client) -> tuple[_SshSession, list[_Client]]:
    made: list[_Client] = []
    queue = list(clients)

    def connect() -> _Client:
        made.append(queue.pop(0) if queue else _Client())
        return made[-1]

    return _SshSession(connect, "the login node", OSError), made


def test_one_login_serves_every_command_and_a_dropped_one_is_made_again():
    session, made = _session()
    for _ in range(5):
        assert session(["squeue", "-j", "7"], None, 10) == (0, "ran squeue -j 7\n", "")
    assert session.logins == 1 and len(made[0].commands) == 5
    made[0].transport.active = False  # the login node dropped it between two polls
    session(["squeue", "-j", "7"], None, 10)
    assert session.logins == 2 and made[0].closed and len(made[1].commands) == 1
    session.close()
    assert made[1].closed


def test_a_half_open_login_is_made_again_once_since_the_command_was_never_sent():
    session, made = _session(_Client(half_open=True))
    assert session(["sbatch", "--parsable"], "#!/bin/sh\n", 10)[0] == 0
    assert session.logins == 2 and made[0].closed and made[0].commands == [] and len(made[1].commands) == 1


def test_a_login_that_drops_after_the_command_was_sent_is_one_slurm_error_and_nothing_is_sent_again():
    session, made = _session(_Client(drops_after_send=True))
    with pytest.raises(SlurmError, match=r"sbatch on the login node failed: connection closed by the login node"):
        session(["sbatch", "--parsable"], "#!/bin/sh\n", 10)
    assert [len(c.commands) for c in made] == [1] and made[0].closed  # sbatch sent once, never again
    session(["squeue"], None, 10)  # the next command logs in again
    assert session.logins == 2


def test_two_logins_that_cannot_open_a_channel_are_one_slurm_error():
    session, made = _session(_Client(half_open=True), _Client(half_open=True))
    with pytest.raises(SlurmError, match=r"cannot open a session on the login node: Timeout opening channel"):
        session(["squeue"], None, 10)
    assert session.logins == 2 and all(c.closed and not c.commands for c in made)
