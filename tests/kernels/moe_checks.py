"""The MoE kernel tests' problems and checks (test_moe.py's module docstring states the tolerances): random tiny and
released-shape layers, router inputs without near-ties, and the up / down / forward comparisons with the golden."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.moe import ExpertWeights, moe_down_ref, moe_route, moe_up_ref, stack_experts
from engine.model.layers import Linear
from engine.model.moe import MoE
from engine.presets import full_config, tiny_config
from engine.quant import (act_dequant, act_quant, dequant_fp4_weight, dequant_fp8_weight, quant_fp4_weight,
                          quant_fp8_weight)
from tests.kernels.numeric import bf16_ulp

TIE_GAP = 1e-4
CPU_EPS, GPU_EPS = 2.0**-16, 2.0**-14
LIMIT = 10.0


def fill_moe(moe: MoE, seed: int, exact: bool = False) -> MoE:
    """Random buffers. exact: routed weights are random FP4 codes with one scale 2^-6 (with integer
    activations every product sum is exact in fp32)."""
    g = torch.Generator().manual_seed(seed)
    dev = moe.gate.weight.device
    for m in moe.modules():
        if isinstance(m, Linear):
            if m.fmt == "fp4" and exact:
                m.weight.copy_(torch.randint(0, 256, m.weight.shape, generator=g, dtype=torch.uint8))
                m.scale.view(torch.uint8).fill_(121)  # 2^-6
                continue
            w = torch.randn(m.out_features, m.in_features, generator=g) * 0.05
            w *= torch.logspace(-0.5, 0.5, m.in_features)[torch.randperm(m.in_features, generator=g)]
            q, s = (quant_fp4_weight if m.fmt == "fp4" else quant_fp8_weight)(w)
            m.weight.copy_(q)
            m.scale.copy_(s)
    moe.gate.weight.copy_((torch.randn(moe.gate.weight.shape, generator=g) * 0.1).bfloat16())
    moe.gate.bias.copy_(torch.randn(moe.gate.bias.shape, generator=g) * 0.1)
    return moe.to(dev)


def tiny_moe(seed: int = 0, exact: bool = False, layer: int = 0) -> tuple[MoE, ExpertWeights]:
    moe = fill_moe(MoE(tiny_config(), layer), seed, exact)
    return moe, stack_experts(moe)


def router_gaps(x: torch.Tensor, moe: MoE) -> torch.Tensor:
    """Per token: the smallest gap between adjacent biased golden scores among the top k + 1 (float64)."""
    scores = F.softplus(x.double() @ moe.gate.weight.double().T).sqrt() + moe.gate.bias.double()
    top = scores.topk(min(moe.gate.topk + 1, scores.size(1)), dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(dim=-1).values


def draw_tokens(t: int, moe: MoE, seed: int, exact: bool = False) -> torch.Tensor:
    """x bf16 [T, D] without router near-ties (tiny shapes: redraw a row until its gaps exceed TIE_GAP).
    exact: integers in [-8, 8] with 8 in every 32-block (act_quant keeps them exactly)."""
    g = torch.Generator().manual_seed(seed)
    d = moe.gate.weight.size(1)
    rows = []
    while len(rows) < t:
        if exact:
            r = torch.randint(-8, 9, (d,), generator=g).float()
            r[::32] = 8.0
        else:
            r = torch.randn(d, generator=g) * torch.logspace(-1, 0.5, d)[torch.randperm(d, generator=g)]
        r = r.bfloat16().to(moe.gate.weight.device)
        if router_gaps(r[None], moe).item() > TIE_GAP:
            rows.append(r)
    return torch.stack(rows) if rows else torch.zeros(0, d, dtype=torch.bfloat16, device=moe.gate.weight.device)


def route(x: torch.Tensor, moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    g = moe.gate
    return moe_route(x, g.weight, g.bias, g.topk, g.route_scale, g.norm_topk)


def fail_worst(bad: torch.Tensor, err: torch.Tensor, allowed: torch.Tensor, y, ref, what: str) -> None:
    if bad.any():
        worst = int(torch.where(bad, err / allowed, -1.0).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), bad.shape))
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance; worst at {idx}: y={y[idx].item():.6g} "
                    f"ref={ref[idx].item():.6g} err={err[idx].item():.3g} allowed={allowed[idx].item():.3g}")


def gu_ref(x: torch.Tensor, ex: ExpertWeights, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Golden bf16 pre-activations [w1(x) | w3(x)] per pair, float64 [T*k, 2I], and S = Σ_i |A(x)_i| |W_i| of
    each (the scale of the fp32 summation-order error)."""
    t, k = ids.shape
    a = act_dequant(*act_quant(x), 32).double()
    out = torch.zeros(t * k, 2 * ex.inter, dtype=torch.float64, device=x.device)
    mag = torch.zeros_like(out)
    for e in torch.unique(ids[ids >= 0]).tolist():  # dropped pairs (id -1) stay zero, as moe_up_ref's
        rows, slot = torch.where(ids == e)
        w = dequant_fp4_weight(ex.w13[e], ex.s13[e]).double()
        out[rows * k + slot] = (a[rows] @ w.T).float().bfloat16().double()
        mag[rows * k + slot] = a[rows].abs() @ w.abs().T
    return out, mag


