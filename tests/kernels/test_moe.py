"""Routed-expert MoE kernels (engine.kernels.moe) against the golden model's math.

Tolerances (per element; ULP = bf16 unit in the last place of the reference value):
- router: ids equal to the golden's (inputs are drawn with no near-ties: adjacent biased scores among the
  top k + 1 at least TIE_GAP apart; at the real shapes tokens with closer scores are excluded and counted);
  weights within 2^-16 relative (fp32 scores and normalisation vs float64).
- plan: bitwise (the stable order of the valid pairs and an exact tile cover).
- up (h = bf16(w silu(min(g, L)) clamp(u, ±L))): the kernel's g, u are bf16 of fp32 sums, so either may
  be the neighbouring bf16 of the golden's (fp32 summation order); h must lie within 1 ULP of the interval
  spanned by the float64 SwiGLU at g +- (1 ULP + eps S), u +- (1 ULP + eps S) (g, u the golden pre-activations,
  S = Σ|a||w| of each, eps as for down: the summation order matters where the sum cancels). With an
  exact problem (integer activations, one weight scale: every fp32 sum is exact) g and u are the golden's
  and h is within 1 ULP of the golden's h (fp32 vs float64 SwiGLU), at least 95% bitwise. The fused QDQ
  output is bitwise act_quant_qdq of the plain output.
- down (fp32): |o - ref| <= eps * S, S = Σ_i |A(h)_i| |W2_i|, eps 2^-16 on the CPU (numpy fp32 sums), 2^-14
  on the GPU (bf16 MMA, fp32 accumulation); bitwise on the exact problem.
- moe_forward (bf16) vs the golden MoE: |y - ref| <= 1 ULP + 2^-7 (Σ_j |o_j| + |shared|) + 2^-8 S_t, where
  o_j are the golden's expert outputs and S_t sums Σ_i |A(h)_i| |W2_i| over the token's routed and shared
  experts (each term may round to the neighbouring bf16; an h element 1 ULP off moves o by <= 2^-8 of its
  share of S); and at least 90% of the elements bitwise equal.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.kernels.fp8_linear import split_k_tickets
from engine.kernels.moe import (MoeGemmConfig, gate_scores, moe_down, moe_forward, moe_forward_ref, moe_plan, moe_route,
                                moe_route_ref, moe_up, moe_up_ref, pick_block_m, pick_gemm_config, route_scores,
                                stack_experts)
from engine.kernels.moe_fp4 import (FP4_MAX_TOKENS, MAX_TILE_PAIRS, Fp4Params, dequant_rows, moe_down_fp4,
                                    moe_up_fp4, pick_params, plan_and_quant, quant_rows, route_cuda)
from engine.model.moe import MoE
from engine.presets import tiny_config
from engine.quant import act_quant_qdq
from tests.kernels.moe_checks import (CPU_EPS, GPU_EPS, LIMIT, TIE_GAP, assert_down_close, assert_forward_close,
                                      assert_up_close, draw_tokens, fail_worst, fill_moe, forward_bound, gpu_tokens,
                                      route, router_gaps, tiny_moe)
from tests.kernels.numeric import bf16_ulp

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- problems ------------------------------------------------------------------------------------------------------

def _unsort(h: torch.Tensor, plan) -> torch.Tensor:
    """Rows by sorted position -> rows by pair id (all pairs valid)."""
    return h[torch.argsort(plan.sorted_pairs.long())]




# --- router --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 3, 17])
def test_route_matches_golden(t):
    moe, _ = tiny_moe(seed=t)
    x = draw_tokens(t, moe, seed=100 + t)
    w, ids = route(x, moe)
    g = moe.gate
    w_ref, ids_ref = moe_route_ref(x, g.weight, g.bias, g.topk, g.route_scale, g.norm_topk)
    gw, gids = g(x)  # the golden module itself
    assert torch.equal(ids_ref, gids) and torch.equal(w_ref, gw), "moe_route_ref is not the golden Gate"
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref), f"ids {ids.tolist()} != golden {ids_ref.tolist()}"
    rel = ((w.double() - w_ref) / w_ref).abs().max().item()
    assert rel <= 2.0**-16, f"weights relative error {rel:.3g}"


def test_route_without_normalisation_and_empty():
    moe, _ = tiny_moe(seed=4)
    x = draw_tokens(5, moe, seed=5)
    g = moe.gate
    w, ids = moe_route(x, g.weight, g.bias, 3, 2.5, False)
    w_ref, ids_ref = moe_route_ref(x, g.weight, g.bias, 3, 2.5, False)
    assert torch.equal(ids.long(), ids_ref)
    assert ((w.double() - w_ref) / w_ref).abs().max().item() <= 2.0**-16
    w0, ids0 = moe_route(x[:0], g.weight, g.bias, 3, 2.5, False)
    assert w0.shape == ids0.shape == (0, 3)


# --- plan ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_m", [16, 32])
def test_plan_groups_pairs_stably(block_m):
    g = torch.Generator().manual_seed(7)
    e, k = 40, 3
    ids = torch.randint(0, 6, (37, k), generator=g, dtype=torch.int32)  # experts 6..39 get no tokens
    ids[:20, 0] = 2  # one expert with more than a tile of pairs
    ids[3] = -1  # a padding token: all slots dropped
    ids[5, 1] = -1
    plan = moe_plan(ids, e, block_m)
    flat = ids.view(-1).long()
    valid = torch.where(flat >= 0)[0]
    expect = valid[torch.sort(flat[valid], stable=True).indices]
    n = valid.numel()
    assert torch.equal(plan.sorted_pairs[:n].long(), expect), "pairs are not in stable expert order"
    covered = []
    for te, start, rows in zip(plan.tile_expert.tolist(), plan.tile_start.tolist(), plan.tile_rows.tolist()):
        if rows:
            assert 0 < rows <= block_m
            seg = plan.sorted_pairs[start:start + rows].long()
            assert bool((flat[seg] == te).all()), f"tile of expert {te} holds other pairs"
            covered.extend(range(start, start + rows))
    assert sorted(covered) == list(range(n)), "tiles do not cover every valid sorted row exactly once"
    assert plan.tile_rows.numel() == min(e, ids.numel()) + ids.numel() // block_m


# --- up / down -----------------------------------------------------------------------------------------------------

# the automatic configs (no split, 128-row tiles; x quantised in the up GEMM at block_m 16, before it at 32)
# and small tiles with K splits
CPU_CASES = [(1, 16, None), (3, 16, MoeGemmConfig(64, 128, 2, 4, 2, fuse_quant=False)),
             (5, 16, MoeGemmConfig(32, 32, 3, 4, 2)), (17, 32, None)]  # (T, block_m, config)
CASE_IDS = ["T1-auto", "T3-bn64-split2-prequant", "T5-bn32-bk32-split3", "T17-bm32-auto"]






@pytest.mark.parametrize("t,block_m,cfg", CPU_CASES, ids=CASE_IDS)
def test_up_and_down_match_golden(t, block_m, cfg):
    moe, ex = tiny_moe(seed=t)
    x = draw_tokens(t, moe, seed=t)
    w, ids = route(x, moe)
    plan = moe_plan(ids, ex.w13.size(0), block_m)
    h = moe_up(x, ex, plan, w, LIMIT, qdq_out=False, config=cfg)
    assert_up_close(_unsort(h, plan), x, ex, w, ids, f"up T={t} {cfg}", min_bitwise=0.9)
    hq = moe_up(x, ex, plan, w, LIMIT, qdq_out=True, config=cfg)
    assert torch.equal(hq.view(torch.int16), act_quant_qdq(h).view(torch.int16)), "fused QDQ is not act_quant_qdq"
    o = moe_down(hq, ex, plan, config=cfg)
    assert o.dtype == torch.float32 and o.shape == (t * ids.size(1), moe.gate.weight.size(1))
    assert_down_close(o, _unsort(hq, plan), ex, ids, CPU_EPS, f"down T={t} {cfg}")
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"


@pytest.mark.usefixtures("one_torch_thread")
def test_up_exact_problem():
    moe, ex = tiny_moe(seed=2, exact=True)
    x = draw_tokens(9, moe, seed=3, exact=True)
    assert torch.equal(act_quant_qdq(x), x), "the exact problem's activations must survive act_quant"
    w, ids = route(x, moe)
    plan = moe_plan(ids, ex.w13.size(0), 16)
    h = moe_up(x, ex, plan, w, LIMIT, qdq_out=False, config=MoeGemmConfig(32, 64, 2, 4, 2))
    ref = moe_up_ref(x, ex, w, ids, LIMIT, qdq_out=False)
    hu = _unsort(h, plan)
    err = (hu.double() - ref.double()).abs()
    fail_worst(err > bf16_ulp(ref), err, bf16_ulp(ref), hu.double(), ref.double(), "exact up")
    assert (hu == ref).double().mean().item() >= 0.95






def test_down_exact_problem_with_dropped_slots():
    """Integer h, one weight scale: fp32 sums are exact, so the kernel is bitwise the golden; -1 slots
    and experts without tokens included; one expert shared by all tokens (more pairs than a tile)."""
    moe, ex = tiny_moe(seed=5, exact=True)
    g = torch.Generator().manual_seed(6)
    t, k = 19, 2
    ids = torch.stack([torch.full((t,), 3), torch.randint(5, 8, (t,), generator=g)], 1).to(torch.int32)
    ids[4, 1] = -1
    ids[11] = -1
    h_by_pair = torch.randint(-8, 9, (t * k, ex.inter), generator=g).float()
    h_by_pair[:, ::32] = 8
    h_by_pair = h_by_pair.bfloat16()
    plan = moe_plan(ids.contiguous(), ex.w13.size(0), 16)
    h_sorted = h_by_pair[plan.sorted_pairs.long()].contiguous()  # rows past the valid pairs: unused
    for cfg in (None, MoeGemmConfig(64, 64, 2, 4, 2)):
        o = moe_down(h_sorted, ex, plan, config=cfg)
        assert_down_close(o, h_by_pair, ex, ids, 0.0, f"exact down {cfg}", exact=True)


# --- stacking and the whole layer ----------------------------------------------------------------------------------

def test_stack_experts_replaces_buffers_with_views():
    moe = fill_moe(MoE(tiny_config(), 0), seed=8)
    x = draw_tokens(6, moe, seed=9)
    before = moe_forward_ref(x, moe)
    e3, sh = moe.experts[3], moe.shared_experts
    originals = [e3.w2.weight.clone(), e3.w1.scale.clone(), sh.w3.weight.clone()]
    ex = stack_experts(moe)
    after = moe_forward_ref(x, moe)
    assert torch.equal(before.view(torch.int16), after.view(torch.int16)), "stacking changed the golden output"
    assert torch.equal(e3.w2.weight, originals[0])
    assert torch.equal(e3.w1.scale.view(torch.uint8), originals[1].view(torch.uint8))
    assert torch.equal(sh.w3.weight.view(torch.uint8), originals[2].view(torch.uint8))
    for view, base in ((e3.w1.weight, ex.w13), (e3.w3.weight, ex.w13), (e3.w2.weight, ex.w2), (e3.w2.scale, ex.s2),
                       (e3.w3.scale, ex.s13), (sh.w1.weight, ex.shared_w13),
                       (sh.w3.scale, ex.shared_s13)):
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), "not a view of the stack"
    assert e3.w3.weight.data_ptr() == ex.w13[3, ex.inter:].data_ptr()
    assert e3.w1.weight.dtype == torch.uint8 and e3.w1.scale.dtype == torch.float8_e8m0fnu






@pytest.mark.parametrize("t", [1, 3, 17])
def test_moe_forward_matches_golden(t):
    moe, ex = tiny_moe(seed=10 + t)
    x = draw_tokens(t, moe, seed=30 + t)
    y = moe_forward(x, moe, ex)
    ref = moe_forward_ref(x, moe)
    assert_forward_close(y, ref, forward_bound(x, moe, ex, ref), f"moe_forward T={t}")
    assert torch.equal(y, moe_forward(x, moe, ex)), "not deterministic"


def test_moe_forward_repeated_experts_and_dropped_slots():
    """Given routing: every token shares expert 6, expert 0-2 get no tokens, a token with both slots -1 gets
    only the shared expert, another drops one slot."""
    moe, ex = tiny_moe(seed=12)
    x = draw_tokens(7, moe, seed=13)
    ids = torch.tensor([[6, 3], [6, 4], [5, 6], [6, 7], [-1, -1], [6, -1], [3, 6]], dtype=torch.int32)
    weights = torch.rand(7, 2, generator=torch.Generator().manual_seed(1)) + 0.2
    y = moe_forward(x, moe, ex, ids=ids, weights=weights)
    ref = torch.zeros(7, x.size(1), dtype=torch.float64)
    for tok in range(7):
        for j in range(2):
            e = int(ids[tok, j])
            if e >= 0:
                ref[tok] += moe.experts[e](x[tok:tok + 1], weights[tok:tok + 1, j:j + 1].double()).double()[0]
    ref = (ref + moe.shared_experts(x).double()).bfloat16()
    err = (y.double() - ref.double()).abs()
    fail_worst(~(err <= 2 * bf16_ulp(ref)), err, 2 * bf16_ulp(ref), y.double(), ref.double(), "given routing")
    assert (y == ref).double().mean().item() >= 0.9
    assert moe_forward(x[:0], moe, ex).shape == (0, x.size(1))


def test_contract_is_asserted():
    moe, ex = tiny_moe(seed=14)
    x = draw_tokens(2, moe, seed=15)
    g = moe.gate
    with pytest.raises(AssertionError, match="bf16"):
        moe_route(x.float(), g.weight, g.bias, 2, 1.5, True)
    with pytest.raises(AssertionError, match="bias"):
        moe_route(x, g.weight, g.bias.double(), 2, 1.5, True)
    with pytest.raises(AssertionError, match="ids"):
        moe_plan(torch.zeros(2, 2, dtype=torch.int64), 8, 16)
    with pytest.raises(AssertionError, match="does not match"):
        moe_up(x[:, :128].contiguous(), ex, moe_plan(torch.zeros(2, 2, dtype=torch.int32), 8, 16),
               torch.ones(2, 2), LIMIT)


# --- GPU: real shapes ------------------------------------------------------------------------------------------------





@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 6, 64, 512])
def test_route_real_shapes_gpu(full_moe, t):
    moe, _ = full_moe
    x = gpu_tokens(t, t)
    w, ids = route(x, moe)
    g = moe.gate
    w_ref, ids_ref = moe_route_ref(x, g.weight, g.bias, g.topk, g.route_scale, g.norm_topk)
    clear = router_gaps(x, moe) > TIE_GAP  # tokens without near-ties
    # 384 experts: a gap < TIE_GAP at the 6th/7th boundary is common (1 token in 6 on the H200 run)
    assert clear.sum().item() >= max(1, t // 2), "too many near-ties to test"
    assert torch.equal(ids.long()[clear], ids_ref[clear]), "ids differ from the golden"
    same = (ids.long() == ids_ref).all(1)
    rel = ((w.double() - w_ref) / w_ref).abs()[same].max().item()
    assert rel <= 2.0**-16, f"weights relative error {rel:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 6, 64])
@pytest.mark.parametrize("norm", [True, False])
def test_route_cuda_matches_triton_and_golden_gpu(full_moe, t, norm):
    """moe_fp4.route_cuda (the decode router) against the Triton route on the same gate partials and against the
    golden: the same ids wherever the golden has no near-tie, weights within 2^-16 of the golden's."""
    moe, _ = full_moe
    x = gpu_tokens(t, 200 + t)
    g = moe.gate
    part = gate_scores(x, g.weight)
    w, ids = route_cuda(part, g.bias, g.topk, g.route_scale, norm)
    w_tri, ids_tri = route_scores(part, g.bias, g.topk, g.route_scale, norm)
    w_ref, ids_ref = moe_route_ref(x, g.weight, g.bias, g.topk, g.route_scale, norm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (t, g.topk)
    clear = router_gaps(x, moe) > TIE_GAP
    assert clear.sum().item() >= max(1, t // 2), "too many near-ties to test"
    assert torch.equal(ids[clear], ids_tri[clear]) and torch.equal(ids.long()[clear], ids_ref[clear])
    same = (ids.long() == ids_ref).all(1)
    rel = ((w.double() - w_ref) / w_ref).abs()[same].max().item()
    assert rel <= 2.0**-16, f"weights relative error {rel:.3g}"
    assert ((w - w_tri).abs() <= 2.0**-20 * w_tri.abs())[same].all(), "weights differ from the Triton route's"


@gpu
@needs_cuda
def test_route_cuda_tiny_and_ties_gpu():
    """Tiny router (8 experts, top-2) and exact ties: equal biased scores pick the lowest expert id, as the Triton
    route does."""
    moe, _ = tiny_moe(seed=21)
    g = moe.gate
    x = draw_tokens(5, moe, seed=22).cuda()
    part = gate_scores(x, g.weight.cuda())
    bias = g.bias.cuda()
    w, ids = route_cuda(part, bias, g.topk, g.route_scale, g.norm_topk)
    w_tri, ids_tri = route_scores(part, bias, g.topk, g.route_scale, g.norm_topk)
    assert torch.equal(ids, ids_tri) and torch.allclose(w, w_tri, rtol=2.0**-20, atol=0)
    tied = torch.zeros(1, 1, 8, device="cuda")  # one split, one token: every score sqrt(softplus(0)), no bias
    w, ids = route_cuda(tied, torch.zeros(8, device="cuda"), 3, 1.0, True)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(w, torch.full((1, 3), 1 / 3, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(23)  # 1000 experts: 32 warps, the last one partly empty
    part = torch.randn(21, 3, 1000, device="cuda", generator=gen)
    bias = torch.randn(1000, device="cuda", generator=gen) * 0.1
    for k in (1, 6, 32):
        w, ids = route_cuda(part, bias, k, 2.5, True)
        w_tri, ids_tri = route_scores(part, bias, k, 2.5, True)
        assert torch.equal(ids, ids_tri) and torch.allclose(w, w_tri, rtol=2.0**-20, atol=0), f"E = 1000, k = {k}"


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 6, 64, 512, 2048])  # 2048: 32-token tiles, x pre-quantised
@pytest.mark.parametrize("dot_scaled", [False, True])
def test_experts_real_shapes_gpu(full_moe, t, dot_scaled):
    moe, ex = full_moe
    x = gpu_tokens(t, 100 + t)
    w, ids = route(x, moe)
    e = ex.w13.size(0)
    plan = moe_plan(ids, e, pick_block_m(ids.numel(), e))
    up_cfg = pick_gemm_config(plan.tile_rows.numel(), ex.inter, x.size(1), plan.block_m)
    down_cfg = pick_gemm_config(plan.tile_rows.numel(), x.size(1), ex.inter, plan.block_m)
    if dot_scaled:
        up_cfg, down_cfg = replace(up_cfg, dot_scaled=True), replace(down_cfg, dot_scaled=True)
    what = f"T={t} block_m={plan.block_m} {up_cfg} / {down_cfg}"
    h = moe_up(x, ex, plan, w, LIMIT, qdq_out=False, config=up_cfg)
    assert_up_close(_unsort(h, plan), x, ex, w, ids, f"up {what}", min_bitwise=0.9)
    hq = moe_up(x, ex, plan, w, LIMIT, config=up_cfg)
    assert torch.equal(hq.view(torch.int16), act_quant_qdq(h).view(torch.int16)), "fused QDQ is not act_quant_qdq"
    o = moe_down(hq, ex, plan, config=down_cfg)
    assert_down_close(o, _unsort(hq, plan), ex, ids, GPU_EPS, f"down {what}")
    again = moe_down(moe_up(x, ex, plan, w, LIMIT, config=up_cfg), ex, plan, config=down_cfg)
    assert torch.equal(o, again), "not deterministic"
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 6, 64, 256, 4096])  # from 256: prefill chunks
def test_moe_forward_real_shapes_gpu(full_moe, t):
    moe, ex = full_moe
    x = gpu_tokens(t, 200 + t)
    y = moe_forward(x, moe, ex)
    ref = moe_forward_ref(x, moe)
    clear = router_gaps(x, moe) > TIE_GAP
    assert_forward_close(y, ref, forward_bound(x, moe, ex, ref), f"moe_forward T={t}", rows=clear)
    assert torch.equal(y, moe_forward(x, moe, ex)), "not deterministic"


