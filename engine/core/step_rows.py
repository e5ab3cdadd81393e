"""A step's rows, shared by both runner paths (engine/core/runner.py golden, engine/core/kernel_layers.py
kernels): where each chunk sits in the flat stream, which rows the decoder layers keep, the Engram hashes
of the stream, which rows reach the head and how their logits are returned."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.plan import ENGRAM_LOOKBACK, ChunkPlan, StepPlan
from engine.core.sampler import SampleOutput, sample_specs
from engine.core.speculative import Verified
from engine.engram_tables import EngramTables, hash_ngrams, initial_history, next_history
from engine.host_copy import tensor_on
from engine.vision.inputs import image_mask


@dataclass(slots=True)
class Segment:
    """One chunk's rows in the current stream: positions start..end-1 at stream rows offset.."""

    index: int  # chunk index in the step
    start: int
    end: int
    offset: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class StepLogits:
    sample: torch.Tensor  # fp32 [num sampled chunks, vocab], chunk order: position end-1 of each
    rows: dict[int, tuple[int, torch.Tensor]]  # chunk index -> (first position, fp32 [rows, vocab])


@dataclass(frozen=True, slots=True)
class CompressorRows:
    """The fp32 rows a ratio-r compressor saw for one verify chunk, from its first group's start (the pending
    tokens, then the chunk's): what the pending group is rolled back from."""

    first: int  # position of row 0
    kv: torch.Tensor  # fp32 [1, n, hd]
    score: torch.Tensor  # fp32 [1, n, hd]


@dataclass(slots=True)
class ForwardState:
    """What a forward leaves (either path) besides its logits: the decoder rows' tap hiddens (DSpark context on) and
    segments, and the compressor rows of each (verify chunk index, ratio > 1 KV source)."""

    logits: StepLogits
    main_hidden: torch.Tensor | None = None  # [1, R, taps*D]
    segs: list[Segment] = field(default_factory=list)
    groups: dict[tuple[int, int], CompressorRows] = field(default_factory=dict)


@dataclass(slots=True)
class StepOutput:
    """What a step returns to the engine: one token per plan.samples entry (engine/core/sampler.py), the
    logits of the chunks that keep theirs (chunk index -> (first position, fp32 [rows, vocab])), and per
    plan.verifies entry the tokens its verify chunk emits (engine/core/speculative.py)."""

    sample: SampleOutput
    rows: dict[int, tuple[int, torch.Tensor]]
    verified: list[Verified] = field(default_factory=list)


@dataclass(slots=True)
class HeadRows:
    """The stream rows the head reads (`picks`) and, per chunk that keeps its logits, (chunk, first
    position, first pick, rows)."""

    picks: list[int]
    kept: list[tuple[int, int, int, int]]


def segments(chunks: list[ChunkPlan]) -> list[Segment]:
    out, off = [], 0
    for i, c in enumerate(chunks):
        out.append(Segment(i, c.start, c.end, off))
        off += c.end - c.start
    return out


def decoder_rows(chunks: list[ChunkPlan], segs: list[Segment]) -> tuple[list[Segment], torch.Tensor]:
    """The rows the decoder layers run: each chunk's positions >= its request's decoder_from (CPU long)."""
    out, keep, off = [], [], 0
    for c, s in zip(chunks, segs):
        first = min(max(s.start, c.decoder_from), s.end)
        keep.append(torch.arange(s.offset + first - s.start, s.offset + s.rows))
        out.append(Segment(s.index, first, s.end, off))
        off += s.end - first
    return out, torch.cat(keep)


def engram_hashes(tables: EngramTables | None, chunks: list[ChunkPlan], segs: list[Segment],
                  ids: torch.Tensor) -> torch.Tensor | None:
    """Hash ids of every stream row [1, T, engram layers, cols], each chunk continuing its request's
    look-back (plan.prev_ids); image-span positions (plan.images), in the chunk or its look-back, are DEAD.
    None without Engram."""
    if tables is None:
        return None
    out = []
    K = tables.max_ngram_size - 1
    assert K <= ENGRAM_LOOKBACK, f"Engram n-grams of {K + 1} need more look-back than plans carry"
    for c, s in zip(chunks, segs):
        prev = c.prev_ids[len(c.prev_ids) - min(K, len(c.prev_ids)):]
        before = tensor_on([prev], ids.device, torch.long).view(1, -1)
        before_text = text = None  # Engram's token_mask: False in image spans
        if c.images:
            before_text = ~tensor_on([image_mask(c.start - len(prev), c.start, c.images)], ids.device,
                                     torch.bool).view(1, -1)
            text = ~tensor_on([image_mask(s.start, s.end, c.images)], ids.device, torch.bool)
        history = next_history(tables, initial_history(tables, 1, ids.device), before, before_text)
        out.append(hash_ngrams(tables, ids[s.offset:s.offset + s.rows].view(1, -1), history, c.start, text))
    return torch.cat(out, dim=1)


def head_rows(chunks: list[ChunkPlan], segs: list[Segment]) -> HeadRows:
    """Each sampled chunk's last decoder row, and every decoder row of chunks that keep their logits or verify
    drafts (a verify chunk's rows are all kept, none sampled: StepPlan.verifies draws from them)."""
    picks, kept = [], []
    for c, s in zip(chunks, segs):
        if (c.keep_logits or c.num_draft) and s.rows:
            kept.append((s.index, s.start, len(picks), s.rows))
            picks += range(s.offset, s.offset + s.rows)
        if c.sample and not c.num_draft:
            assert s.rows > 0 and s.end == c.end, f"chunk {s.index} samples but has no decoder rows"
            picks.append(s.offset + s.rows - 1)
    return HeadRows(picks, kept)


def split_logits(logits: torch.Tensor, head: HeadRows) -> StepLogits:
    """fp32 [len(picks), V] in pick order -> the sampled rows and the kept rows per chunk."""
    is_sample = torch.ones(len(head.picks), dtype=torch.bool)
    rows = {}
    for index, first_pos, at, n in head.kept:
        is_sample[at:at + n] = False
        rows[index] = (first_pos, logits[at:at + n])
    return StepLogits(logits[is_sample.to(logits.device)], rows)


def no_logits(vocab_size: int, device: torch.device) -> StepLogits:
    return StepLogits(torch.empty(0, vocab_size, device=device), {})


def sample_step(plan: StepPlan, logits: StepLogits) -> StepOutput:
    """The step's tokens drawn beside the model from its sampled rows (the kept rows pass through)."""
    return StepOutput(sample_specs(logits.sample, plan.samples), logits.rows)
