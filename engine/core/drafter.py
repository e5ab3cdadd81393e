"""Drafters for speculative decoding (issue 22): a `Drafter` proposes up to k tokens after each verify chunk's
anchor; `DSparkDrafter` runs the checkpoint's DSpark stages (spec 4.9) over their context KV in the paged pools,
and the stages' `write_context` stores that context: every DSpark stage's window KV of each target position the
engine keeps, projected from the tap hiddens of the target's own forward (main_x). The stages' math runs on the
runner's path: the golden modules (GoldenDSpark) or the kernel path's ops (engine/core/kernel_drafter.py). Tests
pass other drafters (an oracle that proposes the target's continuation) through the same seam (ModelRunner's
`drafter`).

Context invariant: a request's DSpark context KV is valid at every position below its num_computed that a draft
can read (num_computed - window .. num_computed - 1): write_context stores only positions the verify kept (an
accepted draft or a plain chunk's decoder rows), and the window blocks keep one position below the target's
window (CacheLayout.swa_lookback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from engine.core.kv_cache import PagedKVCache
from engine.core.plan import ChunkPlan
from engine.core.sampling_params import SamplingParams
from engine.core.speculative import draw_draft, keys
from engine.core.step_rows import Segment
from engine.kernels import paged
from engine.model.dspark import DraftOutput, DSparkStage
from engine.model.transformer import Transformer

if TYPE_CHECKING:
    from engine.core.draft_step import DraftStep


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One verify chunk's request, as a drafter sees it."""

    anchor: int  # the request's last token, at `position` (the drafts follow it)
    position: int
    prev_ids: list[int]  # up to plan.ENGRAM_LOOKBACK ids just before the anchor
    num_tokens: int  # drafts wanted, <= the DSpark block
    swa_blocks: dict[int, int]  # its window blocks (which hold the DSpark context KV)
    params: SamplingParams
    seed: int
    step: int  # output index the first draft proposes


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [k]
    q: Tensor | None  # float64 [k, V]: the distribution each token was drawn from; None: greedy (one-hot at each)
    confidence: list[float]  # [k] logits of the drafter's estimate that each draft is accepted (sigmoid)

    def prefix(self, k: int) -> "Draft":
        return Draft(self.token_ids[:k], None if self.q is None else self.q[:k], self.confidence[:k])


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft of exactly request.num_tokens tokens per request, drawn with the request's sampling params
        (engine/core/speculative.draw_draft keys the draws by (seed, output index))."""
        ...


class DSparkStages(Protocol):
    """The DSpark stages' math on one runner path (spec 4.9): GoldenDSpark here (the golden modules), KernelDSpark
    (engine/core/kernel_drafter.py) on the kernel path. DSparkDrafter holds the rest of the draft (which context each
    request reads, the keyed draws), so the draft logic lives in one place for both."""

    def hidden(self, anchors: Tensor, contexts: list[tuple[int, Tensor]]) -> Tensor:
        """anchors int64 [B], contexts per request (last context position, its window slots [C] in the DSpark
        pools) -> x [B, block, D]: the draft block [anchor, noise, ...] through every stage, collapsed."""
        ...

    def propose(self, x: Tensor, anchors: Tensor, pick: Callable[[int, Tensor], Tensor],
                num_tokens: int) -> DraftOutput:
        """Transformer.dspark_propose's contract: the sequential Markov correction and the confidences."""
        ...

    def write_context(self, main_hidden: Tensor, segs: list[Segment], chunks: list[ChunkPlan],
                      ends: dict[int, int]) -> None:
        """main_hidden [1, R, taps*D]: the tap hiddens of the decoder rows segs (the step's final stream) -> every
        DSpark stage's context KV at those positions, below ends[chunk] where given (a verify chunk: its accepted
        positions)."""
        ...


