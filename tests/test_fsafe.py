"""fsafe: private folders reached from / without following a link, and files in them written and read
without following one (issue 48). Tests run as root: uid 65534 stands for another local user."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cedana_airflow.fsafe import UnsafePath, private_folder, read_bounded, replace_file, secure_base, unlink

OTHER = 65534


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """tmp_path (root's, 0700) stands for "/": the real one's /tmp is everyone's (see the first test)."""
    return tmp_path


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_a_base_under_a_folder_everyone_may_write_is_refused_and_nothing_is_made(tmp_path):
    target = tmp_path / "cedana-airflow" / "taskflow"
    with pytest.raises(UnsafePath, match=r"^/tmp is writable by others \(mode 1777\)"):
        secure_base(target)  # from the real /: /tmp (1777) stops the walk
    assert not (tmp_path / "cedana-airflow").exists()


def test_missing_folders_are_made_ours_the_last_one_0700_whatever_the_umask(base):
    old = os.umask(0o277)
    try:
        fd = secure_base(base / "var" / "taskflow", below=base)
    finally:
        os.umask(old)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(base / "var" / "taskflow"))
    finally:
        os.close(fd)
    assert _mode(base / "var") == 0o755 and _mode(base / "var" / "taskflow") == 0o700
    assert os.stat(base / "var" / "taskflow").st_uid == os.geteuid()
    os.close(secure_base(base / "var" / "taskflow", below=base))  # again: the same folder, accepted


@pytest.mark.parametrize("plant, why", [
    ("other", r"is owned by uid 65534, not by root:"),
    ("world", r"is writable by others \(mode 0777\)"),
    ("group", r"is writable by its group \(mode 0775\)"),
    ("link", r"is a symbolic link or not a folder"),
    ("file", r"is a symbolic link or not a folder"),
])
def test_an_existing_folder_others_could_shape_is_refused_by_name(base, plant, why):
    mid = base / "var"
    elsewhere = base / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if plant == "link":
        mid.symlink_to(elsewhere)
    elif plant == "file":
        mid.write_text("")
    else:
        mid.mkdir()
        os.chmod(mid, {"other": 0o755, "world": 0o777, "group": 0o775}[plant])
        if plant == "other":
            os.chown(mid, OTHER, OTHER)
    with pytest.raises(UnsafePath, match=rf"^{mid} {why}"):
        secure_base(mid / "taskflow", below=base)
    assert not (elsewhere / "taskflow").exists() and not (mid.is_dir() and (mid / "taskflow").exists())


def test_a_path_that_climbs_or_is_relative_is_refused(base):
    with pytest.raises(UnsafePath, match="not a single file name"):
        secure_base(f"{base}/a/../b", below=base)
    with pytest.raises(UnsafePath, match="not an absolute path"):
        secure_base("var/lib/x")


def test_a_per_id_folder_is_made_0700_and_then_accepted_again(base):
    fd = secure_base(base / "tf", below=base)
    try:
        old = os.umask(0o777)
        try:
            os.close(private_folder(fd, "ckpt-1", base / "tf" / "ckpt-1"))
        finally:
            os.umask(old)
        os.close(private_folder(fd, "ckpt-1", base / "tf" / "ckpt-1"))
    finally:
        os.close(fd)
    assert _mode(base / "tf" / "ckpt-1") == 0o700


@pytest.mark.parametrize("plant", ["other", "wide", "link"])
def test_a_per_id_folder_someone_else_made_is_refused(base, plant):
    fd = secure_base(base / "tf", below=base)
    planted = base / "tf" / "ckpt-1"
    decoy = base / "decoy"
    decoy.mkdir(mode=0o700)
    os.chown(decoy, OTHER, OTHER)
    if plant == "link":
        planted.symlink_to(decoy)
    else:
        planted.mkdir(mode=0o700)
        if plant == "other":
            os.chown(planted, OTHER, OTHER)
        else:
            os.chmod(planted, 0o755)
    try:
        with pytest.raises(UnsafePath, match=rf"^{planted} (is not ours|is a symbolic link)"):
            private_folder(fd, "ckpt-1", planted)
    finally:
        os.close(fd)
    assert list(decoy.iterdir()) == []


def test_a_file_is_replaced_never_written_through_a_planted_link(base):
    victim = base / "victim"
    victim.write_text("root's own")
    (base / "args.json").symlink_to(victim)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        replace_file(fd, "args.json", b'{"args": [1]}')
    finally:
        os.close(fd)
    assert victim.read_text() == "root's own"
    assert not (base / "args.json").is_symlink() and (base / "args.json").read_text() == '{"args": [1]}'
    assert _mode(base / "args.json") == 0o600
    assert sorted(p.name for p in base.iterdir()) == ["args.json", "victim"]  # no temporary file left


def test_reads_follow_no_link_and_are_bounded(base):
    forged = base / "forged"
    forged.write_text("666")
    (base / "link.json").symlink_to(forged)
    (base / "big.json").write_bytes(b"1" * 101)
    (base / "ok.json").write_text("42")
    os.mkfifo(base / "fifo.json")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(UnsafePath, match="link.json is a symbolic link"):
            read_bounded(fd, "link.json", 100)
        with pytest.raises(UnsafePath, match="big.json is 101 bytes, over the limit of 100"):
            read_bounded(fd, "big.json", 100)
        with pytest.raises(UnsafePath, match="fifo.json is not a regular file"):  # and no blocking open
            read_bounded(fd, "fifo.json", 100)
        assert read_bounded(fd, "missing.json", 100) is None
        assert read_bounded(fd, "ok.json", 100) == b"42"
        unlink(fd, "link.json")
        unlink(fd, "link.json")  # already gone: fine
    finally:
        os.close(fd)
    assert forged.read_text() == "666" and not (base / "link.json").exists()
