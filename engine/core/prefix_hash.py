"""Prefix-cache keys: a replica fingerprint (the salt) and sha256 chain hashes of full token blocks (no torch)."""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Mapping, Sequence

_INT64 = "q"
assert array(_INT64).itemsize == 8


def fingerprint(model_config: Mapping, weights_identity: str, cache_layout: Mapping) -> bytes:
    """32-byte sha256 of the canonical JSON (sorted keys, no whitespace) of
    {"model": model_config, "weights": weights_identity, "layout": cache_layout}.
    Used as the chain salt, so replicas that differ in any of the three never share blocks."""
    doc = {"model": model_config, "weights": weights_identity, "layout": cache_layout}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=_plain_mapping)
    return hashlib.sha256(text.encode()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes, parent: bytes | None = None) -> list[bytes]:
    """Chain hashes of the full blocks of token_ids (a trailing partial block gets none):
    h_i = sha256(h_{i-1} || block i's tokens as little-endian int64), h_{-1} = parent if given, else salt.
    h_i thus names the whole prefix up to the end of block i, and passing the last known hash as parent
    extends a chain: block_hashes(t[B:2B], B, salt, parent=h_0) == block_hashes(t[:2B], B, salt)[1:]."""
    assert block_size > 0, f"block_size must be > 0, got {block_size}"
    num_full = len(token_ids) // block_size
    packed = array(_INT64, token_ids[: num_full * block_size])
    if sys.byteorder != "little":
        packed.byteswap()
    raw = memoryview(packed).cast("B")
    block_bytes = block_size * packed.itemsize
    prev = salt if parent is None else parent
    hashes = []
    for i in range(num_full):
        h = hashlib.sha256(prev)
        h.update(raw[i * block_bytes : (i + 1) * block_bytes])
        prev = h.digest()
        hashes.append(prev)
    return hashes


def _plain_mapping(obj: object) -> dict:
    # json.dumps only knows dict; accept any Mapping (e.g. MappingProxyType) anywhere in the config.
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"fingerprint input holds a {type(obj).__name__}, which has no canonical JSON form")
