"""Counter-based Gumbel noise and a fused Gumbel-max: token = argmax_v x[v] + g(seed, step, v).

The noise of token v in the row keyed by (seed, step) is a pure function of those three integers:

    (r0, r1, r2, r3) = Philox4x32-10(counter = (v >> 2, 0, step_lo, step_hi), key = (seed_lo, seed_hi))
    h = r_(v & 3)                                      # uint32
    w = min(fp32(h) + 0.5, 2^32 - 256) * 2^-32         # in [2^-33, 1 - 2^-24], ~U(0, 1)
    g = -log(-log1p(-w))                               # standard Gumbel, in [-2.81, 22.9]

- Hash: Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3"; also
  cuRAND's Philox4_32_10 and Triton's `tl.rand`), a keyed bijection of 128-bit counters whose outputs
  pass TestU01's BigCrush (per that paper). Different (seed, step, v >> 2) are different (counter, key) pairs, so
  every token of every step of every seed gets its own 32 bits; rows never share a stream (no 32-bit
  birthday collisions between requests). Counter word 1 is 0 for this noise: another per-(seed, step)
  draw (e.g. a speculative-acceptance uniform) takes another value there. Known-answer vectors and
  uniformity/independence tests: tests/kernels/test_gumbel.py.
- Uniform: w is built from the side where the Gumbel's upper tail lives (w -> 0 <=> g -> +inf), so the
  tail that picks tokens is resolved to 2^-32 near w = 0 and to fp32's 2^-24 relative step above.
- Logs: Cephes' logf polynomial (argument reduction by exponent bits, degree-9 polynomial, ln 2 split in
  two parts), written with fp32 multiplies and adds only. With FMA contraction off (the launch passes
  enable_fp_fusion=False) every operation is one IEEE-rounded fp32 op, so the Triton kernel on the GPU,
  the same kernel under TRITON_INTERPRET=1 and the torch reference (int64 tensors holding uint32
  values, 16-bit limbs for the 32x32 products) give the same noise bits, hence the same tokens, on
  every device and in any batch. Negations are written 0 - x (Triton's -x is 0 - x: +0.0 at g = 0).
  Accuracy vs float64 -log(-log1p(-w)) of the same w: within 3 fp32 ULPs of max(|g|, 1) on all 2^32
  inputs (GPU test; max 2.16 on CPU samples).

Memory traffic of gumbel_argmax: the logits once (4·N·V bytes) plus 8·N·splits bytes of partials; no
noise is written. Compute: one Philox call (10 rounds of two 32x32 -> 64 products) per 4 tokens and
two polynomial logs per token, ~75 instructions per token, so at 128 x 129,280 the kernel is
instruction- rather than HBM-bound on an H200 (measured in benchmarks/kernels.py).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import cdiv, row_splits


def _f32(v: float) -> float:
    """v rounded to fp32 (returned as the exactly representable Python float), so constants are exact."""
    return struct.unpack("f", struct.pack("f", v))[0]


_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_ROUNDS = 10
_MASK32 = 0xFFFFFFFF
# Cephes logf: log(1 + f) = f - f^2/2 + f^3 P(f) for 1 + f in [sqrt(1/2), sqrt(2)); ln 2 = HI + LO.
_LOG_P = tuple(_f32(c) for c in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                                 1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                                 3.3333331174e-1))
_LN2_HI, _LN2_LO = _f32(0.693359375), _f32(-2.12194440e-4)
_SQRT_HALF = _f32(0.70710678118654752440)
_W_NEAR0 = _f32(0.29289320)  # w <= this: 1 - w >= sqrt(1/2), so log1p(-w) takes f = -w directly
_W_MAX = 4294967040.0  # 2^32 - 256, the largest fp32 below 2^32
_TWO_M32 = 2.0**-32

_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7, _P8 = (tl.constexpr(c) for c in _LOG_P)
_C_LN2_HI, _C_LN2_LO, _C_SQRT_HALF = tl.constexpr(_LN2_HI), tl.constexpr(_LN2_LO), tl.constexpr(_SQRT_HALF)
_C_W_NEAR0, _C_W_MAX, _C_TWO_M32 = tl.constexpr(_W_NEAR0), tl.constexpr(_W_MAX), tl.constexpr(_TWO_M32)
_C_M0, _C_M1, _C_W0, _C_W1 = tl.constexpr(_M0), tl.constexpr(_M1), tl.constexpr(_W0), tl.constexpr(_W1)
_NEG_INF = tl.constexpr(float("-inf"))

BLOCK_J = 512  # Philox counters per tile: 2048 tokens
_PROGRAMS_PER_SM = 4


# --- Triton ------------------------------------------------------------------------------------------------------

@triton.jit
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 counter words (c0..c3) and key (k0, k1); Random123's round and key order."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _C_M0)
        lo0 = c0 * _C_M0
        hi1 = tl.umulhi(c2, _C_M1)
        lo1 = c2 * _C_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _C_W0
        k1 = k1 + _C_W1
    return c0, c1, c2, c3


@triton.jit
def _log_parts(f, k):
    """log(1 + f) + k ln 2 for 1 + f in [sqrt(1/2), sqrt(2)), k an integer-valued fp32 (Cephes logf)."""
    z = f * f
    p = _P0 * f
    p = (p + _P1) * f
    p = (p + _P2) * f
    p = (p + _P3) * f
    p = (p + _P4) * f
    p = (p + _P5) * f
    p = (p + _P6) * f
    p = (p + _P7) * f
    p = p + _P8
    p = (p * f) * z
    p = p + k * _C_LN2_LO
    p = p + z * -0.5
    r = f + p
    return r + k * _C_LN2_HI


@triton.jit
def _reduce(y):
    """y > 0 normal fp32 -> (f, k) with y = 2^k (1 + f), 1 + f in [sqrt(1/2), sqrt(2)); exact."""
    bits = y.to(tl.int32, bitcast=True)
    k = (bits >> 23) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)  # [0.5, 1)
    low = m < _C_SQRT_HALF
    f = tl.where(low, (m + m) - 1.0, m - 1.0)
    return f, tl.where(low, k - 1, k).to(tl.float32)


@triton.jit
def gumbel_from_bits(h):
    """uint32 -> fp32 standard Gumbel -log(-log1p(-w)), w = (h + 1/2) 2^-32 (see the module docstring)."""
    w = tl.minimum(h.to(tl.float32) + 0.5, _C_W_MAX) * _C_TWO_M32
    fy, ky = _reduce(1.0 - w)
    near0 = w <= _C_W_NEAR0
    e = 0.0 - _log_parts(tl.where(near0, 0.0 - w, fy), tl.where(near0, 0.0, ky))  # -log1p(-w) ~ Exp(1)
    fe, ke = _reduce(e)
    return 0.0 - _log_parts(fe, ke)  # (Triton's -x is 0 - x: +0.0 at g = 0; written out to match the ref)


@triton.jit
def _row_keys(seed_ptr, step_ptr, row):
    """Row's Philox key (seed_lo, seed_hi) and counter words 2-3 (step_lo, step_hi), uint32 scalars."""
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    return ((seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
            (step & 0xFFFFFFFF).to(tl.uint32), ((step >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _tile_noise(k0, k1, s0, s1, tile, j0, BLOCK_J: tl.constexpr):
    """Token ids [BLOCK_J, 4] (int32, from the slice's first token) of one tile and their noise [BLOCK_J, 4]
    (fp32); j0: the slice's first counter (its first token's id / 4: token v of the slice is token 4 j0 + v)."""
    j = tile * BLOCK_J + tl.arange(0, BLOCK_J)  # [BJ] counters within the slice; token v = 4 j + lane
    zero = tl.zeros([BLOCK_J], dtype=tl.uint32)
    r0, r1, r2, r3 = _philox4x32_10((j + j0).to(tl.uint32), zero, zero + s0, zero + s1, k0, k1)
    lane = tl.arange(0, 4)[None, :]
    h = tl.where(lane == 0, r0[:, None], tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None],
                                                                                    r3[:, None])))
    return j[:, None] * 4 + lane, gumbel_from_bits(h)


@triton.jit
def _gumbel_noise_kernel(seed_ptr, step_ptr, out_ptr, V, BLOCK_J: tl.constexpr):
    row = tl.program_id(0)
    k0, k1, s0, s1 = _row_keys(seed_ptr, step_ptr, row)
    v, g = _tile_noise(k0, k1, s0, s1, tl.program_id(1), 0, BLOCK_J)
    tl.store(out_ptr + row.to(tl.int64) * V + v, g, mask=v < V)


@triton.jit
def _gumbel_argmax_kernel(x_ptr, seed_ptr, step_ptr, val_ptr, idx_ptr, V, stride_x, num_tiles, tiles_per_split,
                          num_splits, j0, BLOCK_J: tl.constexpr):
    """Program (row, split): max over its tiles of x + g and the lowest token id reaching it. Each lane keeps
    its own running (max, id) across tiles (strict >: a later tile has higher ids), reduced once at the end."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    k0, k1, s0, s1 = _row_keys(seed_ptr, step_ptr, row)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    first = split * tiles_per_split
    best_val = tl.full([BLOCK_J, 4], _NEG_INF, tl.float32)
    best_idx = first * BLOCK_J * 4 + tl.arange(0, BLOCK_J)[:, None] * 4 + tl.arange(0, 4)[None, :]  # all -inf: lowest
    for tile in range(first, tl.minimum(first + tiles_per_split, num_tiles)):
        v, g = _tile_noise(k0, k1, s0, s1, tile, j0, BLOCK_J)
        y = tl.where(v < V, tl.load(x_row + v, mask=v < V, other=0.0) + g, _NEG_INF)  # [BJ, 4]
        better = y > best_val
        best_idx = tl.where(better, v, best_idx)
        best_val = tl.where(better, y, best_val)
    m = tl.max(tl.max(best_val, axis=1), axis=0)
    i = tl.min(tl.min(tl.where(best_val == m, best_idx, 0x7FFFFFFF), axis=1), axis=0)
    tl.store(val_ptr + row * num_splits + split, m)
    tl.store(idx_ptr + row * num_splits + split, i)


# --- host wrappers -----------------------------------------------------------------------------------------------

def _check_keys(seeds: Tensor, steps: Tensor, num_rows: int, device: torch.device) -> None:
    for name, t in (("seeds", seeds), ("steps", steps)):
        assert t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous(), (
            f"{name} must be contiguous int64 [N], got {t.dtype} {tuple(t.shape)}")
        assert t.size(0) == num_rows, f"{name} has {t.size(0)} entries for {num_rows} rows"
        assert t.device == device, f"{name} on {t.device}, expected {device}"


def gumbel_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """Kernel form of gumbel_noise_ref (same bits): int64 [N] seeds and steps -> fp32 [N, V] noise,
    on the keys' device. For tests and inspection; sampling uses gumbel_argmax, which writes no noise."""
    _check_keys(seeds, steps, seeds.size(0), seeds.device)
    assert 0 < vocab_size < 2**31 - 4, f"vocab_size {vocab_size} out of range"
    out = torch.empty(seeds.size(0), vocab_size, dtype=torch.float32, device=seeds.device)
    if seeds.size(0):
        _gumbel_noise_kernel[(seeds.size(0), cdiv(vocab_size, 4 * BLOCK_J))](
            seeds, steps, out, vocab_size, BLOCK_J=BLOCK_J, enable_fp_fusion=False)
    return out


def gumbel_argmax(x: Tensor, seeds: Tensor, steps: Tensor, num_splits: int | None = None, block_j: int = BLOCK_J,
                  num_warps: int = 4) -> Tensor:
    """argmax_v x[n, v] + g(seeds[n], steps[n], v), ties to the lower id: the Gumbel-max draw from softmax(x).

    x fp32 [N, V] (temperature-scaled, filtered: dropped tokens -inf; no NaN), unit stride along V;
    seeds, steps int64 [N] on x's device (any 64-bit patterns). Returns int64 [N], bitwise
    gumbel_argmax_ref. num_splits: programs per row (default: ~4 programs per SM over the batch);
    block_j, num_warps: the launch shape (4 block_j tokens per tile; any choice gives the same tokens).
    """
    return gumbel_max(x, seeds, steps, 0, num_splits, block_j, num_warps)[1]


def gumbel_max(x: Tensor, seeds: Tensor, steps: Tensor, first_id: int = 0, num_splits: int | None = None,
               block_j: int = BLOCK_J, num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """gumbel_argmax over a slice of the vocabulary: x fp32 [N, V'] holds tokens first_id .. first_id + V' - 1
    (first_id a multiple of 4: a Philox counter's 4 tokens stay in one slice), each keyed by its own id.
    Returns (max_v x[n, v] + g(.., first_id + v), the lowest v reaching it): fp32 [N] and int64 [N] (v counted
    from the slice's start), bitwise gumbel_max_ref; a row of -inf gives (-inf, 0)."""
    assert x.dtype == torch.float32, f"x must be fp32, got {x.dtype}"
    assert x.dim() == 2 and (x.size(1) <= 1 or x.stride(1) == 1), (
        f"x must be [N, V] with unit stride along V, got shape {tuple(x.shape)} strides {x.stride()}")
    num_rows, vocab_size = x.shape
    _check_keys(seeds, steps, num_rows, x.device)
    assert 0 < vocab_size < 2**31 - 4 * 4 * block_j, f"vocab_size {vocab_size} out of range"
    assert first_id % 4 == 0 and 0 <= first_id < 2**31 - vocab_size, f"first_id {first_id}: a multiple of 4 in range"
    if num_rows == 0:
        return (torch.empty(0, dtype=torch.float32, device=x.device),
                torch.empty(0, dtype=torch.int64, device=x.device))
    num_tiles = cdiv(vocab_size, 4 * block_j)
    num_splits, tiles_per_split = row_splits(num_rows, num_tiles, x.device, num_splits, _PROGRAMS_PER_SM)
    val = torch.empty(num_rows, num_splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(num_rows, num_splits, dtype=torch.int32, device=x.device)
    _gumbel_argmax_kernel[(num_rows, num_splits)](
        x, seeds, steps, val, idx, vocab_size, x.stride(0), num_tiles, tiles_per_split, num_splits, first_id // 4,
        BLOCK_J=block_j, num_warps=num_warps, enable_fp_fusion=False)
    if num_splits == 1:
        return val[:, 0], idx[:, 0].long()
    best = val.argmax(dim=1, keepdim=True)  # first max split: lower ids
    return val.gather(1, best)[:, 0], idx.gather(1, best)[:, 0].long()


# --- torch reference ---------------------------------------------------------------------------------------------

def _mulhilo32(m: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit halves of m * x for uint32 values in int64 tensors, via 16-bit limbs of m
    (every partial product < 2^48: nothing overflows int64)."""
    a = x * (m >> 16)
    b = x * (m & 0xFFFF)
    return (a + (b >> 16)) >> 16, (((a & 0xFFFF) << 16) + b) & _MASK32


def philox4x32_10_ref(c: tuple[Tensor, Tensor, Tensor, Tensor], k0: Tensor, k1: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 on int64 tensors holding uint32 words (broadcastable): counter c, key (k0, k1)."""
    c0, c1, c2, c3 = c
    for _ in range(_ROUNDS):
        hi0, lo0 = _mulhilo32(_M0, c0)
        hi1, lo1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def _log_parts_ref(f: Tensor, k: Tensor) -> Tensor:
    z = f * f
    p = f * _LOG_P[0]
    for c in _LOG_P[1:-1]:
        p = (p + c) * f
    p = p + _LOG_P[-1]
    p = (p * f) * z
    p = p + k * _LN2_LO
    p = p + z * -0.5
    r = f + p
    return r + k * _LN2_HI


def _reduce_ref(y: Tensor) -> tuple[Tensor, Tensor]:
    bits = y.view(torch.int32)
    k = (bits >> 23) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)
    low = m < _SQRT_HALF
    return torch.where(low, (m + m) - 1.0, m - 1.0), torch.where(low, k - 1, k).to(torch.float32)


def gumbel_from_bits_ref(h: Tensor) -> Tensor:
    """int64 tensor of uint32 values -> fp32 Gumbel noise, op for op the kernel's gumbel_from_bits."""
    w = torch.clamp_max(h.to(torch.float32) + 0.5, _W_MAX) * _TWO_M32
    fy, ky = _reduce_ref(1.0 - w)
    near0 = w <= _W_NEAR0
    e = 0.0 - _log_parts_ref(torch.where(near0, 0.0 - w, fy), torch.where(near0, 0.0, ky))
    fe, ke = _reduce_ref(e)
    return 0.0 - _log_parts_ref(fe, ke)  # 0 - x, not -x: +0.0 at g = 0, as the kernel


def philox_bits_ref(seeds: Tensor, steps: Tensor, vocab_size: int, stream: int = 0, first_id: int = 0) -> Tensor:
    """The 32 hash bits of every (row, token): int64 [N, V] holding uint32 values, tokens first_id .. first_id +
    V - 1 (first_id a multiple of 4). stream: the counter's second word (0: the sampler's noise; speculative
    decoding draws its other keyed numbers from streams > 0)."""
    assert first_id % 4 == 0, f"first_id {first_id} is not a multiple of 4"
    j = torch.arange(first_id // 4, first_id // 4 + cdiv(vocab_size, 4), dtype=torch.int64,
                     device=seeds.device)[None, :]  # [1, J]
    counter = (j, torch.full_like(j, stream), (steps & _MASK32)[:, None], ((steps >> 32) & _MASK32)[:, None])
    r = philox4x32_10_ref(counter, (seeds & _MASK32)[:, None], ((seeds >> 32) & _MASK32)[:, None])  # 4 x [N, J]
    r = [t.expand(seeds.size(0), j.size(1)) for t in r]
    return torch.stack(r, dim=-1).reshape(seeds.size(0), 4 * j.size(1))[:, :vocab_size]  # [N, V]: token v = 4 j + lane


def gumbel_noise_ref(seeds: Tensor, steps: Tensor, vocab_size: int, first_id: int = 0) -> Tensor:
    """The oracle: int64 [N] seeds and steps -> fp32 [N, V] Gumbel noise of tokens first_id .., on the keys' device."""
    _check_keys(seeds, steps, seeds.size(0), seeds.device)
    return gumbel_from_bits_ref(philox_bits_ref(seeds, steps, vocab_size, first_id=first_id))


def gumbel_argmax_ref(x: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """The oracle of gumbel_argmax: fp32 [N, V] -> int64 [N], argmax(x + noise) (first max -> lower id)."""
    return gumbel_max_ref(x, seeds, steps)[1]


def gumbel_max_ref(x: Tensor, seeds: Tensor, steps: Tensor, first_id: int = 0) -> tuple[Tensor, Tensor]:
    """The oracle of gumbel_max: (max of x + noise over the slice, its first position)."""
    assert x.dtype == torch.float32 and x.dim() == 2, f"x must be fp32 [N, V], got {x.dtype} {tuple(x.shape)}"
    return (x + gumbel_noise_ref(seeds, steps, x.size(1), first_id)).max(dim=-1)
