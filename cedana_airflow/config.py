"""Settings: one validated model, filled from defaults < config file < environment < explicit overrides.

Sources, in rising precedence:

- the TOML file at ``CEDANA_CONFIG`` (its ``[cedana]`` table), when set;
- environment variables ``CEDANA_<FIELD>`` (``CEDANA_STORE``, ``CEDANA_NODE``, ``CEDANA_WORK_DIR``,
  ``CEDANA_CRIU``, ...);
- explicit overrides (CLI flags, operator arguments).

Nothing here runs at import time; :func:`load_settings` reads the sources when called.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .errors import ConfigError
from .units import parse_duration

__all__ = ["FailureHistory", "HEARTBEAT_AUTO_SETTINGS", "Layer", "Settings", "default", "env_text", "env_var",
           "load_settings", "redact", "NODE_SETTINGS", "node_settings_refusal", "DEFAULT_CRIU_PREFIX", "STORE_URL_HINT"]

#: Where scripts/install-criu.sh unpacks a private CRIU on machines whose apt has no CRIU >= 4.
DEFAULT_CRIU_PREFIX = "/opt/cedana-airflow/criu"

#: Settings only a node's own configuration may give (its environment, a CEDANA_CONFIG root owns,
#: airflow.cfg): an operator argument, the opt-in list's defaults, a pod's or a batch job's environment
#: naming one is refused, since whoever chooses the key that verifies chooses what the node runs (keys.py).
NODE_SETTINGS = frozenset({"signing_key", "signing_key_file", "allow_unsigned", "legacy_key_file"})

_ENV_PREFIX = "CEDANA_"
STORE_URL_HINT = "use file:///abs/dir or s3://bucket/prefix"
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def redact(value: object) -> object:
    """A value fit for an error message or a log line: credentials in URLs are masked."""
    return _USERINFO.sub("***@", value) if isinstance(value, str) else value


def printable(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, each control character a ``?``: fit for one log line (what a
    caller sent, or a line that quotes it)."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


class FailureHistory(BaseModel):
    """Failures of one kind of work (a queue's tasks) that were not the workload's own doing: nodes lost,
    tries killed from outside, tasks stopped by their infrastructure; and the run time they were seen in.
    The Airflow adapter reads it from Airflow's history (airflow/history.py); the core only uses it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # Bounded, and its text one printable line: through the node agent it is a caller's word, said in the
    # agent's log and the checkpoint listing (0.8.3).
    failures: int = Field(default=0, ge=0, le=10**9)
    exposure_seconds: float = Field(default=0.0, ge=0, le=1e12, allow_inf_nan=False,
                                    description="Run time of the tries seen.")
    tries: int = Field(default=0, ge=0, le=10**9)
    window_days: float = Field(default=30.0, gt=0, le=36500, allow_inf_nan=False)
    scope: str = Field(default="", max_length=300, description="What was counted, e.g. 'queue gpu'.")
    note: str = Field(default="", max_length=300, description="Why the history is partial or missing, when it is.")

    @field_validator("scope", "note")
    @classmethod
    def _one_printable_line(cls, v: str) -> str:
        return printable(v, len(v))


class Settings(BaseModel):
    """Every core setting, with its default written once, here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str = Field(
        default="",
        description="Store URL: file://DIR or s3://bucket/prefix. Empty means file:// under the working directory.",
    )
    node: str = Field(default="", description="This node's name. Empty means the hostname.")
    work_dir: Path | None = Field(
        default=None, description="Local work directory for dumps and restores. None means a temp dir."
    )
    criu: str = Field(default="", description="Path to the criu binary. Empty means: private prefix, else PATH.")
    criu_prefix: Path = Field(default=Path(DEFAULT_CRIU_PREFIX), description="Private CRIU prefix.")
    heartbeat_seconds: float | Literal["auto"] = Field(
        default=600.0, description="Seconds between heartbeats: a task the opt-in list admits is checkpointed every "
        "10 minutes unless this says otherwise; 0 = none (only a stop's final checkpoint); auto = chosen from this "
        "task's measured checkpoint cost and the failure rate of its kind of work (Young/Daly: docs/heartbeat.md), "
        "between heartbeat_min_seconds and heartbeat_max_seconds, and chosen again as the cost changes.",
    )
    heartbeat_min_seconds: float = Field(
        default=60.0, gt=0, allow_inf_nan=False, description="heartbeat = auto never checkpoints more often than this.")
    heartbeat_max_seconds: float = Field(
        default=3600.0, gt=0, allow_inf_nan=False,
        description="heartbeat = auto never waits longer than this between checkpoints: where no failure was ever "
        "seen (and no mtbf_hours is declared), this is its interval.",
    )
    mtbf_hours: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="heartbeat = auto's prior: the mean time between failures this work should expect (a spot "
        "fleet's eviction rate, a flaky rack's), counted as one failure in this many hours on top of what Airflow's "
        "history shows. Unset: the history alone.",
    )
    failure_history: FailureHistory | None = Field(
        default=None,
        description="What Airflow's history says of this kind of work's failures, for heartbeat = auto: set by the "
        "operators from Airflow's API (docs/heartbeat.md); a JSON object in CEDANA_FAILURE_HISTORY.",
    )
    mode: Literal["transparent", "cooperative", "auto"] = Field(
        default="transparent",
        description="How a heartbeat checkpoints: transparent = CRIU (and the driver API) freeze and dump the "
        "tree, no code change; cooperative = the workload writes its own state into CEDANA_CHECKPOINT_DIR when "
        "asked (cedana_airflow.coop; docs/cooperative.md); auto = transparent where CRIU can run here (with "
        "CAP_SYS_ADMIN), else, or for GPU state this node cannot dump, cooperative once the workload declares it "
        "can, else nothing (said once).",
    )
    cooperative_signal: str = Field(
        default="SIGUSR1",
        description="The signal that asks a cooperative workload for its state (besides the request file it can "
        "poll); sent only to processes that handle it, so it never kills one that does not. none = file only.",
    )
    cooperative_verify_command: str = Field(
        default="",
        description="A command that checks a cooperative checkpoint's files, recorded in each one: the verify drill "
        "puts the files back in a scratch directory, runs it there with CEDANA_RESTORE_DIR naming them, and exit 0 "
        "means good. Split with shell rules; no shell runs it.",
    )
    cooperative_timeout_seconds: float = Field(
        default=300.0, gt=0, allow_inf_nan=False,
        description="How long a cooperative checkpoint may take from the request to its COMPLETE marker; past "
        "it the heartbeat is skipped (nothing of it is kept) and the workload runs on.",
    )
    job_parts: int = Field(
        default=1, ge=1, le=1024,
        description="How many nodes' parts one job has (docs/jobs.md): above 1, every part's supervisor runs under "
        "the same checkpoint ID with its own job_part, part 0 opens each heartbeat's round, the parts freeze "
        "together, and a seq exists only once every part is stored. 1 = a job on one node.",
    )
    job_part: int = Field(
        default=0, ge=0,
        description="Which part of the job this supervisor runs: 0 (the coordinator) to job_parts - 1, the same "
        "on every try (a node rank: Slurm's SLURM_NODEID, torchrun's --node-rank).",
    )
    job_barrier_seconds: float = Field(
        default=30.0, gt=0, le=110, allow_inf_nan=False,
        description="How long the parts of a job may wait for each other, frozen, at a heartbeat (and, after a "
        "restore, for each other to be up); past it the round fails, every part runs on and the previous seq "
        "stays the latest.",
    )
    agent: Literal["off", "auto", "require"] = Field(
        default="auto",
        description="How a task's workload is checkpointed: through the node agent (`cedana-airflow agent`, "
        "docs/agent.md), or by the task's own process. auto = the task's process where it is root (it runs "
        "CRIU itself, as before), else the agent, and where none answers the task runs unprotected and says "
        "so; require = the agent always (none answering fails the try); off = the task's own process always.",
    )
    agent_socket: Path = Field(
        default=Path("/run/cedana-airflow/agent.sock"),
        description="Where the node agent listens (`cedana-airflow agent`) and its callers find it; its folder "
        "must be one only root may write (docs/agent.md).",
    )
    agent_coop_dir: Path | None = Field(
        default=None, description="The node agent's: where its callers' cooperative checkpoints are written and put "
        "back (root's, 0711, in folders of root's: each workload reaches only its own folder, by name). Unset: "
        "`coop` beside the agent's socket, which is memory (a tmpfs under /run): point it at a local disk for "
        "states of more than a few GB.",
    )
    agent_readers: tuple[str, ...] = Field(
        default=(), description="The node agent's: groups (names or gids) whose members may see, through the agent, "
        "every checkpoint ID's facts (seq, node, time, size, Airflow task; never an image), e.g. the triggerer's "
        "user for deferred checkpoint sensors. Anyone else sees only its own uid's IDs, and root all. Several: "
        "separated by ','.",
    )
    agent_drillers: tuple[str, ...] = Field(
        default=(), description="The node agent's: groups (names or gids) whose members may have it run fleet drills "
        "(verify, canary: as root, with the node's store and key) and keep live drill reports, and see every ID as "
        "agent_readers do: the drill DAG's user. Several: separated by ','.",
    )
    agent_max_keep_checkpoints: int = Field(
        default=50, ge=1, description="The node agent's: the most checkpoints a request may keep per checkpoint ID "
        "(keep_checkpoints); a request for more is refused in one line. Bounds what one caller makes every listing, "
        "query and retention pass of that ID cost (0.8.4).",
    )
    writer_lease_seconds: float = Field(
        default=60.0, ge=0, allow_inf_nan=False,
        description="A supervisor's hold on its checkpoint ID lapses this long after its last renewal (it renews "
        "every third of it). A second supervisor of the same try waits up to this long to learn whether the "
        "holder is alive before it is refused; a newer try takes over at once. 0 = no lease (stores without "
        "conditional writes).",
    )
    gpu: Literal["auto", "off", "require"] = Field(
        default="auto",
        description="GPU state: auto = a tree holding CUDA state is checkpointed through the driver's checkpoint "
        "API when this node has it, else its heartbeats are skipped (said once); require = refuse to start "
        "where GPU state cannot be checkpointed; off = never touch the GPU (a tree holding CUDA state is not "
        "checkpointed).",
    )
    gpu_lock_timeout_seconds: float = Field(
        default=10.0, gt=0, le=3600, allow_inf_nan=False,
        description="How long the driver may wait for a CUDA process's running work before it is locked for a "
        "checkpoint; past it the heartbeat is skipped and the process runs on.",
    )
    checkpoint_on_term: bool = Field(
        default=True, description="On SIGTERM to the supervisor, take a final checkpoint before stopping."
    )
    stop_grace_seconds: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="A stop ends the workload tree right after its final checkpoint (SIGKILL: nothing it does after "
        "the checkpoint survives, since the retry redoes it). Above 0: for a workload that needs its own shutdown, "
        "SIGTERM goes to it after the final checkpoint, then SIGKILL this many seconds later (capped to fit the "
        "stop window). Unprotected workloads get SIGTERM and 3 s when this is 0."
    )
    chunk_avg_bytes: int = Field(
        default=1 << 20, ge=64 << 10, le=64 << 20, description="Average chunk size for new stores."
    )
    compression: Literal["zstd", "none"] = Field(default="zstd", description="Chunk compression.")
    keep_local: bool = Field(default=False, description="Keep local dump directories after upload (debugging).")
    keep_checkpoints: int = Field(default=3, ge=1, description="Complete checkpoints kept per checkpoint ID.")
    delete_on_success: bool = Field(
        default=False, description="Delete every checkpoint of an ID once its workload exits 0."
    )
    max_checkpoint_bytes: int = Field(
        default=64 << 30, ge=0,
        description="Skip a heartbeat whose estimated size (RSS + memfds + GPU memory) is above this, or whose "
        "dump came out above it (the tree grew after the estimate: the dump is dropped, a final checkpoint at a "
        "stop is stored anyway); 0 = no limit. 64 GiB freezes for about 40 s at the 0.6 s/GB measured here.",
    )
    max_captured_bytes: int = Field(
        default=256 << 20, ge=0,
        description="Files the tree holds open for writing are copied while it is frozen; above this many bytes "
        "in all, a heartbeat is skipped, naming the largest file. 0 = no limit.",
    )
    stop_window_seconds: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="How long a stop leaves for the final checkpoint (Airflow: 5 s from SIGTERM to SIGKILL; its "
        "operators set that when this is 0). A checkpoint that took longer is said once: a stop will fall back "
        "to the last heartbeat. 0 = not checked.",
    )
    checkpoint_above_bytes: int = Field(
        default=0, ge=0, description="Checkpoint at once when the tree's memory crosses this (a policy trigger); 0 = off."
    )
    s3_endpoint_url: str = Field(
        default="", description="S3-compatible endpoint (MinIO, Ceph RGW, R2...). Empty: AWS_ENDPOINT_URL, else AWS."
    )
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="Bucket addressing; 'path' for most self-hosted S3-compatible servers."
    )
    s3_sse: Literal["", "AES256", "aws:kms"] = Field(
        default="", description="Server-side encryption for every object written: '', 'AES256' (SSE-S3) or 'aws:kms'."
    )
    s3_sse_kms_key_id: str = Field(default="", description="KMS key ID or ARN for s3_sse = 'aws:kms'.")
    s3_conditional_writes: Literal["probe", "trust"] = Field(
        default="probe", description="'probe': before the first write, check on a scratch key that the S3 server "
        "honours create-only (If-None-Match: *) and compare-and-swap (If-Match) PUTs, and refuse a server that "
        "ignores them; 'trust': skip the check, for a server that cannot be probed (its risks: docs/store-format.md, "
        "Conditional writes).")
    s3_parallelism: int = Field(default=16, ge=1, le=256, description="S3 requests in flight at once.")
    s3_read_timeout_seconds: float = Field(
        default=60.0, gt=0, allow_inf_nan=False, description="How long one S3 request may wait for an answer before "
        "it is retried (5 attempts in all): a heartbeat against a hung endpoint gives up after about 5 times this.")
    s3_connect_timeout_seconds: float = Field(
        default=10.0, gt=0, allow_inf_nan=False, description="How long connecting to the S3 endpoint may take.")
    optin_file: Path | None = Field(
        default=None, description="The opt-in list (TOML, or YAML with PyYAML). None: nothing is in scope."
    )
    progress: Literal["auto", "always", "never"] = Field(
        default="auto", description="Progress display for long transfers: auto = only on a terminal."
    )
    restore_mode: Literal["lazy", "full"] = Field(
        default="lazy",
        description="lazy = the restored workload runs while its memory streams in from the store (each chunk "
        "verified first), where the kernel has userfaultfd (doctor says); elsewhere, and for GPU state, full = "
        "fetch and verify every chunk, then restore.",
    )
    io_uring: Literal["deny", "allow"] = Field(
        default="deny",
        description="Transparent mode: deny = the workload's tree is refused io_uring (io_uring_setup answers ENOSYS, "
        "through a seccomp filter), so libraries that would take one fall back to epoll (libuv >= 1.50, in PyTorch's "
        "TCPStore and so in every torchrun job, and in Node.js): CRIU cannot checkpoint an io_uring. allow = no "
        "filter; a workload that then holds an io_uring is named at its first heartbeat and not checkpointed.",
    )
    lazy_pages_via: Literal["auto", "ours", "file", "socket"] = Field(
        default="auto",
        description="Who serves a lazy restore's page faults: ours = our own lazy-pages daemon (each fault answered "
        "with the 1 MiB around it); or CRIU's, fed with page files over /dev/fuse (file) or its page-server "
        "protocol over a socketpair (socket); auto = ours.",
    )
    full_restore_via: Literal["write", "stream"] = Field(
        default="write",
        description="How a full restore hands pages to criu restore: write = every image file is written to the "
        "work dir first, then restored; stream = page files over /dev/fuse that fill with verified chunks while CRIU "
        "reads them (no copy of the pages on the work dir's disk; where /dev/fuse is not usable, write). On 2 cores "
        "stream measured no faster (bench/README.md).",
    )
    max_restore_gap_seconds: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description="Never restore a checkpoint older than this (a real-time reader's data has moved on): "
        "older ones are refused one by one, and with none left the workload starts fresh. Unset: no limit."
    )
    lease_seconds: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="License lease length of license-bound software (cedana:license=NAME): a checkpoint older than "
        "this holds a dead license checkout, so it is not restored and the workload starts fresh, unless "
        "lease_renew_command renews the lease first. Unset: no lease."
    )
    lease_renew_command: str | None = Field(
        default=None,
        description="Run (split with shell rules, no shell) before restoring a checkpoint older than lease_seconds, "
        "with CEDANA_CHECKPOINT_ID and CEDANA_RESTORE_GAP_SECONDS in its environment, e.g. to check the license out "
        "again: exit 0 restores, anything else starts fresh."
    )
    signing_key: SecretStr | None = Field(
        default=None, description="A node setting: the node key inline (tests, the CLI by hand). Prefer "
        "signing_key_file; never in a config file others read."
    )
    signing_key_file: Path | None = Field(
        default=None, description="A node setting: the node key, the file that signs every manifest this node writes "
        "and verifies every one it restores (its first line; root-only, mode 0400). Unset: "
        "/etc/cedana-airflow/node.key, created on first use by a supervisor running as root "
        "(docs/security.md#the-node-key)."
    )
    allow_unsigned: bool = Field(
        default=False, description="A node setting: restore unsigned manifests too (each such restore is logged). "
        "Whoever can write the store then chooses what this node runs. Writers sign whatever it says."
    )
    legacy_key_file: Path | None = Field(
        default=None, description="A node setting: verify-only keys, one per line, for checkpoints signed before a "
        "key change (e.g. the Airflow Variable cedana_signing_secret before 0.8.0): they verify, never sign."
    )
    taskflow_dir: Path | None = Field(
        default=None, description="@task.checkpointed's folders (<taskflow_dir>/<checkpoint ID>): the same real path "
        "on every node, outside the work dir; every folder on the way root's or the worker's and writable by nobody "
        "else. Unset: /var/lib/cedana-airflow/taskflow for a root worker, else ~/.local/state/cedana-airflow/taskflow."
    )
    store_credentials_dir: Path | None = Field(
        default=None, description="A directory of files named AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (optional: "
        "AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION): the S3 store's credentials, read by the supervisor only "
        "(a Kubernetes Secret mounted as a volume: the wrap route). Unset: boto3's standard credential chain."
    )
    keep_env: tuple[str, ...] = Field(
        default=(), description="Store credential variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
        "AWS_PROFILE, ...) the workload keeps: by default they are left out of its environment, which every "
        "checkpoint image holds. Several: separated by ','."
    )
    restore_roots: tuple[Path, ...] = Field(
        default=(), description="Where a restore may put back captured files (files the workload held open for "
        "writing) and create its working directory. Signed checkpoints (every one since 0.8.0): anywhere the "
        "workload's own user could write when unset, only under these (and the working directory) when set. "
        "Unsigned (allow_unsigned): only under these and the restoring command's working directory. Never a system "
        "tree or the deny-list (docs/security.md#where-a-restore-writes), never through a symlink; the first "
        "checkpoint says which files a restore would refuse. Several: separated by ':' (CEDANA_RESTORE_ROOTS)."
    )
    restore_deny: tuple[Path, ...] = Field(
        default=(), description="More paths a restore never writes, at or below each, whatever the manifest, its "
        "signature and restore_roots say (docs/security.md#where-a-restore-writes); the Airflow side adds its "
        "dags_folder, plugins_folder and airflow.cfg. Several: separated by ':' (CEDANA_RESTORE_DENY)."
    )

    @field_validator("store")
    @classmethod
    def _store_scheme(cls, v: str) -> str:
        if v and not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError(f"store {redact(v)!r} has no known scheme; {STORE_URL_HINT}")
        return v

    @field_validator("keep_env", "agent_readers", "agent_drillers", mode="before")
    @classmethod
    def _names_from_text(cls, v: object) -> object:
        if isinstance(v, str):  # CEDANA_KEEP_ENV, [cedana] keep_env
            return tuple(n.strip() for n in v.split(",") if n.strip())
        return v

    @field_validator("keep_env")
    @classmethod
    def _never_the_key(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if "CEDANA_SIGNING_KEY" in v:
            raise ValueError("CEDANA_SIGNING_KEY is the node key: a workload holding it could sign any checkpoint. "
                             "Remove it from keep_env")
        return v

    @field_validator("restore_roots", "restore_deny", mode="before")
    @classmethod
    def _roots_from_text(cls, v: object) -> object:
        if isinstance(v, str):  # CEDANA_RESTORE_ROOTS, [cedana] restore_roots: a PATH-like list
            return tuple(p for p in v.split(":") if p)
        return v

    @field_validator("restore_roots", "restore_deny")
    @classmethod
    def _roots_absolute(cls, v: tuple[Path, ...]) -> tuple[Path, ...]:
        for p in v:
            if not p.is_absolute():
                raise ValueError(f"restore root {str(p)!r} is not an absolute path; write it as /abs/dir")
        return v

    @field_validator("cooperative_verify_command")
    @classmethod
    def _splits(cls, v: str) -> str:
        import shlex

        try:
            shlex.split(v)
        except ValueError as e:
            raise ValueError(f"{v!r} does not split into a command ({e}); quote it as a shell would") from None
        return v

    @field_validator("cooperative_signal")
    @classmethod
    def _signal_name(cls, v: str) -> str:
        import signal

        name = v.strip().upper()
        if name in ("", "NONE"):
            return "none"
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT") or not hasattr(signal.Signals, name):
            raise ValueError(f"{v!r} is not a signal a workload can catch for a checkpoint request; use e.g. "
                             "SIGUSR1, SIGUSR2 or none")
        return name

    @field_validator("node")
    @classmethod
    def _node_name(cls, v: str) -> str:
        if v and (len(v) > 253 or any(c.isspace() or c == "/" for c in v)):
            raise ValueError(f"node {v!r} must be a host-like name without spaces or '/'")
        return v

    @field_validator("failure_history", mode="before")
    @classmethod
    def _history_from_text(cls, v: object) -> object:
        if isinstance(v, str):  # CEDANA_FAILURE_HISTORY: JSON, as the routes carry it
            return json.loads(v) if v.strip() else None
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _duration_text(cls, v: object, info: ValidationInfo) -> object:
        """``10m``, ``1h30m``, ``250ms`` wherever seconds are taken (every ``*_seconds`` setting: a variable,
        airflow.cfg, a DAG's argument): a number stays pydantic's to check, ``auto`` its field's."""
        if (info.field_name or "").endswith("_seconds") and isinstance(v, str) and v.strip() \
                and v.strip().lower() != "auto":
            try:
                float(v)
            except ValueError:
                return parse_duration(v)  # its ValueError names the forms it takes
        return v

    @field_validator("heartbeat_seconds")
    @classmethod
    def _heartbeat(cls, v: float | str) -> float | str:
        if not isinstance(v, str) and not 0 <= v < float("inf"):
            raise ValueError("a heartbeat is 0 (none), a number of seconds, or auto")
        return v

    @model_validator(mode="after")
    def _heartbeat_bounds(self) -> Settings:
        if self.heartbeat_min_seconds > self.heartbeat_max_seconds:
            raise ValueError(f"heartbeat_min_seconds {self.heartbeat_min_seconds:g} is above heartbeat_max_seconds "
                             f"{self.heartbeat_max_seconds:g}")
        return self

    @property
    def heartbeat_auto(self) -> bool:
        return self.heartbeat_seconds == "auto"

    @property
    def heartbeat_on(self) -> bool:
        return self.heartbeat_auto or float(self.heartbeat_seconds) > 0

    #: Where each value came from (a flag, a variable, a file, airflow.cfg, an operator argument): said
    #: next to the value where a person reads it (the heartbeat in force). A value not named is the default.
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    def source(self, name: str) -> str:
        return self._sources.get(name, f"the default of {name}")

    def given(self, name: str) -> bool:
        """Whether ``name`` was set somewhere (not its default)."""
        return name in self._sources

    def with_sources(self, sources: Mapping[str, str]) -> Settings:
        """These settings, with ``sources`` said for the values they name (on top of those known)."""
        self._sources = {**self._sources, **sources}
        return self

    def sources(self) -> dict[str, str]:
        return dict(self._sources)

    def heartbeat_text(self) -> str:
        """The heartbeat in force and where it came from, as a person reads it: ``every 10m (the default of
        heartbeat_seconds)``, ``off (heartbeat_seconds = 0 from --heartbeat)``, ``auto, 1m to 10m (...)``."""
        from .units import duration_text

        where = self.source("heartbeat_seconds")
        if self.heartbeat_auto:
            return (f"auto, between {duration_text(self.heartbeat_min_seconds)} and "
                    f"{duration_text(self.heartbeat_max_seconds)} (from {where})")
        if not self.heartbeat_on:
            return f"off (heartbeat_seconds = 0 from {where}): only a stop's final checkpoint protects it"
        return f"every {duration_text(float(self.heartbeat_seconds))} (from {where})"

    @model_validator(mode="after")
    def _job_part_in_job(self) -> Settings:
        if self.job_part >= self.job_parts:
            raise ValueError(f"job_part {self.job_part} is not a part of a job of job_parts {self.job_parts}: "
                             f"give 0 to {self.job_parts - 1}")
        return self

    @model_validator(mode="after")
    def _kms_needs_key(self) -> Settings:
        if self.s3_sse_kms_key_id and self.s3_sse != "aws:kms":
            raise ValueError("s3_sse_kms_key_id is set but s3_sse is not 'aws:kms'; set both or neither")
        return self

    def resolved_store(self) -> str:
        return self.store or f"file://{Path.cwd() / '.cedana' / 'store'}"

    def resolved_node(self) -> str:
        return self.node or socket.gethostname()


def default(name: str) -> Any:
    """The default of setting ``name``, for code below the settings that needs the same value (a
    store.json written by hand, a library call without settings): written once, in Settings."""
    return Settings.model_fields[name].default


#: What heartbeat = auto chooses from besides the heartbeat itself: a route that carries auto carries these.
HEARTBEAT_AUTO_SETTINGS = ("heartbeat_min_seconds", "heartbeat_max_seconds", "mtbf_hours", "failure_history")


def env_var(name: str) -> str:
    """The environment variable of setting ``name``."""
    return _ENV_PREFIX + name.upper()


def env_text(name: str, value: Any) -> str:
    """Setting ``name``'s ``value`` as its CEDANA_* variable spells it, so that :func:`load_settings` reads
    it back (what the routes put into a pod or a batch job)."""
    if isinstance(value, (tuple, list)):  # restore_roots reads like PATH, keep_env like a list
        return (":" if name in ("restore_roots", "restore_deny") else ",").join(str(v) for v in value)
    if isinstance(value, BaseModel):  # failure_history: JSON
        return value.model_dump_json()
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        key = env_var(name)
        if key in environ and environ[key] != "":
            out[name] = environ[key]
    _warn_near_misses(environ)
    return out


_said_near_misses: set[str] = set()
#: CEDANA_* variables of ours that are not settings: what the routes and the hooks hand a workload or a pod.
OWN_VARIABLES = frozenset({
    "CEDANA_CONFIG", "CEDANA_ENABLE", "CEDANA_CHECKPOINT", "CEDANA_CHECKPOINT_ID", "CEDANA_CHECKPOINT_DIR",
    "CEDANA_CHECKPOINT_READY", "CEDANA_CHECKPOINT_REQUEST", "CEDANA_CHECKPOINT_SIGNAL", "CEDANA_RESTORE_DIR",
    "CEDANA_RESTORE_GAP_SECONDS", "CEDANA_IDEMPOTENCY_KEY", "CEDANA_FAILPOINTS", "CEDANA_MIN_SUPERVISOR",
    "CEDANA_NODE_LABELS", "CEDANA_OPERATOR_VERSION", "CEDANA_TEMPLATE_FIELDS"})


def _warn_near_misses(environ: Mapping[str, str]) -> None:
    """A CEDANA_* variable that no setting reads and that is one typo from one (CEDANA_STOR): said once per
    process, with the name meant, instead of ignored in silence. Only near misses: other tools (and our own
    routes: CEDANA_ENABLE, CEDANA_CHECKPOINT_DIR) set CEDANA_* names of their own."""
    known = [env_var(name) for name in Settings.model_fields]
    for var in environ:
        if var.startswith(_ENV_PREFIX) and var not in known and var not in OWN_VARIABLES and var not in _said_near_misses:
            close = [f"{var}_SECONDS"] if f"{var}_SECONDS" in known else difflib.get_close_matches(var, known, n=1,
                                                                                                    cutoff=0.85)
            if close:
                _said_near_misses.add(var)
                logging.getLogger(__name__).warning("%s is not a setting and is ignored. Did you mean %s?", var,
                                                    close[0])


def _from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())  # the file read is the file judged below: no swap between them
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} (CEDANA_CONFIG) does not exist. Create it or unset CEDANA_CONFIG.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}. Fix the file or unset CEDANA_CONFIG.") from None
    table = doc.get("cedana", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [cedana] must be a table. Write it as '[cedana]' followed by key = value lines.")
    if NODE_SETTINGS & table.keys():  # a DAG may name the file (the Slurm route's node_config=): root must own it
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise ConfigError(f"config file {path} sets {', '.join(sorted(NODE_SETTINGS & table.keys()))}, node settings, "
                              f"but root does not own it alone (uid {st.st_uid}, mode {st.st_mode & 0o777:04o}). "
                              f"Run 'chown root: {path}; chmod go-w {path}'.")
    return table


def node_settings_refusal(values: Mapping[str, Any], source: str) -> None:
    """Refuse node settings (the key, allow_unsigned) from ``source``: a DAG's arguments, the opt-in list."""
    named = sorted(k for k, v in values.items() if k in NODE_SETTINGS and v is not None)
    if named:
        raise ConfigError(f"setting {named[0]} (from {source}) is a node setting: a DAG cannot choose the key that "
                          "signs and verifies its checkpoints. Remove it; the node's configuration names the key "
                          "(docs/security.md#the-node-key).")


#: A layer of settings between the environment and the overrides: (how to name a key's source, values).
Layer = tuple[Callable[[str], str], Mapping[str, Any]]


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None, *,
                  layers: Sequence[Layer] = (), overrides_source: Callable[[str], str] | None = None) -> Settings:
    """Read the config file and environment, then ``layers`` (e.g. airflow.cfg's [cedana]), then
    ``overrides`` (None values ignored everywhere), and validate once, naming the source of a bad value."""
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    if env.get("CEDANA_CONFIG"):
        for k, v in _from_file(env["CEDANA_CONFIG"]).items():
            merged[k], source[k] = v, f"{env['CEDANA_CONFIG']} [cedana] {k}"
    for k, v in _from_env(env).items():
        merged[k], source[k] = v, env_var(k)
    name_override = overrides_source or (lambda k: f"--{k.replace('_', '-')}")
    for name, values in [*layers, (name_override, overrides or {})]:
        for k, v in values.items():
            if v is not None:
                merged[k], source[k] = v, name(k)
    try:
        return Settings(**merged).with_sources(source)
    except ValidationError as e:
        err = e.errors()[0]
        if not err["loc"]:  # a rule between settings (model_validator): its message names them
            raise ConfigError(f"settings: {str(err['msg']).removeprefix('Value error, ')}. Fix one of them.") from None
        field = str(err["loc"][0])
        where = source.get(field, field)
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(Settings.model_fields))
            raise ConfigError(f"unknown setting {field!r} (from {where}). Known settings: {known}.") from None
        shown = "***" if field in ("signing_key",) else redact(merged.get(field))  # a key is never said, even a bad one
        raise ConfigError(
            f"setting {field} = {shown!r} (from {where}) is invalid: {str(err['msg']).removeprefix('Value error, ')}. "
            "Fix or remove it."
        ) from None
