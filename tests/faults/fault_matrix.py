"""The fault matrix: every fault at every step of a heartbeat and of a restore, with what happened.

    python tests/faults/fault_matrix.py [--steps a,b] [--faults x,y] [--write docs/faults.md]

Each case is real: the CLI's supervisor (``cedana-airflow run``) runs a training-style workload with
real CRIU against moto's S3 server behind a fault proxy (s3_faults.py); the fault comes either from
the proxy (store errors), from a failpoint inside the supervisor (cedana_airflow/failpoints.py: a
SIGKILL at that step, a clock jump, a full disk, a concurrent gc or second writer), or both. A
heartbeat-step fault hits the second heartbeat of try 1 (so a committed checkpoint exists); a
restore-step fault hits try 2, after try 1's node was lost. Then the next try runs to the end. Each
case checks what a user relies on:

- **output**: the last try's output equals an uninterrupted run's;
- **store**: ``check --read-data`` finds nothing missing or bad (no "latest" that points at a partial
  checkpoint; every committed checkpoint's chunks are there and verify);
- **strays**: no process of the case and no mount under its directories is left;
- **lease**: the next try started within the writer lease's TTL (no orphaned lease blocks it);
- **line**: the supervisor said what happened in one line (the case records it).

tests/faults/test_fault_slice.py runs a slice of it in the suite (every step and every fault once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "scripts")]

from local_parts import processes_with  # noqa: E402
from s3_faults import FaultProxy, Rule  # noqa: E402

TRAIN = REPO / "tests" / "workloads" / "train.py"
TRAIN_ARGS = ["--mb", "16", "--steps", "60", "--step-seconds", "0.08"]
HEARTBEAT = "0.6"
LEASE_TTL = 6.0  # writer_lease_seconds for the cases: a lease left behind would block the next try this long
BUCKET = "faults"

HEARTBEAT_STEPS = ("heartbeat.freeze", "heartbeat.dump", "heartbeat.capture", "heartbeat.chunk", "heartbeat.upload",
                   "heartbeat.manifest", "heartbeat.index", "heartbeat.lease")
RESTORE_STEPS = ("restore.lease", "restore.manifest", "restore.chunks", "restore.criu", "restore.resume")
STEPS = HEARTBEAT_STEPS + RESTORE_STEPS
FAULTS = ("kill-supervisor", "kill-workload", "s3-500", "s3-503", "s3-reset", "s3-timeout", "s3-short", "disk-full",
          "clock-jump", "gc", "second-writer")
#: The S3 requests of a step (method, path regex): where a store fault can land.
S3_REQUESTS = {"heartbeat.upload": ("PUT", r"/chunks/"), "heartbeat.manifest": ("PUT", r"/manifest\.json"),
               "heartbeat.index": ("PUT", r"/index/"), "heartbeat.lease": ("PUT", r"/leases/"),
               "restore.lease": ("PUT", r"/leases/"), "restore.manifest": ("GET", r"/manifest\.json"),
               "restore.chunks": ("GET", r"/chunks/")}
#: Steps whose failpoint knows the workload's pid (the store's steps run apart from it; before a
#: restore has made one there is none).
HAS_WORKLOAD = ("heartbeat.freeze", "heartbeat.dump", "heartbeat.capture", "heartbeat.index", "restore.resume")
#: Steps after which something is written to the work dir (a dump, or a restore's fetch).
WRITES_AFTER = ("heartbeat.freeze", "heartbeat.dump", "restore.lease", "restore.manifest")
#: Steps after which the supervisor reads its wall clock (time.time: the lease's renewals).
READS_CLOCK_AFTER = ("heartbeat.lease", "restore.lease")


def applies(step: str, fault: str) -> str | None:
    """Why a cell of the matrix does not exist, or None when it does."""
    if fault.startswith("s3-") and step not in S3_REQUESTS:
        return "no S3 request at this step"
    if fault == "kill-workload" and step not in HAS_WORKLOAD:
        return "the step runs apart from the workload (or before there is one)"
    if fault == "disk-full" and step not in WRITES_AFTER:
        return "nothing is written to the work dir after this step"
    if fault == "clock-jump" and step not in READS_CLOCK_AFTER:
        return "no wall-clock reading follows this step"
    return None


@dataclass
class Outcome:
    step: str
    fault: str
    tries: list[int] = field(default_factory=list)  # each try's exit code
    committed: int = 0  # checkpoints in the store at the end
    output_equal: bool = False
    store_clean: bool = False
    strays: list[str] = field(default_factory=list)
    next_try_wait_seconds: float = 0.0  # from its start to its restore (or fresh start): for the table
    next_try_held: bool = False  # it said it waited on a writer lease the faulted try left behind
    line: str = ""  # what the faulted try said about it
    faults_injected: int = 0  # requests the proxy answered with the fault
    seconds: float = 0.0
    error: str = ""

    @property
    def passed(self) -> bool:
        return (not self.error and self.output_equal and self.store_clean and not self.strays
                and not self.next_try_held)


class Bench:
    """moto's S3 server and the fault proxy in front of it, shared by the cases of one run."""

    def __init__(self, root: Path) -> None:
        from local_parts import moto_server

        self.root = root
        self._moto = moto_server()
        self.moto_url = self._moto.__enter__()
        self.proxy = FaultProxy(self.moto_url)
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=self.moto_url, aws_access_key_id="t", aws_secret_access_key="t",
                               region_name="us-east-1")
        self.s3.create_bucket(Bucket=BUCKET)
        self.expected = subprocess.run([sys.executable, str(TRAIN), *TRAIN_ARGS, "--step-seconds", "0"],
                                       capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        self.n = 0

    def close(self) -> None:
        self.proxy.close()
        self._moto.__exit__(None, None, None)

    def manifests(self, prefix: str) -> list[str]:
        keys = self.s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", [])
        return [o["Key"] for o in keys if o["Key"].endswith("manifest.json")]


@dataclass
class _Try:
    proc: subprocess.Popen[bytes]
    out: Path
    started: float

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def stderr(self) -> str:
        return self.out.with_suffix(".err").read_text(errors="replace")

    def seconds_until(self, pattern: str, timeout: float = 120) -> float:
        """From this try's start until its supervisor says ``pattern`` (inf if it never does)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.stderr()):
                return time.monotonic() - self.started
            if self.proc.poll() is not None:
                return 0.0 if re.search(pattern, self.stderr()) else float("inf")
            time.sleep(0.05)
        return float("inf")

    def stdout(self) -> str:
        return self.out.with_suffix(".out").read_text(errors="replace")


def _env(bench: Bench, case: Path, node: str, prefix: str, failpoints: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CEDANA_", "AWS_"))}
    env.update(CEDANA_STORE=f"s3://{BUCKET}/{prefix}", CEDANA_NODE=node, CEDANA_WORK_DIR=str(case / f"work-{node}"),
               CEDANA_WRITER_LEASE_SECONDS=str(LEASE_TTL), CEDANA_S3_READ_TIMEOUT_SECONDS="1.5",
               CEDANA_STOP_WINDOW_SECONDS="5", CEDANA_RESTORE_ROOTS=str(case), AWS_ENDPOINT_URL=bench.proxy.url, AWS_ACCESS_KEY_ID="t",
               AWS_SECRET_ACCESS_KEY="t", AWS_DEFAULT_REGION="us-east-1", PYTHONUNBUFFERED="1")
    if failpoints:
        env["CEDANA_FAILPOINTS"] = failpoints
    return env


def _start(case: Path, name: str, env: dict[str, str], try_number: int, cid: str) -> _Try:
    out = case / name
    cmd = [sys.executable, "-m", "cedana_airflow", "run", "--resume", "--id", cid, "--heartbeat", HEARTBEAT,
           "--try-number", str(try_number), "--", sys.executable, str(TRAIN), *TRAIN_ARGS,
           "--log", str(case / "steps.log")]  # a captured file; its path also marks the case's processes
    return _Try(subprocess.Popen(cmd, env=env, stdout=open(out.with_suffix(".out"), "wb"),
                                 stderr=open(out.with_suffix(".err"), "wb"), start_new_session=True), out, time.monotonic())


def _wait_for(predicate, timeout: float, what: str, t: _Try | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if t is not None and t.proc.poll() is not None:
            raise RuntimeError(f"{what}: the supervisor ended first (exit {t.proc.returncode}): {t.stderr()[-500:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


def _strays(case: Path) -> list[str]:
    """Processes whose command line names the case's directory, and mounts under it."""
    mark = str(case)
    found = [f"pid {pid}: {cmd[:120]}" for pid, cmd in processes_with(mark).items()]
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if mark in line:
            found.append(f"mount: {line.split()[4]}")
    return found


def _kill_case(case: Path) -> None:
    for s in _strays(case):
        if s.startswith("pid "):
            try:
                os.kill(int(s.split()[1].rstrip(":")), signal.SIGKILL)
            except OSError:
                pass


def _fault_spec(step: str, fault: str, case: Path, cid: str) -> tuple[str, Rule | None]:
    """(the failpoints, the proxy rule) that make ``fault`` happen at ``step``."""
    nth = "@2" if step in HEARTBEAT_STEPS else ""
    if step in ("heartbeat.chunk", "heartbeat.upload"):  # hit per file / per chunk: the second heartbeat's first
        nth = ""
    if fault.startswith("s3-"):
        method, path = S3_REQUESTS[step]
        kind = fault[3:]
        return "", Rule(method, path, kind, times=6, hang=2.5)
    if fault == "kill-supervisor":
        return f"{step}=kill-supervisor{'+0.02' if step == 'heartbeat.freeze' else ''}{nth}", None
    if fault == "kill-workload":
        return f"{step}=kill-workload{nth}", None
    if fault == "disk-full":
        return f"{step}=fill-disk{nth}", None
    if fault == "clock-jump":
        return f"{step}=clock+7200{nth}", None
    if fault == "gc":
        gc = f"{sys.executable} -m cedana_airflow gc --grace 0 --wait 0 >{case}/gc.out 2>&1"
        return f"{step}=run:{gc}{nth}", None
    if fault == "second-writer":
        second = (f"{sys.executable} -m cedana_airflow run --id {cid} --try-number 1 -- true "
                  f">{case}/second.out 2>{case}/second.err")
        return f"{step}=run:{second}{nth}", None
    raise ValueError(fault)


def _said(text: str) -> str:
    """The line a user would read about the fault: the supervisor's first warning-like line, or the
    CLI's error line (``ClassName: message``)."""
    pats = ("failed", "refused", "skipped", "unreachable", "held", "lost", "not updated", "error", "busy", "no room",
            "No space")
    for line in text.splitlines():
        if line.startswith("cedana: ") and any(p in line for p in pats):
            return line[len("cedana: "):][:240]
        if re.match(r"^[A-Z]\w+: ", line) and not line.startswith("cedana"):
            return line[:240]
    return ""


def run_case(bench: Bench, step: str, fault: str) -> Outcome:
    bench.n += 1
    case = bench.root / f"case-{bench.n:03d}-{step}-{fault}"
    case.mkdir(parents=True)
    prefix, cid = f"c{bench.n:03d}", f"case{bench.n:03d}"
    o = Outcome(step, fault)
    t0 = time.monotonic()
    faults_before = bench.proxy.faults
    tries: list[_Try] = []
    small: list[Path] = []
    try:
        if fault == "disk-full":  # never the machine's own disk: the node's work dir is a small tmpfs
            for node in ("node-a", "node-b"):
                small.append(case / f"work-{node}")
                small[-1].mkdir()
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m,mode=0700", "tmpfs", str(small[-1])], check=True)
        env_a = _env(bench, case, "node-a", prefix)
        failpoints, rule = _fault_spec(step, fault, case, cid)
        if step in HEARTBEAT_STEPS:
            first = _start(case, "try1", {**env_a, **({"CEDANA_FAILPOINTS": failpoints} if failpoints else {})}, 1, cid)
            tries.append(first)
            if rule is not None:  # after the first commit: the fault hits a later heartbeat
                _wait_for(lambda: len(bench.manifests(prefix)) >= 1, 60, "first checkpoint", first)
                bench.proxy.arm(rule)
            code = first.wait()
            bench.proxy.arm(None)
            o.tries.append(code)
            o.line = _said(first.stderr())
            last = first
        else:
            first = _start(case, "try1", env_a, 1, cid)
            tries.append(first)
            _wait_for(lambda: len(bench.manifests(prefix)) >= 2, 60, "two checkpoints", first)
            os.killpg(first.proc.pid, signal.SIGKILL)  # node loss: the supervisor and its workload
            o.tries.append(first.wait())
            env_b = _env(bench, case, "node-b", prefix, failpoints)
            bench.proxy.arm(rule)
            second = _start(case, "try2", env_b, 2, cid)
            tries.append(second)
            o.tries.append(second.wait())
            bench.proxy.arm(None)
            o.line = _said(second.stderr())
            last = second
        for side in ("second.err", "gc.out"):  # a concurrent command's own answer is the line to read
            if (case / side).exists() and (said := _said((case / side).read_text(errors="replace"))):
                o.line = f"{side.split('.')[0]}: {said}"
        if last.proc.returncode != 0 or not last.stdout().strip().endswith(bench.expected):
            n = len(o.tries) + 1
            nxt = _start(case, f"try{n}", _env(bench, case, f"node-{'abc'[n - 1]}", prefix), n, cid)
            tries.append(nxt)
            # held up by nothing but its own start-up and restore: a lease left behind would show here
            o.next_try_wait_seconds = round(nxt.seconds_until(r"restored seq \d+|workload started checkpoint_id"), 2)
            o.tries.append(nxt.wait())
            # the event, not the time (a loaded machine is slow to start a try): the lease's own line
            o.next_try_held = bool(re.search(r"writer lease of checkpoint ID \S+ is held by", nxt.stderr()))
            if not o.line:  # the faulted try was killed before it could say anything: the retry says what it found
                o.line = next((ln[len("cedana: "):] for ln in nxt.stderr().splitlines()
                               if "restored seq " in ln or "no checkpoint to resume" in ln), "")[:240]
            last = nxt
        o.output_equal = last.stdout().strip().splitlines()[-1:] == [bench.expected]
        o.committed = len(bench.manifests(prefix))
        chk = subprocess.run([sys.executable, "-m", "cedana_airflow", "check", "--read-data", "--json"],
                             env=_env(bench, case, "checker", prefix), capture_output=True, text=True, timeout=300)
        o.store_clean = chk.returncode == 0 and json.loads(chk.stdout or "{}").get("clean") is True
        for d in small:
            subprocess.run(["umount", str(d)], check=False)
        small.clear()
        time.sleep(0.3)
        o.strays = _strays(case)
    except Exception as e:  # a case that could not be run is a failed case, with why
        o.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        bench.proxy.arm(None)
        o.faults_injected = bench.proxy.faults - faults_before
        _kill_case(case)
        for d in small:
            subprocess.run(["umount", "-l", str(d)], check=False)
        o.seconds = round(time.monotonic() - t0, 1)
    return o


def cells(steps: tuple[str, ...] = STEPS, faults: tuple[str, ...] = FAULTS) -> Iterator[tuple[str, str]]:
    for step in steps:
        for fault in faults:
            if applies(step, fault) is None:
                yield step, fault


#: The suite's slice: every step and every fault at least once.
SLICE = (("heartbeat.freeze", "kill-supervisor"), ("heartbeat.dump", "disk-full"), ("heartbeat.capture", "kill-workload"),
         ("heartbeat.chunk", "second-writer"), ("heartbeat.upload", "s3-503"), ("heartbeat.manifest", "s3-reset"),
         ("heartbeat.index", "s3-500"), ("heartbeat.lease", "clock-jump"), ("restore.lease", "s3-timeout"),
         ("restore.manifest", "gc"), ("restore.chunks", "s3-short"), ("restore.criu", "kill-supervisor"),
         ("restore.resume", "kill-workload"))


@contextmanager
def bench_in(root: Path | None = None) -> Iterator[Bench]:
    root = root or Path(tempfile.mkdtemp(prefix="cedana-faults-"))
    b = Bench(root)
    try:
        yield b
    finally:
        b.close()


def table(outcomes: list[Outcome]) -> str:
    rows = ["| step | fault | injected | tries (exit codes) | checkpoints | output = uninterrupted | store clean | "
            "strays | next try waited | what was said |", "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        wait = f"{o.next_try_wait_seconds:.1f} s" if o.next_try_wait_seconds not in (0.0, float("inf")) else "-"
        said = (o.error or o.line or "-").replace("|", "\\|")
        injected = str(o.faults_injected) if o.fault.startswith("s3-") else "-"
        rows.append(f"| {o.step} | {o.fault} | {injected} | {' '.join(map(str, o.tries))} | {o.committed} | "
                    f"{'yes' if o.output_equal else 'NO'} | {'yes' if o.store_clean else 'NO'} | "
                    f"{len(o.strays) or 'none'} | {wait} | {said} |")
    return "\n".join(rows)


def machine() -> str:
    """The machine a run was measured on, for the doc."""
    cpus = os.cpu_count()
    criu = subprocess.run([sys.executable, "-c", "from cedana_airflow.engine.criu import find_criu; "
                           "from cedana_airflow.config import load_settings as l; s = l(environ={}); "
                           "print(find_criu(s.criu, s.criu_prefix).version)"], capture_output=True, text=True)
    return f"{cpus} cores, kernel {os.uname().release}, CRIU {criu.stdout.strip() or '?'}"


def write_doc(path: Path, marker: str, body: str) -> None:
    """Replace what lies between ``<!-- marker -->`` and ``<!-- /marker -->`` in ``path``."""
    text = path.read_text()
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    a, b = text.index(start) + len(start), text.index(end)
    path.write_text(text[:a] + "\n" + body.rstrip() + "\n" + text[b:])


def matrix_doc(outcomes: list[Outcome], seconds: float) -> str:
    passed = sum(o.passed for o in outcomes)
    skipped = [(s, f, why) for s in STEPS for f in FAULTS if (why := applies(s, f))]
    na = {}
    for s, f, why in skipped:
        na.setdefault(why, []).append(f"{s} x {f}")
    lines = [f"Generated by `make faults` on {time.strftime('%Y-%m-%d')} ({machine()}): {len(outcomes)} cases, "
             f"{passed} passed every check, in {seconds / 60:.0f} min.", "", table(outcomes), "",
             "Cells that do not exist: " + "; ".join(f"{why} ({len(cells)})" for why, cells in na.items()) + "."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--slice", action="store_true", help="only the suite's slice")
    ap.add_argument("--json", type=Path, help="write every outcome here")
    ap.add_argument("--write", type=Path, help="put the table into this doc (between <!-- matrix --> markers)")
    args = ap.parse_args()
    t0 = time.monotonic()
    todo = list(SLICE) if args.slice else list(cells(tuple(args.steps.split(",")), tuple(args.faults.split(","))))
    outcomes = []
    with bench_in() as bench:
        for i, (step, fault) in enumerate(todo, 1):
            o = run_case(bench, step, fault)
            outcomes.append(o)
            print(f"[{i}/{len(todo)}] {step} x {fault}: {'pass' if o.passed else 'FAIL'} ({o.seconds} s) "
                  f"{o.error or o.line}", flush=True)
        shutil.rmtree(bench.root, ignore_errors=True)
    print(table(outcomes))
    if args.write:
        write_doc(args.write, "matrix", matrix_doc(outcomes, time.monotonic() - t0))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(o), "passed": o.passed} for o in outcomes], indent=1))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
