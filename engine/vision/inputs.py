"""A request's images as the engine carries them (plain data, no torch: they travel in step plans to the shard
actors): where each span sits in the prompt, its resize plan, its ViT patches as raw bf16 bytes, and the key
that stands for its positions in the prefix cache.

Prefix-cache keys: every position of an image span carries the same token id (129264), so token ids alone
would let a different image at the same positions hit another image's KV. `cache_ids` replaces each span's
ids by the image's key, a negative int64 derived from the sha256 of the encoded image (token ids are >= 0, so
a key never equals a text token): the chain hashes, and the snapshots' token lists, then name the image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.vision.layout import ImageGrid


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt, ready for the tower."""

    start: int  # prompt position of its IMAGE_START
    grid: ImageGrid
    patches: bytes  # bf16 [grid.num_patches, 3 * p * p], raw (engine/vision/image_processing.py)
    key: int  # < 0: the id its positions take in prefix-cache hashes (`image_key`)

    @property
    def end(self) -> int:
        """One past its IMAGE_END."""
        return self.start + self.grid.num_tokens

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end

    def positions_only(self) -> "ImageInput":
        """The image without its patches: what a chunk that only looks back at it needs (its span's positions)."""
        return replace(self, patches=b"")


def image_key(data: bytes) -> int:
    """The prefix-cache key of an encoded image: -1 - (the first 63 bits of its sha256), always < 0."""
    return -1 - (int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1)


def cache_ids(ids: Sequence[int], start: int, images: Sequence[ImageInput]) -> list[int]:
    """ids at positions start.. with every image-span position replaced by its image's key."""
    out = list(ids)
    end = start + len(out)
    for im in images:
        if im.overlaps(start, end):
            lo, hi = max(im.start, start), min(im.end, end)
            out[lo - start:hi - start] = [im.key] * (hi - lo)
    return out


def image_mask(start: int, end: int, images: Sequence[ImageInput]) -> list[bool]:
    """Per position start..end-1: True inside an image span (Engram's DEAD and gate 0, the router's bias_vl)."""
    mask = [False] * (end - start)
    for im in images:
        if im.overlaps(start, end):
            lo, hi = max(im.start, start), min(im.end, end)
            mask[lo - start:hi - start] = [True] * (hi - lo)
    return mask
