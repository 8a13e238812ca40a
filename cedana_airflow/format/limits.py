"""What a reader accepts of a manifest before it fetches anything large (issue 48).

Whoever can write the store can write a manifest. Without caps one manifest could make every reader
hold gigabytes (its JSON, then its parsed form: the api-server parses several at once), make a restore
create millions of files, or make it write terabytes from one chunk named over and over. The caps sit
well above the largest manifest we write; writers check them too (store/transfer.py), so no node
writes what another refuses. Sizing, from about 117 bytes of JSON per chunk ref (measured on
``Manifest.to_json``; parsed, about 600 bytes held and 780 at the peak):

- a 1 TiB checkpoint at the default 1 MiB chunks names about 2**20 refs: 117 MiB of manifest;
- ``MAX_CHUNK_REFS`` is twice that (FastCDC cuts vary around the average, captured and state files
  end on short chunks): 2 TiB at 1 MiB chunks, 128 GiB at the smallest (64 KiB);
- ``MAX_MANIFEST_BYTES`` holds that many refs (2**21 * 117 B = 234 MiB) plus the file entries.

docs/store-format.md, "Limits", is the reading rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpoint

if TYPE_CHECKING:
    from .manifest import Manifest

__all__ = ["MAX_CAPTURED_FILES", "MAX_CHUNK_REFS", "MAX_DECLARED_BYTES", "MAX_FILES", "MAX_MANIFEST_BYTES",
           "MAX_UNKNOWN_BLOCK_BYTES", "TooLarge",
           "count_problem", "declared_bytes", "doc_counts", "manifest_counts", "restore_limit", "restore_refusal",
           "total_problem"]

MAX_MANIFEST_BYTES = 256 << 20
MAX_CHUNK_REFS = 1 << 21
#: Image, captured and state files together: the inodes a restore creates. A CRIU image set is about a
#: dozen files per process; 100k stays far below a small file system's inodes (6.5M on 100 GiB ext4).
MAX_FILES = 100_000
#: Files the tree held open for writing, each copied while it was frozen and written back at its own
#: path (outside the restore folder) by a restore.
MAX_CAPTURED_FILES = 10_000
#: The declared raw total a restore takes at most (the only bound where the node sets no
#: max_checkpoint_bytes): MAX_CHUNK_REFS references of 2 MiB, as chunks run up to 4 x the average.
MAX_DECLARED_BYTES = 4 << 40
#: Blocks of a later format this reader skips but keeps (the signature covers them), as JSON: parsed
#: JSON takes ~20x its text in memory, so the manifest's own cap does not bound them usefully.
MAX_UNKNOWN_BLOCK_BYTES = 1 << 20


class TooLarge(CorruptCheckpoint):
    """An object above a reader's byte cap, refused before its body is read."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, more than the {limit} a reader accepts")
        self.size, self.limit = size, limit


def _entries(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []  # a wrong type counts nothing here: validation refuses it


def doc_counts(doc: dict[str, Any]) -> tuple[int, int, int]:
    """(files, captured files, chunk refs) of a manifest's JSON, counted before validation builds an
    object per entry."""
    coop = doc.get("cooperative")
    groups = (_entries(doc.get("files")), _entries(doc.get("captured")),
              _entries(coop.get("files")) if isinstance(coop, dict) else [])
    refs = sum(len(_entries(f.get("chunks"))) for g in groups for f in g if isinstance(f, dict))
    return sum(map(len, groups)), len(groups[1]), refs


def manifest_counts(m: Manifest) -> tuple[int, int, int]:
    state = m.cooperative.files if m.cooperative is not None else ()
    return len(m.files) + len(m.captured) + len(state), len(m.captured), len(m.chunk_refs())


def count_problem(checkpoint_id: object, seq: object, counts: tuple[int, int, int]) -> str | None:
    """The one line refusing a manifest over a count cap, or None."""
    for n, cap, what in zip(counts, (MAX_FILES, MAX_CAPTURED_FILES, MAX_CHUNK_REFS),
                            ("files", "captured files", "chunk references")):
        if n > cap:
            return (f"checkpoint {checkpoint_id} seq={seq} is refused: its manifest lists {n} {what}, more than the "
                    f"{cap} a restore accepts")
    return None


def declared_bytes(m: Manifest) -> int:
    """What a restore writes: every file's size. Each file's chunks add up to it (validated), so a chunk
    named N times counts N times."""
    state = m.cooperative.files if m.cooperative is not None else ()
    return sum(f.size for group in (m.files, m.captured, state) for f in group)


def restore_limit(m: Manifest, settings: object) -> int:
    """The most a restore of ``m`` may write on this node. A CRIU image is bounded by what the writer
    took: ``max_checkpoint_bytes`` (images and captured files), twice over as a stop's final checkpoint is
    stored even when the tree grew past it after the estimate, plus ``max_captured_bytes``. No setting
    bounds a cooperative checkpoint's state, nor a node whose max_checkpoint_bytes is 0: the hard ceiling."""
    most = getattr(settings, "max_checkpoint_bytes", 0) or 0
    if not most or m.is_cooperative:
        return MAX_DECLARED_BYTES
    return min(MAX_DECLARED_BYTES, 2 * most + (getattr(settings, "max_captured_bytes", 0) or 0))


def total_problem(m: Manifest, limit: int, why: str = "a restore accepts") -> str | None:
    total = declared_bytes(m)
    if total <= limit:
        return None
    return (f"checkpoint {m.checkpoint_id} seq={m.seq} is refused: its manifest declares {total} bytes of files, "
            f"more than the {limit} {why}")


def restore_refusal(m: Manifest, settings: object) -> str | None:
    """Checkpointer._refusal's line for a candidate that would write more than this node takes, or None."""
    limit = restore_limit(m, settings)
    return total_problem(m, limit, "a restore accepts" if limit == MAX_DECLARED_BYTES else
                         "this node restores (2 x max_checkpoint_bytes + max_captured_bytes)")
