"""A store writer must not get a root write primitive on restoring nodes (issue 11, item 1).

Each test stores a crafted but well-formed checkpoint whose captured files (or working directory)
aim somewhere a restore must not write, restores it with the real Checkpointer, and checks that the
checkpoint is refused with one line and that nothing was written. The refusal comes before CRIU
runs, so the images are random bytes.
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path, PurePosixPath

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import CorruptCheckpoint
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.run.captured import CapturedFilesBack, refusal, restore_roots
from cedana_airflow.run.checkpointer import Checkpointer
from cedana_airflow.store import open_store
from cedana_airflow.store.transfer import CapturedSource, CheckpointMeta, fetch_checkpoint, save_checkpoint


def _stored(tmp_path: Path, captured: dict[str, bytes], cwd: str | None = None, mode: int = 0o640):
    """A store holding one checkpoint whose manifest lists ``captured`` {path: content}."""
    store = open_store(f"file://{tmp_path / 'store'}", Settings())
    cfg = store.open(create=True, chunk_avg_bytes=64 << 10)
    images = tmp_path / "img"
    images.mkdir(exist_ok=True)
    (images / "pages-1.img").write_bytes(os.urandom(4096))
    sources = []
    for i, (path, data) in enumerate(captured.items()):
        copy = tmp_path / f"copy-{i}"
        copy.write_bytes(data)
        sources.append(CapturedSource(path, copy, mode))
    proc = ProcessInfo(pid=1, command=("x",), cwd=cwd or str(tmp_path), stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
    m = save_checkpoint(store, cfg, CheckpointMeta("job", "node-a", "4.1.1", proc), images, sources)
    return store, cfg, m


def _restore(tmp_path: Path, store, cfg, roots: tuple[Path, ...] = (), cwd: Path | None = None) -> str:
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    cp = Checkpointer(engine, store, cfg, "job", Settings(node="node-b", restore_roots=roots),
                      work_dir=tmp_path / "work")
    with pytest.raises(CorruptCheckpoint) as e:
        cp.restore(cwd=str(cwd or tmp_path / "job-cwd"))
    return str(e.value)


def test_a_captured_file_in_a_system_tree_is_refused_and_never_written(tmp_path):
    target = f"/etc/cedana-test-{uuid.uuid4().hex}"
    store, cfg, _ = _stored(tmp_path, {target: b"root::0:0::/root:/bin/sh\n"})
    msg = _restore(tmp_path, store, cfg, roots=(Path("/etc"),))  # listing /etc does not make it writable
    assert f"{target} is in /etc, which a restore never writes" in msg and "\n" not in msg
    assert not os.path.exists(target)


def test_a_captured_file_outside_the_restore_roots_is_refused_and_nothing_is_created(tmp_path):
    elsewhere = tmp_path / "elsewhere" / "deep" / "authorized_keys"
    store, cfg, _ = _stored(tmp_path, {str(elsewhere): b"ssh-ed25519 AAAA attacker\n"})
    msg = _restore(tmp_path, store, cfg, roots=(tmp_path / "outputs",))
    assert "is outside the restore roots" in msg and "restore_roots" in msg
    assert not (tmp_path / "elsewhere").exists()


def _linked_outputs(tmp_path: Path) -> tuple[Path, Path]:
    """An outputs directory whose ``link`` leads to a victim directory: what a store writer would aim at."""
    outputs, victim = tmp_path / "outputs", tmp_path / "victim"
    outputs.mkdir()
    victim.mkdir()
    (outputs / "link").symlink_to(victim)
    return outputs, victim


def test_a_symlink_on_the_way_refuses_the_file_instead_of_redirecting_it(tmp_path):
    outputs, victim = _linked_outputs(tmp_path)
    store, cfg, _ = _stored(tmp_path, {str(outputs / "link" / "file"): b"payload"})
    msg = _restore(tmp_path, store, cfg, roots=(outputs,))
    assert "cannot be reached safely" in msg
    assert list(victim.iterdir()) == []


def test_a_target_that_is_a_symlink_or_a_directory_is_refused_and_left_alone(tmp_path):
    outputs, victim = tmp_path / "outputs", tmp_path / "victim.txt"
    outputs.mkdir()
    victim.write_text("the node's own file\n")
    (outputs / "log").symlink_to(victim)
    (outputs / "dir").mkdir()
    store, cfg, _ = _stored(tmp_path, {str(outputs / "log"): b"payload"})
    assert "exists and is not a regular file" in _restore(tmp_path, store, cfg, roots=(outputs,))
    assert victim.read_text() == "the node's own file\n" and (outputs / "log").is_symlink()
    second = tmp_path / "second"
    second.mkdir()
    store, cfg, _ = _stored(second, {str(outputs / "dir"): b"payload"})
    assert "exists and is not a regular file" in _restore(second, store, cfg, roots=(outputs,))
    assert (outputs / "dir").is_dir() and list((outputs / "dir").iterdir()) == []


def test_a_missing_working_directory_outside_the_roots_is_refused_and_not_created(tmp_path):
    cwd = tmp_path / "not-a-root" / "cwd"
    store, cfg, _ = _stored(tmp_path, {}, cwd=str(cwd))
    msg = _restore(tmp_path, store, cfg, roots=(tmp_path / "outputs",))
    assert "its working directory" in msg and "outside the restore roots" in msg
    assert not (tmp_path / "not-a-root").exists()


def test_under_a_root_the_file_is_put_back_with_permission_bits_only_and_old_links_cannot_redirect(tmp_path):
    outputs, victim = tmp_path / "outputs", tmp_path / "victim.txt"
    (outputs / "run").mkdir(parents=True)
    victim.write_text("untouched\n")
    target = outputs / "run" / "steps.log"
    target.write_text("the node's newer version\n")
    # the temp name the old code used, planted as a link: a new restore must not write through it
    (outputs / "run" / ".steps.log.cedana-restore").symlink_to(victim)
    store, cfg, m = _stored(tmp_path, {str(target): b"step 0\nstep 1\n", str(outputs / "new" / "x.bin"): b"x"},
                            mode=0o777)
    fetched = tmp_path / "fetched"
    fetch_checkpoint(store, m, fetched)
    roots = restore_roots([outputs], str(tmp_path / "job-cwd"))
    with CapturedFilesBack(m, fetched / "captured", roots) as back:
        assert target.read_bytes() == b"step 0\nstep 1\n" and (outputs / "new" / "x.bin").read_bytes() == b"x"
        assert stat.S_IMODE(target.stat().st_mode) == 0o777 and not target.stat().st_mode & 0o7000
        back.keep()
    assert victim.read_text() == "untouched\n"
    assert sorted(p.name for p in (outputs / "run").iterdir()) == [".steps.log.cedana-restore", "steps.log"]
    # a restore that fails afterwards puts the node's own versions back and removes what it added
    target.write_text("the node's newer version\n")
    (outputs / "new" / "x.bin").unlink()
    with pytest.raises(RuntimeError), CapturedFilesBack(m, fetched / "captured", roots):
        raise RuntimeError("criu restore failed")
    assert target.read_text() == "the node's newer version\n" and not (outputs / "new" / "x.bin").exists()


def test_roots_never_include_slash_or_a_system_tree():
    roots = restore_roots([Path("/"), Path("/usr/local"), Path("/lib64"), Path("/data/out")], "/srv/job")
    assert roots == (PurePosixPath("/data/out"), PurePosixPath("/srv/job"))
    assert refusal("/data/out", roots) is not None  # a root itself is a directory, not a file to write
    assert refusal("/data/out/a/../../etc/x", roots) is not None
    assert refusal("/data/out/a/b", roots) is None


def test_a_listed_root_in_a_system_tree_is_warned_about_and_a_working_directory_of_slash_is_not(caplog):
    """A container's working directory is often /: that default must not warn at every checkpoint."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="cedana_airflow"):
        assert restore_roots([], "/") == ()
        assert restore_roots([Path("/usr/share")], "/srv/job") == (PurePosixPath("/srv/job"),)
    levels = {r.getMessage(): r.levelno for r in caplog.records if "is ignored" in r.getMessage()}
    assert levels == {"restore root / is ignored: / is never written by a restore": logging.DEBUG,
                      "restore root /usr/share is ignored: /usr is never written by a restore": logging.WARNING}


