"""The ops of the runner's kernel path (engine/core/kernel_layers.py), in one table: each an
`engine.kernels` kernel, with the torch glue a module's weights need (stacked experts, pinned Engram tables,
fp32 weight copies) and the plain-torch fp32 implementations used where no kernel applies (FP4 dense
linears, routers other than V4.1's). `op_backends()` says which is which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import cache_store, paged
from engine.kernels.compressor import compress_ratio2
from engine.kernels.engram_gather import HostEngramTable, engram_gather
from engine.kernels.fp8_linear import fp8_linear
from engine.kernels.indexer import index_scores
from engine.kernels.mhc import hc_mixes, hc_post, hc_pre_norm
from engine.kernels.moe import ExpertWeights, moe_forward, stack_experts
from engine.kernels.norm import rms_norm
from engine.kernels.rope import apply_rope
from engine.kernels.sparse_prefill import sparse_attn
from engine.kernels.topk import candidate_blocks, index_topk
from engine.model.engram import Engram, EngramEmbedding
from engine.model.layers import Linear
from engine.model.moe import MoE
from engine.quant import act_quant_qdq, dequant_fp4_weight

INDEXER_MAX_M = 16  # index_scores keeps all M*H query rows in registers: queries go in groups of 16


# ---- torch ops (the reference's fp32 / bf16 math on the device) ----------------------------------------------

_FP32_WEIGHTS: dict[int, tuple[Tensor, Tensor]] = {}  # id(bf16 weight) -> (weight, fp32 copy)


def _fp32_weight(w: Tensor) -> Tensor:
    """A cached fp32 copy of a bf16 weight (re-made when the tensor object changes)."""
    hit = _FP32_WEIGHTS.get(id(w))
    if hit is None or hit[0] is not w:
        hit = (w, w.float())
        _FP32_WEIGHTS[id(w)] = hit
    return hit[1]


def mm_fp32(x: Tensor, w: Tensor) -> Tensor:
    """x [..., K] (bf16) @ w^T (bf16 [N, K]) in fp32 -> fp32 [..., N] (the reference's fp32 linears)."""
    return F.linear(x.float(), _fp32_weight(w))


def rms_norm_torch(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """w * x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype."""
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def fp4_linear_torch(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """act_quant(x) @ dequant(FP4 weight)^T with fp32 accumulation -> bf16 (a routed expert's linear)."""
    return F.linear(act_quant_qdq(x).float(), dequant_fp4_weight(weight, scale)).to(torch.bfloat16)


def _expert_torch(e, x: Tensor, weight: Tensor | None) -> Tensor:
    """One clamped SwiGLU expert (engine.model.moe.Expert math in fp32), routing weight fp32 [T, 1] or None."""
    gate, up = linear(e.w1, x).float(), linear(e.w3, x).float()
    if e.limit > 0:
        up = up.clamp(-e.limit, e.limit)
        gate = gate.clamp(max=e.limit)
    h = F.silu(gate) * up
    return linear(e.w2, (h if weight is None else weight * h).to(x.dtype))


def moe_torch(x: Tensor, moe: MoE) -> Tensor:
    """x bf16 [T, D] -> bf16 [T, D]: the router (any score_func), routed experts + shared, fp32 sum; the
    fallback for routers moe_forward does not take. Eager: the picked experts only (one host sync);
    under CUDA-graph capture every expert on every token, weighted 0 where not picked (sync-free)."""
    g = moe.gate
    scores = mm_fp32(x, g.weight) / g.temp  # [T, E]
    if g.score_func == "sqrtsoftplus":
        scores = F.softplus(scores).sqrt()
    elif g.score_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        scores = scores.softmax(dim=-1)
    ids = (scores + g.bias).topk(g.topk, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if g.norm_topk and g.topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * g.route_scale
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    for e in range(len(moe.experts)) if capturing else torch.unique(ids).tolist():
        w = torch.where(ids == e, weights, 0.0).sum(-1, keepdim=True)  # [T, 1]
        if capturing:
            y += _expert_torch(moe.experts[e], x, w).float()
        else:
            rows = (ids == e).any(-1).nonzero().squeeze(-1)
            y.index_add_(0, rows, _expert_torch(moe.experts[e], x[rows], w[rows]).float())
    y += _expert_torch(moe.shared_experts, x, None).float()
    return y.to(x.dtype)


_EXPERTS: dict[int, tuple[MoE, ExpertWeights]] = {}  # id(MoE) -> its stacked experts


def moe_kernels(x: Tensor, moe: MoE) -> Tensor:
    """moe_forward on the module's experts, stacked once (stack_experts turns the modules' buffers into
    views of the stacks); moe_torch for routers moe_forward does not take."""
    g = moe.gate
    if g.score_func != "sqrtsoftplus" or g.temp != 1.0 or moe.experts[0].w1.fmt != "fp4":
        return moe_torch(x, moe)
    hit = _EXPERTS.get(id(moe))
    if hit is None or hit[0] is not moe:
        hit = _EXPERTS[id(moe)] = (moe, stack_experts(moe))
    return moe_forward(x.contiguous(), moe, hit[1])


_ENGRAM: dict[int, tuple[EngramEmbedding, HostEngramTable]] = {}  # id(table module) -> where the gather reads it


def engram_table(embed: EngramEmbedding) -> HostEngramTable:
    """The module's table for engram_gather (on CUDA machines pinned in place: never copied)."""
    hit = _ENGRAM.get(id(embed))
    if hit is None or hit[0] is not embed:
        hit = _ENGRAM[id(embed)] = (embed, HostEngramTable.from_embedding(embed))
    return hit[1]


def engram_rows(eng: Engram, hash_ids: Tensor, device: torch.device) -> Tensor:
    """hash_ids int64 [N, cols] -> the dequantised table rows bf16 [N, cols, ehd] on `device` (engram_gather)."""
    return engram_gather(engram_table(eng.embed), hash_ids.to(device).contiguous())


def engram_mix(eng: Engram, h: Tensor, rows: Tensor) -> Tensor:
    """h bf16 [N, hc, D], rows bf16 [N, cols, ehd] -> h + gate * value: wkv by fp8_linear, the gate (signed
    sqrt of the normed key . stream product) in fp32 torch (engine.model.engram math)."""
    kv = linear(eng.wkv, rows.flatten(-2))  # [N, (hc+1)*D]
    key, value = kv.split([eng.hc * eng.dim, eng.dim], dim=-1)
    key, hf = key.float().unflatten(-1, (eng.hc, eng.dim)), h.float()
    w = eng.q_weight.float() * eng.k_weight.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eng.eps) * torch.rsqrt(key.square().mean(-1) + eng.eps)
    dot = (hf * w * key).sum(-1) * rstd * eng.dim ** -0.5  # [N, hc]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(h.dtype)


def rms_norm_rows(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return rms_norm(x.contiguous(), w, eps)


def index_topk_rows(score: Tensor, k: int) -> Tensor:
    return index_topk(score, k).long()


def index_scores_rows(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor) -> Tensor:
    """index_scores over any number of queries (the kernel takes up to 16 at a time)."""
    return torch.cat([index_scores(q[i:i + INDEXER_MAX_M], w[i:i + INDEXER_MAX_M], key_pool, slots,
                                   visible[i:i + INDEXER_MAX_M]) for i in range(0, q.size(0), INDEXER_MAX_M)])


# ---- the op table ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class OpTable:
    fp8_linear: Callable  # (x bf16 [..., K], weight fp8 [N, K], scale e8m0) -> bf16 [..., N]
    rms_norm: Callable  # (x [N, D], w bf16 [D], eps) -> bf16
    hc_pre_norm: Callable  # (x [N, hc, D], pre fp32 [N, hc], w, eps) -> rms_norm(hc_pre(x, pre)) bf16 [N, D]
    hc_mixes: Callable  # (x [N, hc, D], fn, scale, base, hc, iters, hc_eps, norm_eps) -> (pre, post, comb) fp32
    hc_post: Callable  # (y [N, D], residual [N, hc, D], post, comb) -> [N, hc, D]
    rope: Callable  # (x [N, (H,) d] contiguous, positions [N], RopeTable, inverse) -> rotated copy
    store_window: Callable  # (kv [N, hd] pre-norm, norm_w, eps, positions, RopeTable, pool, slots): norm, RoPE, FP8
    store_main_kv: Callable  # (pool, slots [G], latent [G, hd] pre-RoPE, positions [G], RopeTable): RoPE, NVFP4
    store_index_keys: Callable  # (keys [G, ihd] pre-norm, norm_w, eps, positions, RopeTable, pool, slots): MXFP4
    compress_ratio2: Callable  # engine.kernels.compressor.compress_ratio2's signature
    index_scores: Callable  # (q bf16 [M, H, D], w bf16 [M, H], key_pool, slots [T], visible [M]) -> bf16 [M, T]
    candidate_blocks: Callable  # (score [M, T], visible [M], topk_blocks, block) -> bool [M, T]
    index_topk: Callable  # (score bf16 [M, T], k) -> int64 [M, min(k, T)] entry ids, -1 = none
    sparse_attn: Callable  # sparse_attn_paged's signature
    moe: Callable  # (x bf16 [T, D], moe: MoE) -> bf16 [T, D]
    engram: Callable  # (eng, h [N, hc, D], rows bf16 [N, cols, ehd] from engram_gather) -> [N, hc, D]


OPS = OpTable(
    fp8_linear=fp8_linear,
    rms_norm=rms_norm_rows,
    hc_pre_norm=hc_pre_norm,
    hc_mixes=hc_mixes,
    hc_post=hc_post,
    rope=apply_rope,
    store_window=cache_store.store_swa_fused,
    store_main_kv=cache_store.store_main_kv,
    store_index_keys=cache_store.store_index_k_fused,
    compress_ratio2=compress_ratio2,
    index_scores=index_scores_rows,
    candidate_blocks=candidate_blocks,
    index_topk=index_topk_rows,
    sparse_attn=sparse_attn,
    moe=moe_kernels,
    engram=engram_mix,
)


def op_backends() -> dict[str, str]:
    """op name -> "kernel" (Triton kernels of engine.kernels, with torch glue at most) or "torch"."""
    kernels = {index_scores_rows, rms_norm_rows, index_topk_rows, moe_kernels, engram_mix}

    def kind(fn) -> str:
        mod = fn.__module__
        return "kernel" if fn in kernels or (mod.startswith("engine.kernels") and mod != paged.__name__) else "torch"
    return {name: kind(getattr(OPS, name)) for name in OpTable.__slots__}


def linear(lin: Linear, x: Tensor) -> Tensor:
    """A dense Linear on the kernel path: FP8 through fp8_linear; bf16 as the reference computes it (a
    bf16 GEMM with fp32 accumulation on CUDA, fp32 math on the CPU; fp32 out where the module computes
    in fp32, from a cached fp32 copy of the weight); FP4 dequantised (torch)."""
    if lin.fmt == "fp8":
        return OPS.fp8_linear(x.contiguous(), lin.weight, lin.scale)
    if lin.fmt == "fp4":
        return fp4_linear_torch(x, lin.weight, lin.scale)
    if x.is_cuda and lin.compute != "fp32" and x.dtype == lin.weight.dtype:
        return F.linear(x, lin.weight)
    y = mm_fp32(x, lin.weight)
    return y if lin.compute == "fp32" else y.to(lin.weight.dtype)
