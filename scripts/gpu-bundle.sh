#!/usr/bin/env bash
# Build .gpu-bundle/: everything scripts/gpu-validate.sh needs on a GPU machine that reaches no
# package registry. Run it here (PyPI and Debian's mirror reachable), then carry the folder along.
#
#   wheels/   cedana-airflow's wheel (built from this work tree), its runtime dependencies plus the
#             gpu extra (pynvml) for CPython 3.12 manylinux x86_64, and pip itself (the venv there is
#             made --without-pip: Debian and Ubuntu split ensurepip into a package that may be absent)
#   debs/     Debian forky's criu 4.2 and every library it needs, libc included, resolved by apt the
#             way scripts/install-criu.sh does: unpacked into a private prefix there and run through
#             its own loader, so the host's libc (whatever its distribution) is never touched
#   PYTHON    the CPython version the wheels are for (CEDANA_GPU_BUNDLE_PYTHON, default 3.12)
#   SHA256SUMS, CONTENTS  what is in it
#
# Airflow and boto3 are left out: the validation drives the core CLI with a file:// store.
# Fails with one line when the bundle is over 60 MiB (a device call carries 64 MiB in all).
set -euo pipefail

cd "$(dirname "$0")/.."
BUNDLE="${CEDANA_GPU_BUNDLE:-.gpu-bundle}"
PY=.venv/bin/python
SUITE="${CEDANA_CRIU_SUITE:-forky}"  # criu 4.2.1: TCP and UDP sockets on Linux 6.16+ (criu#2718)
MIRROR="${CEDANA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TARGET_PY="${CEDANA_GPU_BUNDLE_PYTHON:-3.12}"  # the GPU machine's Python
LIMIT=$((60 << 20))

say() { echo "gpu-bundle: $*" >&2; }
die() { say "$*"; exit 1; }

[ -x "$PY" ] || die "no virtual environment at .venv: run 'make setup' first (it builds the wheel with .venv's pip)"
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
  || die "apt-get and dpkg-deb are needed to fetch criu's .debs: run this on Debian or Ubuntu"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/debs"

# Runs "$@" quietly; on failure prints its last lines and the one-line reason.
quiet() {
  local what=$1; shift
  if ! "$@" >"$work/log" 2>&1; then
    grep -v 'is ignored: it is neither a file nor a directory' "$work/log" | tail -n 5 >&2 || true
    die "$what failed (see the lines above)"
  fi
}

# Built from a copy of the work tree's tracked and untracked-but-not-ignored files: no stale build/ or
# egg-info of the checkout can leak into the wheel, and the checkout is left as it was.
say "building cedana-airflow's wheel from this work tree"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _ \
  | tar --null -T - -cf - | tar -xf - -C "$work/src"
quiet "building the wheel" "$PY" -m pip wheel --no-deps --disable-pip-version-check -q "$work/src" -w "$BUNDLE/wheels"
wheel=$(ls "$BUNDLE"/wheels/cedana_airflow-*.whl)

# The dependencies come from pyproject.toml (the supervisor group, which leaves Airflow out, plus the gpu
# extra), so the bundle follows it.
mapfile -t reqs < <("$PY" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
for r in [*p["dependency-groups"]["supervisor"], *p["project"]["optional-dependencies"]["gpu"]]:
    print(r)
EOF
)
say "downloading ${#reqs[@]} runtime requirement(s) and pip for CPython $TARGET_PY manylinux x86_64: ${reqs[*]}"
quiet "downloading wheels" "$PY" -m pip download --disable-pip-version-check -q --only-binary=:all: \
  --python-version "$TARGET_PY" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 -d "$BUNDLE/wheels" "${reqs[@]}" pip

say "resolving Debian $SUITE's criu and the libraries it needs"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $SUITE main" >"$work/sources.list"
APT_OPTS=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] \
  || die "/usr/share/keyrings/debian-archive-keyring.gpg is missing: apt-get install debian-archive-keyring"
quiet "apt-get update for $SUITE" apt-get "${APT_OPTS[@]}" update -qq
mapfile -t pkgs < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu | grep -v '^ ' | grep -v '^<' | sort -u)
[ "${#pkgs[@]}" -gt 1 ] || die "apt resolved no dependencies for criu in $SUITE (mirror $MIRROR)"
(cd "$BUNDLE/debs" && quiet "downloading criu's .debs" apt-get "${APT_OPTS[@]}" download -qq "${pkgs[@]}")

echo "$TARGET_PY" >"$BUNDLE/PYTHON"  # gpu-validate.sh looks for this Python on the GPU machine

{
  echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  (cd "$BUNDLE" && ls wheels debs | grep -v ':$' | grep -v '^$')
} >"$BUNDLE/CONTENTS"
(cd "$BUNDLE" && sha256sum PYTHON wheels/* debs/* >SHA256SUMS)

git check-ignore -q "$BUNDLE/" 2>/dev/null || say "warning: $BUNDLE/ is not in .gitignore; add the line '$BUNDLE/'"

bytes=$(du -sb "$BUNDLE" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
if [ "$bytes" -gt "$LIMIT" ]; then
  die "bundle too large: $BUNDLE is $mib MiB, over the 60 MiB limit (a device call carries 64 MiB). Drop what is not needed."
fi
say "$BUNDLE: $mib MiB ($(ls "$BUNDLE/wheels" | wc -l) wheels incl. $(basename "$wheel"), $(ls "$BUNDLE/debs" | wc -l) .debs)"
echo "$mib MiB"
