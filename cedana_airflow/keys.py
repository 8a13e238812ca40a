"""The node key: the secret that signs every manifest a node writes and that every restore requires.

Like Slurm's munge key, one key per trust domain (a "realm": the nodes that share a store), root-only
on every node. It lives in a file, ``/etc/cedana-airflow/node.key`` unless ``signing_key_file`` names
another; a supervisor running as root creates the default one on first use, so a single node works
with no set-up, and ``cedana-airflow key init`` creates it ahead of time. The other nodes get a copy.

What this module promises: a key is only ever read from a file root (or this user) owns and nobody
else can read or change, never chosen by a DAG (the key settings are node settings, see
``NODE_SETTINGS``), and there is no "no key": an unreadable key is one line naming where it looked,
never a silent fall back to unsigned manifests (docs/security.md#the-node-key)."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .config import NODE_SETTINGS, Settings
from .errors import ConfigError
from .format.manifest import AirflowTask
from .format.signing import key_id
from .format.trust import Trust

__all__ = ["DEFAULT_KEY_FILE", "NODE_SETTINGS", "NodeKey", "init_key", "legacy_keys", "node_key", "node_trust",
           "read_key_file"]

log = logging.getLogger(__name__)

#: Where the node key lives unless ``signing_key_file`` says otherwise (root:root 0400 in a 0700 folder).
DEFAULT_KEY_FILE = Path("/etc/cedana-airflow/node.key")

_MIN_BYTES = 16


@dataclass(frozen=True)
class NodeKey:
    key: bytes = field(repr=False)  # never in a log line, a traceback's locals or an error report
    where: str  # for every line that names it: "/etc/cedana-airflow/node.key (the default)"

    @property
    def key_id(self) -> str:
        return key_id(self.key)


def node_key(settings: Settings, *, default_file: Path | None = None) -> NodeKey:
    """This node's key: ``signing_key_file`` when set, else the inline ``signing_key`` (tests, the CLI by
    hand), else the default file, created when missing and this process is root. Never None."""
    if settings.signing_key_file is not None:
        path = settings.signing_key_file
        return NodeKey(read_key_file(path, "node key", "signing_key_file"), f"{path} (signing_key_file)")
    if settings.signing_key is not None:
        key = settings.signing_key.get_secret_value().encode().strip()
        _long_enough(key, "the inline key (signing_key / CEDANA_SIGNING_KEY)")
        return NodeKey(key, "CEDANA_SIGNING_KEY / [cedana] signing_key")
    path = default_file or DEFAULT_KEY_FILE
    try:
        return NodeKey(read_key_file(path, "node key", "the default; signing_key_file is unset"), f"{path} (the default)")
    except _Missing:
        if os.geteuid() != 0:
            raise ConfigError(f"no node key: {path} (the default; signing_key_file is unset) does not exist and uid "
                              f"{os.geteuid()} cannot create it. Run 'cedana-airflow key init' as root, or set "
                              "signing_key_file.") from None
    made = init_key(path, exist_ok=True)
    return NodeKey(made.key, f"{path} (the default)")


def node_trust(settings: Settings, owner: AirflowTask | None = None, key: NodeKey | None = None,
               uid: int | None = None) -> Trust:
    """What this node accepts from the store (format/trust.py): its key (``key``, else read now), the
    legacy keys, allow_unsigned, ``owner``, the task that restores (None: a restore by hand), and ``uid``,
    the node agent's caller (None: not through the agent)."""
    return Trust((key or node_key(settings)).key, legacy_keys(settings), settings.allow_unsigned, owner, uid)


def legacy_keys(settings: Settings) -> tuple[bytes, ...]:
    """Verify-only keys (``legacy_key_file``, one per line): checkpoints signed before a migration."""
    path = settings.legacy_key_file
    if path is None:
        return ()
    text = _read_checked(path, "legacy key file", "legacy_key_file")
    keys = tuple(line.strip() for line in text.splitlines() if line.strip())
    for k in keys:
        _long_enough(k, f"a key in legacy key file {path}")
    return keys


class _Missing(ConfigError):
    pass


