"""Each row's weighted sum of int32 words, mod 2^64: the block checksum (engine/core/block_checksum.py) on the GPU.

    weighted_row_sums(words, weights) -> int64 [n]      words int32 [n, W], weights int64 [W]
    out[r] = sum_i weights[i] * words[r, i]  mod 2^64   (words sign-extended; as a signed int64)

The torch form (words.to(int64) * weights, then a row sum) writes and reads two int64 temporaries per word (16x the
record's bytes) and launches four kernels per slice of rows; a pull checked 70 MB that way in ~1 ms on an H100,
slower than the copy itself. Here each program sums a contiguous span of one row's words in int64 lanes (the words
read once, the weights from L2) and the spans' partial sums are added by torch (int64 adds wrap mod 2^64 on every
device, so the split does not change the result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import cdiv, row_splits

BLOCK = 1024  # words per tile (4 KiB)
_PROGRAMS_PER_SM = 8


# the sizes vary with every export and pull (rows, splits, tiles per split): specialised on their values (== 1,
# multiples of 16), a fresh process compiled a new variant for a new length, ~300 ms inside a publish on the H100
@triton.jit(do_not_specialize=["W", "stride_row", "num_tiles", "tiles_per_split", "num_splits"])
def _weighted_sum_kernel(words_ptr, weights_ptr, part_ptr, W, stride_row, num_tiles, tiles_per_split, num_splits,
                         BLOCK: tl.constexpr):
    """Program (row, split): the wrapped int64 sum of weights * words over its tiles of the row."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_words = words_ptr + row.to(tl.int64) * stride_row
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    first = split * tiles_per_split
    for tile in range(first, tl.minimum(first + tiles_per_split, num_tiles)):
        i = tile * BLOCK + lane
        inside = i < W
        x = tl.load(row_words + i, mask=inside, other=0).to(tl.int64)
        w = tl.load(weights_ptr + i, mask=inside, other=0)
        acc += x * w
    tl.store(part_ptr + row * num_splits + split, tl.sum(acc, axis=0))


def weighted_row_sums(words: Tensor, weights: Tensor, num_splits: int | None = None) -> Tensor:
    """words int32 [n, W] (unit stride along W), weights int64 [W] contiguous, on one device -> int64 [n] (see the
    module docstring), queued on the current stream. num_splits: programs per row (default ~8 per SM over rows)."""
    assert words.dtype == torch.int32 and words.dim() == 2, f"words must be int32 [n, W], got {words.dtype} {tuple(words.shape)}"
    assert words.size(1) <= 1 or words.stride(1) == 1, f"words need unit stride along W, got strides {words.stride()}"
    assert weights.dtype == torch.int64 and weights.shape == (words.size(1),) and weights.is_contiguous(), \
        f"weights {weights.dtype} {tuple(weights.shape)} for {words.size(1)} words"
    n, num_words = words.shape
    if n == 0 or num_words == 0:
        return torch.zeros(n, dtype=torch.int64, device=words.device)
    num_tiles = cdiv(num_words, BLOCK)
    num_splits, tiles_per_split = row_splits(n, num_tiles, words.device, num_splits, _PROGRAMS_PER_SM)
    part = torch.empty(n, num_splits, dtype=torch.int64, device=words.device)
    _weighted_sum_kernel[(n, num_splits)](words, weights, part, num_words, words.stride(0), num_tiles,
                                          tiles_per_split, num_splits, BLOCK=BLOCK)
    return part[:, 0] if num_splits == 1 else part.sum(dim=1)


def weighted_row_sums_ref(words: Tensor, weights: Tensor) -> Tensor:
    """The torch form (the kernel's oracle)."""
    return (words.to(torch.int64) * weights).sum(dim=1)
