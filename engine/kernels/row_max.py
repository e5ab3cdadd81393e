"""One pass over fp32 rows of logits: the row's maximum, the lowest id reaching it, and whether it can be sampled.

    row_max(x) -> (max, first id of the max, bad, drawable)     x fp32 [N, V]

bad: the row holds a NaN or +inf; drawable: it holds a token above -inf (sampler.usable_rows = ~bad & drawable).
For a row without NaN, (max, id) is torch's x.max(dim=-1): the first maximum (a row of -inf gives (-inf, 0)); for
a row with a NaN they are unspecified (the sampler fails such rows). The greedy draw and the usability test were
three torch reductions over the whole vocabulary per step (two `any`, one `argmax`: ~60 us at batch 1 on an H100,
each a single-row reduction with little parallelism); here each row is split over ~4 programs per SM, each lane of
a program keeps its running maximum across tiles with a strict > (later tiles hold higher ids), and the splits'
partials are combined by the first maximum (engine/kernels/gumbel.py's pattern). Memory: the logits once, 12 bytes a split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import cdiv, row_splits

BLOCK = 2048  # tokens per tile
_PROGRAMS_PER_SM = 4
_NO_ID = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _row_max_kernel(x_ptr, val_ptr, idx_ptr, flag_ptr, V, stride_x, num_tiles, tiles_per_split, num_splits,
                    BLOCK: tl.constexpr):
    """Program (row, split): the max over its tiles, the lowest id reaching it, and its flags (1: a NaN or +inf,
    2: a token above -inf). Each lane keeps its own running (max, id) across tiles (strict >: a later tile has
    higher ids), reduced once at the end."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    first = split * tiles_per_split
    lane = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = first * BLOCK + lane  # a lane of -inf keeps its lowest id
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    drawable = tl.zeros([BLOCK], dtype=tl.int32)
    for tile in range(first, tl.minimum(first + tiles_per_split, num_tiles)):
        ids = tile * BLOCK + lane
        x = tl.load(x_row + ids, mask=ids < V, other=float("-inf"))
        better = x > best_val
        best_idx = tl.where(better, ids, best_idx)
        best_val = tl.where(better, x, best_val)
        bad = bad | ((x != x) | (x == float("inf"))).to(tl.int32)
        drawable = drawable | (x > float("-inf")).to(tl.int32)
    m = tl.max(best_val, axis=0)
    at = tl.min(tl.where(best_val == m, best_idx, _NO_ID), axis=0)
    out = row * num_splits + split
    tl.store(val_ptr + out, m)
    tl.store(idx_ptr + out, at)
    tl.store(flag_ptr + out, tl.max(bad, axis=0) | (tl.max(drawable, axis=0) * 2))


def row_max(x: Tensor, num_splits: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x fp32 [N, V], unit stride along V -> (max fp32 [N], its first id int64 [N], bad bool [N], drawable bool
    [N]); see the module docstring. num_splits: programs per row (default ~4 per SM over the rows)."""
    assert x.dtype == torch.float32 and x.dim() == 2, f"x must be fp32 [N, V], got {x.dtype} {tuple(x.shape)}"
    assert x.size(1) <= 1 or x.stride(1) == 1, f"x must have unit stride along V, got strides {x.stride()}"
    num_rows, vocab = x.shape
    assert 0 < vocab < 2**31 - BLOCK, f"vocabulary {vocab} out of range"
    if num_rows == 0:
        empty = torch.empty(0, device=x.device)
        return empty.float(), empty.long(), empty.bool(), empty.bool()
    num_tiles = cdiv(vocab, BLOCK)
    num_splits, tiles_per_split = row_splits(num_rows, num_tiles, x.device, num_splits, _PROGRAMS_PER_SM)
    val = torch.empty(num_rows, num_splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(num_rows, num_splits, dtype=torch.int32, device=x.device)
    flags = torch.empty(num_rows, num_splits, dtype=torch.int32, device=x.device)
    _row_max_kernel[(num_rows, num_splits)](x, val, idx, flags, vocab, x.stride(0), num_tiles, tiles_per_split,
                                            num_splits, BLOCK=BLOCK)
    bad, drawable = (flags & 1).any(dim=1), (flags & 2).any(dim=1)
    if num_splits == 1:
        return val[:, 0], idx[:, 0].long(), bad, drawable
    best = val.argmax(dim=1, keepdim=True)  # the first maximal split: the lower ids
    return val.gather(1, best)[:, 0], idx.gather(1, best)[:, 0].long(), bad, drawable


def row_max_ref(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The torch form (the CPU's path and the kernel's oracle)."""
    top, at = x.max(dim=-1)
    return top, at, (x.isnan() | (x == float("inf"))).any(dim=-1), (x > float("-inf")).any(dim=-1)
