"""Speculative decoding's rule (issue 22; spec 4.9): verify a request's drafts against the target's rows of the same
step, and choose how many drafts each request verifies.

A verify chunk computes the anchor (the request's last token) and k draft tokens in one target pass; target row j
(0..k) is the distribution of output index `step + j`. The rule (`accept_drafts`, Leviathan et al. 2023 / Chen et
al. 2023, as gpt-fast writes it) emits the target's distribution exactly: greedy and teacher-forced rows are one-hot
distributions, so the same rule accepts the longest prefix of drafts equal to the target's tokens and then emits the
target's token at the first mismatch.

Randomness is keyed, never stateful: each number is a Philox draw of (the request's seed, the output index it
decides, a stream), the sampler's noise (engine/kernels/gumbel.py) with the stream in counter word 1: STREAM_SAMPLE
is the sampler's own Gumbel noise (0: a row drawn here draws what the plain sampler would), STREAM_DRAFT the
drafter's Gumbel noise, STREAM_ACCEPT the acceptance uniform. Invariant this relies on: an output index is emitted
once, and the keys of index i are consulted only by the step that emits i (a draft for i in an earlier step that was
never examined, because an earlier draft was rejected, decided nothing), so every emitted token's draws are fresh.
The same seed and the same verify lengths therefore give the same text; a different K (or policy) draws other
numbers, from the same distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.core.plan import DraftPolicy, SampleSpec, VerifySpec
from engine.core.sampler import UNUSABLE_LOGITS, TokenLogprobs, filter_logits, sample_specs, usable_rows
from engine.core.sampling_params import SamplingParams
from engine.kernels.gumbel import gumbel_from_bits_ref, philox_bits_ref

STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT = 0, 1, 2
_INT64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class Verified:
    """One verify chunk's outcome: the tokens it emits (accepted drafts, then the target's token), their logprobs
    (None unless asked), how many drafts were verified and accepted; error: the request failed (no token kept)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    error: str | None = None


def accept_drafts(p: Tensor, q: Tensor, draft: Tensor, u: Tensor, g: Tensor) -> tuple[int, int]:
    """p float64 [k+1, V]: the target's distributions of the anchor and draft rows; q float64 [k, V]: the
    distributions the k draft tokens (int64 [k]) were drawn from; u float64 [k]: uniforms in (0, 1); g [k+1, V]: each
    row's Gumbel noise. Returns (m, token): the first m drafts are accepted and `token` follows them."""
    k = draft.numel()
    p_d, q_d = p[:k].gather(1, draft[:, None])[:, 0], q.gather(1, draft[:, None])[:, 0]
    # p(d) >= q(d): the draft token is always accepted
    # p(d) < q(d): it is accepted with probability p(d) / q(d)
    # at the first rejection the token is drawn from max(0, p - q) renormalised; all k accepted: from p[k]
    rejected = (u * q_d > p_d).nonzero()
    m = int(rejected[0, 0]) if rejected.numel() else k
    last = (p[m] - q[m]).clamp_min(0.0) if m < k else p[m]
    if not bool((last > 0).any()):  # p == q up to rounding, so a rejection had probability ~1e-13: draw from p
        last = p[m]
    return m, int((last.log() + g[m].double()).argmax())  # Gumbel-max: a draw from last / last.sum()


# ---- keyed draws ------------------------------------------------------------------------------------------------

def keyed_gumbel(seeds: Tensor, steps: Tensor, stream: int, vocab_size: int) -> Tensor:
    """fp32 [N, V] standard Gumbel noise of (seed, step, stream); stream STREAM_SAMPLE is the sampler's noise."""
    return gumbel_from_bits_ref(philox_bits_ref(seeds, steps, vocab_size, stream))


def keyed_uniform(seeds: Tensor, steps: Tensor, stream: int) -> Tensor:
    """float64 [N] uniforms in (0, 1) of (seed, step, stream): (h + 1/2) / 2^32 of the first Philox word."""
    return (philox_bits_ref(seeds, steps, 1, stream)[:, 0].double() + 0.5) * 2.0**-32


def keys(seed: int, first_step: int, n: int) -> tuple[Tensor, Tensor]:
    """int64 seeds and steps [n] of output indices first_step.. of one request (seeds as the sampler reads them)."""
    s = seed & _INT64_MASK
    s = s - (1 << 64) if s >> 63 else s
    return torch.full((n,), s, dtype=torch.int64), torch.arange(first_step, first_step + n, dtype=torch.int64)


# ---- distributions ----------------------------------------------------------------------------------------------

def sampling_distributions(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """fp32 [N, V] raw logits, one SamplingParams per row -> float64 [N, V]: what the plain sampler draws each row
    from (engine/core/sampler.py): one-hot at the argmax when greedy, else the softmax of the temperature-scaled,
    filtered logits (the same fp32 division and filters)."""
    out = torch.zeros_like(logits, dtype=torch.float64).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    drawn = [i for i, p in enumerate(params) if not p.is_greedy]
    if drawn:
        ps = [params[i] for i in drawn]
        idx = torch.tensor(drawn, device=logits.device)
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=logits.device)
        x = filter_logits(logits.index_select(0, idx) / temperature[:, None], ps)
        out[idx] = torch.softmax(x.double(), dim=-1)
    return out


