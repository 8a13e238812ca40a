"""What operators install: the built wheel, non-editable, next to Airflow, away from the source tree.

The wheel is built from a copy of the project (a stale ``build/`` of the checkout cannot leak into it),
its files are compared with the source tree's, and it is installed into a fresh virtual environment.
That environment gets Airflow and every other dependency from this checkout's ``.venv`` by hard links
(installing Airflow from PyPI costs minutes, and ``pip install --no-index wheel[amazon,...]`` below still
proves the wheel's declared dependencies are met by them); the editable install of the checkout is
left out, and every command runs outside the checkout, so only the wheel can answer.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, link_site_packages

# one worker runs this module's tests, in order: its module fixture is started once (tests/harness.py)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("wheel")]

#: top-level folders of the checkout -> the package they ship as (setup.py)
SHIPPED = {"cedana_airflow": "cedana_airflow", "operators": "cedana_airflow.operators",
           "sensors": "cedana_airflow.sensors"}
def _source_files() -> set[str]:
    """Every file the source tree means to ship, as its path inside the wheel."""
    out = set()
    for folder, package in SHIPPED.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                out.add("/".join([*package.split("."), *path.relative_to(REPO / folder).parts]))
    return out


def test_the_wheel_holds_every_module_and_file_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if ".dist-info/" not in n}
        meta = {n.split("/", 1)[1]: z.read(n).decode() for n in z.namelist() if ".dist-info/" in n}
    missing = sorted(_source_files() - shipped)
    assert not missing, f"the wheel leaves out {len(missing)} file(s) of the source tree: {missing[:20]}"
    extra = sorted(n for n in shipped - _source_files())
    assert not extra, f"the wheel holds files the source tree does not: {extra[:20]}"
    entry_points = meta["entry_points.txt"]
    for group in ("apache_airflow_provider", "airflow.plugins", "airflow.policy", "console_scripts"):
        assert f"[{group}]" in entry_points, entry_points


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with Airflow beside a non-editable install of the wheel; its python and environment."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    target = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    [dev] = [Path(p) for p in site.getsitepackages() if Path(p, "airflow").is_dir()]
    # without the checkout's editable install: the wheel must stand on its own
    link_site_packages(dev, target, skip=("__editable__", "cedana_airflow"))
    python = venv / "bin" / "python"
    home = tmp_path_factory.mktemp("airflow_home")
    shutil.copytree(REPO / "dags", home / "dags", ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CEDANA_", "PYTHON"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    # Not --no-deps: pip must find every dependency the wheel declares (and its extras) installed.
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--disable-pip-version-check",
                        f"{wheel}[amazon,cncf-kubernetes,ssh,gpu]"], cwd=home, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return python, env


def _run(installed: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    python, env = installed
    r = subprocess.run([str(python), *args], cwd=env["AIRFLOW_HOME"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_every_module_imports_from_the_installed_wheel(installed):
    code = ("import importlib, pkgutil, cedana_airflow as p\n"
            "names = [m.name for m in pkgutil.walk_packages(p.__path__, 'cedana_airflow.')"
            " if not m.name.endswith('__main__')]\n"
            "for n in names: importlib.import_module(n)\n"
            "print(p.__file__, len(names) + 1)\n")  # + the package itself
    where, count = _run(installed, "-c", code).stdout.strip().splitlines()[-1].split()
    assert "site-packages" in where and not where.startswith(str(REPO)), where
    assert int(count) == len([f for f in _source_files() if f.endswith(".py") and not f.endswith("/__main__.py")])


def test_airflow_sees_the_provider_the_plugin_and_the_config_section(installed):
    providers = json.loads(_run(installed, "-m", "airflow", "providers", "list", "-o", "json").stdout)
    assert any(p["package_name"] == "cedana-airflow" for p in providers), providers
    plugins = json.loads(_run(installed, "-m", "airflow", "plugins", "-o", "json").stdout)
    [cedana] = [p for p in plugins if p["name"] == "cedana"]
    assert "cedana_airflow.airflow.plugin:CedanaPlugin" in cedana["source"]
    assert [a["url_prefix"] for a in cedana["fastapi_apps"]] == ["/cedana"]
    assert {v["destination"] for v in cedana["external_views"]} == {"nav", "task_instance"}
    errors = _run(installed, "-c", "from airflow import plugins_manager as m; import json; "
                                  "print(json.dumps(m.get_import_errors()))").stdout
    assert json.loads(errors.strip().splitlines()[-1]) == {}, errors
    section = _run(installed, "-m", "airflow", "config", "list", "--section", "cedana").stdout
    assert _run(installed, "-m", "airflow", "config", "get-value", "cedana", "same_node_retry").stdout.strip() == "allow"
    from cedana_airflow.airflow.config import config_options

    missing = [o.name for o in config_options() if f"{o.name} =" not in section]
    assert "[cedana]" in section and not missing, section


def test_the_shipped_dags_parse_and_the_dag_policy_refuses_a_broken_one(installed):
    _, env = installed
    broken = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "external_no_key.py"
    shutil.copy(REPO / "tests" / "dags_policy" / "external_no_key.py", broken)
    code = ("import json, os\n"
            "from airflow.dag_processing.dagbag import DagBag\n"
            "bag = DagBag(os.environ['AIRFLOW__CORE__DAGS_FOLDER'])\n"
            "print(json.dumps({'dags': sorted(bag.dag_ids), 'errors': bag.import_errors}))\n")
    parsed = json.loads(_run(installed, "-c", code).stdout.strip().splitlines()[-1])
    errors = parsed["errors"]
    assert list(errors) == [str(broken)] and "cedana:" in errors[str(broken)], errors  # the policy ran
    shipped = {p.stem for p in (REPO / "dags").glob("*.py")}
    assert shipped <= set(parsed["dags"]), parsed


def _metadata(text: str) -> tuple[dict[str, list[str]], str]:
    """A METADATA/PKG-INFO file's fields (each a list of its values) and its body (the long description)."""
    from email.parser import Parser

    msg = Parser().parsestr(text)
    fields: dict[str, list[str]] = {}
    for key, value in msg.items():
        fields.setdefault(key, []).append(value)
    return fields, msg.get_payload()


