"""A real local Slurm cluster (Debian's 22.05 packages) for the tests and the demo.

Everything runs on loopback in one dir and is stopped on exit: munged with its own socket and a fresh
key, slurmctld, and one slurmd per node name (Debian builds Slurm with multiple-slurmd, so several
slurmd share this host, each with ``-N name`` and its own port and spool dir). All run in the
foreground as our children, root-owned, no systemd, no cgroups. A part that does not come up is one
line naming it and its log.

    with SlurmCluster(root) as cluster:
        job_id = subprocess.run(["sbatch", "--parsable", "--requeue", ...], env=cluster.env(), ...)
        cluster.kill_node("node1")        # SIGKILL its slurmd and every process of its jobs: a node loss

What a node loss looks like here (measured, SlurmdTimeout=10): the node is ``alloc*`` (not responding)
after ~11 s and ``down*`` after ~19 s; in the same instant its jobs go RUNNING -> PENDING with Restarts=1
(NODE_FAIL is only in the job-completion log; a --no-requeue job stays NODE_FAIL, Reason=NodeDown), then
Reason=BeginTime for cred_expire (5 s), and RUNNING on another node ~26 s after the kill, the batch script
run from its start with SLURM_RESTART_COUNT=1 (unset on the first run). JobRequeue=1 makes every batch job
requeueable unless it says --no-requeue; a rerun truncates its --output unless --open-mode=append. All
nodes share this machine's hostname: a job tells its node by SLURMD_NODENAME (or HOSTNAME, which Slurm sets).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection

from local_parts import Deployment, descendants, free_port, stop_parts, tail  # (scripts/ is on sys.path)


class SlurmError(RuntimeError):
    """One part of the cluster did not come up, or a Slurm command failed; the message names it."""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def reap(pids: Collection[int] = ()) -> None:
    """Reap those of our zombie children that are Slurm's: the slurmstepds and batch scripts, and ``pids``
    (job processes we killed). They are ours to reap when this process is a child subreaper (prctl
    PR_SET_CHILD_SUBREAPER, as a Cedana supervisor in the same test process makes itself): a slurmstepd is
    orphaned by slurmd's double fork, a job's process by its killed parent. Otherwise init reaps them."""
    me = str(os.getpid())
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        pid, comm = int(stat.split("/")[2]), text[text.index("(") + 1 : text.rindex(")")]
        rest = text[text.rindex(")") + 2 :].split()
        if rest[0] == "Z" and rest[1] == me and (comm in ("slurmstepd", "slurm_script") or pid in pids):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _fds(pid: int) -> set[str]:
    """What ``pid``'s open descriptors point at (``socket:[inode]`` for a socket)."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def parse_fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` (``scontrol -o``, jobcomp lines): a value runs up to the next key, so it may
    hold spaces; keys may hold ``/`` and ``:`` (``Socks/Node``, ``ReqB:S:C:T``)."""
    return dict(re.findall(r"([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|\s*$)", line.strip()))


class SlurmCluster(Deployment):
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("node1", "node2"),
                 partitions: dict[str, tuple[str, ...]] | None = None, slurmd_timeout: int = 10) -> None:
        self.root, self.nodes, self.slurmd_timeout = Path(root).resolve(), tuple(nodes), slurmd_timeout
        self.partitions = partitions if partitions is not None else {"cedana": self.nodes, "batch": self.nodes}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[int] = set()
        self.ports: dict[str, int] = {}
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.jobcomp = self.root / "jobcomp.txt"
        self.hostname = socket.gethostname().split(".")[0]  # what slurmctld and slurmd see as "this host"
        self.cluster_name = "cedana"
        #: where node agents listen (start_agent), %n the node's name; jobs find theirs by [cedana] agent_socket
        self.agent_sockets = Path(f"/run/cedana-slurm-{os.getpid()}-{id(self):x}/%n/agent.sock")
        self._agent_env: dict[str, dict[str, str]] = {}

    # -- commands ------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """For sbatch, squeue, scontrol, scancel, sinfo, sacct against this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise SlurmError(f"{' '.join(argv)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
        return r

    def node_state(self, name: str) -> str:
        """sinfo's short state, e.g. ``idle``, ``alloc``, ``mix``, ``down*`` (``*``: not responding)."""
        out = self.run("sinfo", "-h", "-N", "-n", name, "-o", "%t").stdout.split()
        return out[0] if out else ""

    def node_states(self) -> dict[str, str]:
        return dict(line.split()[:2] for line in self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.splitlines())

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, Reason, NodeList, BatchHost, Restarts, ExitCode, ...).
        Once the controller has forgotten the job (MinJobAge), its last job-completion record, whose keys
        are fewer (JobState, NodeList, ExitCode, ...); {} if neither knows it."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if r.returncode == 0 and r.stdout.strip():
            return parse_fields(r.stdout.splitlines()[0])
        if "Invalid job id" not in r.stderr:
            raise SlurmError(f"scontrol show job {job_id} failed ({r.returncode}): {r.stderr.strip()}")
        last: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in self.jobcomp.read_text(errors="replace").splitlines():
                if line.startswith(f"JobId={job_id} "):
                    last = parse_fields(line)
        return last

    def job_ids(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    # -- parts ---------------------------------------------------------------------------------------
    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Start a part in its own session, its stderr appended to ``<name>.out`` (a restarted slurmd keeps its
        earlier output). Slurm's daemons also write a timestamped ``<name>.log``; only stderr has a fatal
        error met before that log is open (a bad slurm.conf)."""
        with open(self.root / f"{name}.out", "ab") as out:
            self.procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait(self, name: str, ready: Callable[[], Any], timeout: float) -> None:
        """Until ``ready()`` is true; else one line naming the part, why, and its output."""
        out = self.root / f"{name}.out"
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except (OSError, ValueError, KeyError, SlurmError, subprocess.TimeoutExpired):
                pass
            p = self.procs.get(name)
            if p is not None and p.poll() is not None:
                raise SlurmError(f"{name} exited {p.returncode} while starting: {tail(out)} (log: {out})")
            if time.monotonic() > deadline:
                raise SlurmError(f"{name} did not come up within {timeout:.0f} s: {tail(out)} (log: {out})")
            time.sleep(0.3)

    def _munge(self) -> None:
        for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
            if not shutil.which(tool):
                raise SlurmError(f"{tool} is not installed: apt-get install slurmctld slurmd slurm-client munge")
        d = self.socket.parent
        d.mkdir(mode=0o755)  # as /run/munge: every local user's sbatch reaches the socket (jobs run as their users)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: munged refuses a socket whose dir's owners are not its own (root's tmp, here)
        self._start("munged", ["munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                               f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                               f"--seed-file={d / 'munged.seed'}"], dict(os.environ))
        self._wait("munged", self.socket.exists, 30)

    def _write_conf(self) -> None:
        cpus = os.cpu_count() or 1
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={self.ports['slurmctld']}",
            "SlurmUser=root", "SlurmdUser=root",
            # one munged for all, ours; cred_expire is also how long a requeued job waits before it may start
            # again (120 s by default)
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket},cred_expire=5",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}", f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
            f"SlurmdPidFile={self.root / 'spool' / '%n' / 'slurmd.pid'}",
            # no cgroups: processes are tracked by parentage, nothing confines them
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "SwitchType=switch/none", "MpiDefault=none", "LaunchType=launch/slurm",
            "AccountingStorageType=accounting_storage/none",
            # a finished job stays findable after the controller forgets it
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.jobcomp}",
            "MailProg=/bin/true",  # Debian ships no mailer: slurmctld logs an error for the default
            # the scheduler looks at pending jobs (a requeued job whose BeginTime passed) every 2 s, not 60/30 s
            "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=2,bf_interval=2",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",  # CPUs only: jobs ask no memory
            # a node loss: noticed after SlurmdTimeout, its --requeue jobs go back to the queue and run elsewhere;
            # a node whose slurmd registers again is back in service whatever downed it
            f"SlurmdTimeout={self.slurmd_timeout}", "ReturnToService=2", "JobRequeue=1",
            "SlurmctldTimeout=30", "MessageTimeout=5", "KillWait=2", "UnkillableStepTimeout=30",
            "InactiveLimit=0", "BatchStartTimeout=10",
            "MinJobAge=600",  # scontrol show job knows a finished job for 10 minutes
        ]
        for name in self.nodes:
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={self.hostname} Port={self.ports[name]}"
                         f" CPUs={cpus} RealMemory=512 State=UNKNOWN")
        for i, (part, members) in enumerate(self.partitions.items()):
            default = "YES" if part == "batch" or ("batch" not in self.partitions and i == 0) else "NO"
            lines.append(f"PartitionName={part} Nodes={','.join(members)} Default={default} MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start_node(self, name: str) -> None:
        """(Re)start node ``name``'s slurmd; returns once it runs and answers (not waiting for the controller
        to see it: after a loss that takes a registration, see ``wait_node``)."""
        p = self.procs.get(f"slurmd-{name}")
        if p is not None and p.poll() is None:
            return
        (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
        out = self.root / f"slurmd-{name}.out"
        start = out.stat().st_size if out.exists() else 0
        self._start(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)], self.env())
        self._wait(f"slurmd-{name}", lambda: "started on" in out.read_text(errors="replace")[start:], 30)
        agent = self.procs.get(f"agent-{name}")
        if name in self._agent_env and (agent is None or agent.poll() is not None):  # it comes back with its node
            self.start_agent(name, self._agent_env[name])

    def wait_node(self, name: str, states: tuple[str, ...] = ("idle", "mix", "alloc"), timeout: float = 60) -> str:
        """Until the controller reports ``name`` in one of ``states``; returns that state."""
        seen: list[str] = []

        def ready() -> bool:
            seen[:] = [self.node_state(name)]
            return seen[0] in states

        try:
            self._wait(f"slurmd-{name}", ready, timeout)
        except SlurmError as e:
            raise SlurmError(f"node {name} is {seen[0] if seen else '?'}, not {'/'.join(states)}: {e}") from None
        return seen[0]

    def _node_pids(self, name: str) -> list[int]:
        """The node's slurmd, its slurmstepds and everything below them (the jobs' processes). A slurmstepd
        is reparented to init and its /proc environ is blanked by its process title, so it is found by the
        socket it listens on in the node's spool dir; a job process that left its stepd's tree, by the
        SLURMD_NODENAME and SLURM_CONF that every job's environment has."""
        spool = f"{self.root / 'spool' / name}/"
        sockets: set[str] = set()
        with contextlib.suppress(OSError):  # "Num RefCount Protocol Flags Type St Inode Path"
            sockets = {f"socket:[{f[6]}]" for f in (x.split() for x in Path("/proc/net/unix").read_text().splitlines())
                       if len(f) > 7 and f[7].startswith(spool)}
        roots = []
        for d in glob.glob("/proc/[0-9]*"):
            pid = int(d[6:])
            env = _environ(pid)
            if (env.get("SLURMD_NODENAME") == name and env.get("SLURM_CONF") == str(self.conf)) or _fds(pid) & sockets:
                roots.append(pid)
        for part in (f"slurmd-{name}", f"agent-{name}"):
            p = self.procs.get(part)
            if p is not None and p.poll() is None:
                roots.append(p.pid)
        return descendants(roots)

    def agent_socket(self, name: str) -> Path:
        """Node ``name``'s agent socket: ``agent_sockets`` with %n, as slurm.conf names a node's paths."""
        return Path(str(self.agent_sockets).replace("%n", name))

    def start_agent(self, name: str, env: dict[str, str]) -> None:
        """Node ``name``'s agent (`cedana-airflow agent`, root; ``env``: its store and node settings), at
        ``agent_socket(name)``: jobs of users other than root are its callers there (issue 49). A node
        loss kills it with the node."""
        sock = self.agent_socket(name)
        sock.parent.parent.mkdir(mode=0o755, exist_ok=True)
        out = self.root / f"agent-{name}.out"
        start = out.stat().st_size if out.exists() else 0
        self._start(f"agent-{name}", [sys.executable, "-m", "cedana_airflow", "agent", "--socket", str(sock),
                                      "--node", name], {**env, "PYTHONUNBUFFERED": "1"})
        self._agent_env[name] = env
        self._wait(f"agent-{name}", lambda: "agent serving on" in out.read_text(errors="replace")[start:], 60)

    def kill_node(self, name: str) -> float:
        """A node loss: freeze, then SIGKILL, its slurmd and every process of its jobs (and its agent with
        the trees it runs). Returns the wall-clock time of the kill."""
        tree = self._node_pids(name)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)  # nothing gets to react to its parent's death
        tree = descendants(tree)  # anything forked meanwhile
        at = time.time()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.killed.update(tree)
        for part in (f"slurmd-{name}", f"agent-{name}"):
            p = self.procs.pop(part, None)
            if p is not None:
                p.wait()
        self._gone(set(tree), 2, zombies=True)  # dead on return, whoever reaps them
        return at

    def logs(self) -> str:
        """The last lines of every part's log (munged has only its stderr), for a failing test's report."""
        files = [*sorted(self.root.glob("*.log")), self.root / "munged.out"]
        return "\n".join(f"--- {p.name}: {tail(p, 15)}" for p in files)

    # -- lifecycle -----------------------------------------------------------------------------------
    def _up(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if len(str(self.socket)) > 100:
            raise SlurmError(f"root {self.root} is too long for munged's unix socket path (108 bytes)")
        for d in ("munge", "state", "spool"):  # a reused root starts afresh: no old jobs, nodes or key
            shutil.rmtree(self.root / d, ignore_errors=True)
        (self.root / "state").mkdir()
        self.ports = {"slurmctld": free_port(), **{n: free_port() for n in self.nodes}}
        self._munge()
        self._write_conf()
        self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], self.env())
        self._wait("slurmctld", lambda: "is UP" in self.run("scontrol", "ping", check=False, timeout=10).stdout, 60)
        for name in self.nodes:
            self.start_node(name)
        for name in self.nodes:
            self.wait_node(name, ("idle",))

    def __exit__(self, *exc: object) -> None:
        # every process of the cluster's jobs, now: those that end by themselves after scancel are waited for too
        watch = set().union(*(self._node_pids(n) for n in self.nodes)) - {p.pid for p in self.procs.values()}
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                if ids := self.job_ids():
                    self.run("scancel", "--full", "--quiet", *ids, check=False, timeout=10)
                    self._gone(watch, 3, zombies=True)  # the jobs end as CANCELLED, in the job-completion log too
        # a slurmstepd outlives its slurmd by design: sweep every node's jobs, like a node loss
        for name in self.nodes:
            self.kill_node(name)
        stop_parts(self.procs.values())
        shutil.rmtree(self.agent_sockets.parent.parent, ignore_errors=True)
        self.procs.clear()
        # the slurmstepds were init's children (or ours, see reap): give init a moment to reap them, so
        # that nothing is listed after us
        self._gone(watch | self.killed, 5)
        self.killed.clear()

    @staticmethod
    def _gone(pids: set[int], timeout: float, zombies: bool = False) -> bool:
        """Until none of ``pids`` is in /proc any more (or is only a zombie, with ``zombies``)."""

        def there(pid: int) -> bool:
            try:
                text = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            return not (zombies and text[text.rindex(")") + 2] == "Z")

        deadline = time.monotonic() + timeout
        while True:
            reap(pids)
            if not any(there(pid) for pid in pids):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
