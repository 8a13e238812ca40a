"""SlurmJobTrigger: follows a Slurm job in the triggerer, holding no worker slot."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from ..errors import CedanaError, SlurmError, SlurmRefused
from ..hooks.slurm import slurm_client
from ..slurm.jobs import GIVE_UP_SECONDS, JobEnd

__all__ = ["SlurmJobTrigger"]



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
        client = None
        try:
            client = slurm_client(self.ssh_conn_id)  # one login for every poll of this run
            end = JobEnd(self.settle_seconds)
            seen: tuple[str, int] | None = None
            while True:
                try:
                    info = await asyncio.to_thread(client.job, self.job_id)
                except SlurmRefused:
                    raise
                except SlurmError as e:  # a controller restart or a slow answer: the job may well be fine
                    failures += 1
                    if failures * self.poll_seconds >= GIVE_UP_SECONDS:
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
        finally:
            if client is not None:
                client.close()
