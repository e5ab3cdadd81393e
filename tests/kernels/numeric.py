"""Numeric helpers the kernel tests share: the bf16 ULP, the tolerance checks used by more than one test file (each
states its bound; a failure names the parameters and the worst element), and the random problems those files
build. The bounds themselves are argued in the docstring of the test module that owns the kernel
(test_sparse_attention, test_fp8_linear, test_indexer, test_norm_mhc).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cache_records import pack_index_k, pack_main_kv, pack_swa, unpack_index_k
from engine.kernels.indexer import index_scores_ref
from engine.kernels.mhc import hc_mixes_ref
from engine.kernels.sparse_attention import gather_rows_ref
from engine.quant import act_dequant, act_quant, dequant_fp8_weight, fp4_qdq, quant_fp8_weight

# --- ULP and bf16 closeness --------------------------------------------------------------------------------------


def bf16_ulp(ref: torch.Tensor, floor: float = 2.0**-126) -> torch.Tensor:
    """float64 bf16 ULP of each element: 2^(floor(log2 max(|ref|, floor)) - 7) (bf16 keeps 8 significant bits).
    `floor` bounds the ULP of tiny values and zeros from below (2^-126: bf16's normal range; the tests with
    larger sums use 2^-100)."""
    _, e = torch.frexp(ref.double().abs().clamp_min(floor))
    return torch.ldexp(torch.ones_like(ref, dtype=torch.float64), e - 8)


def assert_bf16_close(y: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor | float, what: str,
                      min_equal: float = 0.99) -> None:
    """|y - ref| <= 1 bf16 ULP of ref + slack everywhere (NaN fails), and >= min_equal of y bitwise ref."""
    assert y.shape == ref.shape and y.dtype == torch.bfloat16, f"{what}: got {y.dtype} {tuple(y.shape)}"
    yf, rf = y.double().cpu().flatten(), ref.double().cpu().flatten()
    slack = torch.as_tensor(slack, dtype=torch.float64).cpu().expand(ref.shape).flatten()
    allowed = bf16_ulp(rf, 2.0**-133) + slack
    err = (yf - rf).abs()
    bad = ~(err <= allowed)  # NaN fails
    if bad.any():
        i = int(torch.where(bad, err / allowed, torch.inf).nan_to_num(posinf=1e30).argmax())
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance; worst at flat {i} "
                    f"(of shape {tuple(ref.shape)}): y={yf[i].item():.6g} ref={rf[i].item():.6g} "
                    f"err={err[i].item():.3g} allowed={allowed[i].item():.3g} "
                    f"({err[i].item() / bf16_ulp(rf, 2.0**-133)[i].item():.2f} ULP)")
    equal = (y.cpu().view(torch.int16) == ref.cpu().view(torch.int16)).double().mean().item()
    assert equal >= min_equal, f"{what}: only {100 * equal:.2f}% bitwise equal (want >= {100 * min_equal:.0f}%)"


# --- sparse attention (test_sparse_attention, test_sparse_decode, test_sparse_prefill, test_bounds) ---------------


def sparse_attn_problem(m, h, d, kw, km, swa_slots, main_slots, device="cpu", seed=0):
    """[q bf16 [M, H, D], swa_pool, swa_idx int32 [M, KW], main_pool, main_idx int32 [M, KM], sink fp32 [H]], pools
    paged by 4: late-starting windows, top-k padding (-1), an all -1 row, duplicate rows, a dominant sink."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(m, h, d, generator=g) * 2).bfloat16()
    swa_pool = pack_swa((torch.randn(swa_slots, d, generator=g) * torch.logspace(-1, 0.5, d)).bfloat16())
    main_pool = pack_main_kv((torch.randn(main_slots, d, generator=g)).bfloat16())
    swa_idx = torch.randint(0, swa_slots, (m, kw), generator=g, dtype=torch.int32)
    main_idx = torch.randint(0, main_slots, (m, km), generator=g, dtype=torch.int32)
    swa_idx[:, : kw // 3] = -1  # a window that starts late
    main_idx[:, km - km // 4:] = -1  # top-k padding
    if m > 1:
        swa_idx[1] = -1  # an all -1 row: output 0
        main_idx[1] = -1
    if m > 2:
        main_idx[2, :3] = main_idx[2, 3]  # duplicate rows count once per listing, as in the golden
        swa_idx[2, -2:] = swa_idx[2, -3]
    sink = torch.randn(h, generator=g) * 2
    sink[0] = 30.0  # a sink that dominates the denominator
    return [t.to(device) for t in (q, swa_pool.view(-1, 4, swa_pool.size(-1)), swa_idx,
                                   main_pool.view(-1, 4, main_pool.size(-1)), main_idx, sink)]


def assert_attn_close(o, ref, args, scale, what):
    """|o - ref| <= 2 bf16 ULPs of ref + 2^-8 A, A[m, h, d] = Σ_r p_r |kv_r[d]| / denom (test_sparse_attention)."""
    q, swa_pool, swa_idx, main_pool, main_idx, sink = args
    assert o.shape == ref.shape and o.dtype == torch.bfloat16, f"{what}: got {o.dtype} {tuple(o.shape)}"
    kv, idx = gather_rows_ref(q, swa_pool, swa_idx, main_pool, main_idx)
    logits = torch.einsum("mhd,mkd->mhk", q.double(), kv.double()) * scale
    logits = logits.masked_fill(idx < 0, float("-inf"))
    mx = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(logits - mx)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.double().view(1, -1, 1) - mx)
    a = torch.einsum("mhk,mkd->mhd", p, kv.double().abs()) / denom
    of, rf = o.double(), ref.double()
    ulp = bf16_ulp(rf, 2.0**-100)
    allowed = 2 * ulp + 2.0**-8 * a
    err = (of - rf).abs()
    bad = ~(err <= allowed)  # NaN fails
    if bad.any():
        w = int(torch.where(bad, err / allowed, torch.inf).nan_to_num(posinf=1e30).flatten().argmax())
        mi, hi, di = torch.unravel_index(torch.tensor(w), rf.shape)
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance; worst [m={mi}, h={hi}, d={di}]: "
                    f"o={of[mi, hi, di].item():.6g} ref={rf[mi, hi, di].item():.6g} err={err[mi, hi, di].item():.3g} "
                    f"allowed={allowed[mi, hi, di].item():.3g}")