# --- GPU: the CUDA FP4 GEMVs (engine.kernels.moe_fp4), same tolerances as the Triton GEMMs ---------------------------

FP4_PARAMS = [None, Fp4Params(2, 2, 1, 4), Fp4Params(2, 1, 3, 3), Fp4Params(4, 2, 2, 8),
              Fp4Params(2, 4, 8, 6, pdl=False)]


def _check_fp4_experts(x, moe, ex, w, ids, params, what, max_tile_rows=None, min_bitwise=0.9, block_m=8):
    plan = moe_plan(ids, ex.w13.size(0), block_m)
    xq, xs = quant_rows(x)
    assert torch.equal(dequant_rows(xq, xs), act_quant_qdq(x).float()), "quant_rows is not act_quant"
    hq, hs, h = moe_up_fp4(xq, xs, ex, plan, w, LIMIT, want_h=True, max_tile_rows=max_tile_rows, params=params)
    valid = plan.sorted_pairs.numel() if bool((ids >= 0).all()) else int((ids >= 0).sum())
    h_valid, hqd = h[:valid], dequant_rows(hq, hs)[:valid]
    assert torch.equal(hqd, act_quant_qdq(h_valid).float()), f"{what}: h codes are not act_quant of h"
    by_pair = torch.zeros(ids.numel(), ex.inter, dtype=torch.bfloat16, device=x.device)
    by_pair[plan.sorted_pairs[:valid].long()] = h_valid
    assert_up_close(by_pair, x, ex, w, ids, f"up {what}", min_bitwise=min_bitwise)
    by_pair[plan.sorted_pairs[:valid].long()] = hqd.bfloat16()
    o = moe_down_fp4(hq, hs, ex, plan, max_tile_rows=max_tile_rows, params=params)
    return o, by_pair, plan, (xq, xs)


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 6, 8, 64])
@pytest.mark.parametrize("params", FP4_PARAMS, ids=str)
def test_fp4_experts_real_shapes_gpu(full_moe, t, params):
    moe, ex = full_moe
    x = gpu_tokens(t, 300 + t)
    w, ids = route(x, moe)
    what = f"fp4 T={t} {params}"
    o, by_pair, plan, (xq, xs) = _check_fp4_experts(x, moe, ex, w, ids, params, what, max_tile_rows=min(8, t))
    assert_down_close(o, by_pair, ex, ids, GPU_EPS, f"down {what}")
    hq, hs, _ = moe_up_fp4(xq, xs, ex, plan, w, LIMIT, params=params)
    assert torch.equal(o, moe_down_fp4(hq, hs, ex, plan, params=params)), "not deterministic"


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [256, 2048, FP4_MAX_TOKENS])
def test_fp4_experts_at_prefill_chunk_sizes_gpu(full_moe, t):
    """A prefill chunk's tokens on the CUDA GEMVs (moe_forward takes them up to FP4_MAX_TOKENS): experts with more
    pairs than a tile of 8, several tiles each."""
    moe, ex = full_moe
    x = gpu_tokens(t, 400 + t)
    w, ids = route(x, moe)
    o, by_pair, _, _ = _check_fp4_experts(x, moe, ex, w, ids, None, f"fp4 T={t}", max_tile_rows=8)
    assert_down_close(o, by_pair, ex, ids, GPU_EPS, f"down fp4 T={t}")


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [512, 2048])
def test_fp4_wide_tiles_equal_tiles_of_8_gpu(full_moe, t):
    """Tiles of 16 and 32 pairs (a weight fragment converted once for 2 or 4 MMAs) give what tiles of 8 give, bit
    for bit, at one launch shape: h, its codes and scales by sorted row (the stable sort does not depend on the
    tile size), o by pair. The shape is the one pick_params gives tiles of 32 (more K splits, which fit every
    width): pick_params' own shapes differ by width, and a different split of K sums in a different order."""
    moe, ex = full_moe
    x = gpu_tokens(t, 500 + t)
    w, ids = route(x, moe)
    xq, xs = quant_rows(x)
    e, d = ex.w13.size(0), x.size(1)
    up_p = pick_params(True, ex.inter, d, 1, MAX_TILE_PAIRS)
    down_p = pick_params(False, d, ex.inter, 1, MAX_TILE_PAIRS)

    def run(block_m):
        plan = moe_plan(ids, e, block_m)
        rows = min(block_m, t)
        hq, hs, h = moe_up_fp4(xq, xs, ex, plan, w, LIMIT, want_h=True, max_tile_rows=rows, params=up_p)
        return plan.sorted_pairs, hq, hs, h, moe_down_fp4(hq, hs, ex, plan, max_tile_rows=rows, params=down_p)

    ref = run(8)
    for block_m in (16, 32):
        got = run(block_m)
        for name, a, b in zip(("sorted pairs", "h codes", "h scales", "h", "o"), got, ref):
            assert torch.equal(a, b), f"T={t}: tiles of {block_m} pairs: {name} differ from tiles of 8"


