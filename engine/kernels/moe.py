"""Routed-expert MoE: sqrt-softplus router, grouped FP4 expert GEMMs with fused SwiGLU, shared expert (spec 4.5).

Math (engine.model.moe, per token t and selected slot j with expert e = ids[t, j], weight w = weights[t, j]):

    s       = sqrt(softplus(x_t · gate_w^T))        ids = topk(s + bias, k)      w = 1.5 s[ids] / (Σ s[ids] + 1e-20)
            (bias: gate.bias, or gate.bias_vl for an image-span token)
    g, u    = bf16(A(x_t) · W1_e^T), bf16(A(x_t) · W3_e^T)        A = act_quant QDQ (FP8 per 32, UE8M0)
    h_tj    = bf16(w · silu(min(g, L)) · clamp(u, -L, L))          (fp32 here; float64 in the golden)
    o_tj    = A(h_tj) · W2_e^T                                     (fp32; the golden rounds it to bf16)
    y_t     = bf16(Σ_j bf16(o_tj) + shared(x_t))                   (fp32 sum in slot order)

W1/W3/W2 are packed FP4 E2M1 [out, in/2] (even element in the low nibble) with one E8M0 scale per 32 along
`in`. Products: both operands are dequantised in registers; e2m1 · 2^e and e4m3 · 2^e are exact in bf16, so a
bf16 tensor-core MMA with fp32 accumulation sums exact products (fp8_linear.py explains why not FP8 MMA).

Launches of moe_forward:
  1. `_gate_kernel` (gate_scores): partial scores [splits, T, E] (swap-AB, K split);
  2. `_route_kernel` (route_scores): per token, the split sum in order (all splits' loads issued at once),
     sqrt-softplus, top-k by repeated argmax, normalised weights;
  3. `_plan_kernel` (one program): a stable counting sort of the T·k (token, slot) pairs by expert and the
     tile list (expert, first sorted row, rows) with BLOCK_M rows per tile; the grid is sized by the bound
     max_tiles = min(E, T·k) + T·k // BLOCK_M, so nothing is read back to the host (graph-capturable);
  (on CUDA up to moe_fp4.FP4_MAX_TOKENS tokens: step 2 is moe_fp4.route_cuda (one CTA per token) and steps 3-5 are
  engine/kernels/moe_fp4.py: plan_and_quant (this plan, bit for bit, with tiles of 8 or 16 pairs by
  moe_fp4.fp4_tile_pairs, and x's act_quant, one launch), then the CUDA FP4 GEMVs up and down; on CUDA from
  moe_grouped.GROUPED_MIN_PAIRS pairs an expert, steps 3-5 are engine/kernels/moe_grouped.py instead: the pairs
  sorted by expert and two grouped GEMMs on the FP4 weights, fp4_grouped_gemm.py)
  4. `_expert_gemm_kernel` UP: for each tile, BLOCK_N rows of W1 and of W3 (swap-AB: weight rows on the MMA's
     M side, the tile's tokens on N; x act-quantised in registers at 16-token tiles, by one fp8_act_qdq
     launch before it for larger tiles), SwiGLU + clamps + routing weight, bf16, then
     act_quant QDQ of h per 32 (the input of W2, fused here because the tile holds whole 32-blocks);
  5. the same kernel DOWN: W2 over the sorted rows of h, fp32 out [T·k, D] by pair;
  6-8. shared expert: fp8_linear on [W1; W3] (one launch), `_swiglu_kernel`, fp8_linear on W2 (at decode on
     CUDA on a side stream, forked before the gate and joined before the combine);
  9. `_combine_kernel`: y = bf16(Σ_j bf16(o_tj) + shared).
K splits (decode, to fill the GPU) write fp32 partials; the last program of a tile (atomic ticket, as in
fp8_linear) sums them in split order: deterministic, one launch.

Expert- and tensor-parallel (a rank of N, `moe_forward(..., partial=True)`): the router is replicated and routes
over every expert; pairs of other ranks' experts get id -1 (dropped by the plan, the GEMMs and the combine), and
the rank's experts are renumbered from 0 (`stack_experts` stacks only them). The shared expert holds the rank's
intermediate features (its W2 a row-parallel partial, left in fp32). Step 9 then writes the rank's two fp32
partials unrounded, P = [Σ_{local j} bf16(o_tj), shared partial] [2, T, D]; the caller sums P over the ranks (one
all-reduce) and `moe_finish` rounds once: y_t = bf16(R_t + bf16(S_t)), the whole layer's formula with the routed
sum and the shared sum taken in another fp32 order (N = 1: moe_finish(P) is moe_forward's y bit for bit).

Memory traffic (the floor, each selected expert read once): per used expert 3·I·D/2 weight bytes + 3·I·D/32
scale bytes (18.8 MB at the real shapes), plus 2·T·D (x) + T·k·(2·I·2 + 4·D) activations and 2·T·D (y).
At decode (T·k <= 48) the weights are everything: the kernels are weight streams.

Interpreter (TRITON_INTERPRET=1): no bf16 arithmetic there, so loads are upcast at once, bf16 rounding is
integer round-to-nearest-even and the dots take fp32 operands (the same exact products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.fp8_linear import MAX_TICKETS, fp8_act_qdq, fp8_linear, split_k_tickets, stacked_fp8
from engine.kernels.moe_grouped import grouped_applies, routed_grouped
from engine.kernels.moe_fp4 import (fp4_applies, fp4_tile_pairs, moe_down_fp4, moe_up_fp4, plan_and_quant,
                                    route_cuda)
from engine.kernels.side_stream import fork
from engine.kernels.triton_common import act_quant_blocks, bf16_bits, cdiv, launch_sms, round_bf16, swiglu
from engine.model.moe import MoE
from engine.quant import BLOCK, act_dequant, act_quant, act_quant_qdq, dequant_fp4_weight, exact_matmul

_MAX_SCALE_CODE = 240  # E8M0 weight scales folded with 2^14 (see _fp4_pair) must stay below 2^127


# --- jit helpers -------------------------------------------------------------------------------------------------

@triton.jit
def _e2m1_x16384(c):
    """int32 E2M1 codes (0..15) -> fp32 value * 2^-14, via the fp16 whose bits are the code moved into place:
    exponent field e and mantissa top bit m give (1 + m/2) 2^(e-15) (e > 0) or the subnormal m 2^-15 (e = 0),
    i.e. exactly value(c) * 2^-14 in both cases. Six integer ops and one conversion per element."""
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_pair(w_ptrs, s_ptrs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed FP4 tile [BN, BK/2] bytes + E8M0 scales [BN, BK/32] -> the even and the odd K elements,
    dequantised (exact) fp32 [BN, BK/2] each."""
    b = tl.load(w_ptrs).to(tl.int32)
    s = ((tl.load(s_ptrs).to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(e-127) * 2^14
    lo = tl.reshape(_e2m1_x16384(b & 15), (BLOCK_N, BLOCK_K // 32, 16)) * s[:, :, None]
    hi = tl.reshape(_e2m1_x16384(b >> 4), (BLOCK_N, BLOCK_K // 32, 16)) * s[:, :, None]
    return tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _mma(acc, w, x, DOT_F32: tl.constexpr):
    """acc [BN, BM] += w [BN, BK] @ x[BM, BK]^T, bf16 operands (exact values), fp32 accumulation."""
    if DOT_F32:
        return tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)


@triton.jit
def _x_tile(x_ptrs, xe_ptrs, k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, QUANT_X: tl.constexpr,
            DOT_SCALED: tl.constexpr):
    """Columns k .. k + BK of the tile's activation rows as (even, odd, all) columns. QUANT_X: the rows are raw
    x and are act-quantised here (QDQ, exact); otherwise they already are."""
    if QUANT_X:
        q, s = act_quant_blocks(tl.reshape(tl.load(x_ptrs + k).to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32)))
        xn = tl.reshape(q * s[:, :, None], (BLOCK_M, BLOCK_K))
        xe, xo = tl.split(tl.reshape(xn, (BLOCK_M, BLOCK_K // 2, 2)))
    elif DOT_SCALED:
        xn = tl.load(x_ptrs + k)
        xe, xo = xn, xn  # unused
    else:
        xe, xo = tl.load(xe_ptrs + k), tl.load(xe_ptrs + k + 1)
        xn = xe  # unused
    return xe, xo, xn


@triton.jit
def _fp4_dot(acc, w_ptrs, s_ptrs, xe, xo, xn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_F32: tl.constexpr, DOT_SCALED: tl.constexpr):
    """One K step: acc += FP4 tile · x tile^T. DOT_SCALED (GPU only) hands the packed tile to tl.dot_scaled
    (Triton's own E2M1 upcast to bf16 on sm_90); otherwise the even/odd halves meet x's even/odd columns."""
    if DOT_SCALED:
        acc = tl.dot_scaled(tl.load(w_ptrs), tl.load(s_ptrs), "e2m1", tl.trans(xn.to(tl.bfloat16)), None, "bf16", acc)
    else:
        lo, hi = _fp4_pair(w_ptrs, s_ptrs, BLOCK_N, BLOCK_K)
        acc = _mma(acc, lo, xe, DOT_F32)
        acc = _mma(acc, hi, xo, DOT_F32)
    return acc


# --- router ------------------------------------------------------------------------------------------------------

@triton.jit
def _gate_kernel(x_ptr, w_ptr, part_ptr, T, E, D, k_per_split,
                 BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """part[split, t, e] = Σ_{k in split} x[t, k] w[e, k] (bf16 operands: exact products, fp32 sums)."""
    pid_e, pid_k, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    rows_e, rows_t = tl.minimum(offs_e, E - 1), tl.minimum(offs_t, T - 1)
    k_lo = pid_k * k_per_split
    acc = tl.zeros((BLOCK_E, BLOCK_T), dtype=tl.float32)
    for k in range(k_lo, tl.minimum(k_lo + k_per_split, D), BLOCK_K):
        w = tl.load(w_ptr + rows_e[:, None] * D + k + offs_k[None, :])
        x = tl.load(x_ptr + rows_t[:, None] * D + k + offs_k[None, :])
        acc = _mma(acc, w.to(tl.float32), x, DOT_F32)
    mask = (offs_e < E)[:, None] & (offs_t < T)[None, :]
    tl.store(part_ptr + pid_k * T * E + offs_t[None, :] * E + offs_e[:, None], acc, mask=mask)


@triton.jit
def _route_kernel(part_ptr, bias_ptr, w_ptr, ids_ptr, T, E, topk, route_scale, NUM_SPLITS: tl.constexpr,
                  NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """One token: scores from the split partials (summed in split order), top-k of scores + bias by repeated
    argmax (lowest expert id among exact ties), weights from the raw scores."""
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    z = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):  # unrolled: every split's load is issued before the ordered sum waits
        z += tl.load(part_ptr + s * T * E + t * E + offs, mask=offs < E, other=0.0)
    # softplus = max(z, 0) + log1p(exp(-|z|)); log1p(y) = log(1 + y) * y / ((1 + y) - 1) is accurate to ulps
    y = tl.exp(-tl.abs(z))
    one_y = 1.0 + y
    log1p = tl.where(one_y == 1.0, y, tl.log(one_y) * (y / tl.where(one_y == 1.0, 1.0, one_y - 1.0)))
    score = tl.sqrt_rn(tl.maximum(z, 0.0) + log1p)
    biased = tl.where(offs < E, score + tl.load(bias_ptr + offs, mask=offs < E, other=0.0), float("-inf"))
    slots = tl.arange(0, BLOCK_TOPK)
    sel_w = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    sel_id = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    for i in range(topk):
        best = tl.max(biased, axis=0)
        idx = tl.min(tl.where(biased == best, offs, BLOCK_E), axis=0)
        sel_id = tl.where(slots == i, idx, sel_id)
        sel_w = tl.where(slots == i, tl.sum(tl.where(offs == idx, score, 0.0), axis=0), sel_w)
        biased = tl.where(offs == idx, float("-inf"), biased)
    if NORM:
        sel_w = sel_w / (tl.sum(sel_w, axis=0) + 1e-20)
    tl.store(w_ptr + t * topk + slots, sel_w * route_scale, mask=slots < topk)
    tl.store(ids_ptr + t * topk + slots, sel_id, mask=slots < topk)


def gate_scores(x: Tensor, gate_weight: Tensor) -> Tensor:
    """The router's logits as split-K partials: x bf16 [T, D], gate_weight bf16 [E, D] -> fp32 [splits, T, E]
    (exact bf16 products, fp32 sums; route_scores sums the splits in order). Its own launch so that moe_forward
    can start the shared expert after it (see there)."""
    assert x.dtype == gate_weight.dtype == torch.bfloat16, f"x, gate_weight must be bf16: {x.dtype} {gate_weight.dtype}"
    assert x.dim() == 2 and gate_weight.dim() == 2 and x.size(1) == gate_weight.size(1), (
        f"x {tuple(x.shape)} does not match gate_weight {tuple(gate_weight.shape)}")
    assert x.is_contiguous() and gate_weight.is_contiguous(), "inputs must be contiguous"
    t, d = x.shape
    e = gate_weight.size(0)
    assert d % 32 == 0, f"D = {d} must be a multiple of 32"
    block_e, block_t, block_k = 64, 16, 128 if d % 128 == 0 else 32
    programs = cdiv(e, block_e) * max(1, cdiv(t, block_t))
    split = max(1, min(2 * launch_sms(x.device) // programs, d // (2 * block_k)))
    k_per_split = block_k * cdiv(d // block_k, split)
    part = torch.empty(cdiv(d, k_per_split), t, e, dtype=torch.float32, device=x.device)
    if t:
        _gate_kernel[(cdiv(e, block_e), part.size(0), cdiv(t, block_t))](
            x, gate_weight, part, t, e, d, k_per_split, BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_K=block_k,
            DOT_F32=not x.is_cuda, num_warps=4)
    return part


def route_scores(part: Tensor, bias: Tensor, topk: int, route_scale: float, norm_topk: bool) -> tuple[Tensor, Tensor]:
    """gate_scores' partials fp32 [splits, T, E] and bias fp32 [E] -> (weights fp32 [T, k], ids int32 [T, k]):
    sqrt-softplus, biased top-k, weights from the raw scores (see moe_route)."""
    num_splits, t, e = part.shape
    assert bias.dtype == torch.float32 and bias.is_contiguous(), f"bias must be contiguous fp32, got {bias.dtype}"
    assert 0 < topk <= e and bias.shape == (e,), f"topk {topk}, E {e}, bias {tuple(bias.shape)}"
    weights = torch.empty(t, topk, dtype=torch.float32, device=part.device)
    ids = torch.empty(t, topk, dtype=torch.int32, device=part.device)
    if t:
        _route_kernel[(t,)](part, bias, weights, ids, t, e, topk, float(route_scale), NUM_SPLITS=num_splits,
                            NORM=norm_topk and topk > 1, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_TOPK=triton.next_power_of_2(topk), num_warps=4)
    return weights, ids


def moe_route(x: Tensor, gate_weight: Tensor, bias: Tensor, topk: int, route_scale: float,
              norm_topk: bool) -> tuple[Tensor, Tensor]:
    """sqrt-softplus router: x bf16 [T, D], gate_weight bf16 [E, D], bias fp32 [E] -> (weights fp32 [T, k],
    ids int32 [T, k]). fp32 scores (exact bf16 products, fp32 sums), so ids equal the golden's except where
    two biased scores are within fp32 rounding of each other (then the lower expert id wins)."""
    return route_scores(gate_scores(x, gate_weight), bias, topk, route_scale, norm_topk)


def moe_route_ref(x: Tensor, gate_weight: Tensor, bias: Tensor, topk: int, route_scale: float,
                  norm_topk: bool) -> tuple[Tensor, Tensor]:
    """The golden Gate (sqrtsoftplus, gate_temp 1) in float64: (weights float64 [T, k], ids int64 [T, k])."""
    scores = F.softplus(x.double() @ gate_weight.double().T).sqrt()
    ids = (scores + bias).topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, ids


# --- grouping plan -------------------------------------------------------------------------------------------------

@triton.jit
def _plan_kernel(ids_ptr, sorted_ptr, tile_e_ptr, tile_start_ptr, tile_rows_ptr, R, max_tiles,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program. Stable counting sort of the pairs by expert (pairs with id -1 are dropped), then the tiles:
    expert e owns ceil(count_e / BLOCK_M) consecutive tiles of its sorted rows; tiles past the total get 0 rows."""
    ex = tl.arange(0, BLOCK_E)
    lane = tl.arange(0, BLOCK_R)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        e = tl.load(ids_ptr + r0 + lane, mask=r0 + lane < R, other=-1)
        counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
    seg_start = tl.cumsum(counts, axis=0) - counts
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    cursor = seg_start
    for r0 in range(0, R, BLOCK_R):
        e = tl.load(ids_ptr + r0 + lane, mask=r0 + lane < R, other=-1)
        onehot = e[:, None] == ex[None, :]  # [BR, BE]
        base = tl.sum(tl.where(onehot, cursor[None, :], 0), axis=1)
        rank = tl.sum(((e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, r0 + lane, mask=(r0 + lane < R) & (e >= 0))
        cursor += tl.sum(onehot.to(tl.int32), axis=0)
    for t0 in range(0, max_tiles, BLOCK_R):
        t = t0 + lane
        te = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)  # the expert owning tile t
        valid = t < total
        onehot = te[:, None] == ex[None, :]
        local = t - tl.sum(tl.where(onehot, tile_end - tiles, 0), axis=1)
        start = tl.sum(tl.where(onehot, seg_start, 0), axis=1) + local * BLOCK_M
        rows = tl.minimum(tl.sum(tl.where(onehot, counts, 0), axis=1) - local * BLOCK_M, BLOCK_M)
        ok = t < max_tiles
        tl.store(tile_e_ptr + t, tl.where(valid, te, 0), mask=ok)
        tl.store(tile_start_ptr + t, tl.where(valid, start, 0), mask=ok)
        tl.store(tile_rows_ptr + t, tl.where(valid, rows, 0), mask=ok)


@dataclass(frozen=True, slots=True)
class MoePlan:
    """Pairs p = t * k + j grouped by expert. sorted_pairs[r] is the pair at sorted row r (rows past the
    number of valid pairs are unused); tile i covers sorted rows tile_start[i] .. + tile_rows[i] of expert
    tile_expert[i] (tile_rows 0: an empty tile, its programs exit)."""

    sorted_pairs: Tensor  # int32 [T*k]
    tile_expert: Tensor  # int32 [max_tiles]
    tile_start: Tensor  # int32 [max_tiles]
    tile_rows: Tensor  # int32 [max_tiles]
    block_m: int
    topk: int


def moe_plan(ids: Tensor, num_experts: int, block_m: int) -> MoePlan:
    """ids int32 [T, k] (-1: no expert) -> the grouping of the T*k pairs (one launch, no host sync)."""
    assert ids.dtype == torch.int32 and ids.dim() == 2 and ids.is_contiguous(), f"ids: {ids.dtype} {tuple(ids.shape)}"
    r = ids.numel()
    max_tiles = min(num_experts, r) + r // block_m
    sorted_pairs = torch.zeros(r, dtype=torch.int32, device=ids.device)
    tiles = torch.empty(3, max_tiles, dtype=torch.int32, device=ids.device)
    if max_tiles:
        _plan_kernel[(1,)](ids, sorted_pairs, tiles[0], tiles[1], tiles[2], r, max_tiles, BLOCK_M=block_m,
                           BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_R=32, num_warps=8)
    return MoePlan(sorted_pairs, tiles[0], tiles[1], tiles[2], block_m, ids.size(1))


# --- grouped FP4 expert GEMM --------------------------------------------------------------------------------------

@triton.jit
def _up_epilogue(acc1, acc3, rw, out_ptr, rows, offs_n, mask, N, limit,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, QDQ_OUT: tl.constexpr):
    g, u = round_bf16(acc1), round_bf16(acc3)  # the golden's w1(x), w3(x) are bf16 linears
    h = round_bf16(swiglu(g, u, limit) * rw[None, :])  # [BN, BM]
    if QDQ_OUT:  # act_quant of h per 32 along N: the W2 GEMM's input
        q, s = act_quant_blocks(tl.reshape(tl.trans(h), (BLOCK_M, BLOCK_N // 32, 32)))
        h = tl.trans(tl.reshape(q * s[:, :, None], (BLOCK_M, BLOCK_N)))
    tl.store(out_ptr + rows[None, :] * N + offs_n[:, None], bf16_bits(h), mask=mask)


@triton.jit
def _expert_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, ticket_ptr, pairs_ptr, rw_ptr,
    tile_e_ptr, tile_start_ptr, tile_rows_ptr,
    N, K, R, topk, k_per_split, num_splits, max_tiles, limit,
    UP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_X: tl.constexpr, QDQ_OUT: tl.constexpr, DOT_F32: tl.constexpr, DOT_SCALED: tl.constexpr,
):
    """Program (tile, split, n tile). UP: x = tokens [T, K] (raw with QUANT_X, else act_quant QDQ) gathered by
    pair // topk, weights
    [E, 2N, K/2] (W1 rows then W3 rows), out = h bf16 [R, N] by sorted row. DOWN: x = h [R, K] by sorted row,
    weights [E, N, K/2], out = fp32 [R, N] by pair id."""
    pid_t, pid_k, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_rows = tl.load(tile_rows_ptr + pid_t)
    if n_rows > 0:
        expert = tl.load(tile_e_ptr + pid_t).to(tl.int64)
        lane = tl.arange(0, BLOCK_M)
        rows = tl.load(tile_start_ptr + pid_t) + tl.minimum(lane, n_rows - 1)  # sorted rows (clamped)
        pairs = tl.load(pairs_ptr + rows)
        x_rows = rows
        if UP:
            x_rows = pairs // topk
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_n = tl.minimum(offs_n, N - 1)
        half = tl.arange(0, BLOCK_K // 2)
        n_w = N  # weight rows per expert
        if UP:
            n_w = 2 * N
        w_ptrs = w_ptr + expert * n_w * (K // 2) + rows_n[:, None] * (K // 2) + half[None, :]
        ws_ptrs = ws_ptr + expert * n_w * (K // 32) + rows_n[:, None] * (K // 32) + tl.arange(0, BLOCK_K // 32)[None, :]
        xe_ptrs = x_ptr + x_rows[:, None].to(tl.int64) * K + 2 * half[None, :]
        x_ptrs = x_ptr + x_rows[:, None].to(tl.int64) * K + tl.arange(0, BLOCK_K)[None, :]
        k_lo = pid_k * k_per_split
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
            xe, xo, xn = _x_tile(x_ptrs, xe_ptrs, k, BLOCK_M, BLOCK_K, QUANT_X, DOT_SCALED)
            acc1 = _fp4_dot(acc1, w_ptrs + k // 2, ws_ptrs + k // 32, xe, xo, xn, BLOCK_N, BLOCK_K, DOT_F32, DOT_SCALED)
            if UP:
                acc3 = _fp4_dot(acc3, w_ptrs + N * (K // 2) + k // 2, ws_ptrs + N * (K // 32) + k // 32,
                                xe, xo, xn, BLOCK_N, BLOCK_K, DOT_F32, DOT_SCALED)

        mask = (offs_n < N)[:, None] & (lane < n_rows)[None, :]
        rw = tl.load(rw_ptr + pairs)  # routing weight of each column (UP; DOWN passes any fp32 buffer)
        n_part = n_w
        part = part_ptr + rows[None, :] * n_part + offs_n[:, None]  # [BN, BM] in partials [splits, R, n_part]
        if num_splits > 1:
            tl.store(part + pid_k * R * n_part, acc1, mask=mask)
            if UP:
                tl.store(part + pid_k * R * n_part + N, acc3, mask=mask)
            tl.debug_barrier()  # every thread's partial is issued before the ticket releases it
            ticket = tl.atomic_add(ticket_ptr + pid_n * max_tiles + pid_t, 1, sem="acq_rel")
            if ticket == num_splits - 1:  # the last split of this tile: sum the partials in split order
                tl.debug_barrier()
                acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(num_splits):
                    acc1 += tl.load(part + s * R * n_part, mask=mask, other=0.0, cache_modifier=".cg")
                    if UP:
                        acc3 += tl.load(part + s * R * n_part + N, mask=mask, other=0.0, cache_modifier=".cg")
                if UP:
                    _up_epilogue(acc1, acc3, rw, out_ptr, rows, offs_n, mask, N, limit, BLOCK_N, BLOCK_M, QDQ_OUT)
                else:
                    tl.store(out_ptr + pairs[None, :].to(tl.int64) * N + offs_n[:, None], acc1, mask=mask)
                tl.atomic_xchg(ticket_ptr + pid_n * max_tiles + pid_t, 0)
        else:
            if UP:
                _up_epilogue(acc1, acc3, rw, out_ptr, rows, offs_n, mask, N, limit, BLOCK_N, BLOCK_M, QDQ_OUT)
            else:
                tl.store(out_ptr + pairs[None, :].to(tl.int64) * N + offs_n[:, None], acc1, mask=mask)


@dataclass(frozen=True, slots=True)
class MoeGemmConfig:
    """Launch shape of one expert GEMM. block_k is halved until it divides K; split_k is a request (K per
    split rounded to block_k). dot_scaled: tl.dot_scaled on the packed tile (CUDA only). fuse_quant (up only):
    act-quantise x inside the GEMM (decode) instead of one fp8_act_qdq launch first."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    dot_scaled: bool = False
    fuse_quant: bool = True


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Tokens per tile: 16 while experts average fewer than 24 pairs (decode, and prefill up to ~1.5k tokens
    at 384 experts x top-6), then 32 / 64."""
    avg = num_pairs / max(1, num_experts)
    return 16 if avg < 24 else 32 if avg < 48 else 64


def pick_gemm_config(max_tiles: int, n: int, k: int, block_m: int, num_sms: int = 132) -> MoeGemmConfig:
    """128 weight rows per tile; K split until ~2 waves of programs stream the weights (decode); x quantised
    inside the up GEMM at 16-token tiles (re-quantising 32+ rows per weight tile costs more than a launch)."""
    block_n = 128 if n >= 128 else max(32, triton.next_power_of_2(n) // 2)
    programs = max(1, max_tiles * cdiv(n, block_n))
    split = max(1, min(2 * num_sms // programs, k // 512))
    return MoeGemmConfig(block_n, 128, split, num_warps=8, num_stages=3, fuse_quant=block_m <= 16)


def interpreter_gemm_config(n: int) -> MoeGemmConfig:
    """Launch shape off the GPU (TRITON_INTERPRET=1), where each op of each program costs ~0.1 ms of Python: one
    tile of up to 256 weight rows, K in steps of up to 512, no split, x quantised inside the up GEMM."""
    return MoeGemmConfig(min(256, max(32, triton.next_power_of_2(n))), 512, 1, num_warps=4, num_stages=1)


def _block_k(k: int, want: int) -> int:
    while k % want:
        want //= 2
    assert want >= 32, f"K = {k} needs a multiple of 32"
    return want


def _launch(x: Tensor, w: Tensor, ws: Tensor, out: Tensor, rw: Tensor, plan: MoePlan, n: int, k: int, limit: float,
            up: bool, qdq_out: bool, config: MoeGemmConfig | None) -> None:
    r, max_tiles = plan.sorted_pairs.numel(), plan.tile_rows.numel()
    if max_tiles == 0:
        return
    cfg = config or (pick_gemm_config(max_tiles, n, k, plan.block_m, launch_sms(x.device)) if x.is_cuda
                     else interpreter_gemm_config(n))
    assert n % 32 == 0 and cfg.block_n % 32 == 0, f"N = {n} and block_n = {cfg.block_n} must be multiples of 32"
    assert not (cfg.dot_scaled and not x.is_cuda), "dot_scaled needs CUDA"
    quant_x = up and cfg.fuse_quant
    if up and not quant_x:
        x = fp8_act_qdq(x)
    block_k = _block_k(k, cfg.block_k)
    k_per_split = block_k * cdiv(k // block_k, max(1, cfg.split_k))
    num_splits = cdiv(k, k_per_split)
    n_tiles = cdiv(n, cfg.block_n)
    tickets = split_k_tickets(x.device)
    if num_splits > 1:
        assert n_tiles * max_tiles <= MAX_TICKETS, f"{n_tiles * max_tiles} tiles exceed the split-K tickets"
        part = torch.empty(num_splits, r, (2 if up else 1) * n, dtype=torch.float32, device=x.device)
        assert part.numel() < 2**31, f"int32 offsets: {tuple(part.shape)} partials"
    else:
        part = tickets.view(torch.float32)  # not touched without a split
    _expert_gemm_kernel[(max_tiles, num_splits, n_tiles)](
        x, w, ws.view(torch.uint8), out.view(torch.int16) if up else out, part, tickets, plan.sorted_pairs, rw,
        plan.tile_expert, plan.tile_start, plan.tile_rows,
        n, k, r, plan.topk, k_per_split, num_splits, max_tiles, float(limit),
        UP=up, BLOCK_N=cfg.block_n, BLOCK_M=plan.block_m, BLOCK_K=block_k, QUANT_X=quant_x, QDQ_OUT=qdq_out,
        DOT_F32=not x.is_cuda, DOT_SCALED=cfg.dot_scaled, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@dataclass(slots=True)
class ExpertWeights:
    """The routed experts stacked (the golden modules' buffers are views into these) plus the shared expert's
    FP8 [W1; W3] stacked the same way and its W2 (the module's own buffers)."""

    w13: Tensor  # uint8 [E, 2I, D/2]: rows 0..I-1 = W1, I..2I-1 = W3
    s13: Tensor  # float8_e8m0fnu [E, 2I, D/32]
    w2: Tensor  # uint8 [E, D, I/2]
    s2: Tensor  # float8_e8m0fnu [E, D, I/32]
    shared_w13: Tensor  # float8_e4m3fn [2I, D]
    shared_s13: Tensor  # float8_e8m0fnu [2I/32, D/32]
    shared_w2: Tensor  # float8_e4m3fn [D, I]
    shared_s2: Tensor  # float8_e8m0fnu [D/32, I/32]

    @property
    def inter(self) -> int:
        return self.w13.size(1) // 2


def stack_experts(moe: MoE) -> ExpertWeights:
    """Stack the routed experts' FP4 weights (this rank's: moe.local_experts, renumbered from 0) and the shared
    expert's FP8 W1/W3; every expert module's buffers are replaced by views into the stacks (the weights exist
    once; the golden modules still work)."""
    experts = [moe.experts[e] for e in moe.local_experts]
    first = experts[0]
    assert first.w1.fmt == "fp4", f"routed experts must be FP4, got {first.w1.fmt}"
    assert moe.shared_experts.w1.fmt == "fp8", f"the shared expert must be FP8, got {moe.shared_experts.w1.fmt}"
    inter = first.w1.out_features
    assert inter % 32 == 0, f"moe_inter_dim {inter} must be a multiple of 32"

    e = len(experts)
    dev = first.w1.weight.device
    w13 = torch.empty(e, 2 * inter, first.w1.weight.size(1), dtype=torch.uint8, device=dev)
    s13 = torch.empty(e, 2 * inter, first.w1.scale.size(1), dtype=torch.float8_e8m0fnu, device=dev)
    w2 = torch.empty(e, *first.w2.weight.shape, dtype=torch.uint8, device=dev)
    s2 = torch.empty(e, *first.w2.scale.shape, dtype=torch.float8_e8m0fnu, device=dev)
    for i, ex in enumerate(experts):
        for dst, src in ((w13[i, :inter], ex.w1.weight), (w13[i, inter:], ex.w3.weight), (w2[i], ex.w2.weight),
                         (s13[i, :inter], ex.w1.scale), (s13[i, inter:], ex.w3.scale), (s2[i], ex.w2.scale)):
            dst.view(torch.uint8).copy_(src.view(torch.uint8))
        ex.w1.weight, ex.w3.weight = w13[i, :inter], w13[i, inter:]
        ex.w1.scale, ex.w3.scale = s13[i, :inter], s13[i, inter:]
        ex.w2.weight, ex.w2.scale = w2[i], s2[i]
    for s in (s13, s2):
        assert int(s.view(torch.uint8).max()) <= _MAX_SCALE_CODE, "an E8M0 weight scale above 2^113"
    sh = moe.shared_experts
    shared = stacked_fp8(sh.w1, sh.w3)  # W1|W3 as one matrix: one launch (shared_expert)
    assert shared is not None, "the shared expert's W1 and W3 do not stack"
    return ExpertWeights(w13, s13, w2, s2, shared.weight, shared.scale, sh.w2.weight, sh.w2.scale)


def moe_up(x: Tensor, experts: ExpertWeights, plan: MoePlan, weights: Tensor, limit: float, qdq_out: bool = True,
           config: MoeGemmConfig | None = None) -> Tensor:
    """Routed W1/W3 + SwiGLU: x bf16 [T, D] (act-quantised inside the GEMM or by one fp8_act_qdq launch,
    config.fuse_quant), weights fp32 [T, k] -> h bf16 [T*k, I] by sorted row (plan.sorted_pairs[r] is row r's
    pair), act-quantised (QDQ) when qdq_out. Rows of dropped pairs (id -1) are not written."""
    t, d = x.shape
    inter = experts.inter
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), f"x must be contiguous bf16, got {x.dtype}"
    assert experts.w13.shape[2] * 2 == d, f"x {tuple(x.shape)} does not match w13 {tuple(experts.w13.shape)}"
    assert weights.dtype == torch.float32 and weights.shape == (t, plan.topk) and weights.is_contiguous()
    h = torch.empty(t * plan.topk, inter, dtype=torch.bfloat16, device=x.device)
    _launch(x, experts.w13, experts.s13, h, weights, plan, inter, d, limit, True, qdq_out, config)
    return h


def moe_down(h: Tensor, experts: ExpertWeights, plan: MoePlan, config: MoeGemmConfig | None = None) -> Tensor:
    """Routed W2: h bf16 [T*k, I] by sorted row (QDQ form, as moe_up writes it) -> fp32 [T*k, D] by pair id
    (rows of dropped pairs are not written)."""
    r, inter = h.shape
    d = experts.w2.size(1)
    assert h.dtype == torch.bfloat16 and h.is_contiguous() and inter == experts.inter and r == plan.sorted_pairs.numel()
    out = torch.empty(r, d, dtype=torch.float32, device=h.device)
    _launch(h, experts.w2, experts.s2, out, out, plan, d, inter, 0.0, False, False, config)
    return out


# --- shared expert and the final sum --------------------------------------------------------------------------------

@triton.jit
def _swiglu_kernel(gu_ptr, h_ptr, N, limit, BLOCK: tl.constexpr):
    """gu bf16 [T, 2N] ([gate | up]) -> h = bf16(silu(min(g, L)) clamp(u, -L, L)) bf16 [T, N]."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(gu_ptr + t * 2 * N + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * N + N + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + t * N + offs, bf16_bits(swiglu(g, u, limit)), mask=ok)


def shared_expert(x: Tensor, experts: ExpertWeights, limit: float, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The shared expert on the FP8 kernels: bf16 [T, D] -> bf16 [T, D] (the golden Expert without weight); with
    out_dtype fp32 W2's sum before its rounding (a rank's partial when the expert is split over its features)."""
    t = x.size(0)
    inter = experts.shared_w2.size(1)
    gu = fp8_linear(x, experts.shared_w13, experts.shared_s13)  # [T, 2I]: bf16 w1(x) | bf16 w3(x)
    h = torch.empty(t, inter, dtype=torch.bfloat16, device=x.device)
    if t:
        _swiglu_kernel[(t, cdiv(inter, 1024))](gu, h.view(torch.int16), inter, float(limit), BLOCK=1024, num_warps=4)
    return fp8_linear(h, experts.shared_w2, experts.shared_s2, out_dtype=out_dtype)


@triton.jit
def _combine_kernel(o_ptr, ids_ptr, shared_ptr, y_ptr, T, D, topk, BLOCK: tl.constexpr, PARTIAL: tl.constexpr):
    """y[t] = bf16(Σ_j bf16(o[t*k + j]) + shared[t]) over the slots with id >= 0, in slot order (fp32). PARTIAL
    (a rank's share): y fp32 [2, T, D] = (the slot sum unrounded, the fp32 shared partial copied)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(topk):
        used = tl.load(ids_ptr + t * topk + j) >= 0
        o = tl.load(o_ptr + (t * topk + j).to(tl.int64) * D + offs, mask=ok & used, other=0.0)
        acc += round_bf16(o)  # the golden rounds each expert's W2 output to bf16
    shared = tl.load(shared_ptr + t * D + offs, mask=ok, other=0.0).to(tl.float32)
    if PARTIAL:
        tl.store(y_ptr + t * D + offs, acc, mask=ok)
        tl.store(y_ptr + (T + t) * D + offs, shared, mask=ok)
    else:
        tl.store(y_ptr + t * D + offs, bf16_bits(acc + shared), mask=ok)


@triton.jit
def _finish_kernel(p_ptr, y_ptr, N, BLOCK: tl.constexpr):
    """y = bf16(p[0] + bf16(p[1])) elementwise over N = T * D (p fp32 [2, T, D]: the ranks' summed partials)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    routed = tl.load(p_ptr + offs, mask=ok, other=0.0)
    shared = tl.load(p_ptr + N + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, bf16_bits(routed + round_bf16(shared)), mask=ok)


def moe_finish(parts: Tensor) -> Tensor:
    """The MoE layer's output from its partials summed over the ranks: fp32 [2, T, D] (routed, shared) ->
    bf16 [T, D] = bf16(routed + bf16(shared)), as moe_forward's combine and the golden MoE round them."""
    assert parts.dtype == torch.float32 and parts.dim() == 3 and parts.size(0) == 2 and parts.is_contiguous(), (
        f"parts: {parts.dtype} {tuple(parts.shape)}")
    y = torch.empty(parts.shape[1:], dtype=torch.bfloat16, device=parts.device)
    n = y.numel()
    if n:
        _finish_kernel[(cdiv(n, 1024),)](parts, y.view(torch.int16), n, BLOCK=1024, num_warps=4)
    return y


def moe_finish_ref(parts: Tensor) -> Tensor:
    """moe_finish in torch (the same roundings: round to nearest even)."""
    return (parts[0] + parts[1].to(torch.bfloat16).float()).to(torch.bfloat16)


def local_ids(ids: Tensor, local: range, num_experts: int) -> Tensor:
    """Router ids over all num_experts -> this rank's expert ids (id - local.start) or -1 for another rank's (the
    identity when the rank holds every expert)."""
    if len(local) == num_experts:
        return ids
    return torch.where((ids >= local.start) & (ids < local.stop), ids - local.start, -1).to(ids.dtype)


def routed_fp4(x: Tensor, ids: Tensor, weights: Tensor, experts: ExpertWeights, limit: float,
               once_per_token: bool, block: int | None = None) -> Tensor:
    """The routed experts on the CUDA FP4 GEMVs (engine/kernels/moe_fp4.py): the plan with x's act_quant in one
    launch, then up and down -> fp32 [T*k, D] by pair. block: pairs per tile (default fp4_tile_pairs);
    once_per_token: no token names an expert twice (the router's ids), so a tile holds at most T pairs."""
    e = experts.w13.size(0)
    block = block or fp4_tile_pairs(ids.numel(), e)
    sorted_pairs, tiles, xq, xs = plan_and_quant(x, ids, e, block)
    plan = MoePlan(sorted_pairs, tiles[0], tiles[1], tiles[2], block, ids.size(1))
    rows = min(block, x.size(0)) if once_per_token else None
    hq, hs, _ = moe_up_fp4(xq, xs, experts, plan, weights, limit, max_tile_rows=rows)
    return moe_down_fp4(hq, hs, experts, plan, max_tile_rows=rows)


def moe_forward(x: Tensor, moe: MoE, experts: ExpertWeights, ids: Tensor | None = None,
                weights: Tensor | None = None, partial: bool = False, is_image: Tensor | None = None) -> Tensor:
    """The MoE layer on the kernels: x bf16 [T, D] -> bf16 [T, D]. ids int32 / weights fp32 [T, k] override
    the router (tests; global expert ids, -1 drops a slot). partial: this rank's share of an expert- and
    tensor-parallel layer, fp32 [2, T, D] unrounded (module docstring; sum over the ranks, then moe_finish).
    is_image bool [T]: image-span tokens, which select their experts with the gate's bias_vl (spec 4.5)."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), f"x: {x.dtype} {tuple(x.shape)}"
    gate = moe.gate
    assert gate.score_func == "sqrtsoftplus" and gate.temp == 1.0, f"router {gate.score_func} / {gate.temp}"
    t, d = x.shape
    on_cuda_path = fp4_applies(x, experts)  # decode and prefill chunks up to FP4_MAX_TOKENS
    routed = ids is None
    shared_dtype = torch.float32 if partial else torch.bfloat16
    if on_cuda_path:  # the shared expert (three small launches) runs on a side stream, beside the gate, the router and
        # the expert GEMVs. Its GEMVs take narrow grids (72 / 40 CTAs), so the gate's grid finds free SMs: forked
        # here every layer is ~4 us faster at T = 1 than forked after the gate (H200, RESULTS.md, eighth pass).
        shared = fork("shared_expert", x.device,
                      lambda: shared_expert(x, experts, moe.shared_experts.limit, shared_dtype))
    part = gate_scores(x, gate.weight) if routed else None
    if routed:  # on the CUDA path the CUDA route (one CTA per token), else the Triton one
        route = route_cuda if on_cuda_path else route_scores
        weights, ids = route(part, gate.bias, gate.topk, gate.route_scale, gate.norm_topk)
        if is_image is not None:  # each token's route is its own: route again with bias_vl, keep per token
            w_vl, ids_vl = route(part, gate.bias_vl, gate.topk, gate.route_scale, gate.norm_topk)
            weights = torch.where(is_image[:, None], w_vl, weights)
            ids = torch.where(is_image[:, None], ids_vl, ids)
    ids = local_ids(ids, moe.local_experts, gate.weight.size(0))  # expert-parallel: other ranks' pairs dropped
    limit = moe.experts[moe.local_experts[0]].limit
    if grouped_applies(x, ids.numel(), gate.weight.size(0)):  # many pairs an expert: bf16 copies + grouped GEMM
        o = routed_grouped(x, ids, weights, experts, limit)
    elif on_cuda_path:  # the FP4 GEMVs of cuda/moe_fp4.cu
        o = routed_fp4(x, ids, weights, experts, limit, once_per_token=routed)
    else:
        plan = moe_plan(ids, experts.w13.size(0), pick_block_m(ids.numel(), experts.w13.size(0)))
        o = moe_down(moe_up(x, experts, plan, weights, limit), experts, plan)
    if on_cuda_path:
        shared = shared.join()
    else:
        shared = shared_expert(x, experts, moe.shared_experts.limit, shared_dtype)
    y = torch.empty(2, t, d, dtype=torch.float32, device=x.device) if partial else torch.empty_like(x)
    if t:
        _combine_kernel[(t, cdiv(d, 1024))](o, ids, shared, y if partial else y.view(torch.int16), t, d, ids.size(1),
                                             BLOCK=1024, PARTIAL=partial, num_warps=4)
    return y


# --- references (the golden model's math) ---------------------------------------------------------------------------

def moe_up_ref(x: Tensor, experts: ExpertWeights, weights: Tensor, ids: Tensor, limit: float,
               qdq_out: bool = True) -> Tensor:
    """Golden Expert up half per pair: bf16 [T*k, I] by pair id (zeros for id -1): bf16 linears W1, W3 (exact
    products rounded once to fp32, then bf16), SwiGLU with the clamps and the weight in float64, bf16,
    then act_quant QDQ when qdq_out."""
    t, k = ids.shape
    inter = experts.inter
    a = act_dequant(*act_quant(x), BLOCK)  # [T, D] fp32, exact
    h = torch.zeros(t * k, inter, dtype=torch.bfloat16, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slot = torch.where(ids == e)
        w = dequant_fp4_weight(experts.w13[e], experts.s13[e])  # [2I, D]
        gu = exact_matmul(a[rows], w.T).to(torch.bfloat16).double()
        g, u = gu[:, :inter], gu[:, inter:]
        if limit > 0:
            u, g = u.clamp(-limit, limit), g.clamp(max=limit)
        h[rows * k + slot] = (weights[rows, slot, None].double() * (F.silu(g) * u)).to(torch.bfloat16)
    return act_quant_qdq(h) if qdq_out else h


def moe_down_ref(h: Tensor, experts: ExpertWeights, ids: Tensor) -> Tensor:
    """Golden W2 per pair: h bf16 [T*k, I] by pair id -> fp32 [T*k, D] (the exact product rounded once to
    fp32; the golden then rounds to bf16). Rows of id -1 are zero."""
    flat = ids.reshape(-1)
    a = act_dequant(*act_quant(h), BLOCK)
    out = torch.zeros(h.size(0), experts.w2.size(1), dtype=torch.float32, device=h.device)
    for e in torch.unique(flat[flat >= 0]).tolist():
        rows = torch.where(flat == e)[0]
        out[rows] = exact_matmul(a[rows], dequant_fp4_weight(experts.w2[e], experts.s2[e]).T)
    return out


def moe_forward_ref(x: Tensor, moe: MoE) -> Tensor:
    """The golden MoE forward: bf16 [T, D] -> bf16 [T, D]."""
    return moe(x)
