"""A grammar's token bitmask applied to logits in place, on the device (issue 24: the mask in the graph draw).

    x[b, t] = -inf  where bit (first + t) of row b's mask is 0

words: int32 [B, >= ceil((first + V) / 32)], bit i of word i // 32 (lowest bit first) allows token i: llguidance's
layout (engine/core/grammar.py), little-endian words as the host stages them; first: the id of x's column 0 (a
vocab-parallel rank's slice). A row with every bit set is left as it is. Memory traffic: the mask (B * V / 8
bytes) read, and 4 bytes written per disallowed token; the logits are not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import cdiv

BLOCK = 1024


@triton.jit
def _token_mask_kernel(x_ptr, x_s0, words_ptr, words_s0, V, first, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < V
    bit = t + first
    word = tl.load(words_ptr + row * words_s0 + bit // 32, mask=ok, other=-1)
    allowed = ((word >> (bit % 32)) & 1) != 0
    tl.store(x_ptr + row * x_s0 + t, tl.full([BLOCK], float("-inf"), tl.float32), mask=ok & ~allowed)


def token_mask(x: Tensor, words: Tensor, first: int = 0) -> None:
    """x fp32 [B, V] (rows contiguous), in place; words int32 [B, W] with 32 W >= first + V (module docstring)."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1, "x must be fp32 [B, V] with contiguous rows"
    assert words.dtype == torch.int32 and words.dim() == 2 and words.stride(1) == 1 and words.size(0) == x.size(0)
    assert 32 * words.size(1) >= first + x.size(1), f"{words.size(1)} mask words for ids up to {first + x.size(1)}"
    assert words.device == x.device
    if x.numel():
        _token_mask_kernel[(x.size(0), cdiv(x.size(1), BLOCK))](x, x.stride(0), words, words.stride(0), x.size(1),
                                                               first, BLOCK=BLOCK)


def token_mask_ref(x: Tensor, words: Tensor, first: int = 0) -> Tensor:
    """The torch form: a masked copy of x."""
    ids = first + torch.arange(x.size(1), device=x.device)
    bits = (words.long()[:, ids // 32] >> (ids % 32)) & 1
    return x.masked_fill(bits == 0, float("-inf"))
