"""bf16-weight GEMV with fp32 output (cuda/bf16_gemv.cu, engine/kernels/bf16_gemv.py) and linear_fp32.

Tolerance: y is an fp32 sum of exact bf16 products, ref = the float64 sum rounded once to fp32. For
sign-mixed data (RMSNorm outputs against weights) we require |y - ref| <= 2^-22 · Σ_k |x_k w_k| + 2^-100:
a sum of n fp32 terms in any order is within (n - 1) · 2^-24 · Σ|terms| in the worst case, but with mixed
signs the partial sums stay near |y| ~ Σ|terms| / sqrt(K), so the expected error is far below 2^-22 · Σ;
a dropped, doubled or misplaced block or row costs ~|x_k w_k| per term, far above it. For same-sign data
(the partial sums grow to Σ) the worst-case bound (serial adds + 32) · 2^-23 · Σ is used, with the serial
adds of the kernel's summation tree (K / 16, at most). Integer data whose partial sums stay below 2^24 is
exact in any order: there y == ref bit for bit. linear_fp32 above 8 rows is cuBLAS bf16 -> fp32 on tensor
cores, whose accumulation truncates: 2^-18 Σ|xw| there (2^-20.4 seen on the H200).

CPU: the source compiles with nvcc, the launcher rejects parameters outside its contract, the Python
shared-memory model agrees with the launcher's, launch shapes are valid, the K partition covers each block
once, the MMA fragment assignment of the kernel (emulated from the PTX layout tables) computes the block's
product, the wrapper asserts its contract, linear_fp32's CPU path is the reference's math.
GPU: the LM head and the compressor shapes x M, every kernel instance on odd shapes, exact integer data,
zeros, same-sign data, determinism, CUDA-graph capture with PDL, and linear_fp32's dispatch (no fp32 weight).
"""

import ctypes
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cuda_build
from engine.kernels.bf16_gemv import (BLOCK, INSTANCES, MAX_K, MAX_M, GemvParams, bf16_gemv, bf16_gemv_ref,
                                      gemv_applies, linear_fp32, pick_params, smem_bytes)
from engine.presets import full_config

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue
REL = 2.0**-22
CUBLAS_REL = 2.0**-18
TINY = 2.0**-100

ODD_PARAMS = [GemvParams(rt, u, wn, wk, s, pdl) for rt, u, wn, wk, s, pdl in
              [(1, 2, 1, 1, 1, True), (1, 4, 2, 4, 3, False), (1, 8, 8, 1, 2, True), (2, 2, 4, 2, 5, True),
               (2, 4, 2, 4, 8, True), (1, 8, 1, 8, 1, False), (2, 4, 8, 1, 7, True), (2, 2, 1, 8, 8, True)]]


def real_shapes() -> dict[str, tuple[int, int]]:
    """(N, K) of the fp32 linears of V4.1: the LM head and a ratio-2 compressor's wkv / wgate."""
    cfg = full_config()
    return {"head": (cfg.vocab_size, cfg.dim), "compressor": (cfg.head_dim, cfg.dim)}


def _problem(m: int, n: int, k: int, device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x like an RMSNorm output (unit scale), w like a trained weight (0.02 scale), both bf16."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).bfloat16()
    return x, w


def _abs_sum(x: torch.Tensor, w: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    xd = x.reshape(-1, x.size(-1)).double().abs()
    return torch.cat([xd @ w[i:i + chunk].double().abs().T for i in range(0, w.size(0), chunk)], dim=1)


def assert_gemv_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str, rel: float = REL) -> None:
    assert y.dtype == torch.float32 and y.shape == (*x.shape[:-1], w.size(0)), f"{what}: {y.dtype} {tuple(y.shape)}"
    ref = bf16_gemv_ref(x, w).reshape(-1, w.size(0)).double()
    got = y.reshape(-1, w.size(0)).double()
    bound = rel * _abs_sum(x, w) + TINY
    err = (got - ref).abs()
    bad = (err > bound) | ~torch.isfinite(got)
    if bad.any():
        i = int(((err - bound) / bound).argmax())
        m, n = divmod(i, w.size(0))
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside {rel:.3g}·Σ|xw|; worst "
                             f"[m={m}, n={n}]: got {got[m, n].item():.9g} ref {ref[m, n].item():.9g} "
                             f"err {err[m, n].item():.3g} bound {bound[m, n].item():.3g}")


