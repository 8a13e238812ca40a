"""``file://DIR``: the embedded default store, and the honest test double for S3.

Every write goes to a temporary name in the destination folder and is renamed (chunks) or
hard-linked (manifests, so an existing one is never replaced) into place: a reader never sees half
a file, and a crash leaves at most a stray ``.tmp-*`` file that garbage collection removes.

Below the root every path is walked one folder at a time, each opened relative to its parent with
``O_NOFOLLOW`` (and made with ``mkdir`` relative to it): whoever can write the store, but nothing
else on the node, must not turn a folder or a lock file into a symbolic link and have a writer
running as root create or write files where the link points (issue 48). The root itself is the
operator's choice and may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import CorruptCheckpoint, StoreUnavailable
from ..format import layout
from ..format.limits import TooLarge
from .base import RequiredReads, StoreConfig, StoredObject, parse_store_config

__all__ = ["FileStore"]


class FileStore(RequiredReads):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        self.parallelism = max(2, min(8, os.cpu_count() or 2))

    # -- helpers --------------------------------------------------------------------------------
    def _write_atomic(self, key: str, data: bytes, *, exclusive: bool) -> bool:
        try:
            try:
                return self._write(key, data, exclusive=exclusive)
            except FileNotFoundError:  # a delete pruned the folder between our mkdir and our write: once more
                return self._write(key, data, exclusive=exclusive)
        except OSError as e:  # disk full, read-only, permissions: one line, the previous checkpoint stays latest
            raise StoreUnavailable(
                f"store {self.url}: writing {key} failed: {e.strerror or e}. Free space or fix permissions on {self.root}."
            ) from None

    def _folder(self, key: str, *, create: bool) -> int:
        """A descriptor of ``key``'s folder, walked from the root one name at a time without following a
        link (see the module doc); FileNotFoundError where a folder is missing and not ``create``."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)  # the root and above: the operator's path
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in key.split("/")[:-1]:
                if name in ("", ".", ".."):
                    raise OSError(errno.EINVAL, f"not a store key: {key!r}")
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                try:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise OSError(errno.ELOOP, f"{name!r} in {key!r} is a link or not a folder: the store "
                                      "never follows one") from None
                    raise
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _write(self, key: str, data: bytes, *, exclusive: bool) -> bool:
        name = key.rsplit("/", 1)[-1]
        folder = self._folder(key, create=True)
        tmp = f"{layout.TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if exclusive:
                    try:
                        os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
                    except FileExistsError:
                        return False
                else:
                    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
                return True
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=folder)
        finally:
            os.close(folder)

    # -- Store ----------------------------------------------------------------------------------
    def open(self, *, create: bool, chunk_avg_bytes: int) -> StoreConfig:
        cfg_path = self.root / layout.STORE_CONFIG_KEY
        try:
            if cfg_path.exists():
                cfg = parse_store_config(cfg_path.read_bytes(), self.url)
            elif create:
                cfg = StoreConfig(chunk_avg_bytes=chunk_avg_bytes)
                self._write(layout.STORE_CONFIG_KEY, cfg.model_dump_json(indent=2).encode(), exclusive=True)
                cfg = parse_store_config(cfg_path.read_bytes(), self.url)  # a concurrent creator may have won
            else:
                if not self.root.exists():
                    raise StoreUnavailable(f"store {self.url} does not exist. Check --store / CEDANA_STORE.")
                return StoreConfig(chunk_avg_bytes=chunk_avg_bytes)
            if create and not os.access(self.root, os.W_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.root))
        except OSError as e:
            raise StoreUnavailable(
                f"store {self.url} is not usable: {e.strerror or e} ({e.filename or self.root}). "
                "Make the directory writable by this user or choose another --store."
            ) from None
        return cfg

    def has_chunk(self, digest: str) -> bool:
        return (self.root / layout.chunk_key(digest)).exists()

    def put_chunk(self, digest: str, blob: bytes) -> None:
        self._write_atomic(layout.chunk_key(digest), blob, exclusive=False)

    def put_manifest(self, checkpoint_id: str, seq: int, data: bytes) -> bool:
        return self._write_atomic(layout.manifest_key(checkpoint_id, seq), data, exclusive=True)

    def list_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.is_symlink() and p.name not in layout.TOP_LEVEL_NAMES)

    def list_seqs(self, checkpoint_id: str) -> list[int]:
        d = self.root / checkpoint_id
        if not d.is_dir() or d.is_symlink():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / layout.MANIFEST_NAME).is_file())

    def get(self, key: str) -> bytes | None:
        return self.get_bounded(key, -1)

    def get_bounded(self, key: str, limit: int) -> bytes | None:
        """``limit`` < 0: no cap. Else judged by ``fstat`` first, and never more than ``limit`` + 1 bytes read
        (the file may grow in between)."""
        try:
            folder = self._folder(key, create=False)
            try:
                # O_NONBLOCK: a FIFO planted at a key must not hang the reader; only a regular file is read
                fd = os.open(key.rsplit("/", 1)[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             dir_fd=folder)
            finally:
                os.close(folder)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                why = f"store {self.url}: {key} is not a regular file. Remove it from the store."
                raise CorruptCheckpoint(why) if key.startswith(layout.CHUNKS) else StoreUnavailable(why)
            with os.fdopen(fd, "rb") as f:
                if limit < 0:
                    return f.read()
                if (size := os.fstat(fd).st_size) > limit:
                    raise TooLarge(size, limit)
                data = f.read(size + 1)  # read(n) allocates n first: never the cap for a small file
                if len(data) > size:  # grew since fstat
                    data += f.read(limit + 1 - len(data))
                    if len(data) > limit:
                        raise TooLarge(len(data), limit)
                return data
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"store {self.url}: reading {key} failed: {e.strerror or e}. Check the disk and permissions.") from None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._write_atomic(key, data, exclusive=True)

    def delete(self, key: str) -> None:
        path = self.root / key
        if layout.is_cas_lock(key):
            self._delete_cas_lock(path)
        else:
            path.unlink(missing_ok=True)
        # Drop folders a deleted manifest leaves empty (a seq folder, then its checkpoint ID's).
        for d in (path.parent, path.parent.parent):
            if d != self.root and d.is_relative_to(self.root):
                try:
                    d.rmdir()
                except OSError:
                    break

    def _delete_cas_lock(self, path: Path) -> None:
        """Remove a sidecar lock only while holding it, and only when nobody does (else leave it):
        a writer that then locks the unlinked file sees so and locks the new one (_still_linked)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _still_linked(fd, path):
                path.unlink()
        except OSError:
            return  # held: in use now, gc's next run takes it
        finally:
            os.close(fd)

    def get_versioned(self, key: str) -> tuple[bytes | None, str]:
        data = self.get(key)
        return data, ("" if data is None else hashlib.sha256(data).hexdigest())

    def get_if_changed(self, key: str, token: str) -> tuple[bytes | None, str] | None:
        data, now = self.get_versioned(key)  # a local read is cheap; what the caller saves is parsing it
        return None if token and now == token else (data, now)

    def put_if_version(self, key: str, data: bytes, token: str) -> bool:
        # Readers never lock (the write is a rename); writers of one key queue on a sidecar lock,
        # the file-store equivalent of S3's If-Match / If-None-Match.
        lock_key = layout.cas_lock_key(key)
        lock_path = self.root / lock_key
        for attempt in range(1000):
            try:
                folder = self._folder(lock_key, create=True)
                try:
                    fd = os.open(lock_path.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=folder)
                finally:
                    os.close(folder)
            except FileNotFoundError:
                if attempt < 999:  # the folder, emptied, was removed between the two: make it again
                    continue
                raise StoreUnavailable(f"store {self.url}: locking {key} failed: its folder keeps vanishing") from None
            except OSError as e:
                raise StoreUnavailable(f"store {self.url}: locking {key} failed: {e.strerror or e}. "
                                       f"Fix permissions on {self.root}.") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not _still_linked(fd, lock_path):
                    continue  # gc removed the sidecar while we waited: lock the one that is there now
                if self.get_versioned(key)[1] != token:
                    return False
                return self._write_atomic(key, data, exclusive=False)
            finally:
                os.close(fd)
        raise StoreUnavailable(f"store {self.url}: locking {key} failed: its lock file keeps being replaced")

    def list_objects(self, prefix: str, limit: int = 0) -> Iterator[StoredObject]:
        top = self.root / prefix
        if not top.is_dir():
            return
        n = 0
        for dirpath, _, names in os.walk(top):
            for name in names:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                yield StoredObject(str(p.relative_to(self.root)), st.st_size, st.st_mtime)
                n += 1
                if n == limit:
                    return


def _still_linked(fd: int, path: Path) -> bool:
    """Whether the file open at ``fd`` is still the one at ``path`` (gc may have removed it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
