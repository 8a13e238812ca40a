#!/usr/bin/env bash
# A venv with an older Airflow minor for tests/integration/test_airflow_compat.py, from its pinned set:
#   scripts/compat_venv.sh tests/compat/airflow-3.2.2.txt   ->  /opt/cedana-airflow/compat-3.2.2
# Stamped with the pinned set's digest, not file times: a clean clone (CI) has new mtimes and must not
# rebuild the venv (about 30 s and 540 MB each). Debian's python3, readable by every user, as the worker's.
set -euo pipefail
lock=$1
ver=$(basename "$lock" .txt); ver=${ver#airflow-}
dir=${CEDANA_COMPAT_ROOT:-/opt/cedana-airflow}/compat-$ver
stamp="$dir/.installed-$(sha256sum "$lock" | cut -c1-16)"
[ -e "$stamp" ] && exit 0
/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv; }
echo "compat: Airflow $ver in $dir (from $lock)"
rm -rf "$dir"
/usr/bin/python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock"
chmod -R a+rX "$dir"
touch "$stamp"
