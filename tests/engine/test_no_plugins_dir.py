"""CRIU's plugin folder (``-L``): CRIU dlopens every ``.so`` in it as root, so it must be an empty
folder only this process controls, at every use, not only the first (issue 48)."""

from __future__ import annotations

import os
import shutil

from cedana_airflow.engine import criu


def test_a_plugin_folder_someone_else_made_under_its_name_is_not_used(tmp_path, monkeypatch):
    """A /tmp cleaner removed it; whoever made a folder of that name next (it is in our command lines),
    with a plugin inside, is not given to CRIU: a new private folder is."""
    monkeypatch.setattr(criu, "_no_plugins", None)
    monkeypatch.setattr(criu.tempfile, "tempdir", str(tmp_path))
    first = criu.no_plugins_dir()
    assert criu.no_plugins_dir() == first  # kept while it is ours and empty
    os.rmdir(first)
    os.mkdir(first, 0o777)  # another user's, under the same name
    os.chmod(first, 0o777)
    (tmp_path / "payload.so").write_bytes(b"\x7fELF")
    shutil.copy(tmp_path / "payload.so", os.path.join(first, "cuda_plugin.so"))
    second = criu.no_plugins_dir()
    assert second != first and os.listdir(second) == [] and oct(os.stat(second).st_mode & 0o777) == "0o700"
    os.rmdir(second)
    os.symlink(first, second)  # a link in its place
    third = criu.no_plugins_dir()
    assert third not in (first, second) and not os.path.islink(third)
