#!/usr/bin/env bash
# Validate GPU checkpointing end to end on a GPU machine, in one command from the repo root:
#
#   bash scripts/gpu-validate.sh [--gib 4] [--steps 1000] [--step-seconds 0.1] [--heartbeat 10] [--seed 1234] [--keep] [--dry-run]
#
# 1. checks: NVIDIA driver (exit 3 at once without one), x86-64, root, gVisor, a Python with torch on CUDA
#    (the bundle's Python version: .gpu-bundle/PYTHON, 3.12 by default);
# 2. a venv with cedana-airflow from .gpu-bundle/ (no registry needed; build it elsewhere with
#    scripts/gpu-bundle.sh) that also sees that Python's packages (torch), and CRIU >= 4 ($CEDANA_CRIU,
#    PATH, or the bundle's .debs); `criu check` must pass;
# 3. `cedana-airflow doctor --json`, whose gpu object is printed;
# 4. the uninterrupted reference run of scripts/gpu_workload.py (losses and digest);
# 5. scripts/gpu_baseline.py (in the venv: it imports cedana-airflow's /proc helpers): the bare driver
#    API + plain CRIU on a fresh workload, for comparison (first, so its figures survive a failure of
#    ours; its own failure is reported at the end);
# 6. the same workload under `cedana-airflow run --gpu require --heartbeat N`: after 2 checkpoints holding
#    GPU state the supervisor and the workload are SIGKILLed, and `cedana-airflow restore --gpu require`
#    (another node name and work dir, same store) finishes it: every loss and the digest must match 4;
# 7. a table, and every figure as JSON in $OUT/gpu-validate.json ($OUT set) or ./gpu-validate.json; the
#    logs in one archive beside it, gpu-validate-logs.tar.gz (a device call brings back 8 files at most).
#
# --dry-run: every step that needs no GPU, on a machine without one (CI runs it): the interpreter
# choice (torch need not see CUDA), the venv and the package import in each interpreter used, CRIU,
# doctor, the workload on the CPU (--device cpu, small) checkpointed, killed and restored, the baseline
# up to its driver check, the timeouts, the report and the archive. Without .gpu-bundle/ it installs a
# wheel built from this work tree, its dependencies taken from the chosen Python's packages.
#
# Every step is bounded: each has its own limit, a step past it gets SIGTERM and SIGKILL 10 s later,
# and the whole run ends within 8 minutes with the defaults on an H200. Exit codes: 0 validated, 1 a
# check or step failed (one line says which), 2 usage, 3 no NVIDIA driver here, 4 CRIU cannot work in
# this sandbox (gVisor).
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)

DRY=0
for a in "$@"; do [ "$a" = --dry-run ] && DRY=1; done
if [ "$DRY" = 1 ]; then  # the CPU stands in for the GPU: a small model, quick heartbeats
  # 60 s paced, then held before its last step while paced (--pace-file): time for two heartbeats after
  # start-up on a busy machine too (20 s was not, in CI, where a torch process's checkpoint took seconds, nor
  # 60 s once, on a landing machine 90% busy, before the hold); the restored rest runs unpaced
  GIB=0.02 STEPS=600 STEP_SECONDS=0.1 HEARTBEAT=1
else
  GIB=4 STEPS=1000 STEP_SECONDS=0.1 HEARTBEAT=10
fi
SEED=1234 KEEP=0
usage() { echo "usage: bash scripts/gpu-validate.sh [--gib N] [--steps N] [--step-seconds S] [--heartbeat S] [--seed N] [--keep] [--dry-run]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --gib) GIB=${2:?}; shift 2 ;;
    --steps) STEPS=${2:?}; shift 2 ;;
    --step-seconds) STEP_SECONDS=${2:?}; shift 2 ;;
    --heartbeat) HEARTBEAT=${2:?}; shift 2 ;;
    --seed) SEED=${2:?}; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --dry-run) shift ;;
    -h|--help) usage ;;
    *) echo "gpu-validate: unknown argument '$1'" >&2; usage ;;
  esac
done

# -- 1. the driver, before anything else: a machine without one is told so in one line ----------
driver=""
if [ -r /proc/driver/nvidia/version ]; then
  # "... Kernel Module  580.65.06  ..." or "... Open Kernel Module for x86_64  580.65.06  ...": the first dotted number
  driver=$(grep -o 'Kernel Module.*' /proc/driver/nvidia/version | grep -oE '[[:space:]][0-9]+\.[0-9]+(\.[0-9]+)?[[:space:]]' \
    | head -n1 | tr -d '[:space:]' || true)
  driver=${driver:-unknown}
