"""Submit a batch job and follow it, through Slurm's own commands on this machine or on a login node.

Where the commands run is a ``Runner``: ``local_runner`` here, or one that runs them over SSH
(the Airflow adapter builds it from an SSH connection). Every failure is one line naming the
command and what Slurm said; a submission Slurm refuses as asked (an unknown partition) is
SlurmRefused, since submitting it again fails again.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import SlurmError, SlurmRefused
from .batch import JobSpec, batch_script, sbatch_argv
from .jobs import JobInfo, parse_sacct, parse_show_job

__all__ = ["OUTPUT_READ_BYTES", "Runner", "SlurmClient", "local_runner"]

#: The most of a job's output read at once.
OUTPUT_READ_BYTES = 1 << 20

#: (argv, standard input, timeout seconds) -> (exit code, stdout, stderr). Raises FileNotFoundError
#: when the command does not exist.
Runner = Callable[[Sequence[str], "str | None", float], "tuple[int, str, str]"]

# What sbatch says when the submission itself is wrong (not a passing outage of the controller).
_REFUSALS = ("invalid partition", "invalid account", "invalid qos", "invalid generic resource", "invalid gres",
             "requested node configuration is not available", "invalid feature", "invalid time limit",
             "node count specification invalid", "unrecognized option", "invalid option", "memory specification")


def local_runner(env: dict[str, str] | None = None) -> Runner:
    def run(argv: Sequence[str], stdin: str | None, timeout: float) -> tuple[int, str, str]:
        p = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout, p.stderr

    return run


class SlurmClient:
    """``local``: the job's files (its directory, its output) are on this machine's file system, read
    directly; otherwise through the runner (``mkdir``, ``tail`` on the login node)."""

    def __init__(self, runner: Runner, where: str = "this worker", timeout: float = 60, local: bool = False) -> None:
        self.runner, self.where, self.timeout, self.local = runner, where, timeout, local

    def close(self) -> None:
        """End what the runner holds open (an SSH login); a later command opens it again."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> SlurmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, argv: Sequence[str], stdin: str | None = None) -> tuple[int, str, str]:
        try:
            return self.runner(argv, stdin, self.timeout)
        except FileNotFoundError:
            raise SlurmRefused(f"{argv[0]} is not installed on {self.where} (not on PATH). Install Slurm's client "
                               "commands there (Debian: slurm-client), or submit through a login node "
                               "(ssh_conn_id=).") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{argv[0]} on {self.where} did not answer within {self.timeout:.0f} s. Check that "
                             "slurmctld is up (scontrol ping).") from None

    def submit(self, spec: JobSpec) -> str:
        """Submit; return the job ID."""
        rc, out, err = self._run(sbatch_argv(spec), batch_script(spec))
        said = (err or out).strip().splitlines()
        line = said[-1] if said else f"exit code {rc}"
        if rc != 0:
            if rc == 127 or "command not found" in line:
                raise SlurmRefused(f"sbatch is not installed on {self.where}: {line}. Install Slurm's client commands.")
            if any(r in line.lower() for r in _REFUSALS):
                raise SlurmRefused(f"sbatch refused the job on {self.where}: {line}. Fix the operator's arguments "
                                   f"(partition {spec.partition!r}; `sinfo -s` lists the partitions).")
            raise SlurmError(f"sbatch failed on {self.where}: {line}")
        job_id = out.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch on {self.where} printed no job ID: {out.strip()!r}")
        return job_id

    def job(self, job_id: str) -> JobInfo:
        rc, out, err = self._run(["scontrol", "show", "job", "-o", job_id])
        info = parse_show_job(out) if rc == 0 else None
        if info is not None:
            return info
        # The controller forgets a job MinJobAge after it ends; accounting (if any) remembers it.
        rc2, out2, _ = self._run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,NodeList"])
        info = parse_sacct(out2, job_id) if rc2 == 0 else None
        if info is None:
            said = (err or out).strip().splitlines()
            raise SlurmError(f"Slurm on {self.where} no longer knows job {job_id} "
                             f"({said[-1] if said else 'no answer'}), and has no accounting to ask. "
                             "Raise MinJobAge in slurm.conf, or configure accounting storage.")
        return info

    def cancel(self, job_id: str) -> None:
        rc, out, err = self._run(["scancel", job_id])
        if rc != 0:
            raise SlurmError(f"scancel {job_id} failed on {self.where}: {(err or out).strip()}")

    def mkdir(self, path: str) -> None:
        """The job's output directory: slurmd opens the output file before the script runs."""
        if self.local:
            try:
                Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
                st = os.lstat(path)
                if st.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
                    said = "it is not a directory of ours (another user's, or a link)"
                else:
                    return
            except OSError as e:
                said = e.strerror or str(e)
        else:
            rc, out, err = self._run(["mkdir", "-p", path])
            if rc == 0:
                return
            said = (err or out).strip()
        raise SlurmError(f"cannot create the job directory {path} on {self.where}: {said}. Choose a job_dir that the "
                         "submit side and the compute nodes share.")

    def read_from(self, path: str, offset: int, limit: int = OUTPUT_READ_BYTES) -> bytes:
        """Up to ``limit`` bytes of a file the job is writing, from byte ``offset`` (b'' when there are none
        yet). Over SSH the runner hands text back: re-encoded, the offsets hold for UTF-8 output."""
        if self.local:
            try:  # never through a link, as read()
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return b""
            with os.fdopen(fd, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        rc, out, _ = self._run(["tail", "-c", f"+{offset + 1}", path])
        return out.encode()[:limit] if rc == 0 else b""

    def read(self, path: str, limit: int = OUTPUT_READ_BYTES) -> str:
        """The last ``limit`` bytes of a file the job wrote (its output), or '' when there is none."""
        if self.local:
            try:  # never through a link: the task log must show the job's output, not a file it points at
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return ""
            with os.fdopen(fd, "rb") as f:
                f.seek(max(0, os.fstat(fd).st_size - limit))
                return f.read().decode(errors="replace")
        rc, out, _ = self._run(["tail", "-c", str(limit), path])
        return out if rc == 0 else ""

