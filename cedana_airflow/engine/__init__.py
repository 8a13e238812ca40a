"""Engines: what freezes, dumps and restores a process tree. ``criu`` today; ``cedana`` later."""

from __future__ import annotations

from .criu import CriuBinary, CriuEngine, DumpResult, find_criu

__all__ = ["CriuBinary", "CriuEngine", "DumpResult", "find_criu"]
