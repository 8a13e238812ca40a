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
    """A runner over one SSH login, made on the first command and again once it has dropped.

    A channel that cannot be opened means the command was never sent: the login is made again and the
    channel opened once more (a half-open connection looks active until a send fails). Once the command
    is sent, a failure is final for it: it is never sent twice (an ``sbatch`` would submit twice).
    """

    def __init__(self, connect: Any, where: str, ssh_error: type[Exception]) -> None:
        self._connect, self._where, self._ssh_error = connect, where, ssh_error
        self._client: Any = None  # read once per use: a trigger's cancellation may close it from another thread
        self.logins = 0  # how many times it logged in: one, unless the login node dropped it

    def _channel(self, timeout: float) -> Any:
        for attempt in (1, 2):
            client = self._client
            transport = client.get_transport() if client is not None else None
            if transport is None or not transport.is_active():
                self.close()
                client = self._client = self._connect()
                self.logins += 1
                transport = client.get_transport()
            try:
                return transport.open_session(timeout=timeout)
            except (self._ssh_error, EOFError, OSError) as exc:  # not sent: safe to log in again once
                self.close()
                if attempt == 2:
                    raise SlurmError(f"cannot open a session on {self._where}: {exc}") from None
        raise AssertionError("unreachable")

    def __call__(self, argv: Sequence[str], stdin: str | None, timeout: float) -> tuple[int, str, str]:
        chan = self._channel(timeout)
        try:
            chan.settimeout(timeout)
            chan.exec_command(shlex.join(argv))
            if stdin is not None:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
            out = chan.makefile("rb").read().decode(errors="replace")
            err = chan.makefile_stderr("rb").read().decode(errors="replace")
            if not chan.status_event.wait(timeout):
                raise TimeoutError(f"no exit status within {timeout:.0f} s")
            return int(chan.recv_exit_status()), out, err
        except (self._ssh_error, EOFError, OSError) as exc:  # sent: never sent again
            self.close()
            hint = " Check that slurmctld is up (scontrol ping)." if isinstance(exc, TimeoutError) else ""
            raise SlurmError(f"{argv[0]} on {self._where} failed: {exc or type(exc).__name__}.{hint}") from None
        finally:
            chan.close()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def slurm_client(ssh_conn_id: str | None) -> SlurmClient:
    if ssh_conn_id:
        return SlurmClient(_ssh_runner(ssh_conn_id), where=f"the login node of SSH connection {ssh_conn_id!r}")
    return SlurmClient(local_runner(), where="this worker", local=True)