def read_key_file(path: Path, what: str, setting: str) -> bytes:
    """The key in ``path`` (its first line), after checking the file is fit to hold one."""
    text = _read_checked(path, what, setting)
    key = text.splitlines()[0].strip() if text.strip() else b""
    _long_enough(key, f"{what} {path}")
    if key.startswith(b"-----") or len(set(key)) < 8:  # a PEM file's first line is public; so is "0000..."
        raise ConfigError(f"{what} {path} does not hold a random key on its first line (a PEM header, or too few "
                          "distinct bytes). Point it at a node key: 'cedana-airflow key init'.")
    return key


def _read_checked(path: Path, what: str, setting: str) -> bytes:
    # Symlinks are followed: a Kubernetes Secret volume's node.key is a link into ..data/. What is
    # checked is the file actually opened (fstat), so a swap between check and read changes nothing.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _Missing(f"{what} {path} does not exist ({setting}). Copy the key of the other nodes of this store "
                       f"there (root, mode 0400), or create one with 'cedana-airflow key init --file {path}'.") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read as uid {os.geteuid()}: {e.strerror} ({setting}). Run the "
                          "supervisor as root, or fix the file (root, mode 0400).") from None
    try:
        st = os.fstat(fd)
        folder = os.stat(os.path.dirname(os.path.abspath(path)))
        if folder.st_mode & 0o022 and not (folder.st_mode & stat.S_ISVTX and folder.st_uid == 0):
            # whoever may write the folder may swap the name for a link to any root-owned file
            raise ConfigError(f"{what} {path} lies in a folder others may write (mode "
                              f"{stat.S_IMODE(folder.st_mode):04o}): keep the key in a folder only root may change.")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file ({setting}). Point {setting} at the key file.")
        if st.st_uid not in (0, os.geteuid()):
            raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not root: whoever owns it can make every "
                              f"node of its store run their code. Run 'chown root: {path}'.")
        if st.st_mode & 0o027:
            raise ConfigError(f"{what} {path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                              f"whoever reads it can make every node of its store run their code. Run 'chmod 0400 {path}'.")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(64 * 1024)
    finally:
        os.close(fd)


def _long_enough(key: bytes, what: str) -> None:
    if len(key) < _MIN_BYTES:
        raise ConfigError(f"{what} is shorter than {_MIN_BYTES} bytes (or empty). Use a random one: "
                          "'cedana-airflow key init', or 'openssl rand -hex 32'.")


def init_key(path: Path | None = None, *, exist_ok: bool = False) -> NodeKey:
    """Create a node key at ``path`` (default: the default file): 32 random bytes as hex, root-only. The
    file appears whole or not at all (a private temp file, then a hard link), and of racing creators
    the first wins and every other reads the winner's: one node never signs with two keys. An existing
    key is never replaced (every checkpoint signed with it would become unrestorable): with
    ``exist_ok`` it is read, otherwise refused."""
    path = path or DEFAULT_KEY_FILE
    folder = path.parent
    try:
        os.mkdir(folder, 0o700)
        log.info("created %s (mode 0700)", folder)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create {folder} for the node key: {e.strerror}. Run as root, or set signing_key_file.") from None
    st = os.stat(folder, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise ConfigError(f"{folder} must be a folder owned by root that only root may change (it is mode "
                          f"{stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}): the node key cannot be kept there. Fix it "
                          "or set signing_key_file.")
    if os.path.lexists(path):
        if exist_ok:
            return NodeKey(read_key_file(path, "node key", "signing_key_file"), str(path))
        existing = read_key_file(path, "node key", "signing_key_file")
        raise ConfigError(f"node key {path} exists (key {key_id(existing)}); copy it, never replace it: every "
                          "checkpoint signed with it would become unrestorable.")
    key = secrets.token_hex(32).encode()
    tmp = folder / f".node.key.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        os.fchmod(fd, 0o400)  # the umask cannot widen it
        os.write(fd, key + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        if not exist_ok:
            raise ConfigError(f"node key {path} was created by another process meanwhile; copy it, never replace it.") from None
        return NodeKey(read_key_file(path, "node key", "signing_key_file"), str(path))
    except OSError as e:
        os.unlink(tmp)
        raise ConfigError(f"cannot create node key {path}: {e.strerror}.") from None
    os.unlink(tmp)
    made = NodeKey(key, str(path))
    log.warning("created node key %s (key %s): copy it to every node that restores from this store "
                "(docs/security.md#the-node-key)", path, made.key_id)
    return made

