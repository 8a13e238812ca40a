"""A store writer must not get a root write primitive on restoring nodes (issue 11, item 1).

Each test stores a crafted but well-formed checkpoint whose captured files (or working directory)
aim somewhere a restore must not write, restores it with the real Checkpointer, and checks that the
checkpoint is refused with one line and that nothing was written. The refusal comes before CRIU
runs, so the images are random bytes.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import sys
import sysconfig
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX, Settings
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.errors import CorruptCheckpoint
from cedana_airflow.format.manifest import CapturedFile, Manifest, ProcessInfo
from cedana_airflow.run import captured
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
    # a node that accepts unsigned manifests: whose captured files are held to the roots
    cp = Checkpointer(engine, store, cfg, "job", Settings(node="node-b", restore_roots=roots, allow_unsigned=True),
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
    assert refusal("/home/me/data/x", anywhere) is None
    assert "a hidden entry of the home /home/me" in refusal("/home/me/.cache/x", anywhere)  # see the deny-list tests
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


def test_a_file_made_sparse_and_huge_after_the_checkpoint_is_kept_sparse_and_one_past_the_free_space_is_refused(
        tmp_path, monkeypatch):
    """Root keeps a copy of what a captured file holds on this node while the checkpoint's bytes go into
    it. Its user can make that file a terabyte long and empty at no cost (review 49, F2): the copy keeps
    its holes, so it costs the blocks the file holds, and a file holding more than its file system has
    free for users is refused in one line, nothing written."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    log = outputs / "train.log"
    with open(log, "wb") as f:
        f.write(b"written after the checkpoint")
        f.truncate(1 << 40)  # 1 TiB, one block of it held
        f.seek((1 << 39))
        f.write(b"in the middle")
    store, cfg, m = _stored(tmp_path, {str(log): b"at the checkpoint"})
    fetched = tmp_path / "fetched"
    fetch_checkpoint(store, m, fetched)
    roots = restore_roots([outputs], str(tmp_path / "job-cwd"))
    held = log.stat().st_blocks
    with pytest.raises(RuntimeError), CapturedFilesBack(m, fetched / "captured", roots):
        assert log.read_bytes() == b"at the checkpoint"
        [backup] = [p for p in outputs.iterdir() if p.name.startswith(".train.log.cedana-orig-")]
        assert backup.stat().st_blocks <= held and backup.stat().st_size == 1 << 40
        raise RuntimeError("criu restore failed")
    # put back as it was: its length, its bytes, its holes
    st = log.stat()
    assert st.st_size == 1 << 40 and st.st_blocks <= held
    with open(log, "rb") as f:
        assert f.read(28) == b"written after the checkpoint"
        f.seek(1 << 39)
        assert f.read(13) == b"in the middle"
    assert sorted(p.name for p in outputs.iterdir()) == ["train.log"]

    free = os.statvfs(outputs)
    monkeypatch.setattr(captured.os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=1, f_frsize=free.f_frsize))
    with pytest.raises(CorruptCheckpoint, match=r"captured file .*train\.log holds \d+ bytes on this node now, more "
                       r"than its file system has free for users"), CapturedFilesBack(m, fetched / "captured", roots):
        pass
    with open(log, "rb") as f:
        assert f.read(28) == b"written after the checkpoint"
    assert sorted(p.name for p in outputs.iterdir()) == ["train.log"]

    # Room that goes while the copy runs (other restores at once, the user filling the file's holes): the
    # copy stops before it would take what only root may, and the checkpoint is refused (review 49, R1).
    rooms = iter([1 << 40, 1 << 40, 0])
    monkeypatch.setattr(captured.os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=next(rooms, 0), f_frsize=1))
    with pytest.raises(CorruptCheckpoint, match=r"more than its file system has free for users"), \
            CapturedFilesBack(m, fetched / "captured", roots):
        pass
    with open(log, "rb") as f:
        assert f.read(28) == b"written after the checkpoint"
    assert sorted(p.name for p in outputs.iterdir()) == ["train.log"]

    # The checkpoint's own bytes are root's writes too (third review, T2): with no room for users they are
    # refused, whether the file is gone (a new file) or there (written in place, what it held put back).
    small = b"the node's own, small"
    log.write_bytes(small)
    rooms = iter([1 << 40, 1 << 40])  # the in-place check and the backup's one chunk; then none
    monkeypatch.setattr(captured.os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=next(rooms, 0), f_frsize=1))
    with pytest.raises(CorruptCheckpoint, match=r"captured file .*train\.log cannot be put back: its file system has "
                       r"no more room for users"), CapturedFilesBack(m, fetched / "captured", roots):
        pass
    assert log.read_bytes() == small and sorted(p.name for p in outputs.iterdir()) == ["train.log"]
    log.unlink()
    monkeypatch.setattr(captured.os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=0, f_frsize=1))
    with pytest.raises(CorruptCheckpoint, match=r"cannot be put back: its file system has no more room for users"), \
            CapturedFilesBack(m, fetched / "captured", roots):
        pass
    assert list(outputs.iterdir()) == []


