"""What the runner needs for one step, as plain data (no torch, picklable): the model process may be
another Ray actor, so it gets block tables, token ids and what to sample, never the scheduler's request
records; it returns token ids (engine/core/step_rows.py: StepOutput), not logits."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.cache_manager import CopyOp
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.vision.inputs import ImageInput

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
    images: tuple[ImageInput, ...] = ()  # the request's images whose spans overlap start - ENGRAM_LOOKBACK .. end-1


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One token the step draws: from the logits of sampled chunk `row` (chunks with sample=True, in order;
    several specs share a row when an n > 1 request draws its choices' first tokens)."""

    row: int
    params: SamplingParams
    seed: int  # the choice's effective seed
    step: int  # index of the token within the choice's output (0 = first output token)
    force_id: int | None = None  # teacher forcing: this token is taken (its logprob reported) whatever is drawn
    allowed: bytes | None = None  # a grammar's bitmask of the tokens this draw may take (engine/core/grammar.py)


@dataclass(slots=True)
class StepPlan:
    chunks: list[ChunkPlan] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    # per chunk: the row of the previous step's draws that holds its input token (still on the device:
    # request.PENDING_TOKEN in token_ids), -1 where the token is known; None: every token is known
    from_rows: list[int] | None = None


def plan_step(out: SchedulerOutput, samples: list[SampleSpec] | None = None, from_rows: list[int] | None = None,
              lookback: int = ENGRAM_LOOKBACK) -> StepPlan:
    chunks = []
    for c in out.chunks:
        r = c.request
        chunks.append(ChunkPlan(c.start, c.end, r.ids_between(c.start, c.end),
                                r.ids_between(max(0, c.start - lookback), c.start), c.sample,
                                r.keep_logits, list(r.global_blocks), dict(r.swa_blocks), r.pending_slot, r.global_from,
                                r.swa_floor, r.decoder_from, r.decoder_floor,
                                tuple(im for im in r.images if im.overlaps(c.start - lookback, c.end))))
    return StepPlan(chunks, list(out.copies), samples or [], from_rows)
