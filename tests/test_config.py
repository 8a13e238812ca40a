from __future__ import annotations

from pathlib import Path

import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.errors import ConfigError


def test_defaults_without_any_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = load_settings(environ={})
    assert s.resolved_store() == f"file://{tmp_path}/.cedana/store"
    assert s.heartbeat_seconds == 600 and s.work_dir is None and s.checkpoint_on_term


def test_precedence_file_then_env_then_overrides(tmp_path):
    cfg = tmp_path / "cedana.toml"
    cfg.write_text('[cedana]\nstore = "file:///from-file"\nnode = "file-node"\nheartbeat_seconds = 30\n')
    env = {"CEDANA_CONFIG": str(cfg), "CEDANA_NODE": "env-node"}
    s = load_settings({"heartbeat_seconds": 5, "store": None}, environ=env)
    assert (s.store, s.node, s.heartbeat_seconds) == ("file:///from-file", "env-node", 5)
    # where each came from, as the heartbeat's line says it (issue 51)
    assert (s.source("store"), s.source("node"), s.source("heartbeat_seconds"), s.source("mode")) == (
        f"{cfg} [cedana] store", "CEDANA_NODE", "--heartbeat-seconds", "the default of mode")
    assert s.given("node") and not s.given("mode")
    assert s.heartbeat_text() == "every 5s (from --heartbeat-seconds)"
    assert load_settings(environ={}).heartbeat_text() == "every 10m (from the default of heartbeat_seconds)"


def test_bad_value_names_the_setting_its_source_and_value():
    with pytest.raises(ConfigError, match=r"setting heartbeat_seconds = '-1' \(from CEDANA_HEARTBEAT_SECONDS\)"):
        load_settings(environ={"CEDANA_HEARTBEAT_SECONDS": "-1"})


def test_unknown_store_scheme_says_what_is_allowed():
    with pytest.raises(ConfigError, match="use file:///abs/dir or s3://bucket/prefix"):
        load_settings({"store": "ftp://x"}, environ={})


def test_unknown_key_in_file_lists_known_settings(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[cedana]\nheartbeat = 3\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'heartbeat'.*heartbeat_seconds"):
        load_settings(environ={"CEDANA_CONFIG": str(cfg)})


def test_malformed_or_missing_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cedana\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_settings(environ={"CEDANA_CONFIG": str(bad)})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(environ={"CEDANA_CONFIG": str(tmp_path / "nope.toml")})


def test_work_dir_becomes_a_path():
    assert load_settings(environ={"CEDANA_WORK_DIR": "/tmp/w"}).work_dir == Path("/tmp/w")
