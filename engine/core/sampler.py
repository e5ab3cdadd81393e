"""Logits -> tokens, one request per row: greedy or temperature/top-k/top-p/min-p + seeded Gumbel-max.

A row's token depends only on its logits, its SamplingParams and (seed, step): never on its place in
the batch or on the other rows. Ties are broken towards the lower token id everywhere (greedy argmax,
the top-k cut, the top-p cut, the logprobs top list).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


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


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, step: int) -> int:
    """The 64-bit torch.Generator seed of (seed, step): splitmix64(splitmix64(seed) ^ step).
    splitmix64 is a bijection on 64-bit ints, so for one seed every step gets a distinct stream."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def gumbel_noise(seed: int, step: int, vocab_size: int) -> torch.Tensor:
    """float64 [V] standard Gumbel noise -log(-log(u)), drawn on the CPU so every device sees the same
    bits. u is clamped away from 0 so the noise is always finite (a lone kept token can't become -inf)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(noise_seed(seed, step))
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float64).clamp_(min=torch.finfo(torch.float64).tiny)
    return -torch.log(-torch.log(u))


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x float64 [M, V] temperature-scaled logits; top_k int64 [M] (0 = off), top_p / min_p float64 [M].
    Returns x with dropped tokens set to -inf, filters applied in order, each on the previous one's output:
    - top_k keeps exactly the k first tokens in (logit desc, id asc) order: ties at the k-th value -> lower id;
    - top_p keeps the smallest (logit desc, id asc) prefix whose renormalised probability mass >= top_p
      (at least one token; top_p == 1 keeps everything, so float rounding of the cumsum never drops a tail);
    - min_p drops tokens with p < min_p * p_max, i.e. x - x_max < log(min_p) (independent of normalisation).
    """
    vocab_size = x.size(1)
    if bool(((top_k > 0) & (top_k < vocab_size)).any()) or bool((top_p < 1.0).any()):
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [M, V]
        rank = torch.arange(vocab_size, device=x.device)
        k = torch.where(top_k > 0, top_k, vocab_size)
        sorted_x = sorted_x.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        probs = sorted_x.softmax(dim=-1)  # renormalised over the top-k survivors
        mass_before = probs.cumsum(dim=-1) - probs  # [M, V]; exactly 0 at rank 0
        keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    if bool((min_p > 0.0).any()):
        x_max = x.max(dim=-1, keepdim=True).values  # [M, 1]
        x = x.masked_fill(x - x_max < torch.log(min_p)[:, None], float("-inf"))
    return x


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
    """logits fp32 [N, V] (any device), one SampleRow per row -> N tokens and, where asked, their logprobs.

    Temperature 0 is argmax of the raw logits. Otherwise the logits are divided by the temperature,
    filtered (see filter_logits) and the token is argmax(x + gumbel_noise(seed, step, V)), the Gumbel-max
    trick, which draws from softmax(x). Logprobs are log_softmax of the raw logits in float64.
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
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float64, device=device)
        x = logits.index_select(0, idx).double() / temperature[:, None]  # [M, V]
        x = filter_logits(
            x,
            top_k=torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=device),
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float64, device=device),
        )
        noise = torch.stack([gumbel_noise(rows[i].seed, rows[i].step, vocab_size) for i in sampled_idx])
        token_ids[idx] = (x + noise.to(device)).argmax(dim=-1)

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
