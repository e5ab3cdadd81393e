"""CUDA FP8 GEMV (cuda/fp8_gemv.cu) for decode M <= 8: same tolerance as the Triton fp8_linear.

CPU: the source compiles with nvcc (skipped without nvcc), the launcher rejects parameters outside its
contract before touching a device, the Python wrapper asserts its contract, launch shapes are valid.
GPU: real shapes x M against fp8_linear_ref (|y - ref| <= 1 bf16 ULP + FP8_LINEAR_GPU_EPS * Σ|a||w|, see
test_fp8_linear.py), every kernel instance on odd shapes, the fused act_quant bitwise (identity weight),
determinism, CUDA-graph capture, and fp8_linear's dispatch.

Grouped / bf16-exact mode (fp8_gemv_grouped, the attention's wo_a): against the float64 oracle
fp8_gemv_bf16_ref (the golden model's einsum), per output element

    |y - ref| <= 1 bf16 ULP of ref + exact_eps(K) * S + T,
    S[m, g, r] = Σ_d |x| |w|,   T[m, g, r] = Σ_d |x - sa·xs| |w|   (xs, sa = bf16_exact_stage(x)),

where T is the rounding of the elements below amax·2^-32 of their 32-block to the f16 quantum (exactly what
the staging loses: 0 for ordinary data, <= 2^-40·amax per element, checked on the CPU) and
exact_eps(K) = (K/32 + 4)·2^-23 bounds the fp32 accumulation of exact products (K/32 block additions of
relative error 2^-24 each on partial sums <= S, plus the MMA's f32 block sums, with a factor 2 margin).
At the wo_a shape >= 99% of the outputs must moreover equal the oracle bit for bit. The act_quant mode of
the grouped entry is bitwise the per-group fp8_gemv (same kernel, same reduction order).
"""

import ctypes
import time
from dataclasses import replace

import pytest
import torch

import engine.kernels.fp8_linear as fp8_linear_mod
from engine.kernels import cuda_build
from engine.kernels.fp8_gemv import (MAX_K, MAX_M, GemvParams, bf16_exact_stage, fp8_gemv, fp8_gemv_bf16_ref,
                                     fp8_gemv_grouped, gemv_applies, grouped_gemv_applies, pick_params, smem_bytes)
from engine.kernels.fp8_linear import fp8_linear, fp8_linear_ref
from engine.presets import full_config
from engine.quant import act_quant_qdq, dequant_fp8_weight, quant_fp8_weight
from tests.kernels.numeric import (FP8_LINEAR_GPU_EPS, assert_fp8_linear_close, assert_fp8_partial_close,
                                   awkward_act_rows, bf16_ulp, fp8_linear_problem)
from tests.kernels.test_fp8_linear import real_shapes

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue

ODD_PARAMS = [GemvParams(rt, u, wn, wk, s, pdl) for rt, u, wn, wk, s, pdl in
              [(1, 2, 1, 1, 1, True), (1, 4, 2, 4, 3, False), (1, 8, 8, 1, 2, True), (2, 2, 4, 2, 5, True),
               (2, 4, 2, 4, 8, True), (2, 8, 1, 8, 1, False), (2, 4, 8, 1, 7, True)]]


# --- CPU -----------------------------------------------------------------------------------------------------------

