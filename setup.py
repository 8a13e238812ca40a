"""Packages are found, not listed: a package added under cedana_airflow/, operators/ or sensors/ ships
without touching this file. operators/ and sensors/ are top-level folders (the layout our users asked
for) that ship as cedana_airflow.operators and cedana_airflow.sensors. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

#: top-level folder -> the package name it ships as
SHIPPED_AS = {"operators": "cedana_airflow.operators", "sensors": "cedana_airflow.sensors"}


def packages() -> list[str]:
    found = find_packages(include=["cedana_airflow", "cedana_airflow.*"])
    for folder, name in SHIPPED_AS.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


setup(packages=packages(), package_dir={"cedana_airflow": "cedana_airflow",
                                        **{name: folder for folder, name in SHIPPED_AS.items()}})
