"""CSA2 attention: a per-layer sliding window plus top-k entries of a shared compressed "main KV"
chosen by a lightning indexer (spec 4.4). Full / Reuse / Reindex roles come from `LayerRole`.

Reference numerics: bf16 activations, FP8-QDQ window KV, FP4-QDQ main KV (E4M3 scales per 16),
MXFP4-QDQ indexer queries and keys. Index keys are always read from the layer's own KV source
(vLLM's semantics; the reference can read a stale copy on incomplete ratio-2 decode steps, spec 4.4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LayerRole, ModelConfig
from engine.model.cache import ModelCache, SourceCache, StepShared
from engine.model.layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear, register
from engine.model.rope import RotaryTable, apply_rotary
from engine.parallel import SINGLE, ShardSpec
from engine.quant import act_quant_qdq, fp4_qdq

SINK_FREE_MAX = -1e30  # running max seed: an all-invalid row gives 0 output, not NaN


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Multi-query attention over listed rows of one shared K=V head, with a per-head sink.

    q [B,M,H,D] bf16, kv [B,N,D] bf16, sink [H] fp32 (joins the denominator only, not scaled),
    idx [B,M,K] int (-1 = ignored) -> [B,M,H,D] bf16. The reference's fp32 math is done in float64
    (as everywhere in the golden model); probabilities are rounded to bf16 before the PV product; the
    denominator sums the unrounded probabilities.
    """
    B, M, H, D = q.shape
    if idx.size(-1) == 0:
        return torch.zeros_like(q)
    out = torch.empty_like(q)
    for m0 in range(0, M, 256):  # bound the gathered [B, m, K, D] block
        ix = idx[:, m0:m0 + 256].long()
        valid = ix >= 0
        rows = torch.gather(kv.unsqueeze(1).expand(B, ix.size(1), -1, D), 2,
                            ix.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, D)).double()  # [B,m,K,D]
        logits = torch.einsum("bmhd,bmkd->bmhk", q[:, m0:m0 + 256].double(), rows) * scale
        logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
        mx = logits.amax(-1).clamp_min(SINK_FREE_MAX)  # [B,m,H]
        p = torch.exp(logits - mx.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(sink.double().view(1, 1, H) - mx)
        o = torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).double(), rows) / denom.unsqueeze(-1)
        out[:, m0:m0 + 256] = o.to(q.dtype)
    return out


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with a defined tie rule: equal values go to the lower index.

    bf16 index scores tie often, and torch.topk's choice among ties changes with the tensor's length,
    which would make a prefill and a decode step pick different entries for the same query.
    """
    order = torch.sort(x, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def window_indices(qpos: torch.Tensor, window: int, floor: int) -> torch.Tensor:
    """Window KV positions each query sees: max(floor, p-window+1) .. p. qpos [M] -> [M, window] (-1 = none)."""
    pos = qpos.unsqueeze(-1) - window + 1 + torch.arange(window, device=qpos.device)
    return torch.where(pos >= max(floor, 0), pos, -1)


def select_candidate_blocks(score: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level top-k: keep the best `topk_blocks` blocks of `block` positions.

    score [B,M,T] with invisible positions already -inf; visible [M] = visible entries per query.
    The block holding each query's newest visible entry is forced in. Returns a bool mask [B,M,T].
    """
    T = score.size(-1)
    blocks = F.pad(score, (0, -T % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)  # [B,M,nb]
    nb = blocks.size(-1)
    newest = ((visible - 1) // block).view(1, -1, 1)
    blocks = blocks.masked_fill(torch.arange(nb, device=score.device) == newest, float("inf"))
    values, indices = stable_topk(blocks, min(topk_blocks, nb))
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :T]


class Compressor(nn.Module):
    """Pools `ratio` consecutive tokens (grouped by absolute position) into one 512-d latent.

    ratio 1: RMSNorm(wkv(x)) in bf16. ratio r > 1: fp32 wkv / wgate, per-channel softmax over the
    group's tokens, weighted sum, RMSNorm. An incomplete trailing group waits in the cache's pending
    state until its last token arrives.
    """

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.dim, cfg.head_dim, "bf16", compute="fp32" if ratio > 1 else "native")
        if ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, "bf16", compute="fp32")
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, start_pos: int, src: SourceCache) -> torch.Tensor | None:
        """x [B,S,D] bf16 at positions start_pos.. -> pre-RoPE latents of the groups completed in
        this step (first one is group start_pos // ratio), or None."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        return self.pool(*self.group_rows(x, start_pos, src), src, x.dtype)

    def group_rows(self, x: torch.Tensor, start_pos: int, src: SourceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """ratio > 1: fp32 kv and score [B, start_pos % r + S, hd] of positions start_pos - start_pos % r ..: the
        pending group's tokens, then x's (the pending state keeps fp32, as the reference)."""
        kv, score = self.wkv(x), self.wgate(x)  # fp32 [B,S,hd]
        pending = start_pos % self.ratio
        if pending:
            kv = torch.cat([src.pending_kv[:, :pending], kv], dim=1)
            score = torch.cat([src.pending_score[:, :pending], score], dim=1)
        return kv, score

    def pool(self, kv: torch.Tensor, score: torch.Tensor, src: SourceCache, dtype: torch.dtype) -> torch.Tensor | None:
        """group_rows' output (from a group start) -> pre-RoPE latents [B,G,hd] of its complete groups, or None;
        the incomplete tail waits in src's pending state."""
        r = self.ratio
        complete = kv.size(1) // r * r
        rest = kv.size(1) - complete
        src.pending_kv[:, :rest] = kv[:, complete:]
        src.pending_score[:, :rest] = score[:, complete:]
        if complete == 0:
            return None
        kv = kv[:, :complete].unflatten(1, (-1, r))
        score = score[:, :complete].unflatten(1, (-1, r))
        pooled = (kv.double() * score.double().softmax(dim=2)).sum(dim=2)  # [B,G,hd]
        return self.norm(pooled.to(dtype))