@needs_nvcc
def test_cuda_source_compiles_and_launcher_checks_its_contract(tmp_path):
    t0 = time.perf_counter()
    lib_path = cuda_build.build("fp8_gemv", tmp_path)
    assert lib_path.exists() and lib_path.parent == tmp_path
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert cuda_build.build("fp8_gemv", tmp_path) == lib_path  # cached: no second nvcc run
    assert time.perf_counter() - t0 < min(1.0, built / 4), "the second build did not hit the cache"
    lib = ctypes.CDLL(str(lib_path))
    gemv = lib.dsv41_fp8_gemv
    gemv.restype = ctypes.c_int
    gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 9 + [ctypes.c_void_p]
    ok = dict(M=1, N=64, K=1024, rt=2, u=4, wn=2, wk=2, s=2)
    bad = [dict(M=0), dict(M=9), dict(K=48), dict(K=0), dict(N=0), dict(rt=3), dict(u=3), dict(wn=8, wk=2),
           dict(s=9), dict(s=0), dict(K=96, s=4),  # 3 blocks cannot feed 4 CTAs
           dict(K=32 * 16384, s=1)]  # x tile beyond the shared-memory opt-in
    for change in bad:
        a = ok | change
        err = gemv(None, None, None, None, a["M"], a["N"], a["K"], a["rt"], a["u"], a["wn"], a["wk"], a["s"], 1, None)
        assert err == CUDA_INVALID_VALUE, f"{change}: launcher returned {err}, not cudaErrorInvalidValue"
    grouped = lib.dsv41_fp8_gemv_grouped
    grouped.restype = ctypes.c_int
    grouped.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 12 + [ctypes.c_void_p]
    ok_g = ok | dict(G=8, q=0, f32=1, N=1024)
    bad_g = bad + [dict(G=0), dict(G=65536), dict(G=2, N=48), dict(G=3, N=1000), dict(q=2), dict(q=-1), dict(f32=2),
                   dict(f32=-1)]
    for change in bad_g:
        a = ok_g | change
        err = grouped(None, None, None, None, a["M"], a["N"], a["K"], a["G"], a["q"], a["f32"], a["rt"], a["u"],
                      a["wn"], a["wk"], a["s"], 1, None)
        assert err == CUDA_INVALID_VALUE, f"grouped {change}: launcher returned {err}, not cudaErrorInvalidValue"
    lib.dsv41_cuda_error_string.restype = ctypes.c_char_p
    assert lib.dsv41_cuda_error_string(CUDA_INVALID_VALUE) == b"invalid argument"
    # the Python model of the shared memory agrees with the launcher's
    lib.dsv41_fp8_gemv_smem.restype = ctypes.c_size_t
    lib.dsv41_fp8_gemv_smem.argtypes = [ctypes.c_int] * 5
    lib.dsv41_fp8_gemv_ring_smem.restype = ctypes.c_size_t
    lib.dsv41_fp8_gemv_ring_smem.argtypes = [ctypes.c_int] * 6
    for k in (64, 1056, 1280, 2304, 5120, 8192):
        for p in ODD_PARAMS + [pick_params(1, 4096, k)]:
            p = p.normalised(k)
            c_smem = lib.dsv41_fp8_gemv_smem(k, p.row_tiles, p.warps_n, p.warps_k, p.splits)
            assert c_smem == smem_bytes(k, p), f"K={k} {p}: launcher {c_smem} B, Python {smem_bytes(k, p)} B"
            for stages in (2, 3, 4):
                c_ring = lib.dsv41_fp8_gemv_ring_smem(k, p.row_tiles, p.warps_n, p.warps_k, p.splits, stages)
                assert c_ring == smem_bytes(k, replace(p, ring=stages)), f"K={k} {p} x {stages}: {c_ring} B"
    ring = lib.dsv41_fp8_gemv_ring
    ring.restype = ctypes.c_int
    ring.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 12 + [ctypes.c_void_p]
    for change in (dict(stages=1), dict(stages=5), dict(rt=3), dict(m=9), dict(k=48), dict(s=9), dict(f32=2)):
        a = dict(m=1, n=64, k=1024, rt=2, stages=3, s=2, f32=0) | change
        err = ring(None, None, None, None, a["m"], a["n"], a["k"], 1, 1, a["f32"], a["rt"], a["stages"], 4, 1, a["s"],
                   1, None)
        assert err == CUDA_INVALID_VALUE, f"ring {change}: launcher returned {err}"