elif command -v nvidia-smi >/dev/null 2>&1 && v=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null); then
  driver=$(echo "$v" | head -n1)
fi
if [ -z "$driver" ] && [ "$DRY" = 0 ]; then
  echo "gpu-validate: no NVIDIA driver on this machine (no /proc/driver/nvidia/version, no working nvidia-smi): run this on the GPU machine" >&2
  exit 3
fi

START=$SECONDS
DEADLINE=$((SECONDS + 470))  # 8 minutes less a margin for the report
WORK=""
SUP="" WPID="" RESTORE_PID=""
OUT_DIR="${OUT:-$REPO}"
RESULT="$OUT_DIR/gpu-validate.json"
LOGS="$OUT_DIR/gpu-validate-logs.tar.gz"

say() { echo "gpu-validate: $*" >&2; }
left() { local l=$((DEADLINE - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }

# One line, then the report with what was measured so far.
fail() {
  local code=$1; shift
  echo "gpu-validate: FAILED: $*" >&2
  [ -n "$WORK" ] && report "$*" >/dev/null 2>&1 || true
  exit "$code"
}

# Every process this script started and may still own: the supervisors and the workload (their pids
# themselves, never a `timeout` wrapping them: killing that would leave its child running).
cleanup() {
  for p in $SUP $WPID $RESTORE_PID; do kill -KILL "$p" 2>/dev/null || true; done
  if [ -n "$WORK" ] && [ -d "$WORK" ]; then
    # One archive of every log (a device call brings back 8 files at most): CRIU's, ours, the workload's.
    (cd "$WORK" && find . -maxdepth 5 -type f \( -name '*.out' -o -name '*.err' -o -name '*.log' -o -name '*.json' \) \
      -size -4M -not -path './store/*' -not -path './venv/*' -print0 \
      | tar --null -T - -czf "$LOGS") 2>/dev/null || say "warning: the logs could not be archived into $LOGS"
    if [ "$KEEP" = 1 ]; then say "kept $WORK"; else rm -rf "$WORK"; fi
  fi
}
trap cleanup EXIT

# bounded SECONDS CMD...: CMD with SIGTERM after SECONDS and SIGKILL 10 s later; its exit code (124: timed out).
bounded() { local t=$1; shift; timeout -k 10 "$t" "$@"; }

# finish PID SECONDS: wait for a background step; past SECONDS it gets SIGTERM, SIGKILL 10 s later.
# Returns its exit code, or 124 when it had to be stopped.
finish() {
  local pid=$1 until=$((SECONDS + $2)) rc
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$until" ]; do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    until=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$until" ]; do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return 124
  fi
  wait "$pid" && rc=0 || rc=$?
  return "$rc"
}

# Facts go to $WORK/facts (key<TAB>value) and $WORK/*.json; report() folds them into one JSON and a table.
# GPU memory is freed asynchronously after a process ends: wait (10 s at most) until no process holds
# any, so a restore finds the same device addresses free.
wait_gpu_free() {
  [ "$DRY" = 1 ] && return 0
  for _ in $(seq 50); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break; sleep 0.2; done
}
fact() { printf '%s\t%s\n' "$1" "$2" >>"$WORK/facts"; }

report() {
  "${PY:-python3}" - "$WORK" "$RESULT" "${1:-}" <<'EOF'
import json, os, sys
work, result, error = sys.argv[1], sys.argv[2], sys.argv[3]
def load(name):
    try:
        with open(os.path.join(work, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
facts = {}
try:
    for line in open(os.path.join(work, "facts")):
        k, _, v = line.rstrip("\n").partition("\t")
        try:
            facts[k] = json.loads(v)
        except ValueError:
            facts[k] = v
except OSError:
    pass
r = {"ok": not error, "error": error or None, **facts, "doctor_gpu": load("doctor-gpu.json"),
     "manifests": load("manifests.json"), "manifests_after_restore": load("manifests-after-restore.json"),
     "compare": load("compare.json"), "restore": load("restore.json"),
     "baseline": load("baseline.json")}
os.makedirs(os.path.dirname(result) or ".", exist_ok=True)
with open(result, "w") as f:
    json.dump(r, f, indent=1)

ms = [m for m in (r["manifests"] or []) if m.get("node") == "gpu-validate-a" and m.get("gpu")]
after = [m for m in (r["manifests_after_restore"] or []) if m.get("node") == "gpu-validate-b" and m.get("gpu")]
b, rs = r["baseline"] or {}, r["restore"] or {}
def f(x):
    return "-" if x is None else f"{x:.3f}"
if ms:
    m = ms[-1]
    g = m["gpu"]
    criu_ours = m["freeze_seconds"] - g["checkpoint_seconds"] - g["resume_seconds"]
    rows = [
        ("checkpoint: workload stopped (s)", m["freeze_seconds"], b.get("freeze_seconds")),
        ("  GPU lock + copy-out (s)", g["checkpoint_seconds"], (b.get("lock_seconds") or 0) + (b.get("checkpoint_seconds") or 0) if b else None),
        ("  CRIU frozen (s)", criu_ours, b.get("criu_frozen_seconds")),
        ("  GPU copy-back + unlock (s)", g["resume_seconds"], b.get("resume_seconds")),
        ("restore: until it runs (s)", rs.get("restore_seconds"), b.get("restore_seconds")),
        ("  GPU copy-in + unlock (s)", rs.get("gpu_seconds"), b.get("gpu_restore_seconds")),
        ("image (GB)", m["image_bytes"] / 1e9, (b.get("image_bytes") or 0) / 1e9 if b else None),
    ]
    print(f"\n{'':34} {'cedana-airflow':>15} {'bare API+CRIU':>15}")
    for name, ours, bare in rows:
        print(f"{name:34} {f(ours):>15} {f(bare):>15}")
    print(f"(ours: seq {m['seq']}, freeze incl. GPU copy-out/back, from the manifest; restore incl. fetching "
          "from the file:// store and verifying every chunk; bare: local images, nothing verified)")
if after:
    print(f"checkpoints of the restored workload (node b): {len(after)}, freeze "
          + ", ".join(f"{m['freeze_seconds']:.3f}" for m in after) + " s")
print(f"\nfigures: {result}")
EOF
}

# -- 1 (cont.). machine checks ---------------------------------------------------------------------
[ "$(uname -m)" = x86_64 ] || { echo "gpu-validate: this is $(uname -m): NVIDIA's CUDA checkpoint is x86-64 only. Run on an x86-64 GPU machine." >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "gpu-validate: must run as root (CRIU and the driver's checkpoint API act on other processes). Rerun with sudo." >&2; exit 1; }

gvisor=""
if dmesg 2>/dev/null | head -n 5 | grep -q "Starting gVisor"; then gvisor="dmesg says 'Starting gVisor'"
elif uname -r | grep -qi gvisor; then gvisor="uname -r is $(uname -r)"
elif grep -qi gvisor /proc/version 2>/dev/null; then gvisor="/proc/version mentions gVisor"
fi

# The bundle's wheels are built for one CPython version (gpu-bundle.sh writes it to .gpu-bundle/PYTHON).
BUNDLE=""
if [ -d .gpu-bundle/wheels ] && ls .gpu-bundle/wheels/cedana_airflow-*.whl >/dev/null 2>&1; then
  BUNDLE=.gpu-bundle
  (cd .gpu-bundle && sha256sum -c --quiet SHA256SUMS >/dev/null 2>&1) \
    || { echo "gpu-validate: .gpu-bundle/ does not match its SHA256SUMS (truncated or mixed copy): rebuild it with scripts/gpu-bundle.sh." >&2; exit 1; }
  want_py=$(cat .gpu-bundle/PYTHON 2>/dev/null || echo 3.12)
elif [ "$DRY" = 1 ]; then
  want_py=""  # any Python 3.11 or later: the wheel is built here, for it
else
  echo "gpu-validate: no .gpu-bundle/ here: run scripts/gpu-bundle.sh on a machine with PyPI and Debian's mirror, and bring .gpu-bundle/ along." >&2
  exit 1
fi

# The Python that has torch (the GPU machine's, never ours): the workload runs under it, and the venv
# below sees its packages.
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
PY=""
for c in "${CEDANA_GPU_PYTHON:-}" ${want_py:+python$want_py} python3; do
  [ -n "$c" ] && command -v "$c" >/dev/null || continue
  v=$(py_version "$c") || continue
  if [ -n "$want_py" ]; then
    [ "$v" = "$want_py" ] || continue
  else
    "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || continue
  fi
  PY=$(command -v "$c"); break
done
[ -n "$PY" ] || { echo "gpu-validate: no Python ${want_py:-3.11+} found (tried \$CEDANA_GPU_PYTHON, ${want_py:+python$want_py, }python3): the bundle's wheels are for CPython ${want_py:-?}. Set CEDANA_GPU_PYTHON." >&2; exit 1; }
torch_info=$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())' 2>&1 | tail -n1) \
  || { echo "gpu-validate: PyTorch is not importable by $PY ($torch_info). Use the Python that has torch (CEDANA_GPU_PYTHON)." >&2; exit 1; }
read -r torch_version cuda_ok gpu_count <<<"$torch_info"
if [ "$cuda_ok" != True ] && [ "$DRY" = 0 ]; then
  echo "gpu-validate: PyTorch $torch_version under $PY sees no CUDA device (driver $driver): a CPU build of torch, or check nvidia-smi and the device files." >&2
  exit 1
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-validate.XXXXXX")
need_kb=$(awk -v g="$GIB" 'BEGIN { printf "%d", (4 * g + 4) * 1048576 }')
free_kb=$(df -Pk "$WORK" | awk 'NR == 2 { print $4 }')
[ "$free_kb" -ge "$need_kb" ] || fail 1 "only $((free_kb >> 20)) GiB free under $WORK, about $((need_kb >> 20)) GiB needed for --gib $GIB (images, store, restore). Free space, set TMPDIR, or lower --gib."
fact driver_version "\"$driver\""
gpus_json=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
  | "$PY" -c 'import json, sys; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))') || gpus_json=null
fact gpus "$gpus_json"
fact python "\"$("$PY" -c 'import sys; print(sys.version.split()[0])')\""
fact torch "\"$torch_version\""
fact gvisor "$( [ -n "$gvisor" ] && echo "\"$gvisor\"" || echo null)"
fact kernel "\"$(uname -r)\""
fact dry_run "$( [ "$DRY" = 1 ] && echo true || echo false)"
fact args "{\"gib\": $GIB, \"steps\": $STEPS, \"step_seconds\": $STEP_SECONDS, \"heartbeat\": $HEARTBEAT, \"seed\": $SEED}"
say "driver $driver, $gpu_count GPU(s), Python $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch $torch_version, kernel $(uname -r)${gvisor:+, gVisor: $gvisor}"