# --- CPU -----------------------------------------------------------------------------------------------------------

@needs_nvcc
def test_cuda_source_compiles_and_launcher_checks_its_contract(tmp_path):
    lib = ctypes.CDLL(str(cuda_build.build("bf16_gemv", tmp_path)))
    gemv = lib.dsv41_bf16_gemv
    gemv.restype = ctypes.c_int
    gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 9 + [ctypes.c_void_p]
    ok = dict(M=1, N=64, K=1024, rt=2, u=4, wn=2, wk=2, s=2)
    bad = [dict(M=0), dict(M=9), dict(K=48), dict(K=0), dict(N=0), dict(rt=3), dict(u=3), dict(rt=2, u=8),
           dict(wn=8, wk=2), dict(s=9), dict(s=0), dict(K=96, s=4),  # 3 blocks cannot feed 4 CTAs
           dict(K=32 * 8192, s=1)]  # x tile beyond the shared-memory opt-in
    for change in bad:
        a = ok | change
        err = gemv(None, None, None, a["M"], a["N"], a["K"], a["rt"], a["u"], a["wn"], a["wk"], a["s"], 1, None)
        assert err == CUDA_INVALID_VALUE, f"{change}: launcher returned {err}, not cudaErrorInvalidValue"
    lib.dsv41_bf16_gemv_error_string.restype = ctypes.c_char_p
    assert lib.dsv41_bf16_gemv_error_string(CUDA_INVALID_VALUE) == b"invalid argument"
    lib.dsv41_bf16_gemv_smem.restype = ctypes.c_size_t
    lib.dsv41_bf16_gemv_smem.argtypes = [ctypes.c_int] * 5
    for k in (32, 64, 1056, 2304, 5120, 8192, MAX_K):
        for p in ODD_PARAMS + [pick_params(1, 4096, k), pick_params(8, 129280, k)]:
            p = p.normalised(k)
            c_smem = lib.dsv41_bf16_gemv_smem(k, p.row_tiles, p.warps_n, p.warps_k, p.splits)
            assert c_smem == smem_bytes(k, p), f"K={k} {p}: launcher {c_smem} B, Python {smem_bytes(k, p)} B"


def test_contract_is_asserted():
    x, w = _problem(3, 64, 64)
    with pytest.raises(AssertionError, match="bf16"):
        bf16_gemv(x.float(), w)
    with pytest.raises(AssertionError, match="bf16"):
        bf16_gemv(x, w.float())
    with pytest.raises(AssertionError, match="contiguous"):
        bf16_gemv(torch.cat([x, x], 1)[:, ::2], w)
    with pytest.raises(AssertionError, match="multiple of 32"):
        bf16_gemv(x[:, :48].contiguous(), w[:, :48].contiguous())
    with pytest.raises(AssertionError, match="does not match"):
        bf16_gemv(x, w[:, :32].contiguous())
    with pytest.raises(AssertionError, match=f"at most {MAX_M} rows"):
        bf16_gemv(_problem(MAX_M + 1, 64, 64)[0], w)
    with pytest.raises(AssertionError, match="CUDA device"):
        bf16_gemv(x, w)
    assert not gemv_applies(x, w), "CPU tensors must not route to the kernel"


def test_pick_params_are_launchable():
    for m in range(1, MAX_M + 1):
        for n, k in [*real_shapes().values(), (1000, 1056), (16, 32), (32768, 8192), (64, MAX_K), (7, 96)]:
            p = pick_params(m, n, k)
            assert p == p.normalised(k), f"M={m} N={n} K={k}: {p} splits past the K blocks"
            assert (p.row_tiles, p.unroll) in INSTANCES
            assert p.warps_n * p.warps_k <= 8 and 1 <= p.splits <= 8
            assert smem_bytes(k, p) <= 200 * 1024, f"M={m} N={n} K={k}: {p} needs {smem_bytes(k, p)} B"
    head = pick_params(1, *real_shapes()["head"])
    assert head.splits == 1 and head.rows_per_cta >= 128, f"the head needs no K split: {head}"