# --- FP8 linear (test_fp8_linear, test_fp8_gemv) -----------------------------------------------------------------

FP8_LINEAR_CPU_EPS = 2.0**-16  # eps of the fp32 summation-order term on the CPU interpreter (numpy fp32 sums)
FP8_LINEAR_GPU_EPS = 2.0**-14  # on the GPU (bf16 tensor-core MMA, fp32 accumulation)


def fp8_linear_problem(m: int, n: int, k: int, device: str = "cpu", seed: int = 0):
    """(x bf16 [M, K] with per-column magnitudes 1e-2..10, an all-zero row and a loud block; FP8 weight [N, K],
    its E8M0 scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]
    if m > 2:
        x[1] = 0  # an all-zero row: the amax clamp picks its scales
        x[2, :32] *= 1e3  # a loud block next to quiet ones
    w = torch.randn(n, k, generator=g) * 0.02 * torch.logspace(-1, 1, n)[:, None]
    qw, sw = quant_fp8_weight(w)
    return x.bfloat16().to(device), qw.to(device), sw.to(device)


def fp8_abs_sum(x, qw, sw):
    """S[m, n] = Σ_k |a[m, k]| |w[n, k]| with the dequantised operands (float64)."""
    a = act_dequant(*act_quant(x), 32).double().abs()
    return a @ dequant_fp8_weight(qw, sw).double().abs().T


def assert_fp8_linear_close(y, ref, x, qw, sw, eps: float, what: str) -> None:
    """|y - ref| <= 1 bf16 ULP of ref + eps S, S = fp8_abs_sum (test_fp8_linear)."""
    assert y.shape == ref.shape and y.dtype == torch.bfloat16, f"{what}: got {y.dtype} {tuple(y.shape)}"
    yf, rf = y.double().view(-1, ref.size(-1)), ref.double().view(-1, ref.size(-1))
    ulp = bf16_ulp(rf, 2.0**-100)
    allowed = ulp + eps * fp8_abs_sum(x.view(-1, x.size(-1)), qw, sw)
    err = (yf - rf).abs()
    bad = ~(err <= allowed)  # NaN fails
    if bad.any():
        worst = int(torch.where(bad, (err / allowed).nan_to_num(nan=1e30, posinf=1e30), -1.0).argmax())
        m, n = divmod(worst, rf.size(1))
        pytest.fail(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance; worst [m={m}, n={n}]: "
            f"y={yf[m, n].item():.6g} ref={rf[m, n].item():.6g} err={err[m, n].item():.3g} "
            f"allowed={allowed[m, n].item():.3g} ({err[m, n].item() / ulp[m, n].item():.1f} ULP)"
        )


def assert_fp8_partial_close(y, ref, x, qw, sw, eps: float, what: str, y_bf16=None) -> None:
    """An fp32-output FP8 linear (the unrounded partial of a row-parallel product) against the oracle's fp32
    accumulator: |y - ref| <= eps S (only the fp32 summation order differs; no rounding to forgive), and, given the
    bf16 form of the same launch, bf16(y) equal to it bit for bit (the fp32 form is its value before rounding)."""
    assert y.shape == ref.shape and y.dtype == torch.float32, f"{what}: got {y.dtype} {tuple(y.shape)}"
    yf, rf = y.double().view(-1, ref.size(-1)).cpu(), ref.double().view(-1, ref.size(-1)).cpu()
    allowed = eps * fp8_abs_sum(x.view(-1, x.size(-1)).cpu(), qw.cpu(), sw.cpu())
    err = (yf - rf).abs()
    bad = ~(err <= allowed)  # NaN fails
    if bad.any():
        worst = int(torch.where(bad, (err / allowed).nan_to_num(nan=1e30, posinf=1e30), -1.0).argmax())
        m, n = divmod(worst, rf.size(1))
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} fp32 elements out of tolerance; worst [m={m}, n={n}]: "
                    f"y={yf[m, n].item():.9g} ref={rf[m, n].item():.9g} err={err[m, n].item():.3g} "
                    f"allowed={allowed[m, n].item():.3g}")
    if y_bf16 is not None:
        rounded = y.to(torch.bfloat16).cpu().view(torch.int16)  # y_bf16 may live on another device
        diff = (rounded != y_bf16.cpu().view(torch.int16)).nonzero()
        assert diff.numel() == 0, (f"{what}: bf16(fp32 out) differs from the bf16 out at {diff.size(0)} elements, "
                                   f"first {diff[0].tolist()}")


def awkward_act_rows(k: int) -> torch.Tensor:
    """Rows of 32-blocks that stress the quantiser: zeros, -0.0, saturation, E4M3 ties and carries,
    subnormal E4M3 results, and every finite bf16 bit pattern, shuffled into blocks."""
    g = torch.Generator().manual_seed(3)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    every = every[torch.randperm(every.numel(), generator=g)]
    every = every[: every.numel() // k * k].view(-1, k)
    special = torch.randn(8, k, generator=g).bfloat16()
    special[0] = 0
    special[1] = -0.0
    special[2, :16] = 1e4  # saturating block
    special[3, 0] = 448.0  # scale exactly 1: ties are at the bf16-visible E4M3 midpoints
    special[3, 1:32] = torch.tensor([1.0625, 1.1875, 1.9375, 3.875, 0.0029296875, 0.0048828125, 0.01171875,
                                     -1.0625, -1.9375, -0.0029296875] + [0.0] * 21)
    special[4] = special[3] * 2.0**-20  # the same pattern in a tiny block (still a normal scale)
    special[5] = special[3] * 2.0**60
    special[6, ::2] = 0.25
    return torch.cat([special, every])


# --- indexer (test_indexer, test_indexer_cuda) -------------------------------------------------------------------


def index_problem(m, h, d, t, entries, device="cpu", seed=0):
    """[q (MXFP4 QDQ bf16 [M, H, D]), w bf16 [M, H], pool (MXFP4 index-key records [entries, ...]), slots int32 [T],
    visible [M]]: query 0 sees all T entries, query 1 (if any) none."""
    g = torch.Generator().manual_seed(seed)
    q = fp4_qdq((torch.randn(m, h, d, generator=g) * 2).bfloat16(), 32, "ue8m0")
    w = (torch.randn(m, h, generator=g) * (d ** -0.5 * h ** -0.5)).bfloat16()
    pool = pack_index_k((torch.randn(entries, d, generator=g) * torch.logspace(-1, 0.5, d)).bfloat16())
    slots = torch.randperm(entries, generator=g)[:t].to(torch.int32)
    visible = torch.randint(0, t + 1, (m,), generator=g)
    visible[0] = t
    if m > 1:
        visible[1] = 0  # a query that sees nothing: all -inf
    return [x.to(device) for x in (q, w, pool, slots, visible)]


def assert_index_scores_close(out, q, w, pool, slots, visible, min_equal=0.99):
    """out (index scores of q against the pool's slots) vs index_scores_ref: -inf exactly where the golden has it,
    |out - ref| <= 1 bf16 ULP + 2^-8 Σ_h |bf16(relu(s_h) w_h)| elsewhere, >= min_equal bitwise (test_indexer)."""
    ref = index_scores_ref(q, w, pool, slots, visible)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(out), inf), "-inf pattern differs"
    o, r = out.float()[~inf], ref.float()[~inf]
    kd = unpack_index_k(pool.reshape(-1, pool.size(-1))[slots.long()], q.size(-1)).double()
    sh = torch.einsum("mhd,td->mht", q.double(), kd).bfloat16().relu()
    mag = (sh * w.unsqueeze(-1)).double().abs().sum(1).float()[~inf]  # Σ_h |bf16(relu(s_h) w_h)|
    ulp = bf16_ulp(r).float()
    err = (o - r).abs()
    bound = ulp + 2.0**-8 * mag
    equal = (err == 0).float().mean().item() if err.numel() else 1.0
    worst = (err - bound).argmax().item() if err.numel() else 0
    assert (err <= bound).all(), (f"M,H,D,T={tuple(q.shape)},{slots.numel()}: worst err {err[worst]:.3e} "
                                  f"bound {bound[worst]:.3e} out {o[worst]} ref {r[worst]}")
    assert equal >= min_equal, f"only {100 * equal:.2f}% bitwise equal"
    print(f"M,H,D,T={tuple(q.shape)},{slots.numel()}: {err.numel() - int(equal * err.numel() + 0.5)} "
          f"of {err.numel()} elements differ, max {err.max().item() if err.numel() else 0:.3e}")


# --- mHC mixes (test_norm_mhc, test_hc_mixes_cuda) ---------------------------------------------------------------

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-20  # the config's hc_mult, Sinkhorn rounds and epsilons
EPS_M = 2.0**-17  # bound of the mixes GEMM error relative to S_j = r Σ_k |x_k| |fn_jk|
SINKHORN_GAIN = 4.0  # comb's error gain through the softmax and the normalisation rounds


def mhc_stream(n: int, d: int, device: str = "cpu", seed: int = 0, special: bool = True) -> torch.Tensor:
    """bf16 [N, HC, D] with per-row magnitudes over 1e-2 .. 1e2; rows 1/2/3 (when present) are all-zero,
    large (~1e12) and tiny (~1e-25, where eps = 1e-20 dominates the mean square)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-2, 2, max(n, 1))[torch.randperm(max(n, 1), generator=g)][:n]
    x = torch.randn(n, HC, d, generator=g) * mag[:, None, None]
    if special and n > 3:
        x[1] = 0
        x[2] *= 1e12
        x[3] *= 1e-25
    return x.bfloat16().to(device)


