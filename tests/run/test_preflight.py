"""A restore on another node checks what the checkpoint needs from that node's files first.

Against a real dump (a Python process holding a dataset open read-only, a file open for writing, a
file deleted while open, and a multiprocessing listener under its own /tmp-like pymp directory):
a missing or resized dataset gets one line naming it and the remedy; a missing pymp directory is
created, and CRIU, which failed "Can't bind" without it, then restores the tree, whose listener
answers. Crafted image sets (written with a tiny protobuf encoder below) check that socket
directories are never created in a system tree, outside the allowed roots, or through a symlink.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from multiprocessing.connection import Client
from pathlib import Path, PurePosixPath

import pytest

from conftest import criu_image, pb_message

from cedana_airflow.config import DEFAULT_CRIU_PREFIX
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.engine import images
from cedana_airflow.engine.images import read_open_files
from cedana_airflow.errors import NotRestorableHere, RestoreFailed
from cedana_airflow.format.manifest import CapturedFile, Manifest, ProcessInfo
from cedana_airflow.run.preflight import preflight
from cedana_airflow.run.workload import Workload

# one worker runs this module's tests, in order: its module fixture is made once (tests/harness.py)
pytestmark = pytest.mark.xdist_group("preflight")

integration = pytest.mark.integration

WORKLOAD = r"""
import os, sys, time
from multiprocessing.connection import Listener
d = sys.argv[1]
data = open(os.path.join(d, "data.bin"), "rb")          # the dataset: read only
rw = open(os.path.join(d, "rw.bin"), "r+b")             # written: captured by the product, not judged
gone = open(os.path.join(d, "gone.bin"), "rb")          # deleted while open: CRIU keeps a ghost
os.unlink(os.path.join(d, "gone.bin"))
listener = Listener(family="AF_UNIX")                   # $TMPDIR/pymp-XXXX/listener-YYYY, as multiprocessing does
with open(os.path.join(d, "addr.tmp"), "w") as f:
    f.write(listener.address)
os.rename(os.path.join(d, "addr.tmp"), os.path.join(d, "addr"))
while True:
    with listener.accept() as conn:
        conn.send(conn.recv() * 2)
