"""History kept in the store as small JSON records (restore records, drill reports): reading them back.

Records are written create-only under a prefix, one object each; readers take what parses and skip
the rest with a warning, because history must never stop a listing.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .base import Store

__all__ = ["read_records"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


def read_records(store: Store, prefix: str, model: type[M]) -> list[M]:
    """Every readable JSON record directly under ``prefix`` (temp and other files skipped; a damaged
    one is skipped with a warning): history kept in the store, restore records and drill reports."""
    out = []
    for obj in store.list_objects(prefix):
        name = obj.key[len(prefix):]
        if not name.endswith(".json") or name.startswith(".") or "/" in name:
            continue
        try:
            out.append(model.model_validate_json(store.get(obj.key) or b""))
        except (ValidationError, ValueError):
            log.warning("record unreadable, skipped: %s", obj.key)
    return out