def test_a_signed_checkpoint_may_write_anywhere_but_a_system_tree_and_restore_roots_narrow_it():
    anywhere = restore_roots([], "/srv/job", signed=True)
    assert refusal("/data/runs/7/train.log", anywhere) is None  # where the workload had it, no setting needed
    assert refusal("/home/me/.cache/x", anywhere) is None
    for system in ("/etc/passwd", "/usr/lib/x.so", "/lib64/ld.so", "/proc/1/mem", "/dev/sda", "/boot/vmlinuz"):
        assert "which a restore never writes" in refusal(system, anywhere), system
    narrowed = restore_roots([Path("/data/out")], "/srv/job", signed=True)  # listed: only there (and the cwd)
    assert narrowed == (PurePosixPath("/data/out"), PurePosixPath("/srv/job"))
    assert "outside the restore roots" in refusal("/data/runs/7/train.log", narrowed)
    assert restore_roots([], "/srv/job") == (PurePosixPath("/srv/job"),)  # unsigned: the working directory only


def test_a_signed_checkpoint_still_never_writes_through_a_symlink(tmp_path):
    outputs, victim = _linked_outputs(tmp_path)
    store, cfg, m = _stored(tmp_path, {str(outputs / "link" / "file"): b"payload"})
    fetched = tmp_path / "fetched"
    fetch_checkpoint(store, m, fetched)
    with pytest.raises(CorruptCheckpoint, match="cannot be reached safely"):
        with CapturedFilesBack(m, fetched / "captured", restore_roots([], str(tmp_path), signed=True)):
            pass
    assert list(victim.iterdir()) == []


