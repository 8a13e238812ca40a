"""Lazy restore: the restored tree runs while its memory streams in from the store.

A full restore fetches every chunk, writes the image set and only then runs ``criu restore``. A lazy
one fetches the small images and the pages a restore reads itself (the stack, file-backed memory:
what the pagemap does not mark lazy; shared memory and memfds whole, in their own pages images,
which the daemon never serves), writes them into sparse ``pages-N.img`` files, and starts
``criu restore --lazy-pages`` beside a lazy-pages daemon, which fetches the rest: first the pages the
process faults on, then all others in the background. The daemon is one of three (``lazy_pages_via``):

- ``ours`` (the default; engine/uffd_server.py): ``criu restore`` hands us each process's
  userfaultfd and we copy pages in ourselves, the whole 1 MiB window around a fault at once;
- CRIU's own daemon, one page per fault, reading either ``file``: its own copy of the image
  directory, whose pages images are page files (engine/page_file.py, over /dev/fuse) that fill
  themselves on demand, or ``socket``: our page server (engine/page_server.py) over a socketpair,
  a round trip per fault, busy-polling while it waits.

All answer from :class:`~cedana_airflow.store.chunk_view.ChunkView`, so every byte comes from a
verified chunk; a prefetcher fetches ahead, the chunks this checkpoint wrote anew (recently written
memory, likely touched first) before the others in address order.

The one rule that matters: the process must never run on a page it did not get. If a chunk turns
out corrupt or the store goes away, the tree is killed before the daemon is let go (its faults stay
blocked until then), and the caller restores again in full (the next older checkpoint for a corrupt
one). A failure before the tree runs that is not a verified corruption (the lazy machinery's, not
the checkpoint's) makes the caller retry the same checkpoint in full. A heartbeat waits until every
page is in: CRIU cannot dump a tree with pages still missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..engine.criu import CriuEngine
from ..engine.iov import pwritev_all
from ..engine.page_file import PageFile
from ..engine.page_server import PageServer, wire_for
from ..engine.uffd_server import UffdServer
from ..engine.pagemap import PAGE_SIZE, Pagemap, read_pagemaps
from ..engine.procfs import process_start, tree_ended
from ..errors import CorruptCheckpoint, StoreUnavailable
from ..format.manifest import Manifest
from ..store.base import Store
from ..store.chunk_view import ChunkView
from ..units import binary_size
from .timeline import Timeline
from .workload import WAIT_FOR_SUPERVISOR

__all__ = ["LazyFeed", "PREFETCH_WINDOW_BYTES", "lazy_files", "transport"]

log = logging.getLogger(__name__)

#: Fetched-but-unread memory held at most per pages file: enough to keep every fetch thread busy
#: ahead of the daemon's 4 MiB background reads, small beside the image.
PREFETCH_WINDOW_BYTES = 256 << 20
#: What :meth:`LazyFeed.fill` holds in memory at most while it writes a range (fetched in parallel).
_FILL_STEP_BYTES = 64 << 20


def lazy_files(m: Manifest) -> frozenset[str]:
    """The image files a lazy restore does not fetch whole: the pages images."""
    return frozenset(f.name for f in m.files if f.name.startswith("pages-") and f.name.endswith(".img"))


def transport(wanted: str = "auto") -> str:
    """Who serves the faults: "ours", or CRIU's daemon fed by "file" or "socket" (``lazy_pages_via``)."""
    return "ours" if wanted == "auto" else wanted


