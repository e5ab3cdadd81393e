"""Routed experts on bf16 copies and the grouped GEMM (engine.kernels.moe_grouped) against the golden MoE math.

Tolerances: the dequantisation is bitwise engine.quant.dequant_fp4_weight; the sort is bitwise a stable sort by
expert with dropped pairs (-1) last. h (the SwiGLU output before its act_quant, by pair): test_moe.py's up
tolerance (`assert_up_close`). o is bf16-valued (the grouped GEMM writes bf16): per element
|o - bf16(ref)| <= 1 ULP of ref + eps * S, ref the golden's fp32 W2 output from A(h) of the kernel's own h (an h
1 ULP off may move a whole act_quant block, so the golden's h is not the input to compare o with),
S = Σ_i |A(h)_i| |W2_i|, eps 2^-16 on the CPU, 2^-14 on the GPU (test_moe.py's down tolerance plus the final
rounding). moe_forward through this path: test_moe.py's forward bound.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.moe import moe_down_ref, moe_forward, moe_forward_ref
from engine.kernels.moe_fp4 import FP4_MAX_TOKENS
from engine.kernels.moe_grouped import (GROUPED_MIN_PAIRS, dequant_fp4_bf16, experts_per_group, grouped_applies,
                                        routed_grouped, sort_pairs)
from engine.quant import act_quant_qdq, dequant_fp4_weight
from tests.kernels.moe_checks import (CPU_EPS, GPU_EPS, LIMIT, TIE_GAP, abs_experts, assert_forward_close,
                                      assert_up_close, draw_tokens, fail_worst, forward_bound, gpu_tokens, route,
                                      router_gaps, tiny_moe)
from tests.kernels.numeric import bf16_ulp

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_grouped_close(x, ex, w, ids, eps: float, what: str, **kwargs) -> torch.Tensor:
    """routed_grouped's h within test_moe's up tolerance, and its o against the golden W2 of the kernel's own A(h):
    within 1 ULP of ref + eps * S, at least 90% equal to bf16(ref). Returns o."""
    o, h = routed_grouped(x, ids, w, ex, LIMIT, want_h=True, **kwargs)
    assert o.dtype == torch.float32 and o.shape == (ids.numel(), x.size(1)) and h.shape == (ids.numel(), ex.inter)
    flat = ids.reshape(-1)
    h[flat < 0] = 0  # rows of dropped pairs are not written
    assert_up_close(h, x, ex, w, ids, f"up {what}", min_bitwise=0.9)
    hq = act_quant_qdq(h)
    ref = moe_down_ref(hq, ex, ids)[flat >= 0].double()
    s = moe_down_ref(hq.abs(), abs_experts(ex), ids)[flat >= 0].double()
    got = o[flat >= 0]
    assert torch.equal(got, got.bfloat16().float()), f"{what}: o is not bf16-valued"
    allowed = bf16_ulp(ref) + eps * s
    err = (got.double() - ref).abs()
    fail_worst(~(err <= allowed), err, allowed, got.double(), ref, f"down {what}")
    same = (got == ref.float().bfloat16().float()).double().mean().item()
    assert same >= 0.9, f"{what}: only {same:.1%} of o bitwise equal to bf16 of the golden"
    return o


def bf16_bytes_per_expert(ex) -> int:
    """One expert's bf16 copies: every packed FP4 byte of W1|W3 and W2 holds two elements of 2 bytes each."""
    return 4 * (ex.w13[0].numel() + ex.w2[0].numel())


# --- CPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 3, 64), (3, 37, 96), (2, 5, 32)])
def test_dequant_is_the_golden_dequant(shape):
    """Odd row counts, K not a multiple of the launch's columns, several experts at once, every code and a range of
    scales (including small and large exponents)."""
    e, n, k = shape
    g = torch.Generator().manual_seed(k + n)
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 150, (e, n, k // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequant_fp4_bf16(w, s)
    ref = torch.stack([dequant_fp4_weight(w[i], s[i]) for i in range(e)])
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), ref)
    out = torch.full((e + 1, n, k), 7.0, dtype=torch.bfloat16)
    dequant_fp4_bf16(w, s, out[:e])
    assert torch.equal(out[:e].float(), ref) and bool((out[e] == 7).all()), "out= wrote outside its view"


