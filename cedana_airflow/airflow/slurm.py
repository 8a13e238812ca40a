"""The Slurm route's Airflow side: where Slurm's commands run (this worker, or a login node over the
SSH provider's connection), and the trigger that follows a job without holding a worker slot."""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from ..errors import CedanaError, SlurmError, SlurmRefused
from ..slurm.client import Runner, SlurmClient, local_runner
from ..slurm.jobs import JobEnd

__all__ = ["SlurmJobTrigger", "slurm_client"]

#: How long Slurm may fail to answer about a job before following it is given up (the job is then
#: cancelled, so that a retry does not run a second copy beside it).
_GIVE_UP_SECONDS = 600


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
    hook = SSHHook(ssh_conn_id=ssh_conn_id)

    def run(argv: Sequence[str], stdin: str | None, timeout: float) -> tuple[int, str, str]:
        with hook.get_conn() as client:
            i, o, e = client.exec_command(shlex.join(argv), timeout=timeout)
            if stdin is not None:
                i.write(stdin)
            i.channel.shutdown_write()
            out, err = o.read().decode(errors="replace"), e.read().decode(errors="replace")
            return o.channel.recv_exit_status(), out, err

    return run


def slurm_client(ssh_conn_id: str | None) -> SlurmClient:
    if ssh_conn_id:
        return SlurmClient(_ssh_runner(ssh_conn_id), where=f"the login node of SSH connection {ssh_conn_id!r}")
    return SlurmClient(local_runner(), where="this worker", local=True)


class SlurmJobTrigger(BaseTrigger):
    """Runs in the triggerer: asks Slurm about the job every ``poll_seconds`` until it is over.

    A state a requeued job passes through (NODE_FAIL, PREEMPTED) ends it only once it has stayed
    ``settle_seconds``: after a node loss Slurm puts the job back to PENDING and runs it again.
    """

    def __init__(self, job_id: str, ssh_conn_id: str | None, poll_seconds: float = 10.0,
                 settle_seconds: float = 30.0, output: str = "") -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # Airflow's BaseTrigger is not annotated
        self.job_id, self.ssh_conn_id, self.output = job_id, ssh_conn_id, output
        self.poll_seconds, self.settle_seconds = poll_seconds, settle_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"job_id": self.job_id, "ssh_conn_id": self.ssh_conn_id, "poll_seconds": self.poll_seconds,
                 "settle_seconds": self.settle_seconds, "output": self.output})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        failures = 0
        try:
            client = slurm_client(self.ssh_conn_id)
            end = JobEnd(self.settle_seconds)
            seen: tuple[str, int] | None = None
            while True:
                try:
                    info = await asyncio.to_thread(client.job, self.job_id)
                except SlurmRefused:
                    raise
                except SlurmError as e:  # a controller restart or a slow answer: the job may well be fine
                    failures += 1
                    if failures * self.poll_seconds >= _GIVE_UP_SECONDS:
                        raise
                    self.log.warning("cedana: Slurm did not answer about job %s (%s); asking again", self.job_id, e)
                    await asyncio.sleep(self.poll_seconds)
                    continue
                failures = 0
                if (info.state, info.restarts) != seen:
                    seen = (info.state, info.restarts)
                    self.log.info("cedana: %s", info.describe())
                if end.over(info, time.monotonic()):
                    # the output's path rides in the event: `dags test` resumes with the event alone
                    yield TriggerEvent({"status": "done", "job": dataclasses.asdict(info),  # type: ignore[no-untyped-call]
                                        "output": self.output})
                    return
                await asyncio.sleep(self.poll_seconds)
        except SlurmError as e:
            yield TriggerEvent({"status": "error", "message": str(e),  # type: ignore[no-untyped-call]
                                "retryable": not isinstance(e, SlurmRefused), "job_id": self.job_id})
        except CedanaError as e:
            yield TriggerEvent({"status": "error", "message": str(e), "retryable": True,  # type: ignore[no-untyped-call]
                                "job_id": self.job_id})