@needs_nvcc
def test_build_is_keyed_by_source(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.setattr(cuda_build, "CUDA_SRC_DIR", src)
    (src / "probe.cu").write_text('extern "C" int probe() { return 1; }\n')
    first = cuda_build.build("probe", tmp_path / "cache")
    (src / "probe.cu").write_text('extern "C" int probe() { return 2; }\n')
    second = cuda_build.build("probe", tmp_path / "cache")
    assert first != second and first.exists() and second.exists()
    lib = ctypes.CDLL(str(second))
    assert lib.probe() == 2
    assert not list((tmp_path / "cache").glob(".probe-*")), "temporary build outputs were left behind"
    (src / "bad.cu").write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        cuda_build.build("bad", tmp_path / "cache")


def test_contract_is_asserted():
    x, qw, sw = fp8_linear_problem(3, 64, 64)
    with pytest.raises(AssertionError, match="bf16"):
        fp8_gemv(x.float(), qw, sw)
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_gemv(x, qw.view(torch.uint8), sw)
    with pytest.raises(AssertionError, match="float8_e8m0fnu"):
        fp8_gemv(x, qw, sw.float())
    with pytest.raises(AssertionError, match="contiguous"):
        fp8_gemv(torch.cat([x, x], 1)[:, ::2], qw, sw)
    with pytest.raises(AssertionError, match="multiple of 32"):
        fp8_gemv(x[:, :48].contiguous(), qw[:, :48].contiguous(), sw)
    with pytest.raises(AssertionError, match="needs scale"):
        fp8_gemv(x, qw, sw[:1].contiguous())
    with pytest.raises(AssertionError, match=f"at most {MAX_M} rows"):
        fp8_gemv(fp8_linear_problem(MAX_M + 1, 64, 64)[0], qw, sw)
    with pytest.raises(AssertionError, match="out_dtype"):
        fp8_gemv(x, qw, sw, out_dtype=torch.float16)
    with pytest.raises(AssertionError, match="CUDA device"):
        fp8_gemv(x, qw, sw)
    assert not gemv_applies(x, qw), "CPU tensors must stay on the Triton path"


def test_pick_params_are_launchable():
    for m in range(1, MAX_M + 1):
        for n, k in list(real_shapes().values()) + [(1000, 1056), (16, 32), (32768, 8192), (129280, 5120), (64, MAX_K)]:
            p = pick_params(m, n, k)
            assert p == p.normalised(k), f"M={m} N={n} K={k}: {p} splits past the K blocks"
            assert p.warps_n * p.warps_k <= 8 and 1 <= p.splits <= 8 and p.row_tiles in (1, 2)
            assert smem_bytes(k, p) <= 200 * 1024, f"M={m} N={n} K={k}: {p} needs {smem_bytes(k, p)} B"


def wo_a_shape() -> tuple[int, int, int]:
    """(G, R, K) of the attention output projection wo_a at the released V4.1 shape: (8, 1024, 4096)."""
    cfg = full_config()
    return cfg.o_groups, cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups


def exact_eps(k: int) -> float:
    return (k // 32 + 4) * 2.0**-23


def _staged(x: torch.Tensor) -> torch.Tensor:
    """sa·xs of bf16_exact_stage as float64: x as the bf16-exact kernel sees it."""
    xs, sa = bf16_exact_stage(x)
    return (xs.double().unflatten(-1, (-1, 32)) * sa.double().unsqueeze(-1)).flatten(-2)


def assert_bf16_exact_close(y, x, qw, sw, groups: int, what: str, min_bitwise: float = 0.0) -> None:
    """The module docstring's tolerance against fp8_gemv_bf16_ref (computed on the CPU in float64)."""
    x, qw, sw, y = x.cpu(), qw.cpu(), sw.cpu(), y.cpu()
    ref = fp8_gemv_bf16_ref(x, qw, sw, groups)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16, f"{what}: got {y.dtype} {tuple(y.shape)}"
    rows, k = qw.shape
    w = dequant_fp8_weight(qw, sw).double().view(groups, rows // groups, k).abs()
    xd = x.double().reshape(-1, groups, k)
    s_abs = torch.einsum("mgd,grd->mgr", xd.abs(), w).flatten()
    t_tiny = torch.einsum("mgd,grd->mgr", (xd - _staged(x.reshape(-1, groups, k))).abs(), w).flatten()
    yf, rf = y.double().flatten(), ref.double().flatten()
    ulp = bf16_ulp(rf, 2.0**-100)
    allowed = ulp + exact_eps(k) * s_abs + t_tiny
    err = (yf - rf).abs()
    bad = ~(err <= allowed)  # NaN fails
    if bad.any():
        i = int(torch.where(bad, err / allowed, torch.inf).nan_to_num(posinf=1e30).argmax())
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance; worst flat index {i}: "
                    f"y={yf[i].item():.6g} ref={rf[i].item():.6g} err={err[i].item():.3g} allowed="
                    f"{allowed[i].item():.3g} ({err[i].item() / ulp[i].item():.1f} ULP, S={s_abs[i].item():.3g}, "
                    f"T={t_tiny[i].item():.3g})")
    bitwise = (yf == rf).double().mean().item()
    assert bitwise >= min_bitwise, f"{what}: only {100 * bitwise:.3f}% of outputs equal the oracle bit for bit"


def _grouped_problem(m: int, groups: int, n: int, k: int, device: str = "cpu", seed: int = 0):
    """x bf16 [m, G, K] (wide dynamic range, a zero row, a loud block) and the stacked FP8 weight [G·n, K]."""
    x, qw, sw = fp8_linear_problem(m, groups * n, groups * k, seed=seed)  # x [m, G·K]: the same value mix
    w = torch.randn(groups * n, k, generator=torch.Generator().manual_seed(seed + 1)) * 0.02
    perm = torch.randperm(groups * n, generator=torch.Generator().manual_seed(seed))
    w *= torch.logspace(-1, 1, groups * n)[perm][:, None]
    qw, sw = quant_fp8_weight(w)
    return x.view(m, groups, k).to(device), qw.to(device), sw.to(device)


def test_bf16_exact_stage_derivation():
    """The staging's claims (cuda/fp8_gemv.cu header) over every finite bf16 pattern and edge blocks: sa a
    power of two (1 for zero blocks), |xs| <= 65280, sa·xs == x for |x| >= amax·2^-32, and below that an
    error <= 2^(floor(log2 amax) - 40)."""
    g = torch.Generator().manual_seed(7)
    rows = [awkward_act_rows(64)]
    edge = torch.zeros(10, 32)
    edge[0, 0] = 2.0**-133  # the smallest subnormal bf16 as amax: sa floored at 2^-126
    edge[0, 1:] = torch.randint(-127, 128, (31,), generator=g) * 2.0**-133
    edge[1, 0] = 2.0**-126  # the smallest normal
    edge[2] = torch.finfo(torch.bfloat16).max * torch.linspace(-1, 1, 32)  # amax = bf16 max: |xs| = 65280
    edge[3, 0] = 1.0  # amax a power of two, tails at and around the exactness threshold 2^-32
    edge[3, 1:] = torch.tensor([2.0**-e for e in range(17, 48)])
    edge[4] = edge[3] * (1 + 2.0**-7)  # amax with all 8 bits set
    edge[5, 0] = -3.0
    edge[5, 1:] = torch.randn(31, generator=g) * 2.0 ** torch.randint(-45, 0, (31,), generator=g)
    edge[6, 0] = 2.0**-112  # just above the -126 floor
    edge[6, 1:] = torch.randn(31, generator=g) * 2.0**-125
    edge[7] = -0.0
    edge[8, 5] = 1.0
    edge[8, 6] = (2.0**-32) * 1.5  # a tail with the low bit set, just above threshold
    edge[9, ::3] = 1.0e-20
    rows.append(edge.bfloat16().view(-1, 64))
    x = torch.cat(rows)
    xs, sa = bf16_exact_stage(x)
    assert xs.dtype == torch.float16 and sa.dtype == torch.float32 and sa.shape == (x.size(0), 2)
    mant, e = torch.frexp(sa)
    assert torch.all(mant == 0.5), "sa must be a power of two"
    xf = x.float().unflatten(-1, (-1, 32))
    amax = xf.abs().amax(-1)
    assert torch.all(sa[amax == 0] == 1.0), "an all-zero block has sa = 1"
    assert torch.all(sa >= 2.0**-126), "sa is floored at 2^-126 (a normal fp32)"
    assert xs.float().abs().max() <= 65280 and torch.isfinite(xs).all()
    err = (_staged(x).unflatten(-1, (-1, 32)) - xf.double()).abs()
    exact = xf.abs() >= amax.unsqueeze(-1) * 2.0**-32
    assert torch.all(err[exact] == 0), f"{int((err[exact] != 0).sum())} values above amax·2^-32 are not exact"
    e_amax = torch.frexp(amax.double())[1] - 1  # floor(log2 amax)
    assert torch.all(err <= torch.ldexp(torch.ones_like(err), e_amax.unsqueeze(-1) - 40))
    assert (~exact).sum() > 1000 and err.max() > 0, "the edge cases must exercise the rounding"


def test_bf16_ref_is_the_golden_einsum():
    """fp8_gemv_bf16_ref is engine/model/attention.py's wo_a product (weights dequantised to bf16, float64
    einsum, bf16) bit for bit, and its layouts for G = 1 and G > 1."""
    x, qw, sw = _grouped_problem(5, 4, 64, 96, seed=3)
    golden = torch.einsum("bsgd,grd->bsgr", x.unsqueeze(0).double(),
                          dequant_fp8_weight(qw, sw).to(torch.bfloat16).double().view(4, 64, 96)).to(torch.bfloat16)
    ref = fp8_gemv_bf16_ref(x, qw, sw, 4)
    assert ref.shape == (5, 4, 64) and torch.equal(ref, golden[0])
    one = fp8_gemv_bf16_ref(x[:, 1], qw[64:128], sw[2:4], 1)
    assert one.shape == (5, 64) and torch.equal(one, ref[:, 1])


def test_grouped_contract_is_asserted():
    x, qw, sw = _grouped_problem(3, 2, 64, 64)
    with pytest.raises(AssertionError, match="bf16"):
        fp8_gemv_grouped(x.float(), qw, sw, 2, False)
    with pytest.raises(AssertionError, match="needs scale"):
        fp8_gemv_grouped(x, qw, sw[:1].contiguous(), 2, False)
    with pytest.raises(AssertionError, match="equal groups"):
        fp8_gemv_grouped(torch.zeros(1, 3, 64, dtype=torch.bfloat16), qw, sw, 3, False)  # 128 rows
    with pytest.raises(AssertionError, match="multiple of 32"):
        fp8_gemv_grouped(torch.zeros(1, 8, 64, dtype=torch.bfloat16), qw, sw, 8, False)  # 16 rows per group
    with pytest.raises(AssertionError, match=r"must be \[\.\.\., 2, 64\]"):
        fp8_gemv_grouped(x.view(6, 64), qw, sw, 2, False)
    with pytest.raises(AssertionError, match="groups must be"):
        fp8_gemv_grouped(x, qw, sw, 0, False)
    with pytest.raises(AssertionError, match=f"at most {MAX_M} tokens"):
        fp8_gemv_grouped(torch.zeros(MAX_M + 1, 2, 64, dtype=torch.bfloat16), qw, sw, 2, True)
    with pytest.raises(AssertionError, match="CUDA device"):
        fp8_gemv_grouped(x, qw, sw, 2, False)
    assert not grouped_gemv_applies(x, qw, 2), "CPU tensors cannot take the CUDA kernel"


def test_pick_params_grouped_are_launchable():
    g, r, k = wo_a_shape()
    assert (g, r, k) == (8, 1024, 4096)
    for m in range(1, MAX_M + 1):
        for groups, n, kk in [(g, r, k), (2, 64, 64), (3, 96, 1056), (64, 32, 512)]:
            p = pick_params(m, n, kk, 132, groups)
            assert p == p.normalised(kk) and p.warps_n * p.warps_k <= 8 and 1 <= p.splits <= 8
            assert smem_bytes(kk, p) <= 200 * 1024
    assert pick_params(1, 1280, 5120, 132, 1) == pick_params(1, 1280, 5120), "G = 1 keeps the tuned shapes"


# --- GPU: real V4.1 shapes -----------------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("name", list(real_shapes()))
def test_fp8_gemv_real_shapes_gpu(name, m):
    n, k = real_shapes()[name]
    x, qw, sw = fp8_linear_problem(m, n, k, "cuda", seed=m)
    y = fp8_gemv(x, qw, sw)
    what = f"{name} M={m} N={n} K={k} {pick_params(m, n, k)}"
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_GPU_EPS, what)
    assert torch.equal(y, fp8_gemv(x, qw, sw)), f"{what}: not deterministic"


def rank_shapes(num_shards: int = 8) -> dict[str, tuple[int, int]]:
    """The row-parallel FP8 linears of one rank at the released config: wo_b over its output groups' features, the
    shared expert's w2 over its intermediate features (the products that leave the GEMV in fp32, unrounded)."""
    cfg = full_config()
    return {"wo_b": (cfg.dim, cfg.o_groups * cfg.o_lora_rank // num_shards),
            "shared_w2": (cfg.dim, cfg.moe_inter_dim // num_shards)}


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 6, 8])
@pytest.mark.parametrize("shape", [rank_shapes(8)["wo_b"], rank_shapes(8)["shared_w2"], rank_shapes(4)["wo_b"],
                                   real_shapes()["wo_b"], (1000, 1056)], ids=str)
@pytest.mark.parametrize("ring", [0, 3])
def test_fp32_out_is_the_sum_before_its_rounding_gpu(shape, m, ring):
    """out_dtype=fp32 (fp8_gemv and the grouped entry): within eps S of fp8_linear_ref's fp32 accumulator, and bf16
    of it bit for bit the bf16 form of the same launch shape (register and ring forms); deterministic."""
    n, k = shape
    x, qw, sw = fp8_linear_problem(m, n, k, "cuda", seed=m + n)
    p = replace(pick_params(m, n, k), ring=ring)
    if smem_bytes(k, p.normalised(k)) > 200 * 1024:
        pytest.skip("over the shared-memory opt-in")
    y = fp8_gemv(x, qw, sw, p, out_dtype=torch.float32)
    what = f"M={m} N={n} K={k} {p.normalised(k)}"
    assert_fp8_partial_close(y, fp8_linear_ref(x, qw, sw, torch.float32), x, qw, sw, FP8_LINEAR_GPU_EPS, what,
                             fp8_gemv(x, qw, sw, p).cpu())
    assert torch.equal(y, fp8_gemv(x, qw, sw, p, out_dtype=torch.float32)), f"{what}: not deterministic"
    assert torch.equal(fp8_linear(x, qw, sw, out_dtype=torch.float32), fp8_gemv(x, qw, sw, out_dtype=torch.float32))
    xg, qg, sg = _grouped_problem(m, 2, 64, 128, "cuda", seed=m)
    yg = fp8_gemv_grouped(xg, qg, sg, 2, False, out_dtype=torch.float32)
    assert yg.dtype == torch.float32 and torch.equal(yg.to(torch.bfloat16), fp8_gemv_grouped(xg, qg, sg, 2, False))


@gpu
@needs_cuda
@pytest.mark.parametrize("p", ODD_PARAMS, ids=str)
@pytest.mark.parametrize("m,n,k", [(3, 1000, 1056), (8, 72, 64), (1, 16, 32), (7, 4111, 2304)])
def test_fp8_gemv_every_instance_on_odd_shapes_gpu(m, n, k, p):
    x, qw, sw = fp8_linear_problem(m, n, k, "cuda", seed=n)
    y = fp8_gemv(x, qw, sw, p)
    what = f"M={m} N={n} K={k} {p.normalised(k)}"
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_GPU_EPS, what)
    assert torch.equal(y, fp8_gemv(x, qw, sw, p)), f"{what}: not deterministic"


@gpu
@needs_cuda
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("p", ODD_PARAMS, ids=str)
@pytest.mark.parametrize("m,n,k", [(3, 1000, 1056), (8, 72, 64), (7, 4111, 2304), (1, 32768, 1280)])
def test_ring_form_is_bitwise_the_register_form_gpu(m, n, k, p, stages):
    """fp8_gemv_ring (weights through the shared-memory ring) against fp8_gemv with the same launch shape: the
    same products, sums and order, so equal bit for bit (odd K ranges leave partial ring stages)."""
    x, qw, sw = fp8_linear_problem(m, n, k, "cuda", seed=n + stages)
    ring = replace(p, ring=stages)
    if smem_bytes(k, ring.normalised(k)) > 200 * 1024:
        pytest.skip("over the shared-memory opt-in")
    assert torch.equal(fp8_gemv(x, qw, sw, ring), fp8_gemv(x, qw, sw, p)), f"M={m} N={n} K={k} {ring.normalised(k)}"


@gpu
@needs_cuda
@pytest.mark.parametrize("stages", [2, 4])
def test_ring_form_grouped_bf16_exact_gpu(stages):
    g, r, k = wo_a_shape()
    _, qw, sw = fp8_linear_problem(1, g * r, k, "cuda", seed=3)
    x = torch.randn(5, g, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)).bfloat16()
    p = pick_params(5, r, k, groups=g)
    assert torch.equal(fp8_gemv_grouped(x, qw, sw, g, False, replace(p, ring=stages)),
                       fp8_gemv_grouped(x, qw, sw, g, False, p))


