"""The store format: the contract of docs/store-format.md, with no I/O.

- ``manifest``: the manifest document (a checkpoint's description), validated on every read;
- ``chunking``: how image bytes become content-addressed chunks (FastCDC cuts, BLAKE3 names, zstd);
- ``selection``: which checkpoint a restore picks (restore order), and the age rule (restore gap,
  license lease) that may refuse it;
- ``layout``: the store's keys (where each object lives), the only code that spells one.

A change here is a change to the store format: update docs/store-format.md in the same commit.
"""

__all__ = ["manifest", "chunking", "selection", "layout"]
