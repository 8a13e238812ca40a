"""Import hygiene: core without Airflow, quiet imports, an explicit public surface."""

from __future__ import annotations

import subprocess
import sys

import cedana_airflow

CORE = ["cedana_airflow", "cedana_airflow.config", "cedana_airflow.errors", "cedana_airflow.ids",
        "cedana_airflow.manifest", "cedana_airflow.chunking", "cedana_airflow.selection",
        "cedana_airflow.store", "cedana_airflow.store.transfer", "cedana_airflow.engine",
        "cedana_airflow.checkpointer", "cedana_airflow.runner", "cedana_airflow.heartbeat",
        "cedana_airflow.supervisor", "cedana_airflow.doctor", "cedana_airflow.cli",
        "cedana_airflow.operators", "cedana_airflow.sensors"]


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


def test_importing_the_package_does_no_io_and_loads_nothing_heavy():
    code = (
        "import sys, builtins\n"
        "opened = []\n"
        "real = builtins.open\n"
        "builtins.open = lambda *a, **k: (opened.append(a[0]), real(*a, **k))[1]\n"
        "import cedana_airflow\n"
        "heavy = [m for m in ('pydantic', 'blake3', 'zstandard', 'subprocess', 'boto3') if m in sys.modules]\n"
        "print(opened, heavy)\n"
    )
    r = _fresh(code)
    assert r.returncode == 0 and r.stdout.strip() == "[] []", r.stdout + r.stderr


def test_public_names_match_all():
    assert set(cedana_airflow.__all__) == {n for n in dir(cedana_airflow) if not n.startswith("_")} | {"__version__"}
    for name in cedana_airflow.__all__:
        assert getattr(cedana_airflow, name) is not None


def test_operators_and_sensors_ship_inside_the_package():
    import cedana_airflow.operators
    import cedana_airflow.sensors

    assert cedana_airflow.operators.__name__ == "cedana_airflow.operators"
    assert cedana_airflow.sensors.__file__.endswith("sensors/__init__.py")
