"""An image's size plan and its span in the prompt, as DeepSeek's reference `image_processor.py` lays them
out (spec 4.10). Plain arithmetic: no torch, no Pillow, so the ingress can count an image's tokens.

An image of W x H pixels is resized (keeping its aspect ratio, padded with grey) to best_width x
best_height, multiples of the patch size p: a grid of n_vit_h x n_vit_w ViT patches, which the aligner's
r x r downsample turns into n_llm_h x n_llm_w LLM rows (ceil(n_vit / r), the edge zero-padded). The prompt
holds the image as the span

    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]

every position of which carries `image_token_id` (129264, `<｜deepseek_image｜>`); only the token type
tells them apart. IMAGE positions take the aligner rows in reading order, the three delimiters learned
vectors. The span costs n_llm_h * (n_llm_w + 1) + 2 tokens, at most `vision_max_n_token`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from engine.chat.syntax import IMAGE
from engine.config import ModelConfig
from engine.vision import ImageError


class _TokenLookup(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


def image_token_id(tokenizer: _TokenLookup, cfg: ModelConfig) -> int:
    """The id of `<｜deepseek_image｜>` in the tokenizer, which must be the config's image_token_id."""
    token_id = tokenizer.token_to_id(IMAGE)
    if token_id is None or token_id != cfg.image_token_id:
        raise ValueError(f"the tokenizer spells id {token_id} as {IMAGE!r}, the config's image_token_id is "
                         f"{cfg.image_token_id}")
    return token_id


class TokenType(IntEnum):
    """What a prompt position is (the reference's token types; TEXT outside image spans)."""

    TEXT = -1
    IMAGE_START = 0
    IMAGE = 1
    IMAGE_NEW_LINE = 2
    IMAGE_END = 3


def span_len(n_llm_h: int, n_llm_w: int) -> int:
    """Tokens of an image span with an n_llm_h x n_llm_w aligner grid."""
    return n_llm_h * (n_llm_w + 1) + 2


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """The resize plan of one image: pixels after resizing, ViT patch grid, aligner (LLM) grid."""

    best_height: int
    best_width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def num_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def num_tokens(self) -> int:
        """Length of the image's span in the prompt."""
        return span_len(self.n_llm_h, self.n_llm_w)


def _grid(best_height: int, best_width: int, p: int, r: int) -> ImageGrid:
    n_vit_h, n_vit_w = best_height // p, best_width // p
    return ImageGrid(best_height, best_width, n_vit_h, n_vit_w, math.ceil(n_vit_h / r), math.ceil(n_vit_w / r))


def _fit_token_budget(height: float, width: float, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving (best_height, best_width) whose span fits in max_tokens.

    With n_llm_h = a * n_llm_w (a = height / width), a span of n_llm_h * (n_llm_w + 1) + 2 <= max_tokens
    tokens allows n_llm_w <= sqrt((max_tokens - 2) / a + 1/4) - 1/2. An image too tall (too wide) for even
    one aligner column (row) becomes one column (row) of as many cells as the budget allows."""
    aspect = height / width
    max_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    cell = p * r  # pixels per aligner row
    if max_w < 1.0:
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    # The reference floors these float products; where height * scale is mathematically a multiple of p
    # its rounding decides (kept as it is: the trained model saw these sizes).
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_image_grid(width: int, height: int, cfg: ModelConfig) -> ImageGrid:
    """The resize plan for a width x height image (reference `plan_image_grid` + `safe_resize`).

    1. With vision_max_wh_ratio set, a wider image is planned as width = height * ratio (and later
       stretched rather than padded, see `image_processing`).
    2. Below vision_min_pixels, both sides scale up by sqrt(min_pixels / (width * height)), truncated.
    3. Round each side up to a multiple of the patch size.
    4. Over vision_max_n_token tokens: shrink to the largest aspect-preserving size that fits.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width} x {height}")
    p, r, max_tokens = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    w: float = width
    h: float = height
    if cfg.vision_max_wh_ratio is not None and w > h * cfg.vision_max_wh_ratio:
        w = h * cfg.vision_max_wh_ratio
    if w * h < cfg.vision_min_pixels:
        up = (cfg.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    grid = _grid(math.ceil(h / p) * p, math.ceil(w / p) * p, p, r)
    if grid.num_tokens > max_tokens:
        grid = _grid(*_fit_token_budget(h, w, p, r, max_tokens), p, r)
    assert grid.n_llm_h >= 1 and grid.n_llm_w >= 1 and grid.num_tokens <= max_tokens, (width, height, grid)
    return grid


def span_types(grid: ImageGrid) -> list[TokenType]:
    """The token types of one image's span, in prompt order."""
    row = [TokenType.IMAGE] * grid.n_llm_w + [TokenType.IMAGE_NEW_LINE]
    return [TokenType.IMAGE_START, *row * grid.n_llm_h, TokenType.IMAGE_END]


@dataclass(frozen=True, slots=True)
class ImageSpan:
    start: int  # prompt position of its IMAGE_START
    grid: ImageGrid

    @property
    def end(self) -> int:
        """One past its IMAGE_END."""
        return self.start + self.grid.num_tokens


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A prompt with its image placeholders expanded: ids, one TokenType per id, the spans in order."""

    ids: list[int]
    types: list[TokenType]
    spans: list[ImageSpan]

    @property
    def image_mask(self) -> list[bool]:
        """True inside image spans: Engram's DEAD positions and gate 0, the router's bias_vl (spec 4.3, 4.5)."""
        return [t != TokenType.TEXT for t in self.types]


def expand_image_placeholders(ids: Sequence[int], grids: Sequence[ImageGrid], image_token_id: int) -> ImagePrompt:
    """Replace the k-th `image_token_id` of `ids` by the span of grids[k] (reference `prepare_vl_inputs`).

    Raises ImageError("count") when the placeholders and the images differ in number."""
    num_placeholders = sum(1 for i in ids if i == image_token_id)
    if num_placeholders != len(grids):
        raise ImageError("count", f"the prompt has {num_placeholders} image placeholders but {len(grids)} images")
    out_ids: list[int] = []
    types: list[TokenType] = []
    spans: list[ImageSpan] = []
    next_image = iter(grids)
    for token in ids:
        if token != image_token_id:
            out_ids.append(token)
            types.append(TokenType.TEXT)
            continue
        grid = next(next_image)
        spans.append(ImageSpan(len(out_ids), grid))
        out_ids += [image_token_id] * grid.num_tokens
        types += span_types(grid)
    return ImagePrompt(out_ids, types, spans)
