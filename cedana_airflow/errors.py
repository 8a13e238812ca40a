"""Every error cedana-airflow raises on purpose.

::

    CedanaError                      root: callers catch this one
    ├── ConfigError                  a setting is malformed or two settings conflict
    ├── CheckpointIdError            a checkpoint ID is unsafe (path/key traversal) or malformed
    ├── StoreError                   the store cannot be used
    │   ├── StoreUnavailable         not reachable, not writable, unknown format version
    │   ├── StoreBusy                a lock is held: gc runs, or checkpoints are being written
    │   │   ├── WriterLeaseHeld      another supervisor writes this checkpoint ID
    │   │   └── WriterFenced         a newer supervisor took this checkpoint ID over
    │   ├── CheckpointNotFound       no complete checkpoint under that checkpoint ID
    │   └── CorruptCheckpoint        a chunk or manifest failed verification (never restored)
    └── EngineError                  freezing, dumping or restoring failed
        ├── CommandNotFound          the workload's command does not exist (exit code 127)
        ├── EngineUnavailable        CRIU missing, too old, or not permitted (not root)
        ├── DumpFailed               `criu dump` failed; the workload keeps running
        │   └── GpuCheckpointFailed  the driver could not move GPU state out (or back); rolled back
        └── RestoreFailed            `criu restore` failed
    └── SlurmError                   a Slurm job could not be submitted or followed
        └── SlurmRefused             sbatch refused it (unknown partition, bad resources): retrying cannot help
    └── Refused                      the node agent will not do this for this caller (not its workload, a
                                     node setting, a malformed request); said in one line and audited
    EngineUnavailable
        └── AgentUnavailable         no node agent answers on this node's socket, or it is not ready

Messages are one line: "<what failed>: <cause>. <fix>." and name the key, path or value involved.
"""

from __future__ import annotations

__all__ = [
    "AgentUnavailable",
    "CedanaError",
    "CheckpointIdError",
    "CheckpointNotFound",
    "CommandNotFound",
    "ConditionalWritesIgnored",
    "ConfigError",
    "CorruptCheckpoint",
    "DumpFailed",
    "GpuUnavailable",
    "EngineError",
    "EngineUnavailable",
    "GpuCheckpointFailed",
    "NodeInTheWay",
    "NotRestorableHere",
    "Refused",
    "RestoreFailed",
    "SlurmError",
    "SlurmRefused",
    "StoreBusy",
    "StoreError",
    "StoreUnavailable",
    "UnknownRequiredBlock",
    "WriterFenced",
    "WriterLeaseHeld",
]


class CedanaError(Exception):
    """Root of every error raised on purpose; its message is one line for a person."""

    exit_code = 1


class ConfigError(CedanaError):
    """A setting is malformed, or two settings conflict. The message names both and the fix."""

    exit_code = 2


class CheckpointIdError(CedanaError):
    """A checkpoint ID is outside the safe character set or too long."""

    exit_code = 2


class StoreError(CedanaError):
    """The store cannot be used as asked."""


class StoreUnavailable(StoreError):
    """The store is not reachable, not writable, or written in a format version we do not know."""


class ConditionalWritesIgnored(StoreUnavailable):
    """The S3 server does not honour conditional writes (the probe's verdict, not a failed request)."""


class StoreBusy(StoreError):
    """A store lock is held: garbage collection is running, or checkpoints are being written."""


class WriterLeaseHeld(StoreBusy):
    """Another supervisor holds the writer lease of this checkpoint ID (store/writer_lease.py)."""


class WriterFenced(StoreBusy):
    """This supervisor's writer lease was taken over: it must not write the checkpoint ID again."""


class CheckpointNotFound(StoreError):
    """No complete checkpoint exists under a checkpoint ID (a partial one does not count)."""


class CorruptCheckpoint(StoreError):
    """A chunk or manifest did not match its digest; that checkpoint is never restored."""


class UnknownRequiredBlock(CorruptCheckpoint):
    """A manifest of a later version needs a block this reader does not know: it is never restored
    here (the fix is an upgrade, not a repair)."""


class EngineError(CedanaError):
    """The engine could not freeze, dump or restore."""


class CommandNotFound(EngineError):
    """The workload's command is not an executable file, on PATH or at the path given. Exit code 127,
    as a shell reports it."""

    exit_code = 127


class EngineUnavailable(EngineError):
    """The engine cannot run here: CRIU missing or too old, or not running as root."""


class AgentUnavailable(EngineUnavailable):
    """No node agent answers on this node's socket, or it answers that it is not ready (agent/)."""


class DumpFailed(EngineError):
    """`criu dump` failed. With --leave-running the workload keeps running."""


class GpuCheckpointFailed(DumpFailed):
    """The driver could not move a process's GPU state out (or back); what was done is rolled back."""


class RestoreFailed(EngineError):
    """`criu restore` failed."""


class NotRestorableHere(RestoreFailed):
    """The checkpoint is sound, but this node lacks what it needs from the filesystem (a file the
    workload reads is missing or changed, a socket directory cannot be created safely). Older
    checkpoints of the same workload need the same, so none is tried: the run starts fresh, or the
    operator makes the node match (run/preflight.py)."""


class NodeInTheWay(RestoreFailed):
    """The checkpoint is sound, but something on this node stands where it must go: a port a live process
    holds, an address this node does not have (run/sockets.py). Older checkpoints need the same, and a
    fresh start would bury this one under newer checkpoints, so the try fails with the cause named: the
    checkpoint stays the latest, and the next try (on another node, or here once it is free) resumes it."""


class GpuUnavailable(CedanaError):
    """No NVIDIA driver (or no pynvml) on this node: GPU state cannot be read here."""


class SlurmError(CedanaError):
    """A Slurm command failed or is missing, or a job could not be followed (slurm/client.py)."""


class SlurmRefused(SlurmError):
    """sbatch refused the job as asked (an unknown partition, impossible resources): the same
    submission fails again, so a retry cannot help."""

    exit_code = 2


class Refused(CedanaError):
    """The node agent will not do this for this caller: a workload of another uid, a node setting in a
    task's request, a malformed request. The agent audits it; retrying the same request cannot help."""

    exit_code = 2
