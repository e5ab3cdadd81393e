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
from typing import Literal

import torch

from engine.core.plan import SampleSpec
from engine.core.sampling_params import SamplingParams
from engine.kernels.gumbel import gumbel_argmax, gumbel_argmax_ref
from engine.kernels.row_max import row_max, row_max_ref

_TOPK_SELECT_MAX = 1024  # top-k cuts up to this k select the k largest values instead of sorting the row
_INT64_MASK = (1 << 64) - 1
UNUSABLE_LOGITS = "the model produced unusable logits (NaN, +inf or all -inf) for this request"


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
    token_ids: list[int]  # -1 where the row failed (see errors)
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None or the row failed
    errors: list[str | None]  # why a row has no token (its logits are not finite), else None


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


def row_flags(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [N] each: (the row holds a NaN or +inf, the row holds a token above -inf)."""
    return (logits.isnan() | (logits == math.inf)).any(dim=-1), (logits > -math.inf).any(dim=-1)


def usable_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [N]: the row can be sampled (-inf is a token that cannot be drawn; a NaN, a +inf or no drawable
    token makes the row fail)."""
    bad, drawable = row_flags(logits)
    return ~bad & drawable


def _keep_first(x: torch.Tensor, num_keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keep the num_keep[m] first tokens of each row in (value desc, id asc) order; values [M, K] are each
    row's K >= num_keep largest values, descending. Kept: every token above the num_keep-th value kth,
    then the lowest-id tokens equal to it. Others -> -inf."""
    kth = values.gather(1, (num_keep.clamp_min(1) - 1)[:, None])  # [M, 1]
    num_tied = num_keep - (values > kth).sum(dim=-1)  # >= 1; every value above kth is among the K
    tied = x == kth
    keep = (x > kth) | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= num_tied[:, None]))
    return x.masked_fill(~keep, float("-inf"))


def _cut(x: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """The top-k then top-p cut of filter_logits: values [M, K] each row's K largest values descending (K >=
    every row's top_k), top_k int64 [M] (<= K), top_p float64 [M] (None: no top-p cut)."""
    rank = torch.arange(values.size(1), device=x.device)
    num_keep = top_k
    if top_p is not None:
        probs = values.masked_fill(rank[None, :] >= top_k[:, None], float("-inf")).double().softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [M, K]; exactly 0 at rank 0
        keep = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (rank[None, :] < top_k[:, None])
        num_keep = keep.long().cumprod(dim=-1).sum(dim=-1)  # the kept prefix's length, >= 1
    return _keep_first(x, num_keep, values)


def _min_p_cut(x: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """min_p: drop x - x_max < threshold (fp32 [M], from _min_p_thresholds; -inf keeps the row whole)."""
    x_max = x.max(dim=-1, keepdim=True).values  # [M, 1]
    return x.masked_fill(x - x_max < thresholds[:, None], float("-inf"))


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
    Which filters run is decided from the params on the host (no device sync); a filter that is off for a
    row keeps that row whole, so running it anyway (sample_device) gives the same tokens.
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
        top_k = torch.tensor(k, dtype=torch.int64, device=device).clamp_max(values.size(1))
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=device) if use_p else None
        x = _cut(x, values, top_k, top_p)
    if any(p.min_p > 0.0 for p in ps):
        x = _min_p_cut(x, _min_p_thresholds(ps).to(x.device))
    return x


def allowed_tokens(masks: Sequence[bytes | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Grammar bitmasks (engine/core/grammar.py: bit t of little-endian 32-bit word t // 32 allows token t; None: no
    constraint) -> bool [N, V] of the tokens each row may draw; None when no row has a mask."""
    if all(m is None for m in masks):
        return None
    num_bytes = (vocab_size + 31) // 32 * 4  # llguidance may add a word; bits at and above vocab_size are dropped
    assert all(m is None or len(m) >= num_bytes for m in masks), f"a bitmask shorter than {num_bytes} bytes"
    raw = torch.frombuffer(bytearray(b"".join(m[:num_bytes] if m is not None else b"\xff" * num_bytes for m in masks)),
                           dtype=torch.uint8).view(len(masks), num_bytes)
    bits = (raw[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [N, bytes, 8], lowest bit first
    return bits.view(len(masks), -1)[:, :vocab_size].bool().to(device)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], allowed: torch.Tensor | None = None) -> SampleOutput:
    """logits fp32 [N, V] (any device), one SampleRow per row -> N tokens and, where asked, their logprobs.
    allowed: bool [N, V] (allowed_tokens), the tokens a grammar lets each row draw: the others are -inf for the draw
    (not for the logprobs, which are the model's, as vLLM's default raw logprobs).

    Temperature 0 (or below SamplingParams.MIN_TEMPERATURE) is argmax of the raw logits. Otherwise the
    logits are divided by the temperature in fp32 (IEEE division: the same bits on every device), filtered
    (see filter_logits) and the token is argmax(x + g(seed, step, v)), the Gumbel-max trick, which draws
    from softmax(x); g is engine/kernels/gumbel.py's counter-based noise (the Triton kernel on CUDA, its
    torch reference elsewhere: the same bits). Logprobs are log_softmax of the raw logits in float64.
    A row with a NaN or +inf logit, or with every logit -inf, gets no token (-1) and an error; the other
    rows are sampled as if it were not there (every row's math is its own).
    """
    assert logits.dtype == torch.float32, f"logits must be fp32, got {logits.dtype}"
    assert logits.dim() == 2, f"logits must be [N, V], got shape {tuple(logits.shape)}"
    assert logits.size(0) == len(rows), f"{logits.size(0)} logit rows for {len(rows)} SampleRows"
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return SampleOutput(token_ids=[], logprobs=[], errors=[])
    device = logits.device
    raw = logits
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))  # no allowed token left: the row fails (unusable)
    usable = usable_rows(logits)
    logits = logits.masked_fill(~usable[:, None], 0.0)  # a failed row samples harmlessly, then is dropped
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

    token_ids = torch.where(usable, token_ids, -1)
    token_list: list[int] = token_ids.tolist()
    errors = [None if t >= 0 else UNUSABLE_LOGITS for t in token_list]
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    lp_idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None and errors[i] is None]
    if lp_idx:
        lp = torch.log_softmax(raw.index_select(0, torch.tensor(lp_idx, device=device)).double(), dim=-1)
        num_top = max(rows[i].params.logprobs or 0 for i in lp_idx)
        top_lp, top_ids = lp.sort(dim=-1, descending=True, stable=True)  # stable: ties -> lower id
        top_lp, top_ids = top_lp[:, :num_top].tolist(), top_ids[:, :num_top].tolist()
        chosen = lp.gather(1, torch.tensor([[token_list[i]] for i in lp_idx], device=device))[:, 0].tolist()
        for j, i in enumerate(lp_idx):
            k = rows[i].params.logprobs or 0
            logprobs[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen[j],
                                        top=list(zip(top_ids[j][:k], top_lp[j][:k])))
    return SampleOutput(token_ids=token_list, logprobs=logprobs, errors=errors)


def sample_specs(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> SampleOutput:
    """logits fp32 [C, V], one row per sampled chunk -> one token per spec (spec.row picks its logits row;
    see sample). A teacher-forced spec gets its force_id whatever was drawn, and that token's logprob."""
    if not specs:
        return SampleOutput(token_ids=[], logprobs=[], errors=[])
    rows = [spec.row for spec in specs]
    if rows != list(range(logits.size(0))):
        logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
    allowed = allowed_tokens([spec.allowed for spec in specs], logits.size(1), logits.device)
    out = sample(logits, [SampleRow(spec.params, spec.seed, spec.step) for spec in specs], allowed)
    forced = [i for i, spec in enumerate(specs) if spec.force_id is not None and out.errors[i] is None]
    for i in forced:
        out.token_ids[i] = specs[i].force_id
    relog = [i for i in forced if out.logprobs[i] is not None and out.logprobs[i].token_id != specs[i].force_id]
    if relog:
        idx = torch.tensor(relog, device=logits.device)
        ids = torch.tensor([[specs[i].force_id] for i in relog], device=logits.device)
        chosen = torch.log_softmax(logits.index_select(0, idx).double(), dim=-1).gather(1, ids)[:, 0].tolist()
        for i, lp in zip(relog, chosen):
            out.logprobs[i] = TokenLogprobs(specs[i].force_id, lp, out.logprobs[i].top)
    return out


# ---- the same draws on device tensors, with no host decision or sync (inside the decode step's CUDA graph) ----

SampleVariant = Literal["greedy", "plain", "filtered"]  # greedy rows only; temperature (+ min_p); + top-k / top-p


@dataclass(slots=True)
class SampleTensors:
    """Per-row sampling parameters as device tensors [N] (the decode step's persistent buffers)."""

    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # fp32, 1 where greedy
    top_k: torch.Tensor  # int64, V where off
    top_p: torch.Tensor  # float64, 1 where off
    min_p: torch.Tensor  # fp32 thresholds (_min_p_thresholds), -inf where off
    seeds: torch.Tensor  # int64 (_as_int64 of the seed)
    steps: torch.Tensor  # int64
    force: torch.Tensor  # int64 teacher-forced token, -1 where none


@dataclass(slots=True)
class DeviceDraw:
    token_ids: torch.Tensor  # int64 [N], -1 where the row's logits are unusable
    logprob: torch.Tensor | None  # float64 [N]: log_softmax of the raw logits at token_ids
    top_logprobs: torch.Tensor | None  # float64 [N, L] most likely first (ties -> lower id)
    top_ids: torch.Tensor | None  # int64 [N, L]


def sample_variant(ps: Sequence[SamplingParams]) -> SampleVariant:
    """The least work that draws every row as `sample` does."""
    drawn = [p for p in ps if not p.is_greedy]
    if not drawn:
        return "greedy"
    return "filtered" if any(p.top_k > 0 or p.top_p < 1.0 for p in drawn) else "plain"


def sample_row_values(p: SamplingParams, seed: int, step: int, force_id: int | None, vocab_size: int
                      ) -> tuple[int, float, int, float, float, int, int, int]:
    """One row of SampleTensors as host numbers: (greedy, temperature, top_k, top_p, min_p threshold, seed, step,
    force), the values sample() derives for the row (temperature rounded to fp32 on the device)."""
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    thr = float(_min_p_thresholds([p])[0]) if p.min_p > 0.0 else -math.inf
    return (int(p.is_greedy), 1.0 if p.is_greedy else p.temperature, top_k, p.top_p, thr, _as_int64(seed),
            _as_int64(step), -1 if force_id is None else force_id)


def sample_device(logits: torch.Tensor, t: SampleTensors, variant: SampleVariant, num_logprobs: int,
                  raw: torch.Tensor | None = None) -> DeviceDraw:
    """sample() on device tensors without a host sync: fp32 [N, V] logits -> the same tokens (every filter runs
    for every drawn row of the variant, a filter that is off keeping its row whole). A forced row takes its token;
    num_logprobs > 0 also returns each row's logprob of its token and its num_logprobs most likely, from raw where
    given (the model's logits, when `logits` had grammar masks applied: sample()'s raw logprobs), else logits."""
    _, ids, bad, drawable = (row_max if logits.is_cuda else row_max_ref)(logits)  # one pass: greedy ids, usability
    usable = ~bad & drawable
    if variant != "greedy" or num_logprobs:
        logits = logits.masked_fill(~usable[:, None], 0.0)
    if variant != "greedy":
        x = logits / t.temperature[:, None]
        if variant == "filtered":
            x = _cut(x, x.sort(dim=-1, descending=True).values, t.top_k, t.top_p)
        x = _min_p_cut(x, t.min_p)
        draw = gumbel_argmax if x.is_cuda else gumbel_argmax_ref
        ids = torch.where(t.greedy, ids, draw(x, t.seeds, t.steps))
    ids = torch.where(usable, torch.where(t.force >= 0, t.force, ids), -1)
    if num_logprobs == 0:
        return DeviceDraw(ids, None, None, None)
    lp = torch.log_softmax((logits if raw is None else raw).double(), dim=-1)
    top_lp, top_ids = lp.sort(dim=-1, descending=True, stable=True)
    chosen = lp.gather(1, ids.clamp_min(0)[:, None])[:, 0]
    return DeviceDraw(ids, chosen, top_lp[:, :num_logprobs], top_ids[:, :num_logprobs])


def draw_output(token_ids: list[int], logprob: list[float] | None, top_lp: list[list[float]] | None,
                top_ids: list[list[int]] | None, ks: Sequence[int | None]) -> SampleOutput:
    """A DeviceDraw read back to the host -> SampleOutput; ks: each row's params.logprobs."""
    errors = [None if tok >= 0 else UNUSABLE_LOGITS for tok in token_ids]
    logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
    for i, k in enumerate(ks):
        if k is not None and errors[i] is None:
            logprobs[i] = TokenLogprobs(token_ids[i], logprob[i], list(zip(top_ids[i][:k], top_lp[i][:k])))
    return SampleOutput(token_ids, logprobs, errors)