# -- 2. venv and CRIU from the bundle ----------------------------------------------------------------
# A venv that also sees $PY's packages (torch): --system-site-packages would give the *base*
# interpreter's when $PY is itself a venv's python, so $PY's own site directories go in a .pth.
VENV="$WORK/venv"
"$PY" -m venv --without-pip "$VENV" >"$WORK/venv.err" 2>&1 || fail 1 "creating a venv with $PY failed: $(tail -n1 "$WORK/venv.err")"
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Every package directory on $PY's path, those its own .pth files add included (not its standard library).
(cd "$WORK" && "$PY" -c '
import os, sys, sysconfig
std = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
print("\n".join(p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) not in std
                and os.path.basename(p) != "lib-dynload"))') >"$venv_site/cedana-gpu-validate-torch.pth" \
  || fail 1 "listing the package directories of $PY failed"
if [ -n "$BUNDLE" ]; then
  pipwhl=$(ls "$BUNDLE"/wheels/pip-*.whl | head -n1)
  wheel=$(ls "$BUNDLE"/wheels/cedana_airflow-*.whl | head -n1)
  # pip runs from its own wheel: no ensurepip, no registry (--no-index).
  # --no-deps: the bundle holds the supervisor's dependencies (gpu-bundle.sh), not Airflow's.
  "$VENV/bin/python" "$pipwhl/pip" install --no-index --no-deps --disable-pip-version-check -q \
    "$BUNDLE"/wheels/*.whl >"$WORK/pip.err" 2>&1 || fail 1 "installing cedana-airflow from $BUNDLE/ failed: $(grep -v '^ ' "$WORK/pip.err" | tail -n1)"
else
  # Dry run without a bundle: a wheel of this work tree (tracked and untracked-but-not-ignored files,
  # as gpu-bundle.sh builds it), its dependencies from $PY's packages.
  mkdir -p "$WORK/src" "$WORK/wheels"
  git ls-files -z --cached --others --exclude-standard | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _ \
    | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
  bounded 300 "$PY" -m pip wheel --no-deps --no-build-isolation --disable-pip-version-check -q "$WORK/src" -w "$WORK/wheels" \
    >"$WORK/pip.err" 2>&1 || fail 1 "building cedana-airflow's wheel with $PY failed: $(grep -v '^ ' "$WORK/pip.err" | tail -n1)"
  wheel=$(ls "$WORK"/wheels/cedana_airflow-*.whl | head -n1)
  bounded 300 "$PY" -m pip --python "$VENV/bin/python" install --no-deps --no-index --disable-pip-version-check -q "$wheel" \
    >>"$WORK/pip.err" 2>&1 || fail 1 "installing cedana-airflow's wheel failed: $(grep -v '^ ' "$WORK/pip.err" | tail -n1)"
  say "dry run without .gpu-bundle/: installed $(basename "$wheel") built from this work tree"
fi
CLI="$VENV/bin/cedana-airflow"
fact cedana_airflow "\"$("$CLI" --version 2>&1)\""
# Every interpreter this script runs, importing what it will need there: the venv runs the CLI and the
# baseline (cedana-airflow, from the venv itself, and torch), $PY runs the workload (torch). From $WORK:
# in the checkout, `-c` would find the source tree's package first.
venv_imports=$(cd "$WORK" && "$VENV/bin/python" -c '
import os, sys, cedana_airflow, torch
here = os.path.realpath(cedana_airflow.__file__)
if not here.startswith(os.path.realpath(sys.prefix) + os.sep):
    sys.exit(f"cedana_airflow came from {here}, not from the venv")
print(torch.__version__, torch.cuda.is_available())' 2>&1 | tail -n1) \
  || fail 1 "the venv cannot import what it runs: $venv_imports"
read -r venv_torch venv_cuda <<<"$venv_imports"
[ "$venv_cuda" = True ] || [ "$DRY" = 1 ] || fail 1 "in the venv, PyTorch $venv_torch sees no CUDA device, where $PY's did"
fact interpreters "{\"workload\": \"$PY\", \"venv\": \"$VENV/bin/python\", \"venv_torch\": \"$venv_torch\", \"venv_cuda\": $( [ "$venv_cuda" = True ] && echo true || echo false)}"

CRIU_PREFIX=${CEDANA_CRIU_PREFIX:-/opt/cedana-airflow/criu}
criu_major() { "$@" --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\)\..*/\1/p' | head -n1; }
CRIU=""
if [ -n "${CEDANA_CRIU:-}" ]; then
  [ "$(criu_major "$CEDANA_CRIU")" -ge 4 ] 2>/dev/null || fail 1 "CEDANA_CRIU=$CEDANA_CRIU is not a working CRIU 4 or later"
  CRIU=$CEDANA_CRIU
