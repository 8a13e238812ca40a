"""Where the Slurm route's commands run: this worker, or a login node over the SSH provider's connection.

Over SSH, one login serves every command of a client (a submit, or every poll of a trigger run or of a
task that follows its job): a new login per poll costs the login node an authentication and a session
each time. A login that dropped is made again before the next command, never by running a command twice.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from ..errors import SlurmError, SlurmRefused
from ..slurm.client import Runner, SlurmClient, local_runner

__all__ = ["slurm_client"]


def _ssh_runner(ssh_conn_id: str) -> Runner:
    try:
        from airflow.providers.ssh.hooks.ssh import SSHHook
    except ImportError:
        raise SlurmRefused(f"ssh_conn_id={ssh_conn_id!r} needs the SSH provider, which is not installed. "
                           "pip install apache-airflow-providers-ssh.") from None
    try:
        from airflow.sdk import Connection

        Connection.get(ssh_conn_id)  # a missing connection is one line, before any socket is opened
    except Exception as e:  # noqa: BLE001  the SDK's not-found error type differs between Airflow versions
        raise SlurmRefused(f"the SSH connection {ssh_conn_id!r} does not exist ({type(e).__name__}). Create it "
                           "(Admin > Connections, type ssh) or fix ssh_conn_id.") from None
    import paramiko  # type: ignore[import-untyped]  # the SSH provider's own dependency

    hook = SSHHook(ssh_conn_id=ssh_conn_id)
    where = f"the login node of SSH connection {ssh_conn_id!r}"

    def connect() -> Any:  # a paramiko.SSHClient
        try:
            return hook.get_conn()
        except (paramiko.BadHostKeyException, paramiko.AuthenticationException) as e:
            # The connection's settings are wrong (or the host is not the one pinned): a retry fails again.
            raise SlurmRefused(f"cannot log in to {where} ({hook.remote_host}:{hook.port}): {e}. Fix the connection's "
                               "login, key or pinned host_key (Admin > Connections).") from None
        except (paramiko.SSHException, OSError) as e:
            raise SlurmError(f"cannot reach {where} ({hook.remote_host}:{hook.port}): {e}") from None

    return _SshSession(connect, where, paramiko.SSHException)


class _SshSession:
    """A runner over one SSH login, made on the first command and again only once it has dropped."""

    def __init__(self, connect: Any, where: str, ssh_error: type[Exception]) -> None:
        self._connect, self._where, self._ssh_error = connect, where, ssh_error
        self._client: Any = None
        self.logins = 0  # how many times it logged in: one, unless the login node dropped it

    def __call__(self, argv: Sequence[str], stdin: str | None, timeout: float) -> tuple[int, str, str]:
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None or not transport.is_active():
            self.close()
            self._client = self._connect()
            self.logins += 1
        try:
            i, o, e = self._client.exec_command(shlex.join(argv), timeout=timeout)
            if stdin is not None:
                i.write(stdin)
            i.channel.shutdown_write()
            out, err = o.read().decode(errors="replace"), e.read().decode(errors="replace")
            return int(o.channel.recv_exit_status()), out, err
        except (self._ssh_error, EOFError, OSError) as exc:  # the login dropped mid-command: not run again here
            self.close()
            raise SlurmError(f"the SSH session to {self._where} failed during {argv[0]}: {exc}") from None

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None


def slurm_client(ssh_conn_id: str | None) -> SlurmClient:
    if ssh_conn_id:
        return SlurmClient(_ssh_runner(ssh_conn_id), where=f"the login node of SSH connection {ssh_conn_id!r}")
    return SlurmClient(local_runner(), where="this worker", local=True)