"""


def _manifest(captured: tuple[str, ...] = ()) -> Manifest:
    return Manifest(checkpoint_id="job", seq=4, node="node-a", created_at=datetime.now(timezone.utc),
                    engine_version="4.1.1", files=(), image_bytes=0, stored_bytes=0,
                    process=ProcessInfo(pid=1, command=("x",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]"),
                    captured=tuple(CapturedFile(path=p, size=0, mode=0o644, chunks=()) for p in captured))


class Dumped:
    def __init__(self, images: Path, folder: Path, pymp: Path, address: str, w: Workload) -> None:
        self.images, self.folder, self.pymp, self.address, self.w = images, folder, pymp, address, w


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Dumped:
    d = tmp_path_factory.mktemp("preflight")
    (d / "tmpdir").mkdir()
    (d / "data.bin").write_bytes(os.urandom(4096))
    (d / "rw.bin").write_bytes(b"w" * 100)
    (d / "gone.bin").write_bytes(b"g" * 10)
    (d / "w.py").write_text(WORKLOAD)
    out = open(d / "out.txt", "wb")
    w = Workload.start([sys.executable, str(d / "w.py"), str(d)], cwd=str(d), stdout=out, stderr=out,
                       env={**os.environ, "TMPDIR": str(d / "tmpdir")})
    try:
        deadline = time.monotonic() + 10
        while not (d / "addr").exists():
            assert time.monotonic() < deadline and w.poll() is None, (d / "out.txt").read_text()
            time.sleep(0.02)
        engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
        r = engine.dump(w.pid, d / "images", leave_running=False)
    finally:
        w.stop(2)
    address = (d / "addr").read_text()
    return Dumped(r.image_dir, d, Path(address).parent, address, w)


def _restore(dumped: Dumped, name: str) -> Workload:
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    pid, out_r, err_r = engine.restore_piped(dumped.images, dumped.w.stdout_pipe, dumped.w.stderr_pipe,
                                             pidfile=dumped.folder / f"{name}.pid")
    sink = open(os.devnull, "wb")
    return Workload.adopt(pid, dumped.w.command, str(dumped.folder), out_r, err_r, sink, sink)


@integration
def test_the_image_set_lists_what_a_restore_reopens(dumped: Dumped) -> None:
    files = read_open_files(dumped.images)
    assert files is not None
    by_name = {f.name: f for f in files.regular}
    data, rw, gone = (by_name[str(dumped.folder / n)] for n in ("data.bin", "rw.bin", "gone.bin"))
    assert data.size == 4096 and data.flags & os.O_ACCMODE == os.O_RDONLY and stat.S_ISREG(data.mode or 0)
    assert rw.flags & os.O_ACCMODE == os.O_RDWR
    assert gone.id in files.remapped and data.id not in files.remapped  # paths are stored absolute, "/..."
    [listener] = [s for s in files.unix_sockets if s.name.startswith(str(dumped.pymp).encode())]
    assert listener.name == dumped.address.encode() + b"\0"  # Python binds with the terminating NUL
    assert images.read_creds(dumped.images) == images.ROOT_CREDS  # files go back as the tree's user: root here


@integration
def test_an_unchanged_node_passes_and_nothing_is_created(dumped: Dumped) -> None:
    with preflight(dumped.images, _manifest(), ()) as prepared:
        assert prepared.created == ()


@integration
def test_a_missing_dataset_is_one_line_naming_it_and_the_remedy(dumped: Dumped) -> None:
    data = dumped.folder / "data.bin"
    data.rename(dumped.folder / "data.away")
    try:
        with pytest.raises(NotRestorableHere) as e:
            preflight(dumped.images, _manifest(), ())
    finally:
        (dumped.folder / "data.away").rename(data)
    msg = str(e.value)
    assert msg == (f"checkpoint job seq 4 needs {data} (read-only, 4096 bytes), which is missing on this node: "
                   "make the same file available at the same path on every node (a shared volume), or start fresh")
    assert isinstance(e.value, RestoreFailed)


@integration
def test_a_resized_dataset_is_named_and_a_written_file_is_not_judged(dumped: Dumped) -> None:
    data, rw = dumped.folder / "data.bin", dumped.folder / "rw.bin"
    keep = data.read_bytes()
    with open(data, "ab") as f:
        f.write(b"appended")
    rw.write_bytes(b"x")  # open for writing: captured and put back by the product, never a preflight matter
    try:
        with pytest.raises(NotRestorableHere) as e:
            preflight(dumped.images, _manifest(), ())
    finally:
        data.write_bytes(keep)
        rw.write_bytes(b"w" * 100)
    msg = str(e.value)
    assert f"needs {data} (read-only, 4096 bytes), which is 4104 bytes on this node:" in msg
    assert "rw.bin" not in msg and "gone.bin" not in msg and "\n" not in msg


@integration
def test_a_missing_pymp_directory_is_created_and_then_criu_restores_the_listener(dumped: Dumped) -> None:
    for entry in dumped.pymp.iterdir():
        entry.unlink()
    dumped.pymp.rmdir()  # a fresh node's /tmp
    with pytest.raises(RestoreFailed, match="Can't bind"):
        _restore(dumped, "without")
    assert not dumped.pymp.exists()

    with preflight(dumped.images, _manifest(), ()) as prepared:
        assert prepared.created == (str(dumped.pymp),)
        st = dumped.pymp.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and (st.st_uid, st.st_gid) == (0, 0)
        w = _restore(dumped, "with")
    try:
        with Client(dumped.address, family="AF_UNIX") as c:
            c.send(b"ping")
            assert c.recv() == b"pingping"
    finally:
        w.stop(2)


# Crafted image sets: protobuf written by hand, field numbers from CRIU's images/*.proto.



def _sock(name: bytes, *, uid: int = 0, state: int = 10, type_: int = socket.SOCK_STREAM,
          deleted: bool = False) -> bytes:
    perms = pb_message((1, 0o140755), (2, uid), (3, uid))
    usk = pb_message((1, 7), (2, 99), (3, type_), (4, state), (5, 0), (6, 0), (7, 0), (8, 0), (11, name), (13, perms),
               *([(15, 1)] if deleted else []))
    return pb_message((1, 5), (2, 7), (16, usk))


def _reg(name: str, size: int, *, flags: int = os.O_RDONLY, mode: int = 0o100644, fid: int = 1) -> bytes:
    reg = pb_message((1, fid), (2, flags), (3, 0), (6, name.encode()), (8, size), (10, mode))
    return pb_message((1, 1), (2, fid), (3, reg))


def _images(tmp_path: Path, *entries: bytes, remap: tuple[int, ...] = ()) -> Path:
    d = tmp_path / "images"
    d.mkdir()
    (d / "files.img").write_bytes(criu_image(*entries, magic=0x56213732))
    if remap:
        (d / "remap-fpath.img").write_bytes(criu_image(*(pb_message((1, i), (2, 0), (3, 1)) for i in remap),
                                                       magic=0x56213732))
    return d


def test_a_socket_directory_in_a_system_tree_is_refused_and_never_created(tmp_path: Path) -> None:
    target = f"/etc/cedana-test-{uuid.uuid4().hex}"
    images = _images(tmp_path, _sock(f"{target}/listener-1".encode()))
    with pytest.raises(NotRestorableHere, match="is in /etc, which a restore never writes. Create it on this node, or "
                                                "start fresh") as e:
        preflight(images, _manifest(), (PurePosixPath("/etc"),))  # listing /etc does not make it writable
    assert not os.path.exists(target) and "\n" not in str(e.value)


def test_a_socket_directory_outside_the_roots_and_temp_dirs_is_refused(tmp_path: Path) -> None:
    target = f"/srv/cedana-test-{uuid.uuid4().hex}/sock"
    images = _images(tmp_path, _sock(f"{target}/s".encode()))
    with pytest.raises(NotRestorableHere, match=r"is outside the restore roots \(.*\)\. Create it on this node, "
                                                r"add a directory above it to restore_roots \(CEDANA_RESTORE_ROOTS\), "
                                                "or start fresh"):
        preflight(images, _manifest(), ())
    assert not os.path.exists(target)


def test_a_symlink_on_the_way_refuses_the_socket_directory_instead_of_redirecting_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "link").symlink_to(victim)
    images = _images(tmp_path, _sock(f"{tmp_path}/link/pymp-x/listener-1".encode()))
    with pytest.raises(NotRestorableHere, match="cannot be created safely"):
        preflight(images, _manifest(), (PurePosixPath(tmp_path),))
    assert list(victim.iterdir()) == []


def test_created_directories_are_owned_like_the_socket_and_undone_with_what_criu_bound(tmp_path: Path) -> None:
    sock = tmp_path / "a" / "b" / "listener-1"
    images = _images(tmp_path, _sock(str(sock).encode() + b"\0", uid=65534))
    prepared = preflight(images, _manifest(), (PurePosixPath(tmp_path),))
    assert prepared.created == (str(tmp_path / "a"), str(tmp_path / "a" / "b"))
    st = (tmp_path / "a" / "b").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o700)
    with socket.socket(socket.AF_UNIX) as s:  # what a failed `criu restore` leaves: a bound socket
        s.bind(str(sock))
        prepared.undo()
    assert not (tmp_path / "a").exists() and prepared.created == ()


def test_a_socket_directory_through_another_users_directory_or_on_the_deny_list_is_not_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: under /tmp (everyone's), another user's directory is not written through; nor is a
    directory the restoring interpreter imports from, whatever the roots."""
    theirs = Path(tempfile.mkdtemp(prefix="cedana-test-"))  # under /tmp: a temp dir, not a configured root
    try:
        os.chown(theirs, 65534, 65534)
        images_dir = _images(tmp_path, _sock(f"{theirs}/pymp-x/listener-1".encode()))
        with pytest.raises(NotRestorableHere, match="owned by uid 65534, neither root nor the workload's user"):
            preflight(images_dir, _manifest(), ())
        assert os.listdir(theirs) == []
    finally:
        shutil.rmtree(theirs)
    lib = tmp_path / "lib"
    lib.mkdir()
    monkeypatch.syspath_prepend(str(lib))
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(NotRestorableHere, match="code the restoring interpreter imports"):
        preflight(_images(other, _sock(f"{lib}/pymp-y/listener-1".encode())), _manifest(), (PurePosixPath(tmp_path),))
    assert os.listdir(lib) == []