def mhc_mix_params(d: int, device: str = "cpu", seed: int = 2, sharp: bool = False):
    """fn N(0, 1/K) as make_checkpoint; scale, base N(0, 0.25) (sharp: comb logits scaled by 8)."""
    g = torch.Generator().manual_seed(seed)
    k, mix = HC * d, (2 + HC) * HC
    fn = torch.randn(mix, k, generator=g) / k**0.5
    scale = torch.randn(3, generator=g) * 0.5
    if sharp:
        scale[2] = 8.0
    base = torch.randn(mix, generator=g) * 0.5
    return fn.to(device), scale.to(device), base.to(device)


def check_mixes_bounds(got, x, fn, scale, base, what: str, iters: int) -> dict[str, float]:
    """got = (pre, post, comb) within test_norm_mhc's stated bounds of the golden mixes of x; returns the measured
    max |Δ| per output (for the GPU tests' report)."""
    ref = hc_mixes_ref(x, fn, scale, base, HC, iters, HC_EPS, NORM_EPS)
    flat = x.flatten(1).double()
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS)
    dm = EPS_M * r * (flat.abs() @ fn.double().abs().T)  # [N, 24] bound on the GEMM error
    s = scale.double().abs()
    bounds = {"pre": s[0] / 4 * dm[:, :HC].amax(-1, keepdim=True) + 1e-6,
              "post": s[1] / 2 * dm[:, HC:2 * HC].amax(-1, keepdim=True) + 1e-6,
              "comb": (SINKHORN_GAIN * s[2] * dm[:, 2 * HC:].amax(-1) + 4e-6).view(-1, 1, 1)}
    measured = {}
    for name, g_, r_ in zip(("pre", "post", "comb"), got, ref):
        assert g_.dtype == torch.float32 and g_.shape == r_.shape, f"{name}: {g_.dtype} {tuple(g_.shape)}"
        err = (g_.double() - r_.double()).abs()
        bad = ~(err <= bounds[name])
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            pytest.fail(f"hc_mixes {what} {name}: {int(bad.sum())}/{bad.numel()} out of bound; first at {i}: "
                        f"got={g_[i].item():.8g} ref={r_[i].item():.8g} err={err[i].item():.3g} "
                        f"bound={bounds[name].expand_as(err)[i].item():.3g}")
        measured[name] = err.max().item() if err.numel() else 0.0
    return measured


# --- CUDA emulation (test_moe_fp4, test_indexer_cuda) ------------------------------------------------------------


def e2m1_pair(w: int, j: int) -> tuple[int, int]:
    """dsv41::e2m1_pair<J> (cuda/common.cuh; moe_fp4.cu and indexer_scan.cu): the f16 bits (low, high) made from
    32-bit word w."""
    sign, mag = 12 - 4 * j, 9 - 4 * j
    s = ((w << sign) if sign >= 0 else (w >> -sign)) & 0x80008000
    m = ((w << mag) if mag >= 0 else (w >> -mag)) & 0x0E000E00
    v = (s | m) & 0xFFFFFFFF
    return v & 0xFFFF, v >> 16
