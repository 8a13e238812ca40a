"""``file://DIR``: the embedded default store, and the honest test double for S3.

Every write goes to a temporary name in the destination folder and is renamed (chunks) or
hard-linked (manifests, so an existing one is never replaced) into place: a reader never sees half
a file, and a crash leaves at most a stray ``.tmp-*`` file that garbage collection removes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import StoreUnavailable
from ..format import layout
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

    def _write(self, key: str, data: bytes, *, exclusive: bool) -> bool:
        dest = self.root / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=layout.TEMP_PREFIX, dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, dest)
            return True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

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
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name not in layout.TOP_LEVEL_NAMES)

    def list_seqs(self, checkpoint_id: str) -> list[int]:
        d = self.root / checkpoint_id
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / layout.MANIFEST_NAME).is_file())

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
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
        lock_path = self.root / layout.cas_lock_key(key)
        for attempt in range(1000):
            try:
                lock_path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
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