def test_sockets_criu_does_not_bind_by_path_need_nothing(tmp_path: Path) -> None:
    images = _images(
        tmp_path,
        _sock(b"\0abstract-name"),
        _sock(b"relative/listener"),
        _sock(f"{tmp_path}/conn/s".encode(), state=1),  # a connected stream: never bound
        _sock(f"{tmp_path}/deleted/s".encode(), deleted=True),  # CRIU rebuilds and removes it itself
    )
    assert preflight(images, _manifest(), (PurePosixPath(tmp_path),)).created == ()
    assert sorted(os.listdir(tmp_path)) == ["images"]


def test_only_read_only_files_a_node_must_provide_are_judged(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    images = _images(
        tmp_path,
        _reg(f"{missing}/written.bin", 5, flags=os.O_RDWR, fid=1),
        _reg(f"{missing}/captured.bin", 5, fid=2),
        _reg(f"{missing}/deleted-while-open.bin", 5, fid=3),
        _reg("/dev/shm/segment", 5, fid=4),
        _reg("/proc/1/status", 5, fid=5),
        _reg(f"{missing}/dir", 0, mode=0o040755, fid=6),
        remap=(3,),
    )
    assert preflight(images, _manifest(captured=(f"{missing}/captured.bin",)), ()).created == ()


def test_software_gets_its_own_remedy_and_further_problems_are_counted(tmp_path: Path) -> None:
    lib = f"/usr/lib/cedana-test-{uuid.uuid4().hex}.so"
    images = _images(tmp_path, _reg(lib, 100, mode=0o100755, fid=1), _reg(str(tmp_path / "x.bin"), 3, fid=2),
                     _reg(str(tmp_path / "y.bin"), 3, fid=3))
    with pytest.raises(NotRestorableHere) as e:
        preflight(images, _manifest(), ())
    assert str(e.value) == (
        f"checkpoint job seq 4 needs {lib} (read-only, 100 bytes), which is missing on this node "
        f"(2 more files too: {tmp_path}/x.bin, {tmp_path}/y.bin): install the same software at the same path "
        "on every node (the same image), or start fresh")


def test_no_files_img_needs_nothing_and_a_malformed_one_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert preflight(tmp_path / "empty", _manifest(), ()).created == ()
    images = _images(tmp_path, _sock(b"/tmp/x/s"))
    (images / "files.img").write_bytes((images / "files.img").read_bytes()[:-5])
    with pytest.raises(ValueError, match="malformed|past the end"):
        preflight(images, _manifest(), ())


def test_a_link_of_the_trees_user_on_a_path_criu_reopens_refuses_a_tree_that_is_not_root(tmp_path: Path) -> None:
    """Review of issue 48: CRIU reopens files and binds sockets by path as root, so `u -> victim` made by
    the tree's user handed a non-root tree a root daemon's socket and a root-only file."""
    from cedana_airflow.engine.images import ROOT_CREDS, TreeCreds

    victim = tmp_path / "victim"
    (victim / "data").mkdir(parents=True)
    (victim / "data" / "secret").write_bytes(b"root's")
    (tmp_path / "u").symlink_to(victim)
    os.chown(tmp_path / "u", 65534, 65534, follow_symlinks=False)
    images = _images(tmp_path, _reg(f"{tmp_path}/u/data/secret", 6, fid=1))
    nobody = TreeCreds(65534, 65534, ())
    with pytest.raises(NotRestorableHere, match=rf"reopens {tmp_path}/u/data/secret for a tree of uid 65534, but "
                       rf"{tmp_path}/u on this node is a link of uid 65534: the restore \(root\) would follow it"):
        preflight(images, _manifest(), (PurePosixPath(tmp_path),), creds=nobody)
    assert preflight(images, _manifest(), (PurePosixPath(tmp_path),), creds=ROOT_CREDS).created == ()  # root's own
    os.chown(tmp_path / "u", 0, 0, follow_symlinks=False)  # a link of root's is the node's layout
    assert preflight(images, _manifest(), (PurePosixPath(tmp_path),), creds=nobody).created == ()


def test_undo_leaves_alone_a_folder_swapped_in_under_the_name_of_one_it_made(tmp_path):
    """Undo removes what preflight made, by name: a folder renamed into that name since (a caller swapping
    its own folder for another's) keeps its sockets and stays."""
    import socket as socket_

    from cedana_airflow.run.preflight import Prepared

    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "pymp-x").mkdir(mode=0o700)
        prepared = Prepared()
        prepared.made(parent, "pymp-x", str(tmp_path / "pymp-x"))
        (tmp_path / "pymp-x").rename(tmp_path / "moved")
        (tmp_path / "pymp-x").mkdir()  # someone else's, with a listener in it
        with socket_.socket(socket_.AF_UNIX) as s:
            s.bind(str(tmp_path / "pymp-x" / "listener"))
            prepared.undo()
        assert (tmp_path / "pymp-x" / "listener").exists()
        (tmp_path / "pymp-x" / "listener").unlink()
        (tmp_path / "pymp-x").rmdir()
        (tmp_path / "moved").rename(tmp_path / "pymp-x")
        again = Prepared()
        again.made(parent, "pymp-x", str(tmp_path / "pymp-x"))
        again.undo()  # the folder it made, unchanged: removed
        assert not (tmp_path / "pymp-x").exists()
    finally:
        os.close(parent)
