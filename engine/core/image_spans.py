"""A step's image rows, shared by both runner paths (engine/core/runner.py's golden forward and
engine/core/kernel_layers.py): which rows of the flat stream are image-span positions (plan.images; the router's
bias_vl, Engram's gate 0), and the span rows that overwrite their embedding rows (spec 4.10).

Each path encodes with its own tower (the golden one, or engine/core/kernel_vision.py's), given to `SpanCache` as a
function of a list of images. The cache keeps the span rows of the last MAX_KEPT_SPANS images by image key, so a
prefill chunked across a span encodes its image once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from engine.core.plan import ChunkPlan
from engine.vision.inputs import ImageInput, image_mask

MAX_KEPT_SPANS = 4  # images whose span rows a runner keeps

SpanEncoder = Callable[[list[ImageInput]], list[Tensor]]  # images -> each one's span rows bf16 [grid.num_tokens, D]


def image_patches(im: ImageInput) -> Tensor:
    """The image's ViT patches, bf16 [grid.num_patches, 3 * p * p] on the CPU (from the plan's raw bytes)."""
    return torch.frombuffer(bytearray(im.patches), dtype=torch.bfloat16).view(im.grid.num_patches, -1)


def stream_image_mask(chunks: list[ChunkPlan]) -> list[bool] | None:
    """Per stream row (every chunk's positions, in chunk order): True inside an image span. None where no chunk
    carries an image (a chunk may carry one only for its Engram look-back: then every row is False)."""
    if not any(c.images for c in chunks):
        return None
    return [m for c in chunks for m in image_mask(c.start, c.end, c.images)]


class SpanCache:
    """Span rows by image key, the most recently used last; `encode` runs only for images not kept."""

    def __init__(self, encode: SpanEncoder, max_kept: int = MAX_KEPT_SPANS):
        self.encode, self.max_kept = encode, max_kept
        self._kept: OrderedDict[int, Tensor] = OrderedDict()  # image key -> bf16 [span tokens, D]

    def stream_rows(self, chunks: list[ChunkPlan]) -> Tensor:
        """bf16 [image positions, D]: the span rows of every chunk's image positions, in stream order (the rows
        stream_image_mask marks). The images a step misses are encoded in one call."""
        parts = [(im, max(im.start, c.start), min(im.end, c.end)) for c in chunks for im in c.images]
        parts = [(im, lo, hi) for im, lo, hi in parts if lo < hi]
        assert parts, "no chunk holds an image position"
        rows: dict[int, Tensor] = {}
        for im, _, _ in parts:
            if im.key not in rows and im.key in self._kept:
                self._kept.move_to_end(im.key)
                rows[im.key] = self._kept[im.key]
        missing = list({im.key: im for im, _, _ in parts if im.key not in rows}.values())
        if missing:
            assert all(im.patches for im in missing), "an image position's chunk must carry the image's patches"
            for im, r in zip(missing, self.encode(missing), strict=True):
                assert r.size(0) == im.grid.num_tokens, (tuple(r.shape), im.grid)
                rows[im.key] = self._kept[im.key] = r
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)
        return torch.cat([rows[im.key][lo - im.start:hi - im.start] for im, lo, hi in parts])

    def __len__(self) -> int:
        return len(self._kept)
