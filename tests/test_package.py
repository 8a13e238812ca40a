"""Import hygiene: core without Airflow, quiet imports, an explicit public surface."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import cedana_airflow

PKG = Path(cedana_airflow.__file__).parent
#: The Airflow side of the package; everything else is core and must import without Airflow.
ADAPTERS = ("cedana_airflow.airflow", "cedana_airflow.hooks", "cedana_airflow.triggers", "cedana_airflow.operators",
            "cedana_airflow.sensors")
#: Subpackages from the bottom up: a module may import only from its own layer or one below it.
LAYERS = [
    {"cedana_airflow.errors", "cedana_airflow.ids", "cedana_airflow.config", "cedana_airflow.units",
     "cedana_airflow.compat", "cedana_airflow.failpoints", "cedana_airflow.coop", "cedana_airflow.fsafe",
     "cedana_airflow.signal_safe"},
    {"cedana_airflow.format"},
    {"cedana_airflow.store", "cedana_airflow.engine", "cedana_airflow.keys"},
    {"cedana_airflow.node"},
    {"cedana_airflow.run", "cedana_airflow.scope", "cedana_airflow.slurm"},
    {"cedana_airflow.drill"},
    {"cedana_airflow.agent"},  # it runs drills for callers that are not root (0.8.4)
    {"cedana_airflow.airflow_compat"},  # what differs between Airflow 3.1, 3.2 and 3.3 (0.9.0)
    {"cedana_airflow.hooks"},
    {"cedana_airflow.triggers"},
    {"cedana_airflow.cli", "cedana_airflow.airflow"},
]


def _modules() -> list[str]:
    """Every module of the package, found by walking it (a new module is covered without listing it)."""
    return sorted(m.name for m in pkgutil.walk_packages([str(PKG)], "cedana_airflow.")
                  if not m.name.endswith("__main__"))


#: Imported by workloads, not by us, and needing what the workload has (torch): not importable everywhere.
WORKLOAD_HELPERS = ("cedana_airflow.coop.torch",)

CORE = ["cedana_airflow", *(m for m in _modules() if not m.startswith(ADAPTERS) and m not in WORKLOAD_HELPERS)]


def _unit(module: str) -> str:
    """The layer unit a module belongs to: its subpackage, or itself for a top-level module."""
    return ".".join(module.split(".")[:2])


def _imports(path: Path, module: str) -> set[str]:
    """Absolute names of the cedana_airflow modules ``path`` imports (at any depth of the file)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            names = [f"{name}.{a.name}" for a in node.names] if name in _package_names() else [name]
            out.update(n for n in names if n.startswith("cedana_airflow."))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cedana_airflow."))
    return out


def _package_names() -> set[str]:
    return {"cedana_airflow", *(m.name for m in pkgutil.walk_packages([str(PKG)], "cedana_airflow.") if m.ispkg)}


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


def test_the_walk_finds_every_layer_and_the_core_leaves_out_the_adapters():
    assert {"cedana_airflow.format.manifest", "cedana_airflow.store.transfer", "cedana_airflow.engine.criu",
            "cedana_airflow.run.runner", "cedana_airflow.scope.optin", "cedana_airflow.node.gpu"} <= set(CORE)
    assert not [m for m in CORE if m.startswith(ADAPTERS)]
    units = {_unit(m) for m in _modules()} - {"cedana_airflow.__init__"}
    assert units <= set().union(*LAYERS), f"a module outside every layer: {units - set().union(*LAYERS)}"


def test_imports_point_down_the_layers_only():
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = []
    for info in pkgutil.walk_packages([str(PKG)], "cedana_airflow."):
        if info.name.endswith("__main__"):
            continue
        rel = Path(*info.name.split(".")[1:])
        path = PKG / rel / "__init__.py" if info.ispkg else (PKG / rel).with_suffix(".py")
        me = _unit(info.name)
        for target in _imports(path, info.name):
            if rank.get(_unit(target), -1) > rank[me]:
                upward.append(f"{info.name} imports {target}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)
