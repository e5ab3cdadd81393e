"""The ops of the runner's kernel path (engine/core/kernel_layers.py), in one table: each an
`engine.kernels` kernel, with the torch glue a module's weights need (stacked experts, pinned Engram tables,
fp32 weight copies on the CPU), plain-torch fp32 math where no kernel applies (FP4 dense linears), and the golden
module for MoE routers other than V4.1's. `op_backends()` says which is which.

Model parallelism on the kernel path lives here too (the modules carry their ShardSpec; the collectives are
engine/parallel.py's; at one shard each is the single-device op, unchanged): `row_parallel` (wo_b: the rank's fp32
partial from the kernel's unrounded sum, all-reduced, rounded once to bf16), `moe_kernels` (expert-parallel routed
experts + the tensor-parallel shared expert: their fp32 partials in one all-reduce, then one rounding) and
`head_logits` (vocab-parallel head, logits all-gathered). The golden rounds the float64 sum of the ranks' float64
partials; here the ranks' fp32 partials are summed in fp32, so N shards compute what one computes up to fp32
summation order (of the K range, and of the routed experts' outputs) before the one rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import cache_store, paged
from engine.kernels.bf16_gemv import linear_fp32
from engine.kernels.compressor import compress_ratio2
from engine.kernels.engram_gate import engram_gate
from engine.kernels.engram_gather import HostEngramTable, engram_gather
from engine.kernels.fp8_linear import fp8_linear
from engine.kernels.indexer import index_scores
from engine.kernels.indexer import index_scores_batched, index_scores_rows
from engine.kernels.indexer_cuda import MAX_M as SCAN_MAX_M
from engine.kernels.indexer_cuda import index_scores_cuda, scan_applies
from engine.kernels.mhc import hc_mixes, hc_post, hc_pre_norm
from engine.kernels.moe import ExpertWeights, moe_finish, moe_forward, stack_experts
from engine.kernels.norm import rms_norm
from engine.kernels.rope import apply_rope
from engine.kernels.sparse_prefill import sparse_attn
from engine.kernels.topk import candidate_blocks, entry_slots, index_topk
from engine.model.engram import Engram, EngramEmbedding
from engine.model.layers import Linear, ParallelHead, RowParallelLinear
from engine.model.moe import MoE
from engine.parallel import all_gather, all_reduce_sum
from engine.quant import act_quant_qdq, dequant_fp4_weight

INDEXER_MAX_M = 16  # index_scores keeps all M*H query rows in registers: queries go in groups of 16
ROWS_MIN_M = 64  # from this many queries of one request (a prefill chunk), index_scores_rows scores them all at once
SCORE_BYTES = 1 << 29  # a prefill chunk's indexer scores (bf16 [queries, entries]) are made this many bytes at a time


def score_rows(num_queries: int, num_entries: int) -> int:
    """Queries per indexer pass so that a pass's scores stay within SCORE_BYTES (at least one query): a chunk of
    32,768 queries against 512K entries (a 1M-token prompt's end at ratio 2) would otherwise need 32 GB."""
    return max(1, min(num_queries, SCORE_BYTES // (2 * max(num_entries, 1))))


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
    """x [..., K] (bf16) @ w^T (bf16 [N, K]) in fp32 -> fp32 [..., N] (the reference's fp32 linears; every
    bf16 product is exact in fp32): on CUDA bf16_gemv (<= 8 rows) or cuBLAS bf16 -> fp32, streaming the bf16
    weight with no fp32 copy (the head: 1.3 GB instead of 2.6); fp32 math from a cached copy on the CPU."""
    if x.is_cuda:
        return linear_fp32(x, w)
    return F.linear(x.float(), _fp32_weight(w))


def rms_norm_torch(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """w * x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype."""
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def fp4_linear_torch(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """act_quant(x) @ dequant(FP4 weight)^T with fp32 accumulation -> bf16 (a routed expert's linear)."""
    return F.linear(act_quant_qdq(x).float(), dequant_fp4_weight(weight, scale)).to(torch.bfloat16)


_EXPERTS: dict[int, tuple[MoE, ExpertWeights]] = {}  # id(MoE) -> its stacked experts


def moe_kernels(x: Tensor, moe: MoE, is_image: Tensor | None = None) -> Tensor:
    """moe_forward on the module's experts, stacked once (stack_experts turns the modules' buffers into
    views of the stacks). A router or expert format the kernels do not take (not V4.1's sqrt-softplus with
    FP4 experts) runs the golden module: float64, eager only (it picks experts on the host). A rank of a split
    model: its share (its experts' outputs, its shared-expert features) as fp32 partials [2, T, D], summed over the
    ranks in one all-reduce, then rounded once (moe_finish). is_image bool [T]: image-span rows (they route with
    the gate's bias_vl)."""
    g = moe.gate
    if g.score_func != "sqrtsoftplus" or g.temp != 1.0 or moe.experts[moe.local_experts[0]].w1.fmt != "fp4":
        return moe(x, is_image)
    hit = _EXPERTS.get(id(moe))
    if hit is None or hit[0] is not moe:
        hit = _EXPERTS[id(moe)] = (moe, stack_experts(moe))
    if moe.shard.is_single:
        return moe_forward(x.contiguous(), moe, hit[1], is_image=is_image)
    return moe_finish(all_reduce_sum(moe_forward(x.contiguous(), moe, hit[1], partial=True, is_image=is_image),
                                     moe.shard))


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


def engram_mix(eng: Engram, h: Tensor, rows: Tensor, is_image: Tensor | None = None) -> Tensor:
    """h bf16 [N, hc, D], rows bf16 [N, cols, ehd] -> h + gate * value: wkv by fp8_linear, then the gate (signed
    sqrt of the normed key . stream product) and the update in one launch (engine.kernels.engram_gate). is_image
    bool [N]: image-span rows, whose gate is 0 (spec 4.10): they keep h."""
    kv = linear(eng.wkv, rows.flatten(-2))  # [N, (hc+1)*D]
    out = engram_gate(h, kv, eng.q_weight, eng.k_weight, eng.eps)
    return out if is_image is None else torch.where(is_image[:, None, None], h, out)


def rms_norm_rows(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return rms_norm(x.contiguous(), w, eps)


def index_scores_any(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor) -> Tensor:
    """index_scores over any number of queries: from ROWS_MIN_M queries (a prefill chunk) index_scores_rows in
    one launch; fewer, the CUDA scan (engine.kernels.indexer_cuda) 8 queries at a time where it applies (sm_90
    with nvcc, the real head shape), else the Triton kernel 16 at a time. slots [B, T]: row b's own entries
    (the batched decode step: one query per request), the Triton batched kernel; one row takes the one-request
    path."""
    if slots.dim() == 2:
        if slots.size(0) != 1:
            return index_scores_batched(q, w, key_pool, slots, visible)
        slots = slots[0]
    if q.size(0) >= ROWS_MIN_M:
        return index_scores_rows(q, w, key_pool, slots, visible)
    n = SCAN_MAX_M
    if scan_applies(q[:n], w[:n], key_pool, slots, visible[:n]):
        fn = index_scores_cuda
    else:
        fn, n = index_scores, INDEXER_MAX_M
    if q.size(0) <= n:
        return fn(q, w, key_pool, slots, visible)
    return torch.cat([fn(q[i:i + n], w[i:i + n], key_pool, slots, visible[i:i + n]) for i in range(0, q.size(0), n)])


# ---- the op table ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class OpTable:
    fp8_linear: Callable  # (x bf16 [..., K], weight fp8 [N, K], scale e8m0, out_dtype=bf16) -> [..., N]
    rms_norm: Callable  # (x [N, D], w bf16 [D], eps) -> bf16
    hc_pre_norm: Callable  # (x [N, hc, D], pre fp32 [N, hc], w, eps) -> rms_norm(hc_pre(x, pre)) bf16 [N, D]
    hc_mixes: Callable  # (x [N, hc, D], fn, scale, base, hc, iters, hc_eps, norm_eps, beside=False) -> (pre, post,
    #                      comb) fp32; beside: on a side stream, beside other kernels
    hc_post: Callable  # (y [N, D], residual [N, hc, D], post, comb) -> [N, hc, D]
    rope: Callable  # (x [N, (H,) d] contiguous, positions [N], RopeTable, inverse) -> rotated copy
    rope_mxfp4_qdq: Callable  # (x bf16 [N, H, d], positions [N], RopeTable) -> fp4_qdq(rope(x), 32, "ue8m0")
    store_window: Callable  # (kv [N, hd] pre-norm, norm_w, eps, positions, RopeTable, pool, slots): norm, RoPE, FP8
    store_main_kv: Callable  # (pool, slots [G], latent [G, hd] pre-RoPE, positions [G], RopeTable): RoPE, NVFP4
    store_index_keys: Callable  # (keys [G, ihd] pre-norm, norm_w, eps, positions, RopeTable, pool, slots): MXFP4
    compress_ratio2: Callable  # engine.kernels.compressor.compress_ratio2's signature
    index_scores: Callable  # (q bf16 [M, H, D], w bf16 [M, H], key_pool, slots [T] or [M, T], visible [M]) -> [M, T]
    candidate_blocks: Callable  # (score [M, T], visible [M], topk_blocks, block) -> bool [M, T]
    index_topk: Callable  # (score bf16 [M, T], k) -> int32 [M, min(k, T)] entry ids, -1 = none
    topk_slots: Callable  # (ids [m, K], entries int32 [E] or [m, E], out int32 [m, W]): out = entries[ids], -1 = none
    sparse_attn: Callable  # sparse_attn_paged's signature
    moe: Callable  # (x bf16 [T, D], moe: MoE, is_image bool [T] | None: bias_vl rows) -> bf16 [T, D]
    engram: Callable  # (eng, h [N, hc, D], rows bf16 [N, cols, ehd] from engram_gather, is_image bool [N] | None:
    #                    gate 0 rows) -> [N, hc, D]


OPS = OpTable(
    fp8_linear=fp8_linear,
    rms_norm=rms_norm_rows,
    hc_pre_norm=hc_pre_norm,
    hc_mixes=hc_mixes,
    hc_post=hc_post,
    rope=apply_rope,
    rope_mxfp4_qdq=cache_store.rope_mxfp4_qdq,
    store_window=cache_store.store_swa_fused,
    store_main_kv=cache_store.store_main_kv,
    store_index_keys=cache_store.store_index_k_fused,
    compress_ratio2=compress_ratio2,
    index_scores=index_scores_any,
    candidate_blocks=candidate_blocks,
    index_topk=index_topk,
    topk_slots=entry_slots,
    sparse_attn=sparse_attn,
    moe=moe_kernels,
    engram=engram_mix,
)


def op_backends() -> dict[str, str]:
    """op name -> "kernel" (Triton kernels of engine.kernels, with torch glue at most) or "torch"."""
    kernels = {index_scores_any, rms_norm_rows, moe_kernels, engram_mix}

    def kind(fn) -> str:
        mod = fn.__module__
        return "kernel" if fn in kernels or (mod.startswith("engine.kernels") and mod != paged.__name__) else "torch"
    return {name: kind(getattr(OPS, name)) for name in OpTable.__slots__}


def linear(lin: Linear, x: Tensor) -> Tensor:
    """A dense Linear on the kernel path: FP8 through fp8_linear; bf16 as the reference computes it (a
    bf16 GEMM with fp32 accumulation on CUDA, fp32 math on the CPU; fp32 out where the module computes
    in fp32: bf16_gemv / cuBLAS bf16 -> fp32 on CUDA, a cached fp32 copy of the weight on the CPU); FP4
    dequantised (torch)."""
    if lin.fmt == "fp8":
        return OPS.fp8_linear(x.contiguous(), lin.weight, lin.scale)
    if lin.fmt == "fp4":
        return fp4_linear_torch(x, lin.weight, lin.scale)
    if x.is_cuda and lin.compute != "fp32" and x.dtype == lin.weight.dtype:
        return F.linear(x, lin.weight)
    y = mm_fp32(x, lin.weight)
    return y if lin.compute == "fp32" else y.to(lin.weight.dtype)


def row_parallel(lin: RowParallelLinear, x: Tensor) -> Tensor:
    """A row-parallel linear (wo_b) on the kernel path: x [M, K_local] (this rank's input features) -> bf16 [M, N],
    the ranks' fp32 partials (the FP8 kernel's sum left unrounded; bf16 weights: fp32 math) summed by one all-reduce,
    then rounded once, as the golden's round_product rounds its float64 sum. One shard: `linear`, unchanged."""
    if lin.shard.is_single:
        return linear(lin, x)
    assert lin.fmt in ("fp8", "bf16") and lin.compute == "native", f"row-parallel {lin.fmt} / {lin.compute}"
    if lin.fmt == "fp8":
        part = OPS.fp8_linear(x.contiguous(), lin.weight, lin.scale, out_dtype=torch.float32)
    else:
        part = mm_fp32(x, lin.weight)
    return all_reduce_sum(part, lin.shard).to(torch.bfloat16)


def head_logits(x: Tensor, head: ParallelHead, gather: bool = True) -> Tensor:
    """The vocab-parallel head: x bf16 [N, D] -> fp32 logits [N, V], this rank's vocabulary rows in fp32 (mm_fp32)
    and every rank's gathered (one all-gather: each rank then holds every logit, so every rank draws alike);
    gather False: this rank's slice only (the decode step's draw gathers what it needs, sharded_draw.py)."""
    local = mm_fp32(x, head.weight)
    return all_gather(local, head.shard, dim=-1) if gather else local
