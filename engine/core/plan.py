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
    num_draft: int = 0  # a verify chunk: room for this many drafts after its anchor (StepPlan.verifies)
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


@dataclass(frozen=True, slots=True)
class VerifySpec:
    """A verify chunk (speculative decoding, engine/core/speculative.py): the chunk holds the request's anchor (its
    last token) and room for up to its num_draft drafts; the runner drafts them, computes anchor + drafts in the step's
    forward and returns the tokens it accepts. Its rows draw output indices step, step + 1, ..."""

    chunk: int  # index in StepPlan.chunks
    params: SamplingParams
    seed: int
    step: int  # output index the anchor's row draws (the request's number of outputs)
    force_ids: tuple[int, ...] = ()  # teacher forcing: output indices step.. take these
    stop_ids: tuple[int, ...] = ()  # an emitted token among these ends the request: nothing after it is kept


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """How many of its drafts each verify chunk verifies (speculative.verify_lengths): the draft slots whose
    survival (the drafter's confidence) is >= min_survival, at most max_draft_tokens of them in a step."""

    min_survival: float = 0.0
    max_draft_tokens: int | None = None


@dataclass(slots=True)
class StepPlan:
    chunks: list[ChunkPlan] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    # per chunk: the row of the previous step's draws that holds its input token (still on the device:
    # request.PENDING_TOKEN in token_ids), -1 where the token is known; None: every token is known
    from_rows: list[int] | None = None
    verifies: list[VerifySpec] = field(default_factory=list)  # the verify chunks, in chunk order
    draft_policy: DraftPolicy = DraftPolicy()


def plan_step(out: SchedulerOutput, samples: list[SampleSpec] | None = None, from_rows: list[int] | None = None,
              lookback: int = ENGRAM_LOOKBACK, verifies: list[VerifySpec] | None = None,
              draft_policy: DraftPolicy = DraftPolicy()) -> StepPlan:
    """A verify chunk's token_ids hold its anchor only (positions start .. end-1 leave room for its drafts)."""
    chunks = []
    for c in out.chunks:
        r = c.request
        chunks.append(ChunkPlan(c.start, c.end, r.ids_between(c.start, c.end - c.num_draft),
                                r.ids_between(max(0, c.start - lookback), c.start), c.sample,
                                r.keep_logits, list(r.global_blocks), dict(r.swa_blocks), r.pending_slot, r.global_from,
                                r.swa_floor, r.decoder_from, r.decoder_floor, c.num_draft,
                                chunk_images(r.images, c.start, c.end, lookback)))
    return StepPlan(chunks, list(out.copies), samples or [], from_rows, verifies or [], draft_policy)


def chunk_images(images: tuple[ImageInput, ...], start: int, end: int, lookback: int) -> tuple[ImageInput, ...]:
    """The images a chunk start..end-1 touches, in itself or in its Engram look-back. Those wholly in the look-back
    travel without their patches (megabytes each; only their positions are read: the decode steps after an image)."""
    return tuple(im if im.end > start else im.positions_only()
                 for im in images if im.overlaps(start - lookback, end))