def test_dequant_rejects_bad_shapes():
    w = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="scales"):
        dequant_fp4_bf16(w, torch.zeros(4, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with pytest.raises(AssertionError, match="w torch.int8"):
        dequant_fp4_bf16(w.view(torch.int8), torch.zeros(4, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu))


def test_sort_is_stable_by_expert_with_dropped_pairs_last():
    ids = torch.tensor([[3, 0], [-1, 3], [0, 5], [3, -1], [5, 0]], dtype=torch.int32)
    sorted_pairs, ends = sort_pairs(ids, 6)
    flat = ids.view(-1).tolist()
    want = [p for e in range(6) for p in range(len(flat)) if flat[p] == e]
    want += [p for p in range(len(flat)) if flat[p] < 0]
    assert sorted_pairs.tolist() == want
    assert ends.tolist() == [3, 3, 3, 6, 6, 8]


def test_experts_per_group_counts_bf16_bytes():
    _, ex = tiny_moe(seed=1)
    e = ex.w13.size(0)
    per_expert = bf16_bytes_per_expert(ex)
    assert experts_per_group(ex, 3 * per_expert) == 3
    assert experts_per_group(ex, 3 * per_expert - 1) == 2
    assert experts_per_group(ex, 1) == 1 and experts_per_group(ex, 10**15) == e


@pytest.mark.parametrize("group_bytes", [None, "one", "three", "fused"])
def test_routed_grouped_matches_golden(group_bytes):
    """17 routed tokens over the tiny layer's 8 experts, in one group of experts, groups of one and of three (the
    last group short): o by pair within the stated tolerance."""
    moe, ex = tiny_moe(seed=21)
    per_expert = bf16_bytes_per_expert(ex)
    staging = {None: 10**12, "one": per_expert, "three": 3 * per_expert, "fused": 1}[group_bytes]
    fused = group_bytes == "fused"  # fp4_grouped_gemm: no staging at all
    x = draw_tokens(17, moe, seed=22)
    w, ids = route(x, moe)
    o = assert_grouped_close(x, ex, w, ids, CPU_EPS, f"grouped, staging {group_bytes}", staging_bytes=staging,
                             fused=fused)
    again = routed_grouped(x, ids, w, ex, LIMIT, staging_bytes=staging, fused=fused)
    assert torch.equal(o, again), "want_h changed o"


def test_routed_grouped_repeats_dropped_slots_and_unused_experts():
    """Every token shares expert 6, experts 0-2 get no pair, one token drops both slots, one drops one."""
    moe, ex = tiny_moe(seed=12)
    x = draw_tokens(7, moe, seed=13)
    ids = torch.tensor([[6, 3], [6, 4], [5, 6], [6, 7], [-1, -1], [6, -1], [3, 6]], dtype=torch.int32)
    w = torch.rand(7, 2, generator=torch.Generator().manual_seed(1)) + 0.2
    per_expert = bf16_bytes_per_expert(ex)
    for staging in (10**12, 2 * per_expert):
        assert_grouped_close(x, ex, w, ids, CPU_EPS, f"given routing, staging {staging}", staging_bytes=staging,
                             fused=False)
    assert_grouped_close(x, ex, w, ids, CPU_EPS, "given routing, fused", fused=True)
    assert routed_grouped(x[:0], ids[:0], w[:0], ex, LIMIT).shape == (0, x.size(1))


def test_applies_only_on_cuda_with_many_pairs_per_expert():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not grouped_applies(x, 10**6, 8), "the CPU keeps the Triton GEMMs"
    if torch.cuda.is_available():
        xc = x.cuda()
        assert grouped_applies(xc, GROUPED_MIN_PAIRS * 384, 384)
        assert not grouped_applies(xc, GROUPED_MIN_PAIRS * 384 - 1, 384)


# --- GPU: the released layer's shapes -------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("t,groups", [(2048, 1), (2048, 7), (FP4_MAX_TOKENS, 2), (2048, "fused"),
                                      (FP4_MAX_TOKENS, "fused")])
def test_routed_grouped_real_shapes_gpu(full_moe, t, groups):
    """o against the golden at real shapes, with the experts in one group and in several (the last short), or on
    fp4_grouped_gemm (no bf16 copies)."""
    moe, ex = full_moe
    e = ex.w13.size(0)
    per_expert = bf16_bytes_per_expert(ex)
    fused = groups == "fused"
    staging = per_expert if fused else -(-e // groups) * per_expert
    x = gpu_tokens(t, 500 + t)
    w, ids = route(x, moe)
    o = assert_grouped_close(x, ex, w, ids, GPU_EPS, f"grouped T={t} in {groups} groups", staging_bytes=staging,
                             fused=fused)
    again = routed_grouped(x, ids, w, ex, LIMIT, staging_bytes=staging, fused=fused)
    assert torch.equal(o, again), "not deterministic"


@gpu
@needs_cuda
def test_moe_forward_takes_the_grouped_path_gpu(full_moe):
    """moe_forward at a chunk with GROUPED_MIN_PAIRS pairs an expert: the golden's forward within its bound."""
    moe, ex = full_moe
    t = GROUPED_MIN_PAIRS * ex.w13.size(0) // moe.gate.topk
    x = gpu_tokens(t, 600)
    assert grouped_applies(x, t * moe.gate.topk, moe.gate.weight.size(0))
    y = moe_forward(x, moe, ex)
    ref = moe_forward_ref(x, moe)
    clear = router_gaps(x, moe) > TIE_GAP
    assert_forward_close(y, ref, forward_bound(x, moe, ex, ref), f"moe_forward T={t} (grouped)", rows=clear)
    assert torch.equal(y, moe_forward(x, moe, ex)), "not deterministic"
