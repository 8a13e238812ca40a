"""The plugin costs a process that loads it almost nothing: the browser's app (and with it Airflow's API
server) is built on its first request, in the api-server only. Its import cost before and after is
measured by bench/plugin_import.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("airflow")


def _fresh(code: str, **env: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_task_process_that_loads_the_plugin_does_not_import_the_browser_or_airflows_api_server():
    got = _fresh("import json, sys\n"
                 "import airflow.sdk.execution_time.task_runner\n"
                 "from airflow.sdk.plugins_manager import integrate_macros_plugins\n"
                 "integrate_macros_plugins()\n"
                 "import airflow.sdk.plugins_manager as m\n"
                 "print(json.dumps({'plugins': [p.name for p in m._get_plugins()[0]],\n"
                 "  'loaded': sorted(n for n in ('airflow.api_fastapi.app', 'cedana_airflow.airflow.browser.app',\n"
                 "                               'fastapi') if n in sys.modules)}))")
    assert "cedana" in got["plugins"], got
    assert got["loaded"] == [], got


def test_the_browser_is_built_on_its_first_request_and_answers_through_the_mount():
    got = _fresh("import json, sys\n"
                 "from fastapi import FastAPI\n"
                 "from fastapi.testclient import TestClient\n"
                 "from cedana_airflow.airflow.plugin import CedanaPlugin\n"
                 "[spec] = CedanaPlugin.fastapi_apps\n"
                 "before = 'cedana_airflow.airflow.browser.app' in sys.modules\n"
                 "root = FastAPI(); root.mount(spec['url_prefix'], spec['app'])\n"
                 "r = TestClient(root).get('/cedana/api/v1/checkpoints')\n"
                 "print(json.dumps({'before': before, 'after': 'cedana_airflow.airflow.browser.app' in sys.modules,\n"
                 "                  'status': r.status_code}))")
    assert got == {"before": False, "after": True, "status": 401}, got  # Airflow's auth answers: no token


@pytest.mark.parametrize(("setting", "tabs"), [("", ["nav", "task_instance"]), ("False", ["nav"])])
def test_task_instance_tab_turns_the_tab_on_every_task_instance_off(setting, tabs):
    env = {"AIRFLOW__CEDANA__TASK_INSTANCE_TAB": setting} if setting else {}
    got = _fresh("import json\nfrom cedana_airflow.airflow.plugin import CedanaPlugin\n"
                 "print(json.dumps([v['destination'] for v in CedanaPlugin.external_views]))", **env)
    assert got == tabs


def test_a_browser_that_cannot_be_built_answers_one_line_and_logs_why():
    got = _fresh("import json, logging\n"
                 "from fastapi import FastAPI\n"
                 "from fastapi.testclient import TestClient\n"
                 "import cedana_airflow.airflow.browser as browser\n"
                 "def broken(): raise ImportError('no module named jinja2')\n"
                 "browser.fastapi_app = broken\n"
                 "said = []\n"
                 "class Keep(logging.Handler):\n"
                 "    def emit(self, record): said.append(record.getMessage())\n"
                 "logging.getLogger('cedana_airflow.airflow.plugin').addHandler(Keep())\n"
                 "from cedana_airflow.airflow.plugin import CedanaPlugin\n"
                 "[spec] = CedanaPlugin.fastapi_apps\n"
                 "root = FastAPI(); root.mount(spec['url_prefix'], spec['app'])\n"
                 "r = TestClient(root).get('/cedana/')\n"
                 "print(json.dumps({'status': r.status_code, 'text': r.text, 'said': said}))")
    assert got["status"] == 503, got
    assert got["text"] == ("cedana: the checkpoint browser could not be built: ImportError: no module named jinja2 "
                           "(the api-server's log has the traceback)")
    assert got["said"] == ["cedana: the checkpoint browser could not be built"]


def test_a_task_instance_tab_value_airflow_cannot_read_keeps_the_plugin_and_its_macro():
    got = _fresh("import json\nfrom cedana_airflow.airflow.plugin import CedanaPlugin\n"
                 "print(json.dumps([[v['destination'] for v in CedanaPlugin.external_views],\n"
                 "                  [m.__name__ for m in CedanaPlugin.macros]]))",
                 AIRFLOW__CEDANA__TASK_INSTANCE_TAB="maybe")
    assert got == [["nav", "task_instance"], ["checkpoint_id"]]
