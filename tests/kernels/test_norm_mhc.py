"""RMSNorm and the mHC kernels against the golden model's float64 math (engine/kernels/{norm,mhc}.py).

Tolerances, per element, against the golden (float64 math, one rounding):

- bf16 outputs (rms_norm, hc_pre, hc_pre_norm, hc_post): |y - ref| <= 1 bf16 ULP of ref + slack, and
  >= 99% of elements bitwise equal. slack covers the fp32 sums that feed the final rounding:
    rms_norm     0 (fp32 Σx² and rsqrt move the result by a few fp32 ULPs: only a tie can flip)
    hc_pre       2^-20 · Σ_k |pre_k x_k|                 (4 fp32 products and sums)
    hc_post      2^-20 · (|post_k y| + Σ_j |comb_jk R_j|)
    hc_pre_norm  |w| r (1 bf16 ULP of c + 2^-20 Σ_k |pre_k x_k|): the bf16 collapse c may itself land
                 one ULP away (as hc_pre), which the norm carries to the output; r = golden rsqrt.
- mixes: the GEMM error |Δm_j| <= EPS_M · S_j, S_j = r Σ_k |x_k| |fn_jk| (fp32 accumulation of exact
  products on the CPU; on the GPU two tf32 MMAs over fn = hi + lo, products within 2^-21, fp32
  accumulation), then
    pre  |Δ| <= |s0|/4 · max_j∈pre EPS_M S_j + 1e-6      (sigmoid' <= 1/4; fp32 epilogue rounding)
    post |Δ| <= |s1|/2 · max_j∈post EPS_M S_j + 1e-6
    comb |Δ| <= SINKHORN_GAIN · |s2| · max_j∈comb EPS_M S_j + 4e-6   (softmax + 20 normalisation rounds)
  EPS_M = 2^-17. Measured (interpreter, D = 256): max |Δ| ~1e-7 everywhere, i.e. fp32 epilogue rounding;
  the GEMM term is far below its bound. The GPU tests print the measured errors at D = 5120.
"""

import pytest
import torch

from engine.kernels.mhc import (hc_mixes, hc_post, hc_post_mixes, hc_post_ref, hc_pre, hc_pre_norm, hc_pre_norm_ref,
                                hc_pre_ref)
from engine.kernels.norm import rms_norm, rms_norm_ref
from engine.presets import full_config
from tests.kernels.numeric import (HC, HC_EPS, ITERS, NORM_EPS, assert_bf16_close, bf16_ulp, check_mixes_bounds,
                                   mhc_mix_params, mhc_stream)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SUM_EPS = 2.0**-20


def _weights(d: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(d, generator=g)).bfloat16().to(device)


