"""Import hygiene: core without Airflow, quiet imports, an explicit public surface."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cedana_airflow

CORE = ["cedana_airflow", "cedana_airflow.config", "cedana_airflow.errors", "cedana_airflow.ids",
        "cedana_airflow.manifest", "cedana_airflow.chunking", "cedana_airflow.selection",
        "cedana_airflow.store", "cedana_airflow.store.transfer", "cedana_airflow.engine",
        "cedana_airflow.checkpointer", "cedana_airflow.runner", "cedana_airflow.heartbeat",
        "cedana_airflow.supervisor", "cedana_airflow.doctor", "cedana_airflow.cli",
        "cedana_airflow.index", "cedana_airflow.listing", "cedana_airflow.optin", "cedana_airflow.tags",
        "cedana_airflow.gpu"]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_core_imports_with_airflow_blocked():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'airflow' or name.startswith('airflow.'):\n"
        "            raise ImportError('airflow is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import importlib\nfor m in {CORE!r}: importlib.import_module(m)\n"
        "print('ok')\n"
    )
    r = _fresh(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_importing_our_modules_does_no_io():
    # Module code (not the import system, which reads .py files through io.open_code) must open
    # no file, start no process and make no client at import time.
    code = (
        "import builtins, io, os, subprocess, sys\n"
        "calls = []\n"
        "def spy(name, real):\n"
        "    def f(*a, **k):\n"
        "        calls.append((name, str(a[0])[:60] if a else ''))\n"
        "        return real(*a, **k)\n"
        "    return f\n"
        "builtins.open = spy('open', builtins.open); io.open = spy('io.open', io.open)\n"
        "os.open = spy('os.open', os.open); subprocess.Popen.__init__ = spy('Popen', subprocess.Popen.__init__)\n"
        f"import importlib\nfor m in {CORE!r}: importlib.import_module(m)\n"
        # pydantic looks up its plugins in installed packages' metadata when the first model is
        # defined (importlib.metadata); that is the dependency's, read-only, and not ours.
        "meta = ('.dist-info', '.egg-info', 'site-packages/', '.zip')\n"
        "print([c for c in calls if not any(s in c[1] for s in meta)])\n"
    )
    r = _fresh(code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_importing_the_package_root_loads_nothing_heavy():
    r = _fresh("import sys, cedana_airflow\n"
               "print([m for m in ('pydantic', 'blake3', 'zstandard', 'subprocess', 'boto3') if m in sys.modules])")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_public_names_are_exactly_all_and_each_resolves():
    from cedana_airflow import _NAMES

    assert set(cedana_airflow.__all__) == set(_NAMES) | {"__version__"}
    for name in cedana_airflow.__all__:
        assert getattr(cedana_airflow, name) is not None
    with pytest.raises(AttributeError):
        cedana_airflow.NotAPublicName  # noqa: B018


def test_operators_and_sensors_ship_inside_the_package():
    import cedana_airflow.operators
    import cedana_airflow.sensors

    assert cedana_airflow.operators.__name__ == "cedana_airflow.operators"
    assert cedana_airflow.sensors.__file__.endswith("sensors/__init__.py")
