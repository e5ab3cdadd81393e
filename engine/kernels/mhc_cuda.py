"""mHC mixes at decode: the CUDA C++ kernel of `cuda/hc_mixes.cu` (engine.kernels.mhc.hc_mixes's contract,
hc = 4, whose docstring and tests state the math and the bounds).

Why CUDA: the Triton hc_mixes ends in one split-K program that runs the Sinkhorn on [16, 8, 4] tiles behind a
ticket hand-off, ~10 us per call at decode for 2 MB of fn. Here `splits` CTAs of 8 warps split K per token
(each warp 3 fn rows, a lane's loads all in flight together), the token's last CTA sums the partials in split
order (deterministic) and one warp runs the epilogue from registers.

Launch shape: `splits` CTAs of 256 threads per token, K / splits columns each. The split-K tickets are this
module's own (one buffer per device, zero between launches): one stream at a time.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import Tensor

from engine.kernels.cuda_build import cuda_kernels_available, load

HC = 4  # the only hc the kernel takes
MAX_ROWS = 8  # decode: the router sends larger N to the Triton kernel
MAX_SPLITS = 1024
THREADS = 256  # 8 warps x 3 fn rows (the kernel's only block size)
_TICKETS: dict[torch.device, Tensor] = {}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The C signatures of cuda/hc_mixes.cu's entry points on a loaded library (also used by the CPU tests)."""
    lib.dsv41_hc_mixes.restype = ctypes.c_int
    lib.dsv41_hc_mixes.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_int] * 3 + [ctypes.c_float] * 2
                                   + [ctypes.c_int] * 3 + [ctypes.c_void_p])
    lib.dsv41_hc_mixes_error_string.restype = ctypes.c_char_p
    lib.dsv41_hc_mixes_error_string.argtypes = [ctypes.c_int]
    return lib


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    return declare(load("hc_mixes"))


# Splits per token of a call beside other kernels (on a side stream): fewer, longer CTAs. Beside the attention and
# the MoE at decode, 16 took the mixes off the critical path (H200, layer bench at 8K, T = 1: every layer kind
# 10-19 us faster); the 160 of pick_launch slowed the kernels beside them as much as the mixes took alone.
SIDE_SPLITS = 16


def pick_launch(k: int, n: int = 1, beside: bool = False) -> int:
    """Splits per token: 32 column quads per CTA for one token (160 CTAs at K = 20480), 64 for more (80 per
    token), SIDE_SPLITS beside other kernels, fewer where K does not divide. From the H200 sweep (2026-11-30,
    K = 20480): N = 1 7.5 us at 160 splits, 8.5 at 80; N = 6 / 8 8.7 / 9.0 us at 80, 10.0 / 10.8 at 160 (Triton:
    10.0 / 10.9 / 11.0)."""
    splits = SIDE_SPLITS if beside else k // (128 if n == 1 else 256)
    splits = max(1, min(MAX_SPLITS, splits))
    while splits > 1 and k % (4 * splits):
        splits -= 1
    return splits


def _tickets(device: torch.device) -> Tensor:
    if device not in _TICKETS:  # zeroed on first eager use (made inside a capture: see fp8_linear.split_k_tickets)
        assert not torch.cuda.is_current_stream_capturing(), "hc_mixes_cuda tickets made during a CUDA-graph capture"
        _TICKETS[device] = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
    return _TICKETS[device]


def mixes_cuda_applies(x: Tensor, hc: int) -> bool:
    """Whether hc_mixes_cuda takes this call: CUDA sm_90 with nvcc, hc = 4, 1 <= N <= MAX_ROWS."""
    return (x.is_cuda and hc == HC and x.dim() == 3 and 1 <= x.size(0) <= MAX_ROWS
            and cuda_kernels_available(x.device.index or 0))


def hc_mixes_cuda(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
                  norm_eps: float, splits: int | None = None, beside: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """x bf16 [N, 4, D] (contiguous, 1 <= N <= MAX_ROWS), fn fp32 [24, 4·D], scale fp32 [3], base fp32 [24] ->
    (pre fp32 [N, 4], post fp32 [N, 4], comb fp32 [N, 4, 4]). splits overrides pick_launch (tests, sweeps);
    beside: the call runs beside other kernels (pick_launch's SIDE_SPLITS)."""
    assert hc == HC, f"hc = {hc}: the CUDA mixes take {HC}"
    assert x.dtype == torch.bfloat16 and x.dim() == 3 and x.size(1) == hc and x.is_contiguous() and x.is_cuda, (
        f"x: {x.dtype} {tuple(x.shape)}")
    n, k = x.size(0), hc * x.size(2)
    assert 1 <= n <= MAX_ROWS, f"N = {n}: the CUDA mixes take 1..{MAX_ROWS} rows (one ticket each)"
    mix = (2 + hc) * hc
    for t, shape, what in ((fn, (mix, k), "fn"), (scale, (3,), "scale"), (base, (mix,), "base")):
        assert t.dtype == torch.float32 and tuple(t.shape) == shape and t.is_contiguous() and t.device == x.device, (
            f"{what}: want fp32 {shape} contiguous on {x.device}, got {t.dtype} {tuple(t.shape)}")
    splits = splits or pick_launch(k, n, beside)
    assert 1 <= splits <= MAX_SPLITS and k % (4 * splits) == 0, f"splits = {splits} for K = {k}"
    part = torch.empty(n, splits, mix + 1, dtype=torch.float32, device=x.device)
    pre = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    post = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=x.device)
    lib = _lib()
    with torch.cuda.device(x.device):
        err = lib.dsv41_hc_mixes(x.data_ptr(), fn.data_ptr(), scale.data_ptr(), base.data_ptr(), pre.data_ptr(),
                                 post.data_ptr(), comb.data_ptr(), part.data_ptr(), _tickets(x.device).data_ptr(), n,
                                 k, iters, float(hc_eps), float(norm_eps), splits, THREADS, 1,
                                 torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"hc_mixes_cuda (splits {splits}) N={n} K={k} failed: "
                           f"{lib.dsv41_hc_mixes_error_string(err).decode()}")
    return pre, post, comb