def _post_params(n: int, device: str = "cpu", seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    pre = torch.rand(n, HC, generator=g) + 1e-6
    post = 2 * torch.rand(n, HC, generator=g)
    comb = torch.rand(n, HC, HC, generator=g).softmax(-1)
    return pre.to(device), post.to(device), comb.to(device)


# --- checks shared by the CPU and GPU tests ---------------------------------------------------------------------

def check_rms_norm(x2: torch.Tensor, w: torch.Tensor, what: str) -> None:
    assert_bf16_close(rms_norm(x2, w, NORM_EPS), rms_norm_ref(x2, w, NORM_EPS), 0.0, f"rms_norm {what}")


def check_hc_pre(x, pre, w, what: str) -> None:
    abs_sum = (pre.double().unsqueeze(-1) * x.double()).abs().sum(1)  # [N, D]
    c_ref = hc_pre_ref(x, pre)
    assert_bf16_close(hc_pre(x, pre), c_ref, SUM_EPS * abs_sum, f"hc_pre {what}")
    cf = c_ref.double()
    r = torch.rsqrt(cf.square().mean(-1, keepdim=True) + NORM_EPS)
    slack = w.double().abs() * r * (bf16_ulp(cf, 2.0**-133) + SUM_EPS * abs_sum)
    assert_bf16_close(hc_pre_norm(x, pre, w, NORM_EPS), hc_pre_norm_ref(x, pre, w, NORM_EPS), slack,
                      f"hc_pre_norm {what}")


def check_hc_post(y, res, post, comb, what: str, got=None) -> None:
    abs_sum = (post.double().abs().unsqueeze(-1) * y.double().abs().unsqueeze(1)
               + torch.einsum("njk,njd->nkd", comb.double().abs(), res.double().abs()))
    got = hc_post(y, res, post, comb) if got is None else got
    assert_bf16_close(got, hc_post_ref(y, res, post, comb), SUM_EPS * abs_sum,
                      f"hc_post {what}")


def check_hc_mixes(x, fn, scale, base, what: str, iters: int = ITERS, launch=None) -> dict[str, float]:
    return check_mixes_bounds(hc_mixes(x, fn, scale, base, HC, iters, HC_EPS, NORM_EPS, launch), x, fn, scale, base,
                              what, iters)


def check_hc_post_mixes(y, res, post, comb, fn, scale, base, what: str, launch=None) -> dict[str, float]:
    """X against the golden hc_post (hc_post's bounds), the mixes against the golden mixes of that X."""
    x, *mixes = hc_post_mixes(y, res, post, comb, fn, scale, base, ITERS, HC_EPS, NORM_EPS, launch)
    check_hc_post(y, res, post, comb, what, got=x)
    return check_mixes_bounds(mixes, x, fn, scale, base, f"post+mixes {what}", ITERS)


# --- CPU (interpreter) tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("d", [256, 200])
def test_rms_norm(n, d):
    x = mhc_stream(n, d)[:, 0].contiguous()
    check_rms_norm(x, _weights(d), f"N={n} D={d}")


def test_rms_norm_zero_and_extreme_rows():
    x = torch.zeros(4, 256)
    x[1] = torch.linspace(-1e15, 1e15, 256)
    x[2] = torch.linspace(-3e-30, 1e-30, 256)  # x² underflows fp32 and is below eps in float64: eps rules
    x[3, 7] = -5.0  # one non-zero element: output = w·sign·sqrt(D)
    x = x.bfloat16()
    w = _weights(256)
    y = rms_norm(x, w, NORM_EPS)
    assert torch.equal(y[0].view(torch.int16), rms_norm_ref(x, w, NORM_EPS)[0].view(torch.int16))  # zeros
    check_rms_norm(x, w, "zero/extreme rows")


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("d", [256, 200])
def test_hc_pre_and_pre_norm(n, d):
    x = mhc_stream(n, d)
    pre, _, _ = _post_params(n)
    pre[0, 1] = -0.75  # negative pre values cancel
    check_hc_pre(x, pre, _weights(d), f"N={n} D={d}")


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("d", [256, 200])
def test_hc_post(n, d):
    res = mhc_stream(n, d)
    y = mhc_stream(n, d, seed=5, special=False)[:, 0].contiguous()
    _, post, comb = _post_params(n)
    check_hc_post(y, res, post, comb, f"N={n} D={d}")


LAUNCHES = [None, (16, 128, 1), (16, 64, 3), (32, 32, 5), (64, 128, 8)]


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("launch", LAUNCHES, ids=["auto", "nosplit", "split3", "bm32-split5", "bm64-split8"])
def test_hc_mixes(n, launch):
    x = mhc_stream(n, 256)
    check_hc_mixes(x, *mhc_mix_params(256), f"N={n} launch={launch}", launch=launch)


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_hc_mixes_sharp_comb_and_iters(iters):
    x = mhc_stream(5, 256, seed=7)
    check_hc_mixes(x, *mhc_mix_params(256, sharp=True), f"sharp iters={iters}", iters=iters, launch=(16, 64, 2))


def test_hc_mixes_is_deterministic_and_resets_tickets():
    x = mhc_stream(17, 256)
    params = mhc_mix_params(256)
    a = hc_mixes(x, *params, HC, ITERS, HC_EPS, NORM_EPS, (16, 32, 7))
    b = hc_mixes(x, *params, HC, ITERS, HC_EPS, NORM_EPS, (16, 32, 7))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


POST_LAUNCHES = [None, (16, 64, 1), (16, 32, 3), (32, 32, 2), (64, 16, 5)]


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("launch", POST_LAUNCHES, ids=["auto", "nosplit", "split3", "bm32-split2", "bm64-split5"])
def test_hc_post_mixes(n, launch):
    res = mhc_stream(n, 256)
    y = mhc_stream(n, 256, seed=5, special=False)[:, 0].contiguous()
    _, post, comb = _post_params(n)
    params = mhc_mix_params(256, seed=4)
    check_hc_post_mixes(y, res, post, comb, *params, f"N={n} launch={launch}", launch=launch)
    x, *_ = hc_post_mixes(y, res, post, comb, *params, ITERS, HC_EPS, NORM_EPS, launch)
    assert torch.equal(x.view(torch.int16), hc_post(y, res, post, comb).view(torch.int16)), "X differs from hc_post"


def test_empty_rows():
    x = torch.empty(0, HC, 256, dtype=torch.bfloat16)
    w = _weights(256)
    pre = torch.empty(0, HC)
    assert rms_norm(x[:, 0], w, NORM_EPS).shape == (0, 256)
    assert hc_pre(x, pre).shape == (0, 256) and hc_pre_norm(x, pre, w, NORM_EPS).shape == (0, 256)
    assert hc_post(x[:, 0], x, pre, torch.empty(0, HC, HC)).shape == (0, HC, 256)
    p, q, c = hc_mixes(x, *mhc_mix_params(256), HC, ITERS, HC_EPS, NORM_EPS)
    assert p.shape == (0, HC) and q.shape == (0, HC) and c.shape == (0, HC, HC)
    out = hc_post_mixes(x[:, 0], x, pre, torch.empty(0, HC, HC), *mhc_mix_params(256), ITERS, HC_EPS, NORM_EPS)
    assert [tuple(t.shape) for t in out] == [(0, HC, 256), (0, HC), (0, HC), (0, HC, HC)]


def test_contract_asserts():
    x = mhc_stream(3, 256)
    with pytest.raises(AssertionError):
        rms_norm(x[:, 0], _weights(256), NORM_EPS)  # not contiguous
    with pytest.raises(AssertionError):
        hc_pre(x.float(), torch.rand(3, HC))
    fn, scale, base = mhc_mix_params(256)
    with pytest.raises(AssertionError):
        hc_mixes(x, fn.double(), scale, base, HC, ITERS, HC_EPS, NORM_EPS)


# --- GPU tests at the released shapes ----------------------------------------------------------------------------

GPU_N = [1, 6, 64, 4096]


@gpu
@needs_cuda
@pytest.mark.parametrize("n", GPU_N)
def test_norm_and_collapse_real_shapes_gpu(n):
    d = full_config().dim
    x = mhc_stream(n, d, "cuda")
    w = _weights(d, "cuda")
    check_rms_norm(x[:, 0].contiguous(), w, f"N={n} D={d}")
    pre, post, comb = _post_params(n, "cuda")
    check_hc_pre(x, pre, w, f"N={n} D={d}")
    y = mhc_stream(n, d, "cuda", seed=5, special=False)[:, 0].contiguous()
    check_hc_post(y, x, post, comb, f"N={n} D={d}")


@gpu
@needs_cuda
@pytest.mark.parametrize("n", GPU_N)
@pytest.mark.parametrize("sharp", [False, True])
def test_hc_mixes_real_shapes_gpu(n, sharp):
    d = full_config().dim
    cfg = full_config()
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps) == (HC, ITERS, HC_EPS, NORM_EPS)
    x = mhc_stream(n, d, "cuda", seed=11)
    params = mhc_mix_params(d, "cuda", sharp=sharp)
    measured = check_hc_mixes(x, *params, f"N={n} D={d} sharp={sharp}")
    print(f"hc_mixes N={n} D={d} sharp={sharp}: max |err| " + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()))
    y = mhc_stream(n, d, "cuda", seed=5, special=False)[:, 0].contiguous()
    _, post, comb = _post_params(n, "cuda")
    measured = check_hc_post_mixes(y, x, post, comb, *params, f"N={n} D={d} sharp={sharp}")
    print(f"hc_post_mixes N={n} D={d} sharp={sharp}: max |err| "
          + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()))