# Issue 48: where a restore writes. The deny-list, and files going back as the workload's own user,
# through directories that user could write (no CRIU: CapturedFilesBack and refusal directly).
# New names are read through the module (captured.X): on code without them, each test fails alone.

NOBODY = (65534, 65534)


def _back(tmp_path: Path, files: dict[str, bytes], mode: int = 0o640) -> tuple[Manifest, Path]:
    """A manifest capturing ``files`` {path: content} and the fetched copies, as a restore has them."""
    source = Path(tempfile.mkdtemp(prefix="fetched-", dir=tmp_path))
    for i, data in enumerate(files.values()):
        (source / str(i)).write_bytes(data)
    m = Manifest(checkpoint_id="job", seq=1, node="node-a", created_at=datetime.now(timezone.utc),
                 engine_version="4.2.1", files=(), image_bytes=0, stored_bytes=0,
                 process=ProcessInfo(pid=1, command=("x",), cwd=str(tmp_path), stdout_pipe="pipe:[1]",
                                     stderr_pipe="pipe:[2]"),
                 captured=tuple(CapturedFile(path=p, size=0, mode=mode, chunks=()) for p in files))
    return m, source


def _dir(path: Path, mode: int, owner: tuple[int, int] = (0, 0)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, *owner)
    path.chmod(mode)  # after chown, which would clear a setgid bit
    return path


ANYWHERE = (PurePosixPath("/"),)
SITE_PACKAGES = sysconfig.get_paths()["purelib"]


@pytest.mark.parametrize("path", [
    "/root/.ssh/authorized_keys", "/var/spool/cron/crontabs/root", "/run/systemd/system/x.service", "/var/run/x",
    "/var/lib/dpkg/info/x.postinst", f"{SITE_PACKAGES}/x.py", f"{sys.prefix}/bin/python3", "/home/u/.bashrc",
    "/home/u/.ssh/authorized_keys-journal"])
def test_the_deny_list_refuses_each_named_path_whatever_the_signature(path):
    why = refusal(path, ANYWHERE)  # the roots of a signed checkpoint with no restore_roots
    assert why is not None and path in why


def test_a_dags_folder_in_restore_deny_is_never_written(tmp_path):
    dags = _dir(tmp_path / "dags", 0o755)
    (dags / "etl.py").write_text("the node's DAG\n")
    denied = captured.node_denied(SimpleNamespace(restore_deny=(dags,)))
    assert "(restore_deny), which a restore never writes" in refusal(str(dags / "etl.py"), ANYWHERE, denied)
    m, source = _back(tmp_path, {str(dags / "etl.py"): b"import os; os.system('id')\n", str(tmp_path / "ok"): b"x"})
    with pytest.raises(CorruptCheckpoint, match=r"etl.py is in .*dags \(restore_deny\), which a restore never writes$"):
        with CapturedFilesBack(m, source, ANYWHERE, denied):
            pass
    assert (dags / "etl.py").read_text() == "the node's DAG\n" and not (tmp_path / "ok").exists()


def test_a_sys_path_dir_of_the_restoring_interpreter_is_never_written(tmp_path, monkeypatch):
    lib = _dir(tmp_path / "pylib", 0o755)
    monkeypatch.syspath_prepend(str(lib))  # what root imports next: a planted json.py would run as root
    m, source = _back(tmp_path, {str(lib / "json.py"): b"import os; os.system('id')\n"})
    with pytest.raises(CorruptCheckpoint, match="code the restoring interpreter imports"):
        with CapturedFilesBack(m, source, ANYWHERE):
            pass
    assert list(lib.iterdir()) == []


