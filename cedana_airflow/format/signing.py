"""Signed manifests: what makes write access to a store stop meaning code execution on restoring nodes.

Digests prove a chunk is the one its manifest names; nothing proves who wrote the manifest. Every
manifest a writer commits carries an HMAC-SHA256 over its canonical bytes with the node key
(keys.py), and a restoring node refuses a manifest that is unsigned (unless its operator set
allow_unsigned), signed with another key, or signed wrongly: a store writer without the key cannot
choose what a node runs (format/trust.py judges). The canonical bytes
are the manifest's JSON without the signature, keys sorted, no whitespace: any change to any field
(paths, modes, chunk digests, the command) breaks the signature.

HMAC is symmetric: every node that verifies can also sign, so the key is as secret as the store's
write credentials and is never passed to the workload (run/environment.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json

from .manifest import MARKED_BLOCKS_VERSION, Manifest, Signature

__all__ = ["canonical_bytes", "key_id", "sign", "signature_problem"]


def key_id(key: bytes) -> str:
    """A short public name of a key (a hash with a fixed label: it reveals nothing usable about the key)."""
    return hashlib.sha256(b"cedana-airflow signing key\0" + key).hexdigest()[:16]


def canonical_bytes(m: Manifest) -> bytes:
    # Blocks of a later version that this reader skipped are signed too: they are part of what was written.
    doc = {**m.unknown_blocks, **m.model_dump(mode="json", exclude={"signature"} | m.absent_blocks())}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(m: Manifest, key: bytes) -> str:
    return hmac.new(key, canonical_bytes(m), hashlib.sha256).hexdigest()


def sign(m: Manifest, key: bytes) -> Manifest:
    """``m`` as a signed manifest (format version 2, or 3 with a block; 4 and later keep theirs); the
    version is signed too."""
    version = (m.format_version if m.format_version >= MARKED_BLOCKS_VERSION
               else Manifest.version_for(signed=True, blocks=m.has_blocks()))
    v = m.model_copy(update={"format_version": version, "signature": None})
    return v.model_copy(update={"signature": Signature(key_id=key_id(key), hmac=_mac(v, key))})


def signature_problem(m: Manifest, key: bytes) -> str | None:
    """Why ``m`` must not be restored by a node holding ``key``, or None when its signature holds."""
    if m.signature is None:
        return "it is not signed, and this node refuses unsigned manifests (allow_unsigned = false)"
    if m.signature.key_id != key_id(key):
        return (f"it is signed with key {m.signature.key_id}, not this node's key {key_id(key)}; give both "
                "nodes the same signing key")
    if not hmac.compare_digest(m.signature.hmac, _mac(m, key)):
        return "its signature does not match its content: it was changed after it was signed"
    return None