def test_the_wheel_and_sdist_carry_a_providers_metadata_and_pass_twine(wheel, sdist):
    import tarfile

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        [meta_path] = [n for n in names if n.endswith(".dist-info/METADATA")]
        wheel_meta, _ = _metadata(z.read(meta_path).decode())
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
        [pkg_info] = [m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
        sdist_meta, _ = _metadata(t.extractfile(pkg_info).read().decode())  # type: ignore[union-attr]
    for what, meta in (("wheel", wheel_meta), ("sdist", sdist_meta)):
        assert meta["License-Expression"] == ["Apache-2.0"], (what, meta.get("License-Expression"))
        assert set(meta["License-File"]) == {"LICENSE", "NOTICE"}, (what, meta.get("License-File"))
        assert "Framework :: Apache Airflow :: Provider" in meta["Classifier"], what
        assert "Typing :: Typed" in meta["Classifier"], what
        urls = dict(u.split(", ", 1) for u in meta["Project-URL"])
        assert urls.get("Documentation", "").startswith("https://"), (what, urls)
        assert set(meta["Provides-Extra"]) == {"s3", "amazon", "cncf-kubernetes", "ssh", "gpu", "airflow"}, what
        [airflow] = [r for r in meta["Requires-Dist"] if r.split(">")[0].split(";")[0].strip() == "apache-airflow"]
        assert airflow.replace(" ", "") == "apache-airflow>=3.1.8", (what, airflow)  # a floor, no cap
        assert not any("pytest" in r or "playwright" in r for r in meta["Requires-Dist"]), what  # dev tools: a group
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    with zipfile.ZipFile(wheel) as z:
        shipped_licenses = {n.rsplit("/", 1)[1]: z.read(n).decode() for n in z.namelist() if ".dist-info/licenses/" in n}
    assert shipped_licenses == {"LICENSE": license_text, "NOTICE": (REPO / "NOTICE").read_text()}
    assert {"LICENSE", "NOTICE", "README.md", "pyproject.toml"} <= members, sorted(members)[:40]
    assert "cedana_airflow/py.typed" in names
    r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
