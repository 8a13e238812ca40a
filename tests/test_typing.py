"""The package, operators/ and sensors/ are strictly typed (pyproject's [tool.mypy]); a type error fails the suite like any other bug."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_the_package_the_operators_and_the_sensors_pass_strict_mypy():
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # every module was checked, the operators and sensors outside the package folder included
    ours = [p for d in ("cedana_airflow", "operators", "sensors") for p in (repo / d).rglob("*.py")]
    checked = int(re.search(r"in (\d+) source files", r.stdout).group(1))
    assert checked == len(ours), (checked, len(ours))
