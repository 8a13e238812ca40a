"""Engines: what freezes, dumps and restores a process tree. ``criu`` today; ``cedana`` later.

- ``criu``: find the binary, dump (with the capture action script) and restore;
- ``capture``: files the frozen tree holds open for writing, copied while it is frozen;
- ``images``: what CRIU's own images say (dump statistics);
- ``procfs``: facts about a live tree from /proc (its PIDs, its open files).
"""

from __future__ import annotations

from .criu import CriuBinary, CriuEngine, DumpResult, find_criu

__all__ = ["CriuBinary", "CriuEngine", "DumpResult", "find_criu"]
