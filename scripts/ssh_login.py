"""A throwaway SSH login node on loopback, for the Slurm route's SSH submission (tests and demo).

Debian's openssh-server binary, never its service: one sshd in the foreground as our child, on a free
port of 127.0.0.1, with a host key and a client key made for it in ``root`` and a config of its own
(keys only, one user, no PAM, no forwarding). The machine's /etc/ssh is not read or touched. The
Airflow connection it gives pins the host key, as a real one should (no_host_key_check false).

The user is root: the jobs it submits run CRIU, which needs root on this machine (a cluster where
users submit as themselves runs the checkpointing with the capabilities granted there).

    with SshLogin(root, env={"SLURM_CONF": ...}) as login:
        os.environ["AIRFLOW_CONN_LOGIN"] = login.airflow_connection()
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from local_parts import Deployment, free_port, stop_parts, tail  # (scripts/ is on sys.path)

__all__ = ["SshLogin", "SshLoginError"]

SSHD = "/usr/sbin/sshd"


class SshLoginError(RuntimeError):
    """sshd did not come up; the message names its log."""


class SshLogin(Deployment):
    def __init__(self, root: Path, env: dict[str, str] | None = None, user: str = "root") -> None:
        self.root, self.env, self.user = root, env or {}, user
        self.port = 0
        self._sshd: subprocess.Popen[bytes] | None = None

    def _keygen(self, name: str) -> Path:
        key = self.root / name
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"cedana-test-{name}", "-f", str(key)],
                       check=True, capture_output=True)
        return key

    def _up(self) -> None:
        if not os.access(SSHD, os.X_OK) or not shutil.which("ssh-keygen"):
            raise SshLoginError(f"{SSHD} is not installed: apt-get install openssh-server (make slurm does)")
        self.root.mkdir(parents=True, exist_ok=True)
        host_key, client_key = self._keygen("host_key"), self._keygen("client_key")
        (self.root / "authorized_keys").write_text(Path(f"{client_key}.pub").read_text())
        self.port = free_port()
        set_env = " ".join(f"{k}={v}" for k, v in self.env.items())
        (self.root / "sshd_config").write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {self.root / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}", f"AllowUsers {self.user}",
            "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",  # the keys lie under /tmp
            "AllowTcpForwarding no", "X11Forwarding no", "PermitTunnel no", "AllowAgentForwarding no",
            *([f"SetEnv {set_env}"] if set_env else []), "",
        ]))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege-separation directory
        log = self.root / "sshd.log"
        self._sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.root / "sshd_config")],
                                      stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while "Server listening" not in log.read_text(errors="replace"):
            if self._sshd.poll() is not None or time.monotonic() > deadline:
                raise SshLoginError(f"sshd did not start: {tail(log, 3)} (log: {log})")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self._sshd is not None:
            stop_parts([self._sshd])

    def host_key(self) -> str:
        """The public host key as ``type base64`` (what the connection pins)."""
        return " ".join((self.root / "host_key.pub").read_text().split()[:2])

    def airflow_connection(self) -> str:
        """An Airflow connection (JSON, for ``AIRFLOW_CONN_<ID>``) that logs in here with the client key."""
        return json.dumps({"conn_type": "ssh", "host": "127.0.0.1", "port": self.port, "login": self.user,
                           "extra": {"key_file": str(self.root / "client_key"), "host_key": self.host_key(),
                                     "no_host_key_check": "false", "look_for_keys": "false"}})