def draw_draft(logits: Tensor, params: Sequence[SamplingParams], seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
    """One draft position of a batch of requests: fp32 [B, V] draft logits -> (tokens int64 [B], q float64 [B, V]) with
    each token drawn from q = sampling_distributions(its row, its params) by Gumbel-max of stream STREAM_DRAFT."""
    q = sampling_distributions(logits, params)
    tokens = q.argmax(dim=-1)  # a greedy row's q is one-hot: Gumbel-max picks its one token whatever the noise
    drawn = [i for i, p in enumerate(params) if not p.is_greedy]
    if drawn:  # the noise only where it decides (a vocabulary of Philox draws per row costs ~ms on the host)
        idx = torch.tensor(drawn)
        g = keyed_gumbel(seeds[idx], steps[idx], STREAM_DRAFT, logits.size(1)).to(logits.device)
        at = idx.to(logits.device)
        tokens[at] = (q[at].log() + g.double()).argmax(dim=-1)
    return tokens, q


# ---- a step's verify chunks -------------------------------------------------------------------------------------

def verify(rows: Sequence[Tensor], specs: Sequence[VerifySpec], drafts: Sequence[list[int]],
           qs: Sequence[Tensor | None]) -> list[Verified]:
    """Per verify chunk: rows fp32 [k+1, V] the target's logits of its anchor and k drafts, its spec, the drafts and
    their distributions q float64 [k, V] (None: greedy drafts, one-hot at each) -> the tokens it emits: the accepted
    drafts and the token after them, cut after the first stop id. The keyed draws and distributions of every row are
    computed at once (memory O(rows x vocab) in float64)."""
    if not specs:
        return []
    sizes = [len(d) + 1 for d in drafts]
    assert all(r.size(0) == n and (q is None or q.size(0) == n - 1) for r, q, n in zip(rows, qs, sizes)), \
        "rows, drafts and q differ"
    logits = torch.cat(list(rows)).cpu()
    params = [spec.params for spec, n in zip(specs, sizes) for _ in range(n)]
    p = sampling_distributions(logits, params)
    seeds, steps = (torch.cat(t) for t in zip(*(keys(spec.seed, spec.step, n) for spec, n in zip(specs, sizes))))
    u = keyed_uniform(seeds, steps, STREAM_ACCEPT)
    g = keyed_gumbel(seeds, steps, STREAM_SAMPLE, logits.size(1))
    out, at = [], 0
    for spec, draft, q, n in zip(specs, drafts, qs, sizes):
        rows_p = p[at:at + n]
        forced = spec.force_ids[:n]
        if forced:  # teacher forcing: the target's token is the forced one
            rows_p[:len(forced)] = 0.0
            rows_p[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        ids = torch.tensor(draft, dtype=torch.long)
        q = torch.zeros(n - 1, logits.size(1), dtype=torch.float64).scatter_(1, ids[:, None], 1.0) if q is None \
            else q.cpu()
        m, token = accept_drafts(rows_p, q, ids, u[at:at + n - 1], g[at:at + n])
        out.append(_emitted(logits[at:at + n], spec, draft[:m] + [token], n - 1, m))
        at += n
    return out


def _emitted(rows: Tensor, spec: VerifySpec, emitted: list[int], num_drafted: int, num_accepted: int) -> Verified:
    stop = next((i for i, t in enumerate(emitted) if t in spec.stop_ids), None)
    if stop is not None:
        emitted = emitted[:stop + 1]
    if not bool(usable_rows(rows[:len(emitted)]).all()):
        return Verified(num_drafted=num_drafted, error=UNUSABLE_LOGITS)
    logprobs: list[TokenLogprobs | None] = [None] * len(emitted)
    if spec.params.logprobs is not None:
        specs = [SampleSpec(j, spec.params, spec.seed, spec.step + j, t) for j, t in enumerate(emitted)]
        logprobs = sample_specs(rows[:len(emitted)], specs).logprobs
    return Verified(emitted, logprobs, num_drafted, min(num_accepted, len(emitted)), None)


# ---- how many drafts to verify ----------------------------------------------------------------------------------

def survival(confidence: Sequence[float]) -> list[float]:
    """Per draft j: prod_{l <= j} sigmoid(confidence[l]), the drafter's estimate that drafts 0..j are all accepted,
    i.e. the tokens draft j is expected to add."""
    out, s = [], 1.0
    for c in confidence:
        s *= 1.0 / (1.0 + math.exp(-c)) if c >= 0 else math.exp(c) / (1.0 + math.exp(c))  # no overflow either side
        out.append(s)
    return out


def verify_lengths(confidence: Sequence[Sequence[float]], policy: DraftPolicy) -> list[int]:
    """How many of its drafts each request verifies (confidence[i]: request i's drafts' confidence logits, in order).
    The policy (spec 4.9's confidence-scheduled verification, vLLM's adaptive verification): take draft slots in
    decreasing survival (ties: lower request, then lower draft), while a slot's survival is >= policy.min_survival
    and fewer than policy.max_draft_tokens are taken. Survival never increases along a request's drafts, so each
    request gets a prefix. The threshold and budget are where measured step-cost curves come in: a slot is worth
    verifying when its expected tokens exceed what its position adds to the step's time."""
    slots = sorted(((-s, i, j) for i, conf in enumerate(confidence) for j, s in enumerate(survival(conf))
                    if s >= policy.min_survival))
    if policy.max_draft_tokens is not None:
        slots = slots[:policy.max_draft_tokens]
    lengths = [0] * len(confidence)
    for _, i, _ in slots:
        lengths[i] += 1
    return lengths