@gpu
@needs_cuda
@pytest.mark.parametrize("params,block_m", [(p, 8) for p in FP4_PARAMS[:4]] + [(None, 16), (None, 32)], ids=str)
def test_fp4_exact_problem_with_repeats_and_dropped_slots_gpu(params, block_m):
    """Integer activations and one weight scale (every fp32 sum exact): g, u are the golden's; h within 1 ULP
    (fp32 vs float64 SwiGLU); down bitwise. Ids name one expert twice for a token, drop slots, and give
    expert 3 every token (three tiles of 8, two of 16, one of 32)."""
    moe = fill_moe(MoE(tiny_config(), 0), 5, exact=True).cuda()
    ex = stack_experts(moe)
    x = draw_tokens(19, moe, seed=7, exact=True)
    g = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.full((19,), 3), torch.randint(5, 8, (19,), generator=g)], 1).to(torch.int32)
    ids[2, 1] = 3  # token 2 names expert 3 twice
    ids[4, 1] = -1
    ids[11] = -1
    ids, w = ids.cuda().contiguous(), (torch.rand(19, 2, generator=g) + 0.1).cuda()
    what = f"exact {params} block_m={block_m}"
    o, by_pair, _, _ = _check_fp4_experts(x, moe, ex, w, ids, params, what, min_bitwise=0.95, block_m=block_m)
    assert_down_close(o, by_pair, ex, ids, 0.0, f"down {what}", exact=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("t,k,e,block_m", [(1, 6, 384, 8), (8, 6, 384, 8), (64, 6, 384, 8), (19, 2, 8, 8),
                                           (5, 3, 4, 2), (40, 6, 384, 16), (0, 6, 384, 8), (300, 2, 8, 8),
                                           (512, 6, 384, 8), (2048, 6, 384, 8), (300, 2, 8, 32),
                                           (2048, 6, 384, 32)])  # from 300: pairs in many chunks
def test_plan_and_quant_is_moe_plan_and_quant_rows_gpu(t, k, e, block_m):
    """The fused CUDA plan + activation quantisation equals the Triton moe_plan and quant_rows bit for bit
    (router-like ids, repeated experts within a token, dropped slots, experts with more pairs than a tile)."""
    g = torch.Generator(device="cuda").manual_seed(t * 31 + e)
    ids = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices.to(torch.int32)
    if t > 3:
        ids[1, 0] = ids[1, 1]  # one expert twice for a token
        ids[2] = -1
        ids[3, k - 1] = -1
    if t >= 19:
        ids[:, 0] = 3 % e  # expert 3 gets every token: several tiles
    ids = ids.contiguous()
    x = torch.randn(t, 256, generator=g, device="cuda").bfloat16()
    sorted_pairs, tiles, xq, xs = plan_and_quant(x, ids, e, block_m)
    ref = moe_plan(ids, e, block_m)
    assert torch.equal(sorted_pairs, ref.sorted_pairs), "sorted pairs differ from moe_plan"
    assert torch.equal(tiles[0], ref.tile_expert) and torch.equal(tiles[1], ref.tile_start), "tiles differ"
    assert torch.equal(tiles[2], ref.tile_rows), "tile rows differ"
    if t:
        xq_ref, xs_ref = quant_rows(x)
        assert torch.equal(xq.view(torch.int16), xq_ref.view(torch.int16)) and torch.equal(xs, xs_ref)