class Indexer(nn.Module):
    """Lightning indexer: scores every visible compressed entry per query, keeps the top `index_topk`.

    score[t] = sum_h relu(q_h . k_t) * w_h, MXFP4 q and k, bf16 math. A KV source also turns its new
    latents into index keys. The candidate source publishes a block mask; later index sources
    (Reindex) score only inside it.
    """

    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        self.role, self.ratio = role, role.ratio
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.cand_blocks, self.cand_block = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, _dense(cfg))
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, "bf16")
        if role.is_kv_source:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, "bf16")
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps)

    def index_keys(self, latent: torch.Tensor, first_group: int, rope: RotaryTable) -> torch.Tensor:
        """latent [B,G,hd] pre-RoPE of groups first_group.. -> index keys [B,G,index_hd] bf16, before MXFP4."""
        gpos = (first_group + torch.arange(latent.size(1), device=latent.device)) * self.ratio
        return apply_rotary(self.k_norm(self.wk(latent)), rope.at(gpos).unsqueeze(0))

    def write_keys(self, latent: torch.Tensor, first_group: int, rope: RotaryTable, src: SourceCache) -> None:
        """latent [B,G,hd] pre-RoPE -> MXFP4 index keys of groups first_group.. into the source cache."""
        k = self.index_keys(latent, first_group, rope)
        src.index_k[:, first_group:first_group + k.size(1)] = fp4_qdq(k, 32, "ue8m0")

    def forward(self, x: torch.Tensor, qr: torch.Tensor, qpos: torch.Tensor, end_pos: int, rope: RotaryTable,
                src: SourceCache, shared: StepShared) -> torch.Tensor:
        """x [B,M,D], qr [B,M,q_lora] of the queries at qpos [M] -> top-k entry ids [B,M,K] (-1 = none)."""
        B, M, _ = x.shape
        T = end_pos // self.ratio
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = fp4_qdq(apply_rotary(q, rope.at(qpos).unsqueeze(0)), 32, "ue8m0")
        w = self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)  # [B,M,H] bf16
        score = torch.einsum("bshd,btd->bsht", q.double(), src.index_k[:, :T].double()).to(q.dtype)  # bf16 [B,M,H,T]
        score = (score.relu() * w.unsqueeze(-1)).double().sum(dim=2).to(q.dtype)  # [B,M,T]
        visible = (qpos + 1) // self.ratio  # [M]
        score = score.masked_fill(torch.arange(T, device=x.device) >= visible.unsqueeze(-1), float("-inf"))
        if self.role.is_candidate_source:
            shared.candidates = select_candidate_blocks(score, visible, self.cand_blocks, self.cand_block)
        elif self.role.uses_candidates:
            score = score.masked_fill(~shared.candidates, float("-inf"))
        values, indices = stable_topk(score, min(self.topk, T))
        order = indices.sort(dim=-1)  # attend in position order
        picked = values.gather(-1, order.indices)
        # -inf picks (invisible, or outside the candidates) are not attended
        return torch.where(picked > float("-inf"), order.values, -1)


def _dense(cfg: ModelConfig) -> str:
    return "fp8" if cfg.dtype == "fp8" else "bf16"