class LazyFeed:
    """Pages for one lazily restored tree: :meth:`fill` and :meth:`start` before ``criu restore``,
    :meth:`attach` the restored root, then :meth:`wait` for :attr:`failure` or not; :meth:`close` always."""

    def __init__(self, engine: CriuEngine, store: Store, manifest: Manifest, image_dir: Path,
                 hot_digests: set[str], *, keep_dir: bool = False, via: str = "auto",
                 timeline: Timeline | None = None) -> None:
        self.engine, self.store, self.manifest, self.image_dir = engine, store, manifest, image_dir
        self.hot = hot_digests
        self.timeline = timeline
        self.keep_dir = keep_dir
        self.failure: str | None = None
        self.corrupt = False  # the failure was the checkpoint's (a bad chunk), not the store's
        self.started = time.monotonic()
        self.finished: float | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        # reads the daemon waits for never queue behind prefetches: each has its own pool
        self._pool = ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-lazy")
        self._prefetch_pool = ThreadPoolExecutor(store.parallelism, thread_name_prefix="cedana-prefetch")
        self._views: dict[str, ChunkView] = {}
        self._pagemaps: dict[int, Pagemap] = {}
        self.transport = transport(via)
        self._server: PageServer | None = None
        self._uffd: UffdServer | None = None
        self._files: list[PageFile] = []
        self._daemon: subprocess.Popen[bytes] | None = None
        self._janitor: subprocess.Popen[bytes] | None = None
        self._watch: threading.Thread | None = None
        self._holds: tuple[int, ...] = ()

    # -- before criu restore ---------------------------------------------------------------------
    def fill(self) -> None:
        """Fill the sparse pages images with what the restore reads itself, and start fetching the
        rest ahead. That is, in a process's pages image, the runs its pagemap does not mark lazy;
        and every other pages image (shared memory, memfd) whole: CRIU's lazy-pages daemon serves
        private anonymous memory only, and ``criu restore`` reads the rest from the images itself,
        so a hole left there would come back as zeros. Raises CorruptCheckpoint (a bad chunk or
        pagemap), StoreUnavailable."""
        try:
            self._pagemaps = read_pagemaps(self.image_dir)
        except ValueError as e:
            raise CorruptCheckpoint(f"checkpoint {self.manifest.checkpoint_id} seq={self.manifest.seq}: {e}") from None
        entries = {f.name: f for f in self.manifest.files}
        for pm in self._pagemaps.values():
            entry = entries.get(pm.pages_file)
            if entry is None or entry.size != pm.pages_bytes:
                raise CorruptCheckpoint(f"checkpoint {self.manifest.checkpoint_id} seq={self.manifest.seq}: "
                                        f"{pm.pages_file} does not match its pagemap")
            self._views.setdefault(pm.pages_file, ChunkView(
                self.store, entry, self._pool, window_bytes=PREFETCH_WINDOW_BYTES, prefetch_pool=self._prefetch_pool,
                prefetch_width=self.store.parallelism))
        for name in sorted(lazy_files(self.manifest)):
            if name in self._views:
                ranges = [r for pm in self._pagemaps.values() if pm.pages_file == name for r in pm.ranges(lazy=False)]
                self._write(name, self._views[name], ranges)
            else:  # no process's pagemap: not lazy at all
                view = ChunkView(self.store, entries[name], self._pool, window_bytes=_FILL_STEP_BYTES)
                try:
                    self._write(name, view, [(0, entries[name].size)])
                finally:
                    view.close()
        for name, view in self._views.items():  # only chunks with lazy pages in them are still to come
            lazy = {i for pm in self._pagemaps.values() if pm.pages_file == name
                    for off, n in pm.ranges(lazy=True) for i in view.chunks_of(off, n)}
            order = sorted(lazy)
            view.prefetch([i for i in order if view.entry.chunks[i].digest in self.hot]
                          + [i for i in order if view.entry.chunks[i].digest not in self.hot])

    def _write(self, name: str, view: ChunkView, ranges: list[tuple[int, int]]) -> None:
        """Write these ranges of one pages image from its chunks, a bounded step at a time."""
        fd = os.open(self.image_dir / name, os.O_WRONLY)
        try:
            for off, n in ranges:
                for at in range(off, off + n, _FILL_STEP_BYTES):
                    pwritev_all(fd, view.read(at, min(_FILL_STEP_BYTES, off + n - at)), at)
        finally:
            os.close(fd)

    def start(self) -> None:
        """Start the lazy-pages daemon (ours, or CRIU's and its page source) right before ``criu
        restore``, once every check of the checkpoint passed. Raises RestoreFailed when CRIU's daemon
        does not start, OSError when a page file or our socket cannot be made."""
        if self.transport == "ours":
            # it may read a range again (the kernel said "not now"): chunks go once their pages are in
            server = UffdServer(self.image_dir, self._pagemaps, self._peek, self._failed, self._served,
                                pages_done=self._pages_in)
            try:
                server.listen()
            except BaseException:
                server.close()
                raise
            self._uffd, self._holds = server, server.holds
            return
        if self.transport == "file":
            self._start_files()
        else:
            self._start_socket()
        self._janitor = _janitor(self._daemon, [f.target for f in self._files])
        self._watch = threading.Thread(target=self._watch_daemon, name="cedana-lazy-watch", daemon=True)
        self._watch.start()

    def _start_socket(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._daemon = self.engine.start_lazy_pages(self.image_dir, theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._holds = (ours.fileno(),)
        self._server = PageServer(ours, self._pages, self._failed, wire=wire_for(self.engine.version))
        self._server.start()

    def _start_files(self) -> None:
        """The daemon's own image directory: the same images (hard links), with page files for pages."""
        lazy_dir = self.image_dir.with_name(self.image_dir.name + ".lazy")
        lazy_dir.mkdir(mode=0o700)
        pages = {pm.pages_file for pm in self._pagemaps.values()}
        for p in self.image_dir.iterdir():
            if p.is_file() and p.name not in pages:
                os.link(p, lazy_dir / p.name)
        for name in sorted(pages):
            (lazy_dir / name).touch(mode=0o400)
            view = self._views[name]
            f = PageFile(lazy_dir / name, view.entry.size, view.read, self._failed)
            self._files.append(f)
            f.start()
        self._daemon = self.engine.start_lazy_pages(lazy_dir, None, work_dir=self.image_dir)
        self._holds = tuple(f.fd for f in self._files)

    @property
    def holds(self) -> tuple[int, ...]:
        """What the daemon's pages come through (the socket, the page files' device): whoever must
        outlive a dead supervisor holds a copy (the workload's watchdog), so the daemon keeps waiting
        until the tree is killed instead of giving up and leaving it to run on zero-filled pages."""
        return self._holds

    def held_copies(self) -> list[int]:
        """Copies of :attr:`holds` for the watchdog, made now (the caller closes them once passed on);
        none once every page is in: the page files' fds close then, and a number passed after that
        would fail the watchdog's start (EBADF) or name another file."""
        out: list[int] = []
        with self._lock:
            if not self.streaming:
                return out
            for fd in self._holds:
                with contextlib.suppress(OSError):  # closed meanwhile: the stream has just ended
                    out.append(os.dup(fd))
        return out

    def _release(self) -> None:
        if self._uffd is not None:
            self._uffd.release()
        if self._server is not None:
            self._server.release()
        for f in self._files:
            f.release()

    def attach(self, pid: int) -> None:
        """The restored root: killed on any failure from now on (at once if one came first)."""
        with self._lock:
            self._pid = pid
            failed = self.failure is not None
        if failed:
            self._kill_tree()
            self._release()

    # -- while pages stream -------------------------------------------------------------------------
    def _pages(self, pid: int, vaddr: int, nr_pages: int, *, consume: bool = True) -> list[bytes | memoryview]:
        view, off, n = self._locate(pid, vaddr, nr_pages)
        return view.read(off, n * PAGE_SIZE, consume=consume)

    def _peek(self, pid: int, vaddr: int, nr_pages: int) -> list[bytes | memoryview]:
        return self._pages(pid, vaddr, nr_pages, consume=False)

    def _pages_in(self, pid: int, vaddr: int, nr_pages: int) -> None:
        view, off, n = self._locate(pid, vaddr, nr_pages)
        view.consume(off, n * PAGE_SIZE)

    def _locate(self, pid: int, vaddr: int, nr_pages: int) -> tuple[ChunkView, int, int]:
        pm = self._pagemaps.get(pid)
        if pm is None:
            raise ValueError(f"the lazy-pages daemon asked for pages of pid {pid}, which this checkpoint has not")
        off, n = pm.locate(vaddr, nr_pages)
        return self._views[pm.pages_file], off, n

    def _failed(self, e: BaseException) -> None:
        """The page server cannot answer: kill the tree (its faults are still blocked), then let go."""
        what = f"{type(e).__name__}: {e}" if not isinstance(e, (CorruptCheckpoint, StoreUnavailable)) else str(e)
        with self._lock:
            if self.failure is None:
                self.failure = f"pages stopped streaming in ({what})"
                # only a chunk that failed verification is the checkpoint's fault; our bookkeeping's
                # errors (ValueError, LazyPagesError) retry the same checkpoint in full
                self.corrupt = isinstance(e, CorruptCheckpoint)
        log.error("lazy restore failed checkpoint_id=%s seq=%d: %s; the restored tree is killed before it can run on "
                  "a missing page", self.manifest.checkpoint_id, self.manifest.seq, self.failure)
        if self._kill_tree():
            self._release()

    def _kill_tree(self) -> bool:
        """Kill the attached tree and wait until it is dead; False when none is attached yet."""
        with self._lock:
            pid = self._pid
        if pid is None:
            return False  # attach() kills it, then lets the server go
        try:
            os.kill(pid, signal.SIGKILL)  # the namespace's init: the kernel ends everyone in it
        except ProcessLookupError:
            return True
        while not tree_ended(pid):
            time.sleep(0.01)
        return True

    def _watch_daemon(self) -> None:
        """The daemon ends when every page is in or the tree is gone; ending otherwise is a failure."""
        assert self._daemon is not None
        rc = self._daemon.wait()
        if self._server is not None:
            self._server.join(timeout=5)
        with self._lock:
            ok = rc == 0 and (self._server is None or self._server.closed_cleanly) and self.failure is None
            if not ok and self.failure is None:
                self.failure = f"criu lazy-pages exited with {rc} while pages were streaming in " \
                               f"(log: {self.image_dir.with_name(self.image_dir.name + '.lazy-pages.log')})"
        if not ok:
            self._kill_tree()
        self.finished = time.monotonic()
        if ok:
            self._record([self._server] if self._server is not None else self._files)
            self._let_go()  # nothing reads the page files any more: a supervisor killed later leaves no mount
        self._done.set()

    def _served(self, ok: bool) -> None:
        """Our daemon stopped: every page in (ok), or not (a failure said why, or we let go)."""
        assert self._uffd is not None
        with self._lock:
            if not ok and self.failure is None and self._pid is not None and process_start(self._pid) is not None:
                self.failure = "our lazy-pages daemon stopped while pages were streaming in"
        self.finished = time.monotonic()
        if ok:
            self._record([self._uffd])
            self._let_go()
        self._done.set()

    def _record(self, parts: list[PageServer] | list[PageFile] | list[UffdServer]) -> None:
        assert self.finished is not None
        if self.timeline is not None:
            self.timeline.facts["page_source"] = {
                "via": self.transport, "requests": sum(p.requests for p in parts),
                "unmapped_bytes": sum(getattr(p, "unmapped_bytes", 0) for p in parts),
                "served_bytes": sum(p.served_bytes for p in parts), "fetched_bytes": self.fetched_bytes,
                "serving_seconds": round(sum(p.busy_seconds for p in parts), 4)}
            self.timeline.mark("pages_in", at=self.finished)
        # unmapped_bytes: lazy pages the process had unmapped (a forked child without a MADV_DONTFORK
        # region): nothing is dropped that is still mapped, or the restore would have failed
        unmapped = sum(getattr(p, "unmapped_bytes", 0) for p in parts)
        log.info("lazy restore complete seq=%d: every page in %.2f s via %s, %s served in %d request(s) "
                 "(%.2f s serving), %s fetched from the store%s", self.manifest.seq, self.finished - self.started, self.transport,
                 binary_size(sum(p.served_bytes for p in parts)), sum(p.requests for p in parts),
                 sum(p.busy_seconds for p in parts), binary_size(self.fetched_bytes),
                 f", {binary_size(unmapped)} the process had unmapped" if unmapped else "",
                 extra={"checkpoint_id": self.manifest.checkpoint_id})

    @property
    def fetched_bytes(self) -> int:
        return sum(v.fetched_bytes for v in self._views.values())

    @property
    def streaming(self) -> bool:
        return (self._daemon is not None or self._uffd is not None) and not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until pages stopped streaming (all in, or failed); False on timeout."""
        return (self._daemon is None and self._uffd is None) or self._done.wait(timeout)

    def close(self, *, remove_dir: bool = True) -> None:
        """End it all: a daemon still running is let go only after the tree is dead, and the restore
        folder goes (unless kept, or ``remove_dir`` is False: the caller keeps CRIU's logs)."""
        if self.streaming:
            self._kill_tree()
            with self._lock:
                never_attached = self._pid is None
            if never_attached and self._daemon is not None:
                self._daemon.kill()  # the restore failed: no tree has its pages to protect
            self._release()
            if self._daemon is not None:
                try:
                    self._daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._daemon.kill()
                    self._daemon.wait()
        self._let_go()  # (first: a read our daemon waits on ends with its chunk views)
        if self._uffd is not None:
            self._uffd.close()
        if self._janitor is not None:  # everything it would clean up is gone
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._janitor.pid, signal.SIGKILL)
            self._janitor.wait()
            self._janitor = None
        if remove_dir and not self.keep_dir:
            shutil.rmtree(self.image_dir.parent, ignore_errors=True)

    def _let_go(self) -> None:
        """Unmount the page files and drop what is held (the tree is dead or has every page)."""
        self._release()
        with self._lock:
            files, self._files = self._files, []
        for f in files:
            f.close()
        for view in self._views.values():
            view.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._prefetch_pool.shutdown(wait=False, cancel_futures=True)


# After a killed supervisor ($1), what it started for a lazy restore must not stay: the daemon ($2),
# which would wait for pages forever, and the page files' mounts (the rest). 3 s first: a restored
# tree is killed by its watchdog within 1 s, and until then the watchdog holds what the daemon reads
# from, so the daemon never hands that tree zero-filled pages.
_JANITOR = WAIT_FOR_SUPERVISOR + r"""sleep 3
kill -KILL "$2" 2>/dev/null
shift 2
for m in "$@"; do umount -l "$m" 2>/dev/null; done
"""


def _janitor(daemon: subprocess.Popen[bytes] | None, mounts: list[Path]) -> subprocess.Popen[bytes] | None:
    """A helper that cleans up after a supervisor killed mid-restore (its own session: it outlives us)."""
    if daemon is None:
        return None
    return subprocess.Popen(["sh", "-c", _JANITOR, "cedana-lazy-janitor", str(os.getpid()), str(daemon.pid),
                             *map(str, mounts)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
