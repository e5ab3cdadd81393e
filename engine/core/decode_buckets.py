"""Which steps the decode step takes and its buckets (no torch: the replica asks this of plans it sends to a shard
actor, engine/core/decode_step.py runs them)."""

from __future__ import annotations

from engine.core.engine_config import DecodeOptions
from engine.core.plan import StepPlan

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BUCKET = 256


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    return tuple(b for b in BATCH_BUCKETS if b < max_batch) + (bucket(max_batch, BATCH_BUCKETS),)


def context_buckets(max_model_len: int) -> tuple[int, ...]:
    out, c = [], MIN_CONTEXT_BUCKET
    while c < max_model_len:
        out.append(c)
        c *= 2
    return (*out, c)


def decode_takes(plan: StepPlan, options: DecodeOptions, needs_pending: bool) -> bool:
    """Every chunk is one token that samples (decode), one draw per chunk, within the largest buckets; every
    chunk has a pending slot where the model has ratio-2 compressors (needs_pending). Draws with grammar masks are
    taken: the decode step stages the masks and its draw applies them."""
    chunks = plan.chunks
    if not chunks or len(chunks) > batch_buckets(options.max_batch)[-1] or len(plan.samples) != len(chunks):
        return False
    if any(s.row != i for i, s in enumerate(plan.samples)):
        return False
    if plan.from_rows is not None and len(plan.from_rows) != len(chunks):
        return False
    max_context = context_buckets(options.max_model_len)[-1]
    return all(c.end - c.start == 1 and c.sample and not c.keep_logits and c.decoder_from <= c.start
               and c.end <= max_context and (c.pending_slot is not None or not needs_pending) for c in chunks)