def test_a_hidden_entry_of_a_home_is_refused_unless_a_restore_root_lies_within_it(tmp_path, monkeypatch):
    home = _dir(tmp_path / "alice", 0o755)
    users = [*pwd.getpwall(), pwd.struct_passwd(("alice", "x", 0, 0, "", str(home), "/bin/sh"))]
    monkeypatch.setattr(pwd, "getpwall", lambda: users)  # a temp dir registered as a home
    keys = home / ".ssh" / "authorized_keys"
    m, source = _back(tmp_path, {str(keys): b"ssh-ed25519 AAAA attacker\n"})
    with pytest.raises(CorruptCheckpoint, match=r"is in .*alice/\.ssh, a hidden entry of the home .*alice.*"
                                                r"add the directory to restore_roots"):
        with CapturedFilesBack(m, source, ANYWHERE):
            pass
    assert not (home / ".ssh").exists()
    # the operator lists a dir at or below the hidden entry: its files go back there, only there
    cache = home / ".cache" / "hf"
    roots = restore_roots([cache], str(tmp_path / "cwd"), signed=True)
    assert refusal(str(cache / "model.bin"), roots) is None
    assert "a hidden entry of the home" in refusal(str(home / ".cache" / "other"), (*roots, *ANYWHERE))


def test_other_users_directories_and_squatted_names_are_refused_for_a_root_workload(tmp_path):
    bob = _dir(tmp_path / "home" / "bob", 0o755, NOBODY)  # another user's home
    m, source = _back(tmp_path, {str(bob / "notes" / "x.txt"): b"payload"})
    with pytest.raises(CorruptCheckpoint, match=r"cannot be reached safely \(.*bob: owned by uid 65534, neither root "
                                                r"nor the workload's user \(uid 0\)\)"):
        with CapturedFilesBack(m, source, ANYWHERE):
            pass
    assert list(bob.iterdir()) == []
    shared = _dir(tmp_path / "shared", 0o1777)  # /tmp's shape: others' names may be squatted there
    squatted = shared / "out.log"
    squatted.write_text("bob's own\n")
    os.chown(squatted, *NOBODY)
    m, source = _back(tmp_path, {str(squatted): b"payload"})
    with pytest.raises(CorruptCheckpoint, match=r"out.log is owned by uid 65534, not by the workload's user \(uid 0\)"):
        with CapturedFilesBack(m, source, ANYWHERE):
            pass
    assert squatted.read_text() == "bob's own\n" and os.listdir(shared) == ["out.log"]
    loose = _dir(tmp_path / "loose", 0o777)  # writable by others, not sticky: anyone could swap names in it
    m, source = _back(tmp_path, {str(loose / "x"): b"payload"})
    with pytest.raises(CorruptCheckpoint, match="writable by others, and not a sticky directory of root's"):
        with CapturedFilesBack(m, source, ANYWHERE):
            pass


