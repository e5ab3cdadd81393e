"""The DSpark stages on the kernel path (spec 4.9): engine/core/drafter.py's DSparkStages with the kernel runner's
ops, so that a speculative step on the kernel runner drafts and stores its context at the reference's own
precision (fp32 accumulation, bf16 activations, FP8 / FP4 weights through the kernels) rather than through the
golden float64 modules. DSparkDrafter keeps the rest of the draft (the contexts each request reads, the keyed draws).

Each stage is a decoder layer (KernelRunner.layer_forward: mHC mixes, norms, the MoE kernels) whose attention is the
draft's: the block's queries [anchor, noise, ...] attend to the request's context window (the stage's window KV of
the positions before the anchor, in kv.dspark_swa) and to the whole block (bidirectional). The context records and
the block's own window KV (stored as the target's window KV is: norm, RoPE, FP8) go into a scratch pool of records,
one row of `window + block` records per request, which the paged sparse attention kernel reads (no causal mask:
every query sees its request's whole row). The head, the Markov correction and the confidence head are fp32 products
of bf16 weights (mm_fp32), as the reference computes them.

Greedy drafts also run on persistent buffers in CUDA graphs (engine/core/draft_step.py, the same hidden_rows and
propose); sampled drafts run here eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.drafter import context_rows
from engine.core.kernel_layers import KernelRunner
from engine.core.kernel_ops import OPS, head_logits, linear
from engine.core.plan import ChunkPlan
from engine.core.step_rows import Segment
from engine.kernels.mhc import hc_pre
from engine.model.dspark import DraftOutput, DSparkStage


class KernelDSpark:
    """DSparkStages on a KernelRunner's device, model and pools."""

    def __init__(self, runner: KernelRunner):
        self.runner, self.model, self.kv, self.cfg = runner, runner.model, runner.kv, runner.cfg

    @torch.inference_mode()
    def hidden(self, anchors: Tensor, contexts: list[tuple[int, Tensor]]) -> Tensor:
        """DSparkStages.hidden: the contexts as device tensors (context_slots), then hidden_rows."""
        dev = anchors.device
        positions = torch.tensor([last + 1 for last, _ in contexts], device=dev)
        self.runner.reserve_positions(int(positions.max()) + self.cfg.dspark_block_size)
        return self.hidden_rows(anchors, positions, context_slots([slots for _, slots in contexts],
                                                                  self.cfg.window_size).to(dev))

    def hidden_rows(self, anchors: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """anchors int64 [B] at positions [B], each request's context: the window slots [B, W] of its positions
        max(0, p - W) .. p - 1 in order, then -1 -> x [B, block, D] (device work only: the draft step's graph
        body, engine/core/draft_step.py). The RoPE tables must cover positions + block (reserve_positions)."""
        cfg, dev = self.cfg, anchors.device
        B, blk, W = anchors.numel(), cfg.dspark_block_size, cfg.window_size
        ids = torch.where(torch.arange(blk, device=dev) == 0, anchors[:, None], cfg.dspark_noise_token_id)
        width = W + blk  # a request's records: its context (padded to the window), then its block
        base = torch.arange(B, device=dev) * width
        qpos = (positions[:, None] + torch.arange(blk, device=dev)).flatten()  # [B*blk]
        block_slots = (base[:, None] + W + torch.arange(blk, device=dev)).flatten()  # [B*blk]
        held = slots >= 0
        ctx = torch.where(held, base[:, None] + torch.arange(W, device=dev), -1)
        idx = torch.cat([ctx, block_slots.view(B, blk)], dim=1).to(torch.int32)
        idx = idx.repeat_interleave(blk, dim=0)  # [B*blk, width]: each query sees its request's whole row
        src = slots.clamp_min(0)  # a missing record reads slot 0: never attended (idx -1)
        rec = self.kv.dspark_swa[0].size(-1)

        def attend(stage: DSparkStage, x: Tensor) -> Tensor:  # x bf16 [B*blk, D] normed
            attn, runner = stage.attn, self.runner
            table = runner.table_for(attn.rope)
            pool = self.kv.dspark_swa[stage.role.layer_id - cfg.n_layers].view(-1, rec)
            scratch = torch.empty(B, width, rec, dtype=torch.uint8, device=dev)
            scratch[:, :W] = pool[src]
            scratch = scratch.view(B * width, rec)
            OPS.store_window(linear(attn.wkv, x), attn.kv_norm.weight, attn.kv_norm.eps, qpos, table, scratch,
                             block_slots)
            qr = OPS.rms_norm(linear(attn.wq_a, x), attn.q_norm.weight, attn.q_norm.eps)
            q = OPS.rope(linear(attn.wq_b, qr).unflatten(-1, (attn.n_local_heads, attn.head_dim)), qpos, table)
            o = OPS.sparse_attn(q, scratch, idx, runner.no_main, idx.new_empty(idx.size(0), 0), attn.attn_sink,
                                attn.head_dim ** -0.5)
            return runner.attention_output(attn, o, qpos, table)

        h = F.embedding(ids.flatten(), self.model.embed.weight).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [B*blk, hc, D]
        pre_mix = torch.zeros(B * blk, cfg.hc_mult, dtype=torch.float32, device=dev)
        pre_mix[:, 0] = 1.0
        for stage in self.model.mtp:
            h, pre_mix = self.runner.layer_forward(stage, h, pre_mix, None, None,
                                                   attend=lambda x, s=stage: attend(s, x))
        return hc_pre(h, pre_mix).view(B, blk, -1)

    @torch.inference_mode()
    def propose(self, x: Tensor, anchors: Tensor, pick: Callable[[int, Tensor], Tensor],
                num_tokens: int) -> DraftOutput:
        """Transformer.dspark_propose on the kernel path's ops."""
        n = num_tokens
        assert 0 < n <= self.cfg.dspark_block_size, f"{n} draft tokens from a block of {self.cfg.dspark_block_size}"
        B = x.size(0)
        x = x[:, :n].reshape(B * n, -1)
        last = self.model.mtp[-1]
        logits = head_logits(OPS.rms_norm(x, last.norm.weight, last.norm.eps), self.model.head).view(B, n, -1)
        out = anchors.new_empty(B, n + 1)
        out[:, 0] = anchors
        markov = []
        for i in range(n):  # sequential rank-r bigram correction
            e = F.embedding(out[:, i], last.markov_head.embed.weight)  # [B, r] bf16
            logits[:, i] += head_logits(e, last.markov_head.head)
            markov.append(e)
            out[:, i + 1] = pick(i, logits[:, i])
        features = torch.cat([x.view(B, n, -1), torch.stack(markov, dim=1)], dim=-1)  # [B, n, D + r]
        confidence = linear(last.confidence_head.proj, features.flatten(0, 1)).view(B, n)
        return DraftOutput(out, logits, confidence)

    @torch.inference_mode()
    def write_context(self, main_hidden: Tensor, segs: list[Segment], chunks: list[ChunkPlan],
                      ends: dict[int, int]) -> None:
        kept = context_rows(segs, chunks, ends, self.kv.layout.swa_block_size)
        if kept is None:
            return
        rows, pos, slots = (t.to(main_hidden.device) for t in kept)
        self.store_context(main_hidden[0, rows], pos, slots)

    def store_context(self, main_hidden: Tensor, pos: Tensor, slots: Tensor) -> None:
        """main_hidden bf16 [R, taps*D] tap hiddens at positions pos [R] -> every stage's context KV at window slots
        [R] (-1 = skip): device work only (the verify step's graph body, engine/core/verify_step.py)."""
        first = self.model.mtp[0]
        main_x = OPS.rms_norm(linear(first.main_proj, main_hidden), first.main_norm.weight,
                              first.main_norm.eps)  # [R, D]
        for pool, stage in zip(self.kv.dspark_swa, self.model.mtp):
            attn = stage.attn
            OPS.store_window(linear(attn.wkv, main_x), attn.kv_norm.weight, attn.kv_norm.eps, pos,
                             self.runner.table_for(attn.rope), pool, slots)


def context_slots(contexts: list[Tensor], window: int) -> Tensor:
    """Each request's context window slots (CPU long [n <= window], its positions in order) -> int64 [B, window],
    -1 past each one's."""
    out = torch.full((len(contexts), window), -1, dtype=torch.long)
    for b, slots in enumerate(contexts):
        out[b, :slots.numel()] = slots
    return out
