"""CUDA FP8 GEMV (cuda/fp8_gemv.cu) for decode M <= 8: same tolerance as the Triton fp8_linear.

CPU: the source compiles with nvcc (skipped without nvcc), the launcher rejects parameters outside its
contract before touching a device, the Python wrapper asserts its contract, launch shapes are valid.
GPU: real shapes x M against fp8_linear_ref (|y - ref| <= 1 bf16 ULP + GPU_EPS * Σ|a||w|, see
test_fp8_linear.py), every kernel instance on odd shapes, the fused act_quant bitwise (identity weight),
determinism, CUDA-graph capture, and fp8_linear's dispatch.
"""

import ctypes
import time
from dataclasses import replace

import pytest
import torch

import engine.kernels.fp8_linear as fp8_linear_mod
from engine.kernels import cuda_build
from engine.kernels.fp8_gemv import (MAX_K, MAX_M, GemvParams, fp8_gemv, gemv_applies, pick_params,
                                     smem_bytes)
from engine.kernels.fp8_linear import fp8_linear, fp8_linear_ref
from engine.quant import act_quant_qdq
from tests.kernels.test_fp8_linear import GPU_EPS, _awkward_rows, _problem, assert_fp8_linear_close, real_shapes

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
    lib.dsv41_cuda_error_string.restype = ctypes.c_char_p
    assert lib.dsv41_cuda_error_string(CUDA_INVALID_VALUE) == b"invalid argument"
    # the Python model of the shared memory agrees with the launcher's
    lib.dsv41_fp8_gemv_smem.restype = ctypes.c_size_t
    lib.dsv41_fp8_gemv_smem.argtypes = [ctypes.c_int] * 5
    for k in (64, 1056, 1280, 2304, 5120, 8192):
        for p in ODD_PARAMS + [pick_params(1, 4096, k)]:
            p = p.normalised(k)
            c_smem = lib.dsv41_fp8_gemv_smem(k, p.row_tiles, p.warps_n, p.warps_k, p.splits)
            assert c_smem == smem_bytes(k, p), f"K={k} {p}: launcher {c_smem} B, Python {smem_bytes(k, p)} B"


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
    x, qw, sw = _problem(3, 64, 64)
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
        fp8_gemv(_problem(MAX_M + 1, 64, 64)[0], qw, sw)
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


# --- GPU: real V4.1 shapes -----------------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("name", list(real_shapes()))
def test_fp8_gemv_real_shapes_gpu(name, m):
    n, k = real_shapes()[name]
    x, qw, sw = _problem(m, n, k, "cuda", seed=m)
    y = fp8_gemv(x, qw, sw)
    what = f"{name} M={m} N={n} K={k} {pick_params(m, n, k)}"
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, GPU_EPS, what)
    assert torch.equal(y, fp8_gemv(x, qw, sw)), f"{what}: not deterministic"


@gpu
@needs_cuda
@pytest.mark.parametrize("p", ODD_PARAMS, ids=str)
@pytest.mark.parametrize("m,n,k", [(3, 1000, 1056), (8, 72, 64), (1, 16, 32), (7, 4111, 2304)])
def test_fp8_gemv_every_instance_on_odd_shapes_gpu(m, n, k, p):
    x, qw, sw = _problem(m, n, k, "cuda", seed=n)
    y = fp8_gemv(x, qw, sw, p)
    what = f"M={m} N={n} K={k} {p.normalised(k)}"
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, GPU_EPS, what)
    assert torch.equal(y, fp8_gemv(x, qw, sw, p)), f"{what}: not deterministic"


@gpu
@needs_cuda
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fused_act_quant_is_bitwise_gpu():
    """Identity weight (E4M3 1.0, scale 2^0): y = bf16(qa * sa) exactly, i.e. act_quant_qdq bit for bit."""
    k = 512
    rows = _awkward_rows(k).cuda()
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
    x, qw, sw = _problem(6, 512, 5120, "cuda")
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
    _, w1, s1 = _problem(1, n1, k1, "cuda", seed=1)
    _, w2, s2 = _problem(1, n2, k2, "cuda", seed=2)
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
            src.copy_(_problem(m, n1, k1, "cuda", seed=seed + m)[0])
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
        x, qw, sw = _problem(m, n, k, "cuda")
        y = fp8_linear(x, qw, sw)
        assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, GPU_EPS, f"fp8_linear M={m}")
    assert [s[0] for s in calls] == [1, 8], f"expected the GEMV for M = 1 and 8 only, got {calls}"
    x, qw, sw = _problem(4, n, k, "cuda")
    fp8_linear(x, qw, sw, fp8_linear_mod.pick_config(4, n, k))  # an explicit config keeps the Triton path
    assert len(calls) == 2
