"""The decode step's draw from a vocab-parallel head without gathering its logits: greedy and plain sampling, exact.

Rank r of N holds the logits of vocabulary ids r*V/N .. (r+1)*V/N - 1 (ParallelHead). sampler.sample_device on the
whole row takes, per row, argmax(logits) (greedy) or argmax(x + g) with x = logits / T cut by min_p (plain), the
first maximum (the lower id) on ties. Both are maxima of a value that depends on the row and the token's own id
only (the Gumbel noise is keyed by the global id: gumbel_max's first_id), so every rank's maximum over its slice
and the lowest id reaching it, gathered, give the row's: the maximum over ranks, ties to the lower rank (whose
ids are lower). Two small all-gathers per step instead of the logits' 4 V B bytes:
  1. per row: (max logit, its id, a NaN/+inf flag, a drawable flag): the greedy token, whether the row is usable
     (sampler.usable_rows over the whole row), and the row's max logit, which the min_p cut needs;
  2. plain rows only: (max of x + g over the slice's tokens that pass min_p, its id).
Values travel as float64 (fp32 values and ids < 2^31 are exact there). Top-k / top-p rows and logprobs need the
whole row sorted: the decode step gathers the logits for those draws (draws_sharded says which).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.core.sampler import DeviceDraw, SampleTensors, SampleVariant
from engine.kernels.gumbel import gumbel_max, gumbel_max_ref
from engine.kernels.row_max import row_max, row_max_ref
from engine.parallel import ShardSpec, all_gather


def draws_sharded(variant: SampleVariant, num_logprobs: int) -> bool:
    """Whether sample_sharded draws this (variant, logprobs); otherwise the logits are gathered first."""
    return variant in ("greedy", "plain") and num_logprobs == 0


def slice_maxima(local: Tensor, first_id: int) -> Tensor:
    """fp32 [B, V/N] logits of ids first_id .. -> float64 [B, 4]: (max, the lowest id reaching it, 1 if the slice
    holds a NaN or +inf, 1 if it holds a token above -inf)."""
    top, at, bad, drawable = (row_max if local.is_cuda else row_max_ref)(local)  # first maximum: the lowest id
    return torch.stack([top.double(), (at + first_id).double(), bad.double(), drawable.double()], dim=-1)


def best_of_ranks(gathered: Tensor) -> tuple[Tensor, Tensor]:
    """float64 [N, B, >= 2] (value, id, ...) of every rank -> each row's maximum value and its id, the lowest rank
    reaching it (argmax's first maximum)."""
    rank = gathered[..., 0].argmax(dim=0, keepdim=True)  # [1, B]
    return gathered[..., 0].gather(0, rank)[0], gathered[..., 1].gather(0, rank)[0].long()


def gather_ranks(x: Tensor, shard: ShardSpec) -> Tensor:
    """Every rank's x stacked in rank order: [N, *x.shape]."""
    return all_gather(x[None], shard, dim=0)


def sample_sharded(local: Tensor, t: SampleTensors, variant: SampleVariant, shard: ShardSpec,
                   gather: Callable[[Tensor, ShardSpec], Tensor] = gather_ranks) -> DeviceDraw:
    """sample_device(all_gather(local), t, variant, 0) without the gather (variant greedy or plain): the same
    tokens, -1 for unusable rows, forced rows their token. local fp32 [B, V/N], this rank's slice; gather: the
    collective (gather_ranks; tests pass a stand-in)."""
    assert variant in ("greedy", "plain"), f"variant {variant!r} needs the whole row"
    first_id = shard.rank * local.size(1)
    stats = gather(slice_maxima(local, first_id), shard)  # [N, B, 4]
    usable = (stats[..., 2] == 0).all(dim=0) & (stats[..., 3] != 0).any(dim=0)
    top, ids = best_of_ranks(stats)
    if variant == "plain":
        x = local / t.temperature[:, None]
        x_max = top.float() / t.temperature  # = the row's max of x: dividing by T > 0 keeps the order
        x = x.masked_fill(x - x_max[:, None] < t.min_p[:, None], float("-inf"))
        draw = gumbel_max if x.is_cuda else gumbel_max_ref
        val, at = draw(x, t.seeds, t.steps, first_id)
        drawn = gather(torch.stack([val.double(), (at + first_id).double()], dim=-1), shard)
        ids = torch.where(t.greedy, ids, best_of_ranks(drawn)[1])
    ids = torch.where(usable, torch.where(t.force >= 0, t.force, ids), -1)
    return DeviceDraw(ids, None, None, None)