@pytest.fixture
def enterable(tmp_path):
    """A root-owned 0755 directory under /tmp, which any user may enter (pytest's own are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="cedana-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_a_restore_writes_only_where_the_workloads_user_could(tmp_path, enterable):
    user = captured.TreeCreds(*NOBODY)  # the tree's fsuid/fsgid, as read_creds gives them
    own = _dir(enterable / "own", 0o755, NOBODY)
    root_only = _dir(enterable / "root-only", 0o755)
    new = own / "run" / "steps.log"
    m, source = _back(tmp_path, {str(new): b"step 1\n"}, mode=0o600)
    with CapturedFilesBack(m, source, ANYWHERE, None, user) as back:
        back.keep()
    st, dst = new.stat(), new.parent.stat()
    assert new.read_bytes() == b"step 1\n" and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*NOBODY, 0o600)
    assert (dst.st_uid, dst.st_gid) == NOBODY  # the directory the restore made is the user's too
    (own / "root-file").write_text("root's\n")
    for path, why in [(root_only / "x", "may not write it"),  # root's 0755 directory: the user could not create x
                      (root_only / "sub" / "x", "may not create it in its parent"),
                      (own / "root-file", r"is owned by uid 0, not by the workload's user \(uid 65534\)")]:
        m, source = _back(tmp_path, {str(path): b"payload"})
        with pytest.raises(CorruptCheckpoint, match=why):
            with CapturedFilesBack(m, source, ANYWHERE, None, user):
                pass
    assert list(root_only.iterdir()) == [] and (own / "root-file").read_text() == "root's\n"
    # the working directory a restore creates is the user's, through the same rules
    cwd = own / "job" / "cwd"
    m, _ = _back(tmp_path, {})
    captured.ensure_cwd(m.model_copy(update={"process": m.process.model_copy(update={"cwd": str(cwd)})}), ANYWHERE,
                        None, user)
    assert (cwd.stat().st_uid, (own / "job").stat().st_uid) == (65534, 65534)


def test_a_journal_that_may_not_be_set_aside_refuses_the_checkpoint(tmp_path):
    # (a) a journal owned by someone else: refused (was: renamed aside and deleted), the file put back
    out = _dir(tmp_path / "out", 0o755)
    db, journal = out / "steps.db", out / "steps.db-journal"
    db.write_bytes(b"node's db")
    journal.write_bytes(b"bob's journal")
    os.chown(journal, *NOBODY)
    m, source = _back(tmp_path, {str(db): b"checkpoint's db"})
    with pytest.raises(CorruptCheckpoint, match=r"journal .*steps.db-journal .* is owned by uid 65534, not by the "
                                                r"workload's user \(uid 0\), so it cannot be set aside"):
        with CapturedFilesBack(m, source, ANYWHERE):
            pass
    assert db.read_bytes() == b"node's db" and journal.read_bytes() == b"bob's journal"
    assert sorted(os.listdir(out)) == ["steps.db", "steps.db-journal"]
    # (b) under a denied directory: the file and its journal both stay as they are
    dags = _dir(tmp_path / "dags", 0o755)
    (dags / "state.db").write_bytes(b"node's db")
    (dags / "state.db-journal").write_bytes(b"node's journal")
    denied = captured.node_denied(SimpleNamespace(restore_deny=(dags,)))
    m, source = _back(tmp_path, {str(dags / "state.db"): b"checkpoint's db"})
    with pytest.raises(CorruptCheckpoint, match="never writes"):
        with CapturedFilesBack(m, source, ANYWHERE, denied):
            pass
    assert sorted(os.listdir(dags)) == ["state.db", "state.db-journal"]
    assert (dags / "state.db-journal").read_bytes() == b"node's journal"
    # (c) a journal that is itself denied, beside an allowed file
    os.chown(journal, 0, 0)
    only = captured.node_denied(SimpleNamespace(restore_deny=(journal,)))
    m, source = _back(tmp_path, {str(db): b"checkpoint's db"})
    with pytest.raises(CorruptCheckpoint, match=r"journal .*steps.db-journal is in .*restore_deny"):
        with CapturedFilesBack(m, source, ANYWHERE, only):
            pass
    assert db.read_bytes() == b"node's db" and journal.read_bytes() == b"bob's journal"


def test_the_working_directory_root_is_resolved_and_walked_from_the_top_never_vouched_for(tmp_path):
    """Review of issue 48: a DAG's cwd= became a restore root opened through links and never judged: with
    cwd a link to a deny-listed folder a file landed there, and nobody's file was made in root's folder."""
    from cedana_airflow.engine.images import ROOT_CREDS

    data, spool = tmp_path / "data", tmp_path / "spool"
    data.mkdir()
    spool.mkdir()
    (tmp_path / "work").symlink_to(spool)
    roots = restore_roots([data], str(tmp_path / "work"))
    assert roots == (PurePosixPath(data), PurePosixPath(spool)) and isinstance(roots[1], captured.Unvouched)
    denied = captured.DenyList(never=((PurePosixPath(spool), "a test's crontabs"),))
    assert "outside the restore roots" in refusal(str(tmp_path / "work" / "root"), roots, denied)  # the link's name
    assert "a test's crontabs" in refusal(str(spool / "root"), roots, denied)  # where it leads
    theirs = tmp_path / "job"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    (theirs / "out").mkdir()
    job_roots = restore_roots([data], str(theirs / "out"))
    with pytest.raises(PermissionError, match="owned by uid 65534, neither root nor the workload's user"):
        captured.open_dir(PurePosixPath(theirs / "out"), job_roots, create=False, creds=ROOT_CREDS)
    fd = captured.open_dir(PurePosixPath(data), job_roots, create=False, creds=ROOT_CREDS)  # configured: vouched
    os.close(fd)


def test_a_failed_restore_never_writes_back_through_what_was_put_at_the_name_meanwhile(tmp_path):
    """Review of issue 48: the roll-back reopened the file by name, so a hard link swapped in while CRIU
    ran (fs.protected_hardlinks=0) got root's file overwritten and chmodded."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    db, victim = outputs / "state.db", tmp_path / "victim"
    db.write_bytes(b"the user's own rows")
    victim.write_bytes(b"root's own secret")
    victim.chmod(0o600)
    store, cfg, m = _stored(tmp_path, {str(db): b"rows at the checkpoint"})
    fetched = tmp_path / "fetched"
    fetch_checkpoint(store, m, fetched)
    with pytest.raises(RuntimeError), CapturedFilesBack(m, fetched / "captured", restore_roots([outputs], str(tmp_path))):
        db.unlink()
        os.link(victim, db)  # what a user could do while criu restore ran
        raise RuntimeError("criu restore failed")
    assert victim.read_bytes() == b"root's own secret" and stat.S_IMODE(victim.stat().st_mode) == 0o600