@gpu
@needs_cuda
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fused_act_quant_is_bitwise_gpu():
    """Identity weight (E4M3 1.0, scale 2^0): y = bf16(qa * sa) exactly, i.e. act_quant_qdq bit for bit."""
    k = 512
    rows = awkward_act_rows(k).cuda()
    qw = (torch.eye(k, device="cuda")).to(torch.float8_e4m3fn)
    sw = torch.ones(k // 32, k // 32, device="cuda").to(torch.float8_e8m0fnu)
    for lo in range(0, rows.size(0), MAX_M):
        x = rows[lo:lo + MAX_M].contiguous()
        got = fp8_gemv(x, qw, sw).cpu()
        want = act_quant_qdq(x.cpu())
        diff = (got.float() != want.float()).nonzero()  # bitwise but for the sign of zero (fp32 sums of ±0)
        assert diff.numel() == 0, (
            f"rows {lo}..: {diff.size(0)} values differ; first {diff[0].tolist()}: x={x[tuple(diff[0])].item()} "
            f"kernel={got[tuple(diff[0])].item()} ref={want[tuple(diff[0])].item()}")


@gpu
@needs_cuda
def test_leading_dims_and_empty_rows_gpu():
    x, qw, sw = fp8_linear_problem(6, 512, 5120, "cuda")
    y = fp8_gemv(x.view(2, 3, -1), qw, sw)
    assert y.shape == (2, 3, 512) and torch.equal(y.view(6, 512), fp8_gemv(x, qw, sw))
    assert fp8_gemv(x[:0], qw, sw).shape == (0, 512)


@gpu
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
def test_fp8_gemv_chain_in_cuda_graph_gpu(pdl):
    """wq_a then wq_b, each reading what the kernel just before it wrote (the first: a torch kernel), captured
    in one graph and replayed twice with new inputs: equal to the eager calls bit for bit. With PDL this
    checks that x is read only after the previous kernel completed."""
    (n1, k1), (n2, k2) = real_shapes()["wq_a"], real_shapes()["wq_b"]
    assert n1 == k2
    _, w1, s1 = fp8_linear_problem(1, n1, k1, "cuda", seed=1)
    _, w2, s2 = fp8_linear_problem(1, n2, k2, "cuda", seed=2)
    ms = (1, 4, 8)
    srcs = [torch.zeros(m, k1, dtype=torch.bfloat16, device="cuda") for m in ms]
    xs = [torch.empty_like(src) for src in srcs]

    def step() -> list[torch.Tensor]:
        outs = []
        for src, x in zip(srcs, xs):
            torch.mul(src, 1.0, out=x)  # a kernel writes x right before the first GEMV reads it
            q = fp8_gemv(x, w1, s1, replace(pick_params(x.size(0), n1, k1), pdl=pdl))
            outs.append(fp8_gemv(q, w2, s2, replace(pick_params(x.size(0), n2, k2), pdl=pdl)))
        return outs

    step()  # warm-up (and the build) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for seed in (5, 6):
        for m, src in zip(ms, srcs):
            src.copy_(fp8_linear_problem(m, n1, k1, "cuda", seed=seed + m)[0])
        g.replay()
        eager = step()
        torch.cuda.synchronize()
        for m, o, e in zip(ms, outs, eager):
            assert torch.equal(o, e), f"M={m} seed={seed} pdl={pdl}: graph replay differs from the eager calls"
            assert o.float().abs().sum() > 0, "the chain produced zeros: inputs were not read"


@gpu
@needs_cuda
def test_fp8_linear_dispatches_to_gemv_gpu(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return fp8_gemv(*args, **kwargs)

    monkeypatch.setattr(fp8_linear_mod, "fp8_gemv", counting)
    n, k = real_shapes()["wq_a"]
    for m in (1, 8, 9):
        x, qw, sw = fp8_linear_problem(m, n, k, "cuda")
        y = fp8_linear(x, qw, sw)
        assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_GPU_EPS, f"fp8_linear M={m}")
    assert [s[0] for s in calls] == [1, 8], f"expected the GEMV for M = 1 and 8 only, got {calls}"
    x, qw, sw = fp8_linear_problem(4, n, k, "cuda")
    fp8_linear(x, qw, sw, fp8_linear_mod.pick_config(4, n, k))  # an explicit config keeps the Triton path
    assert len(calls) == 2


# --- GPU: grouped GEMV, bf16-exact mode (wo_a) ----------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("m", list(range(1, MAX_M + 1)))
def test_wo_a_bf16_exact_real_shape_gpu(m):
    groups, r, k = wo_a_shape()
    x, qw, sw = _grouped_problem(m, groups, r, k, "cuda", seed=m)
    y = fp8_gemv_grouped(x, qw, sw, groups, False)
    what = f"wo_a M={m} G={groups} R={r} K={k} {pick_params(m, r, k, 132, groups)}"
    assert y.shape == (m, groups, r)
    assert_bf16_exact_close(y, x, qw, sw, groups, what, min_bitwise=0.99)
    assert torch.equal(y, fp8_gemv_grouped(x, qw, sw, groups, False)), f"{what}: not deterministic"
    # the leading dims: [1, m, G, K] (the runner's [T, G, K] with a batch dim) gives the same bits
    assert torch.equal(fp8_gemv_grouped(x.unsqueeze(0), qw, sw, groups, False)[0], y)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8])