def assert_up_close(h: torch.Tensor, x, ex, w, ids, what: str, min_bitwise: float = 0.0) -> None:
    """g and u may each move by 1 ULP plus eps * S (the fp32 sum order: several ULPs where the sum cancels,
    seen on the H200 in ~1e-6 of the elements), and h must lie within 1 ULP of the SwiGLU range they span."""
    ref = moe_up_ref(x, ex, w, ids, LIMIT, qdq_out=False).double()
    gu, mag = gu_ref(x, ex, ids)
    inter = ex.inter
    eps = GPU_EPS if h.is_cuda else CPU_EPS
    g0, u0 = gu[:, :inter], gu[:, inter:]
    dg_max, du_max = bf16_ulp(g0) + eps * mag[:, :inter], bf16_ulp(u0) + eps * mag[:, inter:]
    wd = w.double().view(-1, 1)
    cands = []
    for dg in (-1, 0, 1):
        for du in (-1, 0, 1):
            g = (g0 + dg * dg_max).clamp(max=LIMIT)
            u = (u0 + du * du_max).clamp(-LIMIT, LIMIT)
            cands.append((wd * F.silu(g) * u).bfloat16().double())
    lo, hi = torch.stack(cands).amin(0), torch.stack(cands).amax(0)
    lo, hi = lo - bf16_ulp(lo), hi + bf16_ulp(hi)
    y = h.double()
    bad = ~((y >= lo) & (y <= hi))
    fail_worst(bad, (y - ref).abs(), (hi - lo) / 2, y, ref, what)
    same = (h == ref.bfloat16()).double().mean().item()
    assert same >= min_bitwise, f"{what}: only {same:.1%} of h bitwise equal to the golden"


def abs_experts(ex: ExpertWeights) -> ExpertWeights:
    """The same experts with |W| (E2M1 sign bits cleared)."""
    def fp8_abs(w: torch.Tensor) -> torch.Tensor:  # bit ops: fp8 abs is not implemented on every device
        return (w.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)

    return ExpertWeights(ex.w13 & 0x77, ex.s13, ex.w2 & 0x77, ex.s2, fp8_abs(ex.shared_w13), ex.shared_s13,
                         fp8_abs(ex.shared_w2), ex.shared_s2)


def assert_down_close(o, h_by_pair, ex, ids, eps, what, exact=False):
    ref = moe_down_ref(h_by_pair, ex, ids)
    flat = ids.view(-1)
    o, ref = o[flat >= 0], ref[flat >= 0]  # rows of dropped pairs are not written
    if exact:
        assert torch.equal(o, ref), f"{what}: not bitwise; max err {(o - ref).abs().max().item():.3g}"
        return
    s = moe_down_ref(h_by_pair.abs(), abs_experts(ex), ids)[flat >= 0].double()
    err = (o.double() - ref.double()).abs()
    fail_worst(~(err <= eps * s), err, eps * s, o, ref, what)


def forward_bound(x: torch.Tensor, moe: MoE, ex: ExpertWeights, ref: torch.Tensor) -> torch.Tensor:
    """The allowed |y - ref| per element (see the module docstring), float64 [T, D]."""
    weights, ids = moe.gate(x)
    t, k = ids.shape
    mag = torch.zeros(t, x.size(1), dtype=torch.float64, device=x.device)
    s = torch.zeros_like(mag)
    abs_ex = abs_experts(ex)
    h = moe_up_ref(x, ex, weights.float(), ids.to(torch.int32), LIMIT, qdq_out=False)
    s_routed = moe_down_ref(h.abs(), abs_ex, ids).double().view(t, k, -1).sum(1)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        mag[rows] += moe.experts[e](x[rows], weights[rows, slot, None]).double().abs()
    sh = moe.shared_experts
    mag += sh(x).double().abs()
    g, u = sh.w1(x).double(), sh.w3(x).double()
    h_sh = (F.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT)).bfloat16()
    a = act_dequant(*act_quant(h_sh), 32).double().abs()
    s_shared = a @ dequant_fp8_weight(abs_ex.shared_w2, ex.shared_s2).double().T
    s = s_routed + s_shared
    return bf16_ulp(ref) + 2.0**-7 * mag + 2.0**-8 * s


def assert_forward_close(y, ref, bound, what, rows=None):
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    if rows is not None:
        y, ref, bound = y[rows], ref[rows], bound[rows]
    err = (y.double() - ref.double()).abs()
    fail_worst(~(err <= bound), err, bound, y.double(), ref.double(), what)
    same = (y == ref).double().mean().item()
    assert same >= 0.9, f"{what}: only {same:.1%} bitwise equal to the golden"


def gpu_tokens(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, full_config().dim, generator=g, device="cuda").bfloat16()
