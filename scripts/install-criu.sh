#!/usr/bin/env bash
# Make a CRIU >= 4.2 available that passes `criu check` on this kernel.
#
# 4.2, not 4.0: before 4.2 CRIU reads SO_PASSCRED from every socket, which Linux 6.16 and later refuse
# on TCP and UDP sockets (checkpoint-restore/criu#2718), so no workload that holds one (a serving
# worker, every torchrun job) can be checkpointed there (issue 47).
#
#   1. A system CRIU that is new enough is used as it is.
#   2. Where apt offers criu >= 4.2, it is installed with apt.
#   3. Otherwise (Debian 12 ships 3.17, which fails `criu check` on kernel 6.x with a vDSO error;
#      Debian 13 ships 4.1.1) Debian forky's criu package and the libraries it needs are fetched by
#      package name with apt and unpacked into a private prefix, run through the loader shipped in
#      that prefix, so the system's own libc is never touched.
#
# Idempotent: a prefix that already answers `criu --version` >= 4.2 is kept; an older one is replaced.
# Prefix: $CEDANA_CRIU_PREFIX (default /opt/cedana-airflow/criu); the engine looks there too.
set -euo pipefail

PREFIX="${CEDANA_CRIU_PREFIX:-/opt/cedana-airflow/criu}"
SUITE="${CEDANA_CRIU_SUITE:-forky}"  # Debian 14 (testing): criu 4.2.1 on 2026-12-05
MIRROR="${CEDANA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

say() { echo "install-criu: $*" >&2; }

version_of() {  # prints the version of the criu at "$@" as MAJOR*100+MINOR (4.2.1: 402), or nothing
  "$@" --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | head -n1 | { read -r a b && echo $((a * 100 + b)) || true; }
}

new_enough() { local v; v=$(version_of "$@"); [ -n "$v" ] && [ "$v" -ge 402 ]; }

if [ "$(id -u)" != 0 ]; then
  say "must run as root (CRIU checkpoints need CAP_SYS_ADMIN and apt needs root); rerun with sudo"
  exit 2
fi

export DEBIAN_FRONTEND=noninteractive
# util-linux gives unshare/setsid (the workload's PID namespace); always present on Debian, but be sure.
# iptables-restore: CRIU holds a TCP connection's packets with it while it dumps the connection
# (--tcp-established; nftables where CRIU can, in-process); ss (iproute2) clears a restored
# connection's TIME_WAIT leftovers; nft removes the lock a killed dump left.
need=()
command -v unshare >/dev/null && command -v setsid >/dev/null || need+=(util-linux)
command -v iptables-restore >/dev/null || need+=(iptables)
command -v ss >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)  # removing the network lock a killed criu dump left (engine/net_lock.py)
if [ "${#need[@]}" -gt 0 ]; then apt-get update -qq; apt-get install -y -qq --no-install-recommends "${need[@]}"; fi

if command -v criu >/dev/null && new_enough criu; then
  say "system criu is new enough: $(command -v criu) ($(criu --version | head -n1))"
  exit 0
fi
if [ -x "$PREFIX/bin/criu" ] && new_enough "$PREFIX/bin/criu"; then
  say "private criu already present: $PREFIX/bin/criu ($("$PREFIX/bin/criu" --version | head -n1))"
  exit 0
fi

candidate_of() { apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | { read -r a b && echo $((a * 100 + b)) || true; }; }
candidate=$(candidate_of)
if [ -z "$candidate" ]; then apt-get update -qq; candidate=$(candidate_of); fi
if [ -n "$candidate" ] && [ "$candidate" -ge 402 ]; then
  say "installing criu from this system's apt sources"
  apt-get install -y -qq --no-install-recommends criu
  new_enough criu && exit 0
fi

shown=none; [ -n "$candidate" ] && shown="$((candidate / 100)).$((candidate % 100))"
say "system apt offers criu $shown (4.2 needed); unpacking Debian $SUITE's criu into $PREFIX"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $SUITE main" >"$work/sources.list"
APT_OPTS=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
# A mirror that serves a snapshot (an artifact registry) serves a testing suite's Release past its
# Valid-Until. A host whose apt accepts that (Acquire::Check-Valid-Until "false") applies it here
# itself; CEDANA_APT_ALLOW_EXPIRED=1 says so for a build on such a host (the pod image's, whose base
# has no such setting). The Release's signature is checked either way.
if [ "${CEDANA_APT_ALLOW_EXPIRED:-}" = 1 ]; then APT_OPTS+=(-o "Acquire::Check-Valid-Until=false"); fi
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || apt-get install -y -qq debian-archive-keyring
apt-get "${APT_OPTS[@]}" update -qq
# criu plus everything it needs at run time, resolved by apt for that suite (libc included, since
# criu 4.1 wants glibc >= 2.38 and Debian 12 has 2.36).
mapfile -t pkgs < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu | grep -v '^ ' | grep -v '^<' | sort -u)
(cd "$work/debs" && apt-get "${APT_OPTS[@]}" download -qq "${pkgs[@]}")
rm -rf "$PREFIX.new"
mkdir -p "$PREFIX.new"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$PREFIX.new"; done
lib="$PREFIX/usr/lib/x86_64-linux-gnu"
mkdir -p "$PREFIX.new/bin"
cat >"$PREFIX.new/bin/criu" <<WRAP
#!/bin/sh
# Debian $SUITE's criu, run through its own loader and libraries (see scripts/install-criu.sh).
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$PREFIX/usr/sbin/criu" "\$@"
WRAP
chmod 755 "$PREFIX.new/bin/criu"
rm -rf "$PREFIX"
mv "$PREFIX.new" "$PREFIX"
if ! new_enough "$PREFIX/bin/criu"; then
  say "unpacked criu does not run: $("$PREFIX/bin/criu" --version 2>&1 | tail -n1)"
  exit 1
fi
say "installed $("$PREFIX/bin/criu" --version | head -n1) at $PREFIX/bin/criu"
"$PREFIX/bin/criu" check >/dev/null 2>&1 && say "criu check: ok" || say "warning: 'criu check' failed on this kernel; run 'cedana-airflow doctor'"
