"""What the runner needs for one step, as plain data (no torch, picklable): the model process may be
another Ray actor, so it gets block tables and token ids, never the scheduler's request records."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.cache_manager import CopyOp
from engine.core.scheduler import SchedulerOutput

ENGRAM_LOOKBACK = 3  # ids before a chunk that Engram's n-grams can reach (max_ngram_size - 1 <= 3 here)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    start: int  # positions start .. end-1
    end: int
    token_ids: list[int]  # the ids at those positions
    prev_ids: list[int]  # up to ENGRAM_LOOKBACK ids just before start (Engram history)
    sample: bool  # return the logits of position end-1
    keep_logits: bool  # return the logits of every decoder row
    global_blocks: list[int]
    swa_blocks: dict[int, int]
    pending_slot: int | None
    global_from: int  # positions below hold cached global KV: no compressor or global writes
    swa_floor: int  # window floor of encoder-layer queries
    decoder_from: int  # decoder layers skip positions below
    decoder_floor: int  # window floor of decoder-layer queries


@dataclass(slots=True)
class StepPlan:
    chunks: list[ChunkPlan] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)


def plan_step(out: SchedulerOutput, lookback: int = ENGRAM_LOOKBACK) -> StepPlan:
    chunks = []
    for c in out.chunks:
        r = c.request
        chunks.append(ChunkPlan(c.start, c.end, r.ids_between(c.start, c.end),
                                r.ids_between(max(0, c.start - lookback), c.start), c.sample,
                                r.keep_logits, list(r.global_blocks), dict(r.swa_blocks), r.pending_slot, r.global_from,
                                r.swa_floor, r.decoder_from, r.decoder_floor))
    return StepPlan(chunks, list(out.copies))