def test_restore_roots_come_from_the_environment_as_a_path_list(monkeypatch):
    from cedana_airflow.config import load_settings
    from cedana_airflow.errors import ConfigError

    s = load_settings(environ={"CEDANA_RESTORE_ROOTS": "/data/out:/scratch"})
    assert s.restore_roots == (Path("/data/out"), Path("/scratch"))
    with pytest.raises(ConfigError, match="restore root 'relative/dir' is not an absolute path"):
        load_settings(environ={"CEDANA_RESTORE_ROOTS": "relative/dir"})


def test_an_existing_file_keeps_its_inode_a_hard_linked_one_is_not_written_through_and_a_stale_journal_goes(tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    db, linked, other = outputs / "steps.db", outputs / "linked.bin", tmp_path / "other-link"
    db.write_bytes(b"rows written after the checkpoint")
    linked.write_bytes(b"the node's own")
    os.link(linked, other)  # another name for the same inode, outside the roots
    (outputs / "steps.db-journal").write_bytes(b"a transaction after the checkpoint")
    store, cfg, m = _stored(tmp_path, {str(db): b"rows at the checkpoint", str(linked): b"captured"})
    fetched = tmp_path / "fetched"
    fetch_checkpoint(store, m, fetched)
    roots = restore_roots([outputs], str(tmp_path / "job-cwd"))
    ino = db.stat().st_ino
    with CapturedFilesBack(m, fetched / "captured", roots) as back:
        # SQLite checks that its file is the inode it opened: the bytes go into that inode
        assert db.read_bytes() == b"rows at the checkpoint" and db.stat().st_ino == ino
        assert linked.read_bytes() == b"captured" and other.read_bytes() == b"the node's own"
        assert not (outputs / "steps.db-journal").exists()  # it would be rolled back into the restored file
        back.keep()
    assert sorted(p.name for p in outputs.iterdir()) == ["linked.bin", "steps.db"]
    # A restore that fails afterwards puts everything back as the node had it, journal included.
    db.write_bytes(b"rows written after the checkpoint")
    (outputs / "steps.db-journal").write_bytes(b"a transaction after the checkpoint")
    with pytest.raises(RuntimeError), CapturedFilesBack(m, fetched / "captured", roots):
        raise RuntimeError("criu restore failed")
    assert db.read_bytes() == b"rows written after the checkpoint" and db.stat().st_ino == ino
    assert (outputs / "steps.db-journal").read_bytes() == b"a transaction after the checkpoint"
    assert sorted(p.name for p in outputs.iterdir()) == ["linked.bin", "steps.db", "steps.db-journal"]