elif [ "$(criu_major "$CRIU_PREFIX/bin/criu")" -ge 4 ] 2>/dev/null; then
  CRIU=$CRIU_PREFIX/bin/criu  # where scripts/install-criu.sh puts it, and where the engine looks before PATH
elif command -v criu >/dev/null && [ "$(criu_major criu)" -ge 4 ] 2>/dev/null; then
  CRIU=$(command -v criu)
elif [ -z "$BUNDLE" ]; then
  fail 1 "no CRIU 4 or later here (CEDANA_CRIU, $CRIU_PREFIX, PATH) and no .gpu-bundle/ to take it from: set CEDANA_CRIU or run scripts/install-criu.sh"
else
  prefix="$WORK/criu"
  mkdir -p "$prefix"
  for deb in "$BUNDLE"/debs/*.deb; do dpkg-deb -x "$deb" "$prefix" || fail 1 "unpacking $deb failed (dpkg-deb)"; done
  lib="$prefix/usr/lib/x86_64-linux-gnu"
  mkdir -p "$prefix/bin"
  # As scripts/install-criu.sh: Debian's criu through its own loader and libraries; the host's libc is untouched.
  printf '#!/bin/sh\nexec "%s/ld-linux-x86-64.so.2" --library-path "%s" "%s/usr/sbin/criu" "$@"\n' "$lib" "$lib" "$prefix" >"$prefix/bin/criu"
  chmod 755 "$prefix/bin/criu"
  CRIU="$prefix/bin/criu"
  [ -n "$(criu_major "$CRIU")" ] || fail 1 "the bundled criu does not run here: $("$CRIU" --version 2>&1 | tail -n1)"
fi
criu_version=$("$CRIU" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
check_line=$("$CRIU" check 2>&1 | tail -n1) && criu_check=ok || criu_check=failed
fact criu "{\"path\": \"$CRIU\", \"version\": \"$criu_version\", \"check\": \"$criu_check\", \"check_line\": $(printf '%s' "$check_line" | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}"
if [ "$criu_check" != ok ]; then
  [ -n "$gvisor" ] && fail 4 "CRIU cannot work in this sandbox: gVisor detected ($gvisor) and 'criu check' fails ($check_line). Run on a Firecracker VM or bare metal."
  fail 1 "'criu check' fails here ($check_line): CRIU cannot dump or restore on this kernel or in this container. Run on a host (or a privileged container) where it passes."
fi
say "criu $criu_version at $CRIU (criu check: $criu_check)"

# A stop (finish() past a step's limit) leaves the final checkpoint 8 s, inside finish()'s 10 s to SIGKILL.
export CEDANA_CRIU="$CRIU" CEDANA_STORE="file://$WORK/store" CEDANA_STOP_WINDOW_SECONDS=8 PYTHONUNBUFFERED=1
unset CEDANA_CONFIG CEDANA_SIGNING_KEY CEDANA_SIGNING_KEY_FILE CEDANA_HEARTBEAT_SECONDS CEDANA_GPU || true

# -- 3. doctor -----------------------------------------------------------------------------------
CEDANA_NODE=gpu-validate-a CEDANA_WORK_DIR="$WORK/work-a" bounded 120 "$CLI" doctor --json >"$WORK/doctor.json" 2>"$WORK/doctor.err" || true
"$PY" - "$WORK/doctor.json" "$WORK/doctor-gpu.json" <<'EOF' || fail 1 "cedana-airflow doctor --json gave no gpu check: $(tail -n1 "$WORK/doctor.err")"
import json, sys
checks = json.load(open(sys.argv[1]))
gpu = next(c for c in checks if c["name"] == "gpu")
json.dump({**gpu.get("gpu", {}), "status": gpu["status"], "detail": gpu["detail"]}, open(sys.argv[2], "w"))
print("gpu-validate: doctor gpu: " + json.dumps(gpu.get("gpu", {})), file=sys.stderr)
EOF
problem=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("problem") or "")' "$WORK/doctor-gpu.json")
if [ -n "$problem" ] && [ "$DRY" = 0 ]; then fail 1 "cedana-airflow cannot checkpoint GPU state here (doctor): $problem"; fi
[ -z "$problem" ] || say "dry run: doctor says GPU state cannot be checkpointed here ($problem); the CPU stands in"

# -- 4. the uninterrupted reference ------------------------------------------------------------------
WL=(scripts/gpu_workload.py --gib "$GIB" --steps "$STEPS" --seed "$SEED")
[ "$DRY" = 0 ] || WL+=(--device cpu --hidden 128 --layers 2 --batch 32)
GPU_MODE=require
[ "$DRY" = 0 ] || GPU_MODE=auto  # no GPU state to take: the CPU workload is checkpointed as any other
say "reference run: ${WL[*]} (uninterrupted)"
t0=$SECONDS
bounded "$(left 240)" "$PY" "${WL[@]}" --step-seconds 0 >"$WORK/reference.out" 2>"$WORK/reference.err" \
  || fail 1 "the reference run failed (exit $?): $(tail -n1 "$WORK/reference.err")"
fact reference_seconds "$((SECONDS - t0))"
grep -q '^digest ' "$WORK/reference.out" || fail 1 "the reference run printed no digest: $(tail -n1 "$WORK/reference.err")"

# -- 5. the bare baseline (before ours: its figures are kept even when ours fails) ------------------
say "baseline: bare driver API + criu on a fresh workload"
baseline_error=""
t=$(left 240)
# In the venv: it reads /proc and CRIU's stats with cedana-airflow's helpers ($PY need not have them).
bounded "$t" "$VENV/bin/python" scripts/gpu_baseline.py --gib "$GIB" --seed "$SEED" --criu "$CRIU" --python "$PY" \
  --work-dir "$WORK/baseline" $( [ "$DRY" = 1 ] && echo --dry-run ) >"$WORK/baseline.json" 2>"$WORK/baseline.err" && rc=0 || rc=$?
if [ "$rc" != 0 ]; then  # its last line is its one-line reason, or its last progress line on a timeout
  baseline_error=$(tail -n1 "$WORK/baseline.err")
  [ "$rc" != 124 ] || baseline_error="timed out after $t s (last line: ${baseline_error:-none})"
fi
if [ -n "$baseline_error" ]; then
  fact baseline_error "$(printf '%s' "$baseline_error" | "$PY" -c 'import json, sys; print(json.dumps(sys.stdin.read()))')"
  say "baseline failed (going on with cedana-airflow's run): $baseline_error"
fi
wait_gpu_free

# -- 6. checkpointed, killed, restored elsewhere -----------------------------------------------------
ID="gpu-validate-$$"
STORE="$WORK/store"
say "protected run: cedana-airflow run --id $ID --gpu $GPU_MODE --heartbeat $HEARTBEAT"
# Paced while the pace file is there: removed after the kill, so the restored rest runs at full speed and a
# long paced run (time for the heartbeats on a busy machine) costs nothing after the restore.
: >"$WORK/pace"
CEDANA_NODE=gpu-validate-a CEDANA_WORK_DIR="$WORK/work-a" \
  "$CLI" run --id "$ID" --gpu "$GPU_MODE" --heartbeat "$HEARTBEAT" -- "$PY" "${WL[@]}" --step-seconds "$STEP_SECONDS" \
  --pace-file "$WORK/pace" \
  >"$WORK/run.out" 2>"$WORK/run.err" &
SUP=$!
t0=$SECONDS
gpu_checkpoints() {  # a dry run's CPU workload holds no GPU state: any checkpoint counts there
  # (none yet is 0, not a failure: ls and grep exit 2 on a glob that matched nothing, which pipefail and
  # set -e would turn into the script's silent exit 2 when the workload steps before the first commit)
  if [ "$DRY" = 1 ]; then { ls "$STORE/$ID"/*/manifest.json 2>/dev/null || true; } | wc -l
  else { grep -l '"gpu":' "$STORE/$ID"/*/manifest.json 2>/dev/null || true; } | wc -l; fi
}
# The manifests' figures into $WORK/$1, and the latest one's workload pid. Taken before the restore
# too: the restored workload's heartbeats may prune the run's checkpoints (keep_checkpoints).
save_manifests() {
  "$PY" - "$STORE/$ID" "$WORK/$1" <<'EOF'
import json, pathlib, sys
ms = []
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/manifest.json")):
    m = json.loads(p.read_text())
    ms.append({k: m.get(k) for k in ("seq", "node", "try_number", "freeze_seconds", "image_bytes", "stored_bytes",
                                     "parent_seq", "gpu")} | {"pid": m["process"]["pid"]})
json.dump(ms, open(sys.argv[2], "w"))
print(ms[-1]["pid"] if ms else "")
EOF
}
# Two checkpoints taken once the workload steps: a checkpoint of its start-up (a slow CUDA init, a busy
# machine) restores into start-up again, which would read as "started over".
wait_until=$((SECONDS + $(left 300)))
stepping=""
while [ -z "$stepping" ] || [ "$(gpu_checkpoints)" -lt "$stepping" ]; do
  if [ -z "$stepping" ] && grep -q '^step ' "$WORK/run.out" 2>/dev/null; then
    stepping=$(( $(gpu_checkpoints) + 2 ))
  fi
  if ! kill -0 "$SUP" 2>/dev/null; then
    wait "$SUP" && rc=0 || rc=$?
    SUP=""
    grep -q '^digest ' "$WORK/run.out" \
      && fail 1 "the workload ended before 2 checkpoints holding GPU state were taken: raise --steps or --step-seconds, or lower --heartbeat"
    fail 1 "cedana-airflow run exited $rc before 2 checkpoints: $(grep -v '^ ' "$WORK/run.err" | tail -n1)"
  fi
  [ "$SECONDS" -lt "$wait_until" ] \
    || fail 1 "no 2 checkpoints holding GPU state within $((SECONDS - t0)) s; last supervisor line: $(grep -v '^ ' "$WORK/run.err" | tail -n1)"
  sleep 0.5
done
WPID=$(save_manifests manifests.json)
# Losing the node: no SIGTERM, no final checkpoint. (stderr off: bash's own "Killed" job notice is noise)
{
  kill -KILL "$SUP" || true
  kill -KILL "$WPID" || true
  wait "$SUP" || true
  for _ in $(seq 300); do [ -e "/proc/$WPID" ] || break; sleep 0.1; done
} 2>/dev/null
SUP=""
[ -e "/proc/$WPID" ] && fail 1 "the workload (pid $WPID) was still there 30 s after SIGKILL"
WPID=""
killed_at=$(grep -c '^step ' "$WORK/run.out" || true)
rm -f "$WORK/pace"
say "killed supervisor and workload after step $killed_at; restoring on node gpu-validate-b"
wait_gpu_free

t0=$SECONDS
CEDANA_NODE=gpu-validate-b CEDANA_WORK_DIR="$WORK/work-b" \
  "$CLI" restore --id "$ID" --gpu "$GPU_MODE" --try-number 1 --heartbeat "$HEARTBEAT" >"$WORK/restore.out" 2>"$WORK/restore.err" &
RESTORE_PID=$!  # the restoring supervisor itself: cleanup and finish() stop it, and its tree with it
t=$(left 300)
finish "$RESTORE_PID" "$t" && rc=0 || rc=$?
RESTORE_PID=""
[ "$rc" != 124 ] || fail 1 "cedana-airflow restore did not finish within $t s (stopped): $(grep -v '^ ' "$WORK/restore.err" | grep -v '^step ' | tail -n1)"
fact restore_wall_seconds "$((SECONDS - t0))"
save_manifests manifests-after-restore.json >/dev/null || true
"$PY" - "$WORK" <<'EOF' || true
import json, pathlib, re, sys
work = pathlib.Path(sys.argv[1])
err = (work / "restore.err").read_text(errors="replace")
def num(pattern):
    m = re.search(pattern, err)
    return float(m.group(1)) if m else None
json.dump({"restore_seconds": num(r"restored seq \d+ .*, restore ([0-9.]+) s,"),
           "seq": num(r"restored seq (\d+)"),
           "gpu_seconds": num(r"gpu state restored .*seconds=([0-9.]+)")}, open(work / "restore.json", "w"))
EOF
[ "$rc" = 0 ] || fail 1 "cedana-airflow restore exited $rc: $(grep -v '^ ' "$WORK/restore.err" | grep -v '^step ' | tail -n1)"

"$PY" - "$WORK" <<'EOF' || fail 1 "$(tail -n1 "$WORK/compare.err" 2>/dev/null || echo 'comparing the outputs failed')"
import json, pathlib, re, sys
work = pathlib.Path(sys.argv[1])
def read(name):
    steps, digest, startup = {}, None, 0
    for line in (work / name).read_text(errors="replace").splitlines():
        m = re.match(r"step (\d+)/\d+ loss=", line)
        if m:
            steps[int(m.group(1))] = line
        elif line.startswith("digest "):
            digest = line.split()[1]
        elif line.startswith("start-up:"):
            startup += 1
    return steps, digest, startup
ref, ref_digest, _ = read("reference.out")
run, _, _ = read("run.out")
res, res_digest, res_startup = read("restore.out")
n = max(ref)
bad = [i for src in (run, res) for i in sorted(src) if src[i] != ref.get(i)]
c = {"reference_digest": ref_digest, "restored_digest": res_digest, "steps": n,
     "last_step_before_kill": max(run, default=0), "first_step_after_restore": min(res, default=None),
     "losses_compared": len(set(run) | set(res)), "loss_mismatches": len(bad), "restored_ran_start_up": res_startup > 0}
problem = None
if bad:
    problem = f"step {bad[0]} differs: restored or protected run printed {(run.get(bad[0]) or res.get(bad[0]))!r}, reference {ref.get(bad[0])!r}"
elif res_digest != ref_digest:
    problem = f"digest after restore {res_digest} differs from the uninterrupted run's {ref_digest}"
elif not res or min(res) <= 1 or res_startup:
    problem = "the restored run started over (it printed step 1 or its start-up line) instead of resuming"
elif set(run) | set(res) != set(range(1, n + 1)):
    problem = f"steps missing between the protected run (up to {max(run)}) and the restored one (from {min(res)})"
c["match"] = problem is None
json.dump(c, open(work / "compare.json", "w"))
if problem:
    print(problem, file=open(work / "compare.err", "w"))
    sys.exit(1)
print(f"gpu-validate: restored run matches the uninterrupted one: {len(set(run) | set(res))} losses and digest "
      f"{ref_digest[:16]}... (killed after step {max(run)}, resumed at step {min(res)})", file=sys.stderr)
EOF

fact total_seconds "$((SECONDS - START))"
[ -z "$baseline_error" ] || fail 1 "cedana-airflow's checkpoint and restore passed, but the baseline failed: $baseline_error"
report ""
if [ "$DRY" = 1 ]; then say "OK: dry run passed in $((SECONDS - START)) s (every step but the GPU's; the CPU stood in)"
else say "OK: GPU checkpoint validated in $((SECONDS - START)) s"; fi
