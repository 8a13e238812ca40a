"""A full restore that does not write the pages images first: CRIU reads them while they stream in.

The plain full path fetches every chunk, verifies it, writes the whole image set to disk, and only
then runs ``criu restore``, which reads it all back: two passes over the pages, one after the other,
on a machine whose second core idles through each. Here the pages images are page files
(engine/page_file.py) over the fetched image directory: fetch threads verify chunks in file order
and push them into the files' page cache (FUSE_NOTIFY_STORE) while ``criu restore`` reads them from
the front, so the fetch and CRIU's read overlap, and each page is written once in memory instead of
once to the work dir and once more by CRIU. A read that gets ahead of the pushes waits for its
chunks, fetched on demand. The rest of the image set (small) is fetched as before.

No byte reaches CRIU unverified (it comes from a :class:`~cedana_airflow.store.chunk_view.ChunkView`).
Unlike a lazy restore, nothing of the tree runs until ``criu restore`` has read every page, so a
corrupt chunk or a store gone mid-stream is answered with EIO at once: CRIU's restore fails and
kills what it had built, and :attr:`error` says why.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..engine.page_file import PageFile, fuse_available
from ..engine.pagemap import PAGE_SIZE
from ..format.manifest import FileEntry, Manifest
from ..store.base import Store
from ..store.chunk_view import ChunkView
from .timeline import Timeline

__all__ = ["PageStream", "streamed_files"]

log = logging.getLogger(__name__)

#: Verified-but-not-yet-pushed bytes held at most per pages image.
_WINDOW_BYTES = 128 << 20


def streamed_files(m: Manifest) -> frozenset[str]:
    """The image files a streamed full restore serves as page files: the pages images."""
    return frozenset(f.name for f in m.files if f.name.startswith("pages-") and f.name.endswith(".img"))


def can_stream() -> tuple[bool, str]:
    """Whether this node can serve page files (root and /dev/fuse), and why not."""
    return fuse_available()


class PageStream:
    """Pages images of ``m`` in ``image_dir`` (created, empty, by the fetch) served from the store:
    :meth:`start` before ``criu restore``, :meth:`close` after it, always."""

    def __init__(self, store: Store, m: Manifest, image_dir: Path, *, reader: str = "",
                 timeline: Timeline | None = None) -> None:
        self.store, self.manifest, self.image_dir, self.reader = store, m, image_dir, reader
        self.timeline = timeline
        self.error: BaseException | None = None  # what stopped the pages (CorruptCheckpoint, StoreUnavailable, ...)
        self.started = 0.0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-stream")
        self._push_pool = ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-stream-push")
        self._views: dict[str, ChunkView] = {}
        self._files: dict[str, PageFile] = {}

    def start(self) -> None:
        """Mount a page file over each pages image and start pushing its chunks, in file order.
        Raises OSError when a page file cannot be mounted (nothing is left mounted)."""
        self.started = time.monotonic()
        entries = {f.name: f for f in self.manifest.files}
        try:
            for name in sorted(streamed_files(self.manifest)):
                entry = entries[name]
                view = ChunkView(self.store, entry, self._pool, window_bytes=_WINDOW_BYTES,
                                 prefetch_pool=self._push_pool, prefetch_width=self.store.parallelism, reader=self.reader)
                self._views[name] = view
                f = PageFile(self.image_dir / name, entry.size, view.read, self._failed, fail_fast=True)
                self._files[name] = f
                f.start()
                view.prefetch(range(len(entry.chunks)), then=functools.partial(self._push, name))
        except BaseException:
            self.close()
            raise

    def _push(self, name: str, i: int) -> None:
        """Push the pages chunk ``i`` begins (each page belongs to the chunk holding its first byte,
        so each is pushed once; the last one may need the next chunk's head)."""
        view, f = self._views[name], self._files[name]
        lo, hi = page_span(view.entry, view.starts[i], i)
        if lo >= hi:
            return
        try:
            f.push(lo, view.read(lo, hi - lo))
        except Exception as e:  # noqa: BLE001 - CRIU's read of these pages meets the same error, and fails
            log.debug("pages not pushed file=%s offset=%d: %s", name, lo, e)

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            self.error = self.error or e
        log.error("streamed restore failed checkpoint_id=%s seq=%d: %s", self.manifest.checkpoint_id,
                  self.manifest.seq, e)

    @property
    def pushed_bytes(self) -> int:
        return sum(f.pushed_bytes for f in self._files.values())

    @property
    def served_bytes(self) -> int:
        """Bytes CRIU read before they were pushed (it waited for them)."""
        return sum(f.served_bytes for f in self._files.values())

    def close(self) -> None:
        """Unmount, stop fetching, drop what is held (after ``criu restore``: every page is in the tree)."""
        if self._files and self.error is None:
            if self.timeline is not None:
                self.timeline.facts["page_source"] = {
                    "via": "stream", "pushed_bytes": self.pushed_bytes, "served_bytes": self.served_bytes,
                    "requests": sum(f.requests for f in self._files.values()),
                    "serving_seconds": round(sum(f.busy_seconds for f in self._files.values()), 4)}
            log.info("streamed restore checkpoint_id=%s seq=%d pushed_bytes=%d served_bytes=%d requests=%d "
                     "serving_seconds=%.3f seconds=%.3f", self.manifest.checkpoint_id, self.manifest.seq,
                     self.pushed_bytes, self.served_bytes, sum(f.requests for f in self._files.values()),
                     sum(f.busy_seconds for f in self._files.values()), time.monotonic() - self.started)
        for f in self._files.values():
            f.close()
        for view in self._views.values():
            view.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._push_pool.shutdown(wait=False, cancel_futures=True)


def page_span(entry: FileEntry, start: int, i: int) -> tuple[int, int]:
    """The byte range of the pages whose first byte lies in chunk ``i`` (at ``start``) of ``entry``."""
    lo = -(-start // PAGE_SIZE) * PAGE_SIZE
    hi = min(-(-(start + entry.chunks[i].size) // PAGE_SIZE) * PAGE_SIZE, entry.size)
    return lo, hi