class DSparkDrafter:
    """The DSpark stages drafting from the context KV in the paged pools: `stages` does the stages' math (default:
    the golden modules of `model`, which it must have been loaded with), batched over the requests; each request's
    attention reads its own context window. on_device: the kernel path's draft step (engine/core/draft_step.py),
    which drafts the requests it takes (greedy) on device buffers and their CUDA graphs."""

    def __init__(self, model: Transformer, kv: PagedKVCache, stages: DSparkStages | None = None,
                 on_device: DraftStep | None = None):
        if not model.mtp or len(kv.dspark_swa) != len(model.mtp):
            raise ValueError(f"DSpark drafting needs the model's DSpark stages ({len(model.mtp)} loaded) and their "
                             f"context pools ({len(kv.dspark_swa)})")
        self.model, self.kv, self.cfg = model, kv, model.cfg
        self.stages = stages or GoldenDSpark(model, kv)
        self.on_device = on_device

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        if self.on_device is not None and self.on_device.takes(requests):
            return self.on_device.propose(requests)
        cfg, S = self.cfg, self.kv.layout.swa_block_size
        device = self.model.embed.weight.device
        anchors = torch.tensor([r.anchor for r in requests], dtype=torch.long, device=device)
        contexts = []  # per request: the last context position and its slots (the window before the anchor)
        for r in requests:
            lo = max(0, r.position - cfg.window_size)
            contexts.append((r.position - 1, paged.swa_slots(r.swa_blocks, lo, r.position, S)))
        x = self.stages.hidden(anchors, contexts)
        seeds, steps = (torch.cat(t) for t in zip(*(keys(r.seed, r.step, 1) for r in requests)))
        params = [r.params for r in requests]
        qs: list[Tensor] = []

        def pick(i: int, logits: Tensor) -> Tensor:
            tokens, q = draw_draft(logits, params, seeds, steps + i)
            qs.append(q)
            return tokens.to(logits.device)

        n = max(r.num_tokens for r in requests)
        out = self.stages.propose(x, anchors, pick, n)
        q = torch.stack(qs, dim=1)  # [B, n, V]
        tokens, confidence = out.tokens[:, 1:].tolist(), out.confidence.tolist()
        return [Draft(tokens[b][:r.num_tokens], q[b, :r.num_tokens], confidence[b][:r.num_tokens])
                for b, r in enumerate(requests)]


class GoldenDSpark:
    """DSparkStages on the golden modules (float64 math rounded as the reference rounds)."""

    def __init__(self, model: Transformer, kv: PagedKVCache):
        self.model, self.kv, self.cfg = model, kv, model.cfg

    def hidden(self, anchors: Tensor, contexts: list[tuple[int, Tensor]]) -> Tensor:
        cfg = self.cfg

        def attend(stage: DSparkStage, x: Tensor) -> Tensor:  # x [B, block, D]
            pool = self.kv.dspark_swa[stage.role.layer_id - cfg.n_layers]
            return torch.cat([stage.attn.draft_over(x[b:b + 1], last, paged.gather_swa(pool, slots, cfg.head_dim)[None])
                              for b, (last, slots) in enumerate(contexts)])

        return self.model.dspark_hidden(anchors, attend)

    def propose(self, x: Tensor, anchors: Tensor, pick: Callable[[int, Tensor], Tensor],
                num_tokens: int) -> DraftOutput:
        return self.model.dspark_propose(x, anchors, pick, num_tokens)

    @torch.inference_mode()
    def write_context(self, main_hidden: Tensor, segs: list[Segment], chunks: list[ChunkPlan],
                      ends: dict[int, int]) -> None:
        kept = context_rows(segs, chunks, ends, self.kv.layout.swa_block_size)
        if kept is None:
            return
        rows, pos, slots = (t.to(main_hidden.device) for t in kept)
        model = self.model
        main_x = model.mtp[0].main_x(main_hidden[:, rows])  # [1, R', D]
        for pool, stage in zip(self.kv.dspark_swa, model.mtp):
            paged.store_swa(pool, slots, stage.attn.window_kv_unquantized(main_x, pos)[0])


def context_rows(segs: list[Segment], chunks: list[ChunkPlan], ends: dict[int, int], block_size: int
                 ) -> tuple[Tensor, Tensor, Tensor] | None:
    """The stream rows whose DSpark context is written (segs' rows below ends[chunk] where given), their positions
    and window slots (CPU long [R'] each); None when there are none."""
    rows, pos, slots = [], [], []
    for s in segs:
        end = min(s.end, ends.get(s.index, s.end))
        if end <= s.start:
            continue
        rows.append(torch.arange(s.offset, s.offset + end - s.start))
        pos.append(torch.arange(s.start, end))
        slots.append(paged.swa_slots(chunks[s.index].swa_blocks, s.start, end, block_size))
    if not rows:
        return None
    return torch.cat(rows), torch.cat(pos), torch.cat(slots)
