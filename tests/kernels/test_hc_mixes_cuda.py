"""The CUDA mHC mixes (cuda/hc_mixes.cu, engine/kernels/mhc_cuda.py) against the golden's float64 math, with
test_norm_mhc's bounds (numeric.check_mixes_bounds: the GEMM error bound times the epilogue's gain, plus fp32 slack).

CPU (nvcc only): the source builds and the launcher rejects parameters outside its contract before any CUDA
call; pick_launch's splits divide K. GPU (@gpu, sm_90 + nvcc): several split counts at the real D = 5120 for
N = 1, 6, 8 (special rows: zero, ~1e12, ~1e-25), sharp comb logits and 1 / 2 / 20 Sinkhorn rounds; hc_mixes routes
decode shapes to it; results are deterministic and CUDA-graph capturable.
"""

import ctypes

import pytest
import torch

from engine.kernels import cuda_build
from engine.kernels.mhc import hc_mixes
from engine.kernels.mhc_cuda import (MAX_SPLITS, SIDE_SPLITS, THREADS, declare, hc_mixes_cuda, mixes_cuda_applies,
                                     pick_launch)
from engine.presets import full_config
from tests.kernels.numeric import HC, HC_EPS, ITERS, NORM_EPS, check_mixes_bounds, mhc_mix_params, mhc_stream

gpu = pytest.mark.gpu
needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")
needs_kernels = pytest.mark.skipif(not cuda_build.cuda_kernels_available(), reason="needs CUDA sm_90 and nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue


@needs_nvcc
def test_launcher_rejects_parameters_outside_the_contract(tmp_path):
    lib = declare(ctypes.CDLL(str(cuda_build.build("hc_mixes", tmp_path))))
    ok = dict(x=0, fn=0, n=2, k=20480, iters=20, splits=80, threads=THREADS, pdl=1)

    def call(a):
        return lib.dsv41_hc_mixes(a["x"] or None, a["fn"] or None, None, None, None, None, None, None, None, a["n"],
                                  a["k"], a["iters"], HC_EPS, NORM_EPS, a["splits"], a["threads"], a["pdl"], None)

    assert call(ok | dict(n=0)) == 0, "N = 0 is a valid empty call (nothing launched)"
    bad = [dict(n=-1), dict(k=0), dict(k=20484), dict(splits=0), dict(splits=1025), dict(k=20480 + 16, splits=80),
           dict(iters=0), dict(threads=128), dict(threads=512), dict(pdl=2),
           dict(x=4), dict(fn=8)]  # misaligned pointers
    for change in bad:
        assert call(ok | change) == CUDA_INVALID_VALUE, f"{change}: launcher accepted it"
        if "n" not in change:
            assert call(ok | change | dict(n=0)) == CUDA_INVALID_VALUE, f"{change} at N = 0: launcher accepted it"


def test_pick_launch_divides_k():
    for k in (20480, 16384, 1024, 256, 200 * 4, 12, 4 * 1021):
        splits = pick_launch(k)
        assert 1 <= splits <= MAX_SPLITS and k % (4 * splits) == 0, (k, splits)
    assert pick_launch(20480) == 160 and pick_launch(20480, 6) == 80
    assert pick_launch(20480, 1, beside=True) == pick_launch(20480, 6, beside=True) == SIDE_SPLITS
    assert pick_launch(12, 1, beside=True) == 3, "beside: still a divisor of the column quads"
    assert not mixes_cuda_applies(mhc_stream(1, 256), HC), "CPU tensors never go to the CUDA kernel"


LAUNCHES = [80, 160, 40, 128, 5, 1, SIDE_SPLITS]  # 128: 10 column quads a CTA (lanes 10..31 idle)


@gpu
@needs_kernels
@pytest.mark.parametrize("n", [1, 6, 8])
@pytest.mark.parametrize("launch", LAUNCHES, ids=[f"splits{s}" for s in LAUNCHES])
def test_real_shapes_within_the_bounds(n, launch):
    d = full_config().dim
    x = mhc_stream(n, d, "cuda", seed=11 + n)
    for sharp in (False, True):
        params = mhc_mix_params(d, "cuda", sharp=sharp)
        got = hc_mixes_cuda(x, *params, HC, ITERS, HC_EPS, NORM_EPS, launch)
        measured = check_mixes_bounds(got, x, *params, f"CUDA N={n} launch={launch} sharp={sharp}", ITERS)
        print(f"hc_mixes_cuda N={n} {launch} sharp={sharp}: max |err| "
              + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()))


@gpu
@needs_kernels
@pytest.mark.parametrize("iters", [1, 2])
def test_few_sinkhorn_rounds(iters):
    d = full_config().dim
    x = mhc_stream(5, d, "cuda", seed=7)
    params = mhc_mix_params(d, "cuda", sharp=True)
    check_mixes_bounds(hc_mixes_cuda(x, *params, HC, iters, HC_EPS, NORM_EPS), x, *params, f"iters={iters}", iters)


@gpu
@needs_kernels
def test_hc_mixes_routes_decode_to_cuda_and_is_graph_capturable():
    d = full_config().dim
    x = mhc_stream(6, d, "cuda", seed=3)
    params = mhc_mix_params(d, "cuda")
    want = hc_mixes_cuda(x, *params, HC, ITERS, HC_EPS, NORM_EPS)
    first = hc_mixes(x, *params, HC, ITERS, HC_EPS, NORM_EPS)
    assert all(torch.equal(a, b) for a, b in zip(first, want)), "hc_mixes did not take the CUDA kernel"
    side = hc_mixes(x, *params, HC, ITERS, HC_EPS, NORM_EPS, beside=True)
    want = hc_mixes_cuda(x, *params, HC, ITERS, HC_EPS, NORM_EPS, SIDE_SPLITS)
    assert all(torch.equal(a, b) for a, b in zip(side, want)), "beside=True did not take SIDE_SPLITS"
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(hc_mixes(x, *params, HC, ITERS, HC_EPS, NORM_EPS), first))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = hc_mixes(x, *params, HC, ITERS, HC_EPS, NORM_EPS)
    for t in captured:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, first))
