"""Core is strictly typed (pyproject's [tool.mypy]); a type error fails the suite like any other bug."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_core_passes_strict_mypy():
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
