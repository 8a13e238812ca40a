"""A criu dump killed mid-way leaves its network lock: the rules that drop its connections' packets
(issue 47's review). They outlived the tree and hung every later connection on the same address pair, from
any process. The lock of a dump that is gone is removed; a dump under way keeps its own."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cedana_airflow.config import DEFAULT_CRIU_PREFIX
from cedana_airflow.engine import net_lock
from cedana_airflow.engine.criu import CriuEngine, find_criu
from cedana_airflow.run.workload import Workload

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")]

#: A client of a service outside the tree, with 300 MB to dump: time enough to kill the dump mid-way.
_TREE = """
import os, socket, sys, time
c = socket.socket()
c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # so that the test can take its address pair again
c.connect(("127.0.0.1", int(sys.argv[1])))
blob = bytearray(os.urandom(1 << 20)) * 300
print(c.getsockname()[1], flush=True)
while True: time.sleep(0.1)
"""


def _tables() -> list[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return [ln.split()[-1] for ln in out.splitlines() if "CRIU-" in ln]


def _locking(port: int) -> list[str]:
    """The CRIU tables that hold an address pair with ``port`` (other tests' dumps may hold their own)."""
    out = []
    for name in _tables():
        text = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True).stdout
        if f". {port} ." in text or f". {port} }}" in text or f". {port}," in text:
            out.append(name)
    return out


def test_the_lock_of_a_killed_dump_is_removed_and_the_address_pair_works_again(tmp_path):
    engine = CriuEngine(find_criu("", Path(DEFAULT_CRIU_PREFIX)))
    if not net_lock.lock_flags(engine.binary.path):
        pytest.skip("this CRIU cannot lock with nftables")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:  # the peer closes its end once the tree is gone, as a server does
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    out = open(tmp_path / "out", "w+b")
    w = Workload.start([sys.executable, "-c", _TREE, str(port)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out").read_text().strip():
            assert w.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        client_port = int((tmp_path / "out").read_text().split()[0])
        dumping = threading.Thread(target=lambda: pytest.raises(Exception, engine.dump, w.pid, tmp_path / "img"))
        dumping.start()
        deadline = time.monotonic() + 30
        while not _locking(client_port):  # the dump has locked the connection
            assert dumping.is_alive() and time.monotonic() < deadline, "the dump ended before it locked"
            time.sleep(0.01)
        # killed mid-dump, as a stop that gives up kills it (abort_dump), or its parent-death signal
        engine._dumping.kill()
        dumping.join(30)
        w.stop(0, 9)
    finally:
        w.stop(0, 9)
    assert _locking(client_port) == [], _tables()  # its lock went with it
    time.sleep(0.2)  # the peer closes its end
    with socket.socket() as again:  # the same address pair connects at once
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:  # once the old end has closed (TIME_WAIT, which SO_REUSEADDR on both sides lets us reuse)
            try:
                again.bind(("127.0.0.1", client_port))
                break
            except OSError:
                assert time.monotonic() < deadline, subprocess.run(["ss", "-tan"], capture_output=True, text=True).stdout
                time.sleep(0.1)
        again.settimeout(3)
        again.connect(("127.0.0.1", port))
    server.close()


def test_the_lock_of_a_dump_whose_supervisor_died_goes_at_the_next_dump_and_no_other_is_touched(tmp_path):
    """A dead supervisor cannot clean up: its dump's record (criu gone) names the lock for the next dump on
    the node. A lock whose dump is under way stays (CI caught the sweep of one supervisor taking another's:
    criu ran through the loader, and its process name is the loader's)."""
    dead, other = "CRIU-cedana-test-dead", "CRIU-cedana-test-other"
    for name, ports in ((dead, (40001, 40002)), (other, (40003, 40004))):
        subprocess.run(["nft", "-f", "-"], text=True, check=True, input=(
            f"table inet {name} {{\n set conns4 {{\n  type ipv4_addr . inet_service . ipv4_addr . inet_service\n"
            f"  elements = {{ 127.0.0.1 . {ports[0]} . 127.0.0.1 . {ports[1]} }}\n }}\n}}\n"))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a criu pid that is no more
    net_lock.RECORDS.mkdir(parents=True, exist_ok=True)
    record = net_lock.RECORDS / f"{gone.pid}.json"
    record.write_text('{"pairs": [["127.0.0.1", 40001, "127.0.0.1", 40002], ["127.0.0.1", 40002, "127.0.0.1", 40001]]}')
    # a dump under way on this node, another supervisor's: its criu runs through the private prefix's loader
    # (its process name is the loader's), its record names the other table
    criu = find_criu("", Path(DEFAULT_CRIU_PREFIX)).path
    live = subprocess.Popen(["setpriv", "--", criu, "service", "--address", str(tmp_path / "criu.sock")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    live_record = net_lock.RECORDS / f"{live.pid}.json"
    live_record.write_text('{"pairs": [["127.0.0.1", 40003, "127.0.0.1", 40004]]}')
    try:
        time.sleep(0.3)  # it has become criu
        net_lock.sweep()  # (another worker's dump may have swept it first: every dump on the node does)
        assert dead not in _tables() and other in _tables() and not record.exists() and live_record.exists()
    finally:
        live.kill()
        live.wait()
        for name in (dead, other):
            subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True)
        record.unlink(missing_ok=True)
        live_record.unlink(missing_ok=True)