def test_grouped_act_quant_is_per_group_fp8_gemv_gpu(m):
    """quant_x=True: each group bit for bit the plain fp8_gemv on its weight rows (and so fp8_linear_ref)."""
    groups, r, k = wo_a_shape()
    x, qw, sw = _grouped_problem(m, groups, r, k, "cuda", seed=10 + m)
    p = pick_params(m, r, k, 132, groups)
    y = fp8_gemv_grouped(x, qw, sw, groups, True, p)
    for g in range(groups):
        xg, wg, sg = x[:, g].contiguous(), qw[g * r:(g + 1) * r], sw[g * r // 32:(g + 1) * r // 32]
        assert torch.equal(y[:, g], fp8_gemv(xg, wg, sg, p)), f"M={m} group {g}: differs from fp8_gemv"
        assert_fp8_linear_close(y[:, g].contiguous(), fp8_linear_ref(xg, wg, sg), xg, wg, sg, FP8_LINEAR_GPU_EPS,
                                f"M={m} group {g}")


@gpu
@needs_cuda
@pytest.mark.parametrize("quant_x", [False, True], ids=["exact", "act_quant"])
@pytest.mark.parametrize("p", ODD_PARAMS, ids=str)
@pytest.mark.parametrize("m,groups,n,k", [(3, 3, 96, 1056), (8, 2, 64, 64), (1, 1, 1000, 1056), (7, 5, 160, 2304),
                                          (2, 1, 16, 32), (5, 8, 32, 4096)])
def test_grouped_every_instance_on_odd_shapes_gpu(m, groups, n, k, p, quant_x):
    """Row counts that are not a multiple of the CTA's rows (R = 96, 160, 1000 vs 16..256), tiny K, G = 1."""
    x, qw, sw = _grouped_problem(m, groups, n, k, "cuda", seed=n + k)
    xin = x if groups > 1 else x.view(m, k)
    y = fp8_gemv_grouped(xin, qw, sw, groups, quant_x, p)
    what = f"M={m} G={groups} R={n} K={k} {p.normalised(k)} quant_x={quant_x}"
    if quant_x:
        for g in range(groups):
            xg, wg, sg = x[:, g].contiguous(), qw[g * n:(g + 1) * n], sw[g * n // 32:-(-(g + 1) * n // 32)]
            yg = (y[:, g] if groups > 1 else y).contiguous()
            assert_fp8_linear_close(yg, fp8_linear_ref(xg, wg, sg), xg, wg, sg, FP8_LINEAR_GPU_EPS, f"{what} group {g}")
    else:
        assert_bf16_exact_close(y, xin, qw, sw, groups, what)
    assert torch.equal(y, fp8_gemv_grouped(xin, qw, sw, groups, quant_x, p)), f"{what}: not deterministic"


@gpu
@needs_cuda
def test_bf16_exact_staging_is_bitwise_gpu():
    """Identity weights per group (E4M3 1.0, scale 2^0): y[m, g, r] = sa·xs of bf16_exact_stage exactly, over
    every finite bf16 pattern and the quantiser's awkward blocks (a flushed f16 subnormal or a wrong scale
    shows up as a mismatch)."""
    groups, k = 2, 256
    rows = awkward_act_rows(groups * k).view(-1, groups, k).cuda()
    qw = torch.eye(k, device="cuda").repeat(groups, 1).to(torch.float8_e4m3fn)
    sw = torch.ones(groups * k // 32, k // 32, device="cuda").to(torch.float8_e8m0fnu)
    for lo in range(0, rows.size(0), MAX_M):
        x = rows[lo:lo + MAX_M].contiguous()
        got = fp8_gemv_grouped(x, qw, sw, groups, False).cpu()
        want = _staged(x.cpu()).to(torch.bfloat16)  # sa·xs has <= 8 significant bits: exact in bf16
        diff = (got.float() != want.float()).nonzero()  # bitwise but for the sign of zero
        assert diff.numel() == 0, (
            f"rows {lo}..: {diff.size(0)} values differ; first {diff[0].tolist()}: x={x[tuple(diff[0])].item()} "
            f"kernel={got[tuple(diff[0])].item()} staged={want[tuple(diff[0])].item()}")


@gpu
@needs_cuda
def test_bf16_exact_zeros_and_dynamic_range_gpu():
    """Zero rows, zero weights, f16-subnormal staging (tails 2^-22..2^-19 below a max whose weight column is
    0, so y depends on the tails only), tails below the exactness threshold, subnormal bf16 blocks, 2^100."""
    g = torch.Generator().manual_seed(11)
    groups, n, k = 2, 64, 256

    def tail(lo: int, hi: int, count: int = 31) -> torch.Tensor:
        sign = torch.randint(0, 2, (count,), generator=g) * 2 - 1
        return sign * 2.0 ** (lo + (hi - lo) * torch.rand(count, generator=g))

    x = torch.randn(6, groups, k, generator=g)
    x[0] = 0
    x[1, 0] = 0
    x[1, 0, 0], x[1, 0, 1:32] = 1024.0, tail(-22, -19)  # exact f16 subnormals after staging (sa = 2^-5)
    x[2, 0] = 0
    x[2, 0, 32], x[2, 0, 33:64] = -1024.0, tail(-30, -22)  # below amax·2^-32: rounded (the T term)
    x[3, 1] = 0
    x[3, 1, :32] = tail(-133, -127, 32)  # subnormal bf16 block: sa floored at 2^-126, exact
    x[4, 1, :32] *= 2.0**100
    x[4, 1, 32:64] = tail(-60, 0, 32)
    x[5, 0, :32] = tail(-40, 20, 32)
    x = x.bfloat16()
    w = torch.randn(groups * n, k, generator=g) * 0.02
    w[:n, 0] = 0  # the maxima of rows 1 and 2 meet zero weights
    w[:n, 32] = 0
    w[n:] *= 3000  # group 1: large weights, so row 3's subnormal inputs give normal outputs
    qw, sw = quant_fp8_weight(w)
    y = fp8_gemv_grouped(x.cuda(), qw.cuda(), sw.cuda(), groups, False)
    assert_bf16_exact_close(y, x, qw, sw, groups, "dynamic range")
    assert torch.all(y[0] == 0), "a zero row must give zeros"
    assert y[1, 0].float().abs().min() > 0, "the f16-subnormal tails were lost"
    assert y[3, 1].float().abs().min() > 0, "the subnormal bf16 block was lost"
    zq, zs = quant_fp8_weight(torch.zeros(groups * n, k))
    assert torch.all(fp8_gemv_grouped(x.cuda(), zq.cuda(), zs.cuda(), groups, False) == 0), "zero weights"


@gpu
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
def test_wo_a_then_wo_b_in_cuda_graph_gpu(pdl):
    """The runner's chain: a torch kernel writes o, wo_a (grouped, bf16-exact) reads it, wo_b (fp8_gemv)
    reads wo_a's output; captured in a graph and replayed with new inputs: equal to eager calls bit for bit."""
    groups, r, k = wo_a_shape()
    n2, k2 = real_shapes()["wo_b"]
    assert k2 == groups * r
    _, w1, s1 = _grouped_problem(1, groups, r, k, "cuda", seed=1)
    _, w2, s2 = fp8_linear_problem(1, n2, k2, "cuda", seed=2)
    ms = (1, 4, 8)
    srcs = [torch.zeros(m, groups, k, dtype=torch.bfloat16, device="cuda") for m in ms]
    xs = [torch.empty_like(src) for src in srcs]

    def step() -> list[torch.Tensor]:
        outs = []
        for src, x in zip(srcs, xs):
            torch.mul(src, 1.0, out=x)
            p1 = replace(pick_params(x.size(0), r, k, 132, groups), pdl=pdl)
            o = fp8_gemv_grouped(x, w1, s1, groups, False, p1)
            outs.append(fp8_gemv(o.view(x.size(0), -1), w2, s2, replace(pick_params(x.size(0), n2, k2), pdl=pdl)))
        return outs

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (5, 6):
        for m, src in zip(ms, srcs):
            src.copy_(_grouped_problem(m, groups, r, k, "cuda", seed=seed + m)[0])
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for m, o, e in zip(ms, outs, eager):
            assert torch.equal(o, e), f"M={m} seed={seed} pdl={pdl}: graph replay differs from the eager calls"
            assert o.float().abs().sum() > 0, "the chain produced zeros: inputs were not read"
