"""DSpark draft stages (checkpoint `mtp.S.*`; spec 4.9): drafting only, verification is the engine's.

Context KV of every stage comes from the target model's tap hiddens (main_x), one entry per target
position; a draft block [anchor, noise, ...] attends bidirectionally to itself plus the window of
context KV up to the anchor's predecessor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import LayerRole, ModelConfig
from engine.model.attention import Attention, sparse_attn
from engine.model.block import Block
from engine.model.cache import ModelCache
from engine.model.layers import Embedding, Linear, ParallelHead, RMSNorm
from engine.parallel import SINGLE, ShardSpec


@dataclass(slots=True)
class DraftOutput:
    tokens: torch.Tensor  # [B, block+1]: anchor then the drafted tokens
    logits: torch.Tensor  # fp32 [B, block, vocab], Markov-corrected
    confidence: torch.Tensor  # fp32 [B, block] logits of per-position acceptance (sigmoid -> probability)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Reference sampling: argmax at temperature 0, else Gumbel-max (softmax / Exp(1) noise, argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div_(noise).argmax(dim=-1)


class DSparkAttention(Attention):
    def observe(self, main_x: torch.Tensor, first_pos: int, cache: ModelCache) -> None:
        """main_x [B,S,D] of target positions first_pos.. -> this stage's window KV at those positions."""
        pos = torch.arange(first_pos, first_pos + main_x.size(1), device=main_x.device)
        cache.swa[self.role.layer_id][:, first_pos:first_pos + main_x.size(1)] = self.window_kv(main_x, pos)

    def draft(self, x: torch.Tensor, last_ctx: int, cache: ModelCache) -> torch.Tensor:
        """x [B,blk,D] at positions last_ctx+1.. attends to context positions up to last_ctx (one window)
        and to the whole draft block (bidirectional) -> [B,blk,D]."""
        ctx = cache.swa[self.role.layer_id][:, max(0, last_ctx - self.window + 1):last_ctx + 1]
        return self.draft_over(x, last_ctx, ctx)

    def draft_over(self, x: torch.Tensor, last_ctx: int, ctx: torch.Tensor) -> torch.Tensor:
        """`draft` with the context given: ctx [B,C,hd] the window KV of positions last_ctx-C+1 .. last_ctx
        (C = min(window, last_ctx + 1); from the static cache, or gathered from the engine's paged pools)."""
        B, blk, _ = x.shape
        qpos = torch.arange(last_ctx + 1, last_ctx + 1 + blk, device=x.device)
        _, q = self.queries(x, qpos)
        kv = torch.cat([ctx, self.window_kv(x, qpos)], dim=1)
        idx = torch.arange(kv.size(1), device=x.device).expand(B, blk, -1)
        return self.output(sparse_attn(q, kv, self.attn_sink, idx, self.head_dim ** -0.5), qpos)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int, shard: ShardSpec = SINGLE):
        super().__init__()
        self.embed, self.head = Embedding(vocab, rank), ParallelHead(vocab, rank, shard)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = Linear(dim, 1, "bf16", compute="fp32")


class DSparkStage(Block):
    """Laid out over the shards as a decoder layer is (Block's attention and MoE); the Markov head is
    vocab-parallel like the model's head; the rest is replicated."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, stage: int, shard: ShardSpec = SINGLE):
        super().__init__(cfg, role, attention_cls=DSparkAttention, shard=shard)
        if stage == 0:
            self.main_proj = Linear(cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim,
                                    "fp8" if cfg.dtype == "fp8" else "bf16")
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, shard)
            self.confidence_head = ConfidenceHead(cfg.dim + cfg.dspark_markov_rank)

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """[B,S,taps*D] tap hiddens -> [B,S,D] context input shared by all stages."""
        return self.main_norm(self.main_proj(main_hidden))

    def observe(self, main_x: torch.Tensor, first_pos: int, cache: ModelCache) -> None:
        self.attn.observe(main_x, first_pos, cache)
