"""What pyproject.toml promises users, kept consistent with itself and with the README's install lines. The
built wheel's metadata is checked in tests/integration/test_wheel.py."""

from __future__ import annotations

import re
import tomllib

from conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_the_supervisor_group_is_the_dependencies_without_airflow_and_with_boto3():
    without_airflow = [r for r in PROJECT["dependencies"] if _name(r) != "apache-airflow"]
    assert len(without_airflow) == len(PROJECT["dependencies"]) - 1
    assert PYPROJECT["dependency-groups"]["supervisor"] == [*without_airflow, *EXTRAS["s3"]]


def test_airflow_is_a_floor_without_a_cap():
    [airflow] = [r for r in PROJECT["dependencies"] if _name(r) == "apache-airflow"]
    assert airflow == "apache-airflow>=3.1.8"
    oldest = min(tuple(map(int, p.stem.removeprefix("airflow-").split("."))) for p in (REPO / "tests" / "compat").glob("airflow-*.txt"))
    assert oldest == (3, 1, 8), "the floor is the oldest Airflow the compat slices run"


def test_the_extra_from_before_0_9_is_the_union_of_the_provider_extras():
    union = {r for name in ("amazon", "cncf-kubernetes", "ssh", "gpu") for r in EXTRAS[name]}
    assert set(EXTRAS["airflow"]) == union


def test_the_readme_lists_the_supervisor_s_requirements_as_pyproject_has_them():
    readme = (REPO / "README.md").read_text()
    missing = [r for r in PYPROJECT["dependency-groups"]["supervisor"] if f"'{r}'" not in readme]
    assert not missing, f"README's supervisor-only install line lacks {missing}"
