"""Logits -> tokens, one request per row: greedy or temperature/top-k/top-p/min-p + seeded Gumbel-max.

A row's token depends only on its logits, its SamplingParams and (seed, step): never on its place in
the batch or on the other rows. Ties are broken towards the lower token id everywhere (greedy argmax,
the top-k cut, the top-p cut, the Gumbel-max, the logprobs top list). The noise is counter-based
(engine/kernels/gumbel.py: Philox of (seed, step, token id)) and computed where the logits live; the
CUDA kernel and the CPU reference give the same bits, so a seeded request samples the same tokens on
either device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams
from engine.kernels.gumbel import gumbel_argmax, gumbel_argmax_ref

_TOPK_SELECT_MAX = 1024  # top-k cuts up to this k select the k largest values instead of sorting the row
_INT64_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampleRow:
    params: SamplingParams
    seed: int  # the request's effective seed (the engine fills one in when params.seed is None)
    step: int  # index of the token being sampled within the request's output (0 = first output token)


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first, ties -> lower id


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def _as_int64(v: int) -> int:
    """The int64 with v's low 64 bits (seeds are keys: only their bit pattern matters)."""
    v &= _INT64_MASK
    return v - (1 << 64) if v >> 63 else v


def _min_p_thresholds(ps: Sequence[SamplingParams]) -> torch.Tensor:
    """fp32 [M] t with d < t <=> d < log(min_p) for every fp32 d (log taken on the host in float64, then
    rounded up to fp32), -inf where min_p is off: the min-p cut without float64 on the device."""
    t64 = torch.tensor([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in ps], dtype=torch.float64)
    t32 = t64.float()
    return torch.where(t32.double() < t64, torch.nextafter(t32, torch.tensor(math.inf)), t32)


def _keep_first(x: torch.Tensor, num_keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keep the num_keep[m] first tokens of each row in (value desc, id asc) order; values [M, K] are each
    row's K >= num_keep largest values, descending. Kept: every token above the num_keep-th value kth,
    then the lowest-id tokens equal to it. Others -> -inf."""
    kth = values.gather(1, (num_keep - 1)[:, None])  # [M, 1]
    num_tied = num_keep - (values > kth).sum(dim=-1)  # >= 1; every value above kth is among the K
    tied = x == kth
    keep = (x > kth) | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= num_tied[:, None]))
    return x.masked_fill(~keep, float("-inf"))


def filter_logits(x: torch.Tensor, ps: Sequence[SamplingParams]) -> torch.Tensor:
    """x fp32 [M, V] temperature-scaled logits, one SamplingParams per row -> x with dropped tokens -inf.
    Filters apply in order, each on the previous one's output:
    - top_k keeps exactly the k first tokens in (logit desc, id asc) order: ties at the k-th value -> lower id;
    - top_p keeps the smallest (logit desc, id asc) prefix whose renormalised probability mass >= top_p
      (at least one token; top_p == 1 keeps everything, so float rounding of the cumsum never drops a tail);
      the mass is summed in float64;
    - min_p drops tokens with p < min_p * p_max, i.e. x - x_max < log(min_p) (independent of normalisation).
    Both cuts keep a (value desc, id asc) prefix, so they need only the sorted values (a top-k select when
    every row's k is small) and the count to keep; which tokens tie at the cut is decided by id.
    Which filters run is decided from the params on the host (no device sync).
    """
    num_rows, vocab_size = x.shape
    k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
    use_p = any(p.top_p < 1.0 for p in ps)
    if max(k) < vocab_size or use_p:
        device = x.device
        if max(k) <= _TOPK_SELECT_MAX:
            values = x.topk(max(k), dim=-1, sorted=True).values  # [M, K] descending
        else:
            values = x.sort(dim=-1, descending=True).values  # [M, V]
        rank = torch.arange(values.size(1), device=device)
        top_k = torch.tensor(k, dtype=torch.int64, device=device).clamp_max(values.size(1))
        num_keep = top_k
        if use_p:
            top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=device)
            probs = values.masked_fill(rank[None, :] >= top_k[:, None], float("-inf")).double().softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # [M, K]; exactly 0 at rank 0
            keep = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (rank[None, :] < top_k[:, None])
            num_keep = keep.long().cumprod(dim=-1).sum(dim=-1)  # the kept prefix's length, >= 1
        x = _keep_first(x, num_keep, values)
    if any(p.min_p > 0.0 for p in ps):
        x_max = x.max(dim=-1, keepdim=True).values  # [M, 1]
        x = x.masked_fill(x - x_max < _min_p_thresholds(ps).to(x.device)[:, None], float("-inf"))
    return x


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
    """logits fp32 [N, V] (any device), one SampleRow per row -> N tokens and, where asked, their logprobs.

    Temperature 0 is argmax of the raw logits. Otherwise the logits are divided by the temperature in
    fp32 (IEEE division: the same bits on every device), filtered (see filter_logits) and the token is
    argmax(x + g(seed, step, v)), the Gumbel-max trick, which draws from softmax(x); g is
    engine/kernels/gumbel.py's counter-based noise (the Triton kernel on CUDA, its torch reference
    elsewhere: the same bits). Logprobs are log_softmax of the raw logits in float64.
    """
    assert logits.dtype == torch.float32, f"logits must be fp32, got {logits.dtype}"
    assert logits.dim() == 2, f"logits must be [N, V], got shape {tuple(logits.shape)}"
    assert logits.size(0) == len(rows), f"{logits.size(0)} logit rows for {len(rows)} SampleRows"
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return SampleOutput(token_ids=[], logprobs=[])
    device = logits.device
    token_ids = logits.argmax(dim=-1)  # [N]; first maximum -> lowest id on ties

    sampled_idx = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled_idx:
        ps = [rows[i].params for i in sampled_idx]
        idx = torch.tensor(sampled_idx, device=device)
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device)
        x = filter_logits(logits.index_select(0, idx) / temperature[:, None], ps)  # fp32 [M, V]
        keys = torch.tensor([[_as_int64(rows[i].seed) for i in sampled_idx],
                             [_as_int64(rows[i].step) for i in sampled_idx]], dtype=torch.int64, device=device)
        draw = gumbel_argmax if x.is_cuda else gumbel_argmax_ref
        token_ids[idx] = draw(x, keys[0], keys[1])  # seeds, steps: [M] each

    token_list: list[int] = token_ids.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    lp_idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if lp_idx:
        lp = torch.log_softmax(logits.index_select(0, torch.tensor(lp_idx, device=device)).double(), dim=-1)
        num_top = max(rows[i].params.logprobs or 0 for i in lp_idx)
        top_lp, top_ids = lp.sort(dim=-1, descending=True, stable=True)  # stable: ties -> lower id
        top_lp, top_ids = top_lp[:, :num_top].tolist(), top_ids[:, :num_top].tolist()
        chosen = lp.gather(1, torch.tensor([[token_list[i]] for i in lp_idx], device=device))[:, 0].tolist()
        for j, i in enumerate(lp_idx):
            k = rows[i].params.logprobs or 0
            logprobs[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen[j],
                                        top=list(zip(top_ids[j][:k], top_lp[j][:k])))
    return SampleOutput(token_ids=token_list, logprobs=logprobs)
