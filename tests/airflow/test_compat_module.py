"""One place for what differs between Airflow 3.1, 3.2 and 3.3 (cedana_airflow/airflow_compat.py): every
other module goes through it, and its 3.1 fallbacks work. The minors themselves are run, with the
installed wheel, by tests/integration/test_airflow_compat.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("airflow")

REPO = Path(__file__).resolve().parents[2]
#: Paths that moved between the minors: only airflow_compat may name them.
MOVED = re.compile(r"airflow\.sdk\.exceptions|airflow\.dag_processing\.dagbag|airflow\.models\.dagbag")


def test_only_the_compat_module_names_what_moved_between_minors():
    offenders = [f"{p.relative_to(REPO)}:{n}" for top in ("cedana_airflow", "operators", "sensors")
                 for p in sorted((REPO / top).rglob("*.py")) if p.name != "airflow_compat.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if MOVED.search(line)]
    assert not offenders, ("import these through cedana_airflow.airflow_compat, which knows where each minor "
                           "keeps them:\n" + "\n".join(offenders))


def test_on_this_airflow_the_names_are_the_task_sdk_s():
    import airflow.sdk.exceptions as sdk

    from cedana_airflow import airflow_compat

    assert airflow_compat.AirflowFailException is sdk.AirflowFailException
    assert airflow_compat.AirflowSkipException is sdk.AirflowSkipException


def test_an_airflow_3_1_layout_falls_back_to_airflow_exceptions():
    """3.1's airflow.sdk.exceptions has AirflowException only, and no airflow.dag_processing.dagbag: played
    in a fresh interpreter by modules laid out as 3.1's, whose classes the compat module must then hand out."""
    code = """
import sys, types
import airflow, airflow.sdk
three_one = {}
for name in ("AirflowFailException", "AirflowSkipException", "AirflowNotFoundException"):
    three_one[name] = type(name, (Exception,), {})
sdk = types.ModuleType("airflow.sdk.exceptions")
sdk.AirflowException = Exception
core = types.ModuleType("airflow.exceptions")
vars(core).update(three_one, AirflowException=Exception)
dagbag = types.ModuleType("airflow.models.dagbag")
dagbag.DagBag = lambda **kw: ("3.1's DagBag", kw)
sys.modules.update({"airflow.sdk.exceptions": sdk, "airflow.exceptions": core, "airflow.models.dagbag": dagbag,
                    "airflow.dag_processing.dagbag": None})  # None: the import fails, as on 3.1
from cedana_airflow import airflow_compat as c
for name, cls in three_one.items():
    assert getattr(c, name) is cls, name
assert c.dag_bag(dag_folder="d") == ("3.1's DagBag", {"dag_folder": "d"})
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"