class Attention(nn.Module):
    """Tensor-parallel over heads: a rank holds n_local_heads query heads (wq_b rows, attn_sink) and the
    n_local_groups output groups they feed (wo_a rows); wo_b is row-parallel over those groups' features.
    The single KV head (wkv), the compressor and the indexer are replicated, so every rank writes the
    same caches. n_heads / groups stay the whole model's counts (the kernel path, single-shard, reads them)."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, shard: ShardSpec = SINGLE):
        super().__init__()
        self.cfg, self.role = cfg, role
        self.n_heads, self.head_dim, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.window, self.groups, self.o_lora = cfg.window_size, cfg.o_groups, cfg.o_lora_rank
        self.n_local_heads, self.n_local_groups = shard.split(cfg.n_heads, "n_heads"), shard.split(cfg.o_groups, "o_groups")
        dense = _dense(cfg)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dense)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, dense, shard, "n_heads")
        self.wkv = Linear(cfg.dim, cfg.head_dim, dense)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        # block-diagonal: group g maps the features of heads g*H/G.. to o_lora outputs
        self.wo_a = ColumnParallelLinear(cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank,
                                         dense, shard, "o_groups")
        self.wo_b = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dense, shard, "o_groups")
        register(self, "attn_sink", (self.n_local_heads,), torch.float32)
        self.compressor = Compressor(cfg, role.ratio) if role.is_kv_source else None
        self.indexer = Indexer(cfg, role) if role.is_index_source else None
        if role.ratio > 0:
            self.rope = RotaryTable(self.rd, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                                    cfg.beta_fast, cfg.beta_slow)
        else:
            self.rope = RotaryTable(self.rd, cfg.rope_theta)

    def window_kv_unquantized(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B,S,D] -> window KV [B,S,hd] bf16 (post-RoPE), before FP8."""
        return apply_rotary(self.kv_norm(self.wkv(x)), self.rope.at(pos).unsqueeze(0))

    def window_kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B,S,D] -> FP8-QDQ window KV [B,S,hd] (post-RoPE, whole vector quantised)."""
        return act_quant_qdq(self.window_kv_unquantized(x, pos), 32)

    def rotate_latent(self, latent: torch.Tensor, first_group: int) -> torch.Tensor:
        """Pre-RoPE latents [B,G,hd] of groups first_group.. -> main KV before FP4, each group stamped
        with its first token's position."""
        gpos = (first_group + torch.arange(latent.size(1), device=latent.device)) * self.role.ratio
        return apply_rotary(latent, self.rope.at(gpos).unsqueeze(0))

    def queries(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(x))  # [B,M,q_lora]
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))  # [B,M,H_local,hd]; no per-head norm in V4.1
        return qr, apply_rotary(q, self.rope.at(pos).unsqueeze(0))

    def output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Undo the K=V rotation on the output, then the grouped low-rank projection: [B,M,H_local,hd] -> [B,M,D]
        (wo_b sums the ranks' groups)."""
        o = apply_rotary(o, self.rope.at(pos).unsqueeze(0), inverse=True)
        B, M = o.shape[:2]
        o = o.reshape(B, M, self.n_local_groups, -1)
        wo_a = self.wo_a.dequantized(torch.bfloat16).view(self.n_local_groups, self.o_lora, -1)  # block-diagonal groups
        o = torch.einsum("bsgd,grd->bsgr", o.double(), wo_a.double()).to(o.dtype)
        return self.wo_b(o.flatten(2))

    def forward(self, x: torch.Tensor, start_pos: int, cache: ModelCache, shared: StepShared, q_from: int = 0,
                window_floor: int = 0, global_from: int = 0) -> torch.Tensor:
        """x [B,S,D] (normed, positions start_pos..) writes this layer's window KV for all S tokens (global
        KV only for positions >= global_from) and returns the attention output of the queries
        x[:, q_from:] -> [B,S-q_from,D]. Queries see window KV at positions >= window_floor only (SWA
        bounded replay)."""
        B, S, _ = x.shape
        end_pos = start_pos + S
        pos = torch.arange(start_pos, end_pos, device=x.device)
        qpos = pos[q_from:]
        layer = self.role.layer_id
        cache.swa[layer][:, start_pos:end_pos] = self.window_kv(x, pos)
        xq = x[:, q_from:]
        qr, q = self.queries(xq, qpos)
        idx = window_indices(qpos, self.window, window_floor).unsqueeze(0).expand(B, -1, -1)
        kv = cache.swa[layer][:, :end_pos]
        if self.role.ratio > 0:
            ratio = self.role.ratio
            src = cache.sources[self.role.kv_source]
            global_start = max(start_pos, global_from)
            latent = (self.compressor(x[:, global_start - start_pos:], global_start, src)
                      if self.compressor is not None else None)
            first_group = global_start // ratio
            if latent is not None and self.indexer is not None:
                self.indexer.write_keys(latent, first_group, self.rope, src)  # from the pre-RoPE latent
            if self.indexer is not None:
                topk = self.indexer(xq, qr, qpos, end_pos, self.rope, src, shared)
                shared.topk[layer] = topk
            else:
                topk = shared.topk[self.role.index_source]
            if latent is not None:
                latent = self.rotate_latent(latent, first_group)
                src.main_kv[:, first_group:first_group + latent.size(1)] = fp4_qdq(latent, 16, "e4m3")
            kv = torch.cat([kv, src.main_kv[:, :end_pos // ratio]], dim=1)
            idx = torch.cat([idx, torch.where(topk >= 0, topk + end_pos, -1)], dim=-1)
        o = sparse_attn(q, kv, self.attn_sink, idx, self.head_dim ** -0.5)
        return self.output(o, qpos)