@pytest.mark.parametrize("k", [32, 96, 1056, 5120, MAX_K])
def test_k_partition_covers_every_block_once(k):
    """The kernel's split of K blocks over cluster CTAs and warp columns (kb_lo / kb_hi in the .cu file)."""
    kb = k // BLOCK
    for p in ODD_PARAMS + [pick_params(1, 512, k)]:
        p = p.normalised(k)
        kbc = -(-kb // p.splits)
        seen = []
        for split in range(p.splits):
            kb_valid = min(kbc * BLOCK, k - split * kbc * BLOCK) // BLOCK
            assert kb_valid >= 1, f"K={k} {p}: CTA {split} owns no block"
            per = -(-kb_valid // p.warps_k)
            for wk in range(p.warps_k):
                lo = min(wk * per, kb_valid)
                seen += [split * kbc + b for b in range(lo, min(lo + per, kb_valid))]
        assert sorted(seen) == list(range(kb)), f"K={k} {p}: blocks not covered exactly once"


def _mma_m16n8k16(a: list[list[tuple[float, float]]], b: list[list[tuple[float, float]]]) -> torch.Tensor:
    """D = A @ B of mma.m16n8k16 (.row.col, 16-bit inputs) from per-lane registers, each a pair of values
    (low half first), using the fragment layouts of the PTX ISA; returns D [16, 8] float64."""
    A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(8):  # A elements a0..a7: registers hold (a0, a1), (a2, a3), (a4, a5), (a6, a7)
            row = g + 8 * ((e // 2) % 2)
            col = 2 * t + (e % 2) + 8 * (e >= 4)
            A[row, col] = a[lane][e // 2][e % 2]
        for e in range(4):  # B elements b0..b3: registers hold (b0, b1), (b2, b3)
            B[2 * t + (e % 2) + 8 * (e >= 2), g] = b[lane][e // 2][e % 2]
    return A @ B


def _kernel_block(w: torch.Tensor, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
    """One 32-column block as bf16_gemv_kernel computes it: lane (g, t) holds 16 bytes = 4 pairs of
    w[g, 8t:8t+8] (lo), w[g+8, 8t:8t+8] (hi) and x[g, 8t:8t+8] (q); MMA 0 takes A = (lo.x, hi.x, lo.y, hi.y),
    B = (q.x, q.y), MMA 1 the .z/.w words. Returns Y [16 rows, 8 tokens] from the C fragment layout."""
    def pairs(v: torch.Tensor) -> list[tuple[float, float]]:
        return [(v[2 * i].item(), v[2 * i + 1].item()) for i in range(4)]
    a0, a1, b0, b1 = [], [], [], []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        lo, hi, q = pairs(w[g, 8 * t:8 * t + 8]), pairs(w[g + 8, 8 * t:8 * t + 8]), pairs(x[g, 8 * t:8 * t + 8])
        if swap:  # a plausible slip: both row-g words first
            a0.append([lo[0], lo[1], hi[0], hi[1]])
            a1.append([lo[2], lo[3], hi[2], hi[3]])
        else:
            a0.append([lo[0], hi[0], lo[1], hi[1]])
            a1.append([lo[2], hi[2], lo[3], hi[3]])
        b0.append([q[0], q[1]])
        b1.append([q[2], q[3]])
    d = _mma_m16n8k16(a0, b0) + _mma_m16n8k16(a1, b1)
    y = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):  # C fragment: c0, c1 = (row g, tokens 2t, 2t+1); c2, c3 = row g + 8
        g, t = lane // 4, lane % 4
        for e in range(4):
            row, tok = g + 8 * (e >= 2), 2 * t + (e % 2)
            y[row, tok] = d[row, tok]
    return y


def test_fragment_assignment_computes_the_block_product():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-9, 10, (16, 32), generator=gen).double()
    x = torch.randint(-9, 10, (8, 32), generator=gen).double()
    assert torch.equal(_kernel_block(w, x), w @ x.T)
    assert not torch.equal(_kernel_block(w, x, swap=True), w @ x.T), "the emulation cannot tell layouts apart"


def test_linear_fp32_cpu_is_the_reference_math():
    x, w = _problem(6, 72, 96, seed=3)
    y = linear_fp32(x.view(2, 3, 96), w)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 72)
    assert torch.equal(y.view(6, 72), F.linear(x.float(), w.float()))
    assert_gemv_close(y, x.view(2, 3, 96), w, "linear_fp32 CPU")
    assert linear_fp32(x[:0], w).shape == (0, 72)
    xi = torch.randint(-64, 65, (5, 2048)).bfloat16()  # partial sums < 2^24: exact in any order
    wi = torch.randint(-64, 65, (33, 2048)).bfloat16()
    assert torch.equal(linear_fp32(xi, wi), bf16_gemv_ref(xi, wi))


def test_tolerance_rejects_a_dropped_block():
    x, w = _problem(4, 40, 5120, seed=1)
    y = bf16_gemv_ref(x, w)
    y_bad = y - bf16_gemv_ref(x[:, :32].contiguous(), w[:, :32].contiguous())
    assert_gemv_close(y, x, w, "ref itself")
    with pytest.raises(AssertionError, match="outside"):
        assert_gemv_close(y_bad, x, w, "one 32-column block dropped")


# --- GPU -----------------------------------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("name", list(real_shapes()))
def test_bf16_gemv_real_shapes_gpu(name, m):
    n, k = real_shapes()[name]
    x, w = _problem(m, n, k, "cuda", seed=m)
    y = bf16_gemv(x, w)
    what = f"{name} M={m} N={n} K={k} {pick_params(m, n, k)}"
    assert_gemv_close(y, x, w, what)
    assert torch.equal(y, bf16_gemv(x, w)), f"{what}: not deterministic"


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_bf16_gemv_head_integers_exact_gpu(m):
    """Integer data, partial sums < 2^24: every summation order is exact, so y == ref bit for bit."""
    n, k = real_shapes()["head"]
    gen = torch.Generator("cuda").manual_seed(m)
    x = torch.randint(-8, 9, (m, k), generator=gen, device="cuda").bfloat16()
    w = torch.randint(-8, 9, (n, k), generator=gen, device="cuda").bfloat16()
    y, ref = bf16_gemv(x, w), bf16_gemv_ref(x, w)
    diff = (y != ref).nonzero()
    assert diff.numel() == 0, f"M={m}: {diff.size(0)} outputs differ; first {diff[0].tolist()}: " \
                              f"{y[tuple(diff[0])].item()} vs {ref[tuple(diff[0])].item()}"


@gpu
@needs_cuda
@pytest.mark.parametrize("p", ODD_PARAMS + [GemvParams(rt, u, 4, 2, 3) for rt, u in INSTANCES], ids=str)
@pytest.mark.parametrize("m,n,k", [(3, 1000, 1056), (8, 72, 64), (1, 16, 32), (7, 4111, 2304), (2, 33, 5120)])
def test_bf16_gemv_every_instance_on_odd_shapes_gpu(m, n, k, p):
    x, w = _problem(m, n, k, "cuda", seed=n)
    y = bf16_gemv(x, w, p)
    what = f"M={m} N={n} K={k} {p.normalised(k)}"
    assert_gemv_close(y, x, w, what)
    assert torch.equal(y, bf16_gemv(x, w, p)), f"{what}: not deterministic"
    xi = torch.randint(-8, 9, (m, k), device="cuda").bfloat16()
    wi = torch.randint(-8, 9, (n, k), device="cuda").bfloat16()
    assert torch.equal(bf16_gemv(xi, wi, p), bf16_gemv_ref(xi, wi)), f"{what}: integer data not exact"


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 8])
def test_bf16_gemv_long_k_and_same_sign_gpu(m):
    """K = MAX_K (8 cluster splits), and same-sign data against the worst-case summation bound."""
    x, w = _problem(m, 100, MAX_K, "cuda", seed=7)
    assert_gemv_close(bf16_gemv(x, w), x, w, f"M={m} K={MAX_K}")
    n, k = real_shapes()["head"]
    x, w = _problem(m, 3000, k, "cuda", seed=8)
    x, w = x.abs(), w.abs()
    assert_gemv_close(bf16_gemv(x, w), x, w, f"M={m} same sign", rel=(k // 16 + 32) * 2.0**-23)


@gpu
@needs_cuda
def test_zeros_leading_dims_and_empty_rows_gpu():
    x, w = _problem(6, 512, 5120, "cuda")
    assert torch.equal(bf16_gemv(torch.zeros_like(x), w), torch.zeros(6, 512, device="cuda"))
    assert torch.equal(bf16_gemv(x, torch.zeros_like(w)), torch.zeros(6, 512, device="cuda"))
    y = bf16_gemv(x.view(2, 3, -1), w)
    assert y.shape == (2, 3, 512) and torch.equal(y.view(6, 512), bf16_gemv(x, w))
    assert bf16_gemv(x[:0], w).shape == (0, 512)
    p = pick_params(1, 512, 5120)
    for m in range(1, MAX_M + 1):  # one token's result does not depend on the others (or on their count)
        assert torch.equal(bf16_gemv(x[:m].contiguous(), w, p)[0], bf16_gemv(x[:1].contiguous(), w, p)[0]), f"M={m}"


@gpu
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
def test_bf16_gemv_in_cuda_graph_gpu(pdl):
    """A torch kernel writes x right before each GEMV reads it (compressor shape, then the head), captured in
    one graph and replayed with new inputs: equal to the eager calls bit for bit. With PDL this checks that
    x is read only after the previous kernel completed."""
    (n1, k), (n2, _) = real_shapes()["compressor"], real_shapes()["head"]
    _, w1 = _problem(1, n1, k, "cuda", seed=1)
    _, w2 = _problem(1, n2, k, "cuda", seed=2)
    ms = (1, 4, 8)
    srcs = [torch.zeros(m, k, dtype=torch.bfloat16, device="cuda") for m in ms]
    xs = [torch.empty_like(src) for src in srcs]

    def step() -> list[torch.Tensor]:
        outs = []
        for src, x in zip(srcs, xs):
            torch.mul(src, 1.0, out=x)
            a = bf16_gemv(x, w1, replace(pick_params(x.size(0), n1, k), pdl=pdl))
            torch.mul(src, -1.0, out=x)
            outs.append((a, bf16_gemv(x, w2, replace(pick_params(x.size(0), n2, k), pdl=pdl))))
        return outs

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for seed in (5, 6):
        for m, src in zip(ms, srcs):
            src.copy_(_problem(m, n1, k, "cuda", seed=seed + m)[0])
        g.replay()
        eager = step()
        torch.cuda.synchronize()
        for m, o, e in zip(ms, outs, eager):
            for got, want in zip(o, e):
                assert torch.equal(got, want), f"M={m} seed={seed} pdl={pdl}: graph replay differs from eager"
                assert got.abs().sum() > 0, "zeros: inputs were not read"


@gpu
@needs_cuda
def test_linear_fp32_dispatch_and_no_fp32_weight_gpu(monkeypatch):
    import engine.kernels.bf16_gemv as mod

    calls = []

    def counting(x, w, params=None):
        calls.append(x.shape[0])
        return bf16_gemv(x, w, params)

    monkeypatch.setattr(mod, "bf16_gemv", counting)
    n, k = real_shapes()["head"]
    _, w = _problem(1, n, k, "cuda", seed=11)
    for m in (1, 8, 9, 64):
        x, _ = _problem(m, 8, k, "cuda", seed=m)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = mod.linear_fp32(x, w)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra < n * k, f"M={m}: {extra / 1e6:.0f} MB of temporaries (fp32 weight: {4 * n * k / 1e6:.0f} MB)"
        # M > 8 is cuBLAS bf16 -> fp32 (tensor cores: fp32 accumulation that truncates rather than rounds;
        # seen on the H200 at 2^-20.4 Σ|xw|), so its bound is 2^-18 Σ|xw| (still far below a lost term)
        assert_gemv_close(y, x, w, f"linear_fp32 M={m}", rel=REL if m <= MAX_M else CUBLAS_REL)
    assert calls == [1, 8], f"expected the GEMV for M = 1 and 8 only, got {calls}"
    x, _ = _problem(3, 8, k, "cuda")
    assert torch.equal(mod.linear_fp32(x.float(), w), F.linear(x.float(), w.float())), "fp32 x: reference math"
