"""What the Triton kernels of engine/kernels/ share (the Triton twin of cuda/common.cuh): bf16 rounding and
widening, the FP8 / FP4 decodes, E4M3 rounding and coding, act_quant of 32-blocks, the experts' SwiGLU, the RMSNorm
and RoPE math on rows held as interleaved pairs, and the host-side launch arithmetic.

Every helper is exact integer / fp32 arithmetic (no bf16 arithmetic, no fp8 casts), because the CPU interpreter
(TRITON_INTERPRET=1) has none that is reliable: its fp32 -> bf16 cast truncates, its fp32 -> fp8 cast misrounds
when the carry reaches the exponent, and its bf16 dot is broken. So a kernel built from these helpers gives the
same bits on the GPU and in the interpreter. The @triton.jit helpers are called from other kernels' jit
functions (they are inlined there); the bf16 / E4M3 / E2M1 conventions are engine.quant's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # rounded to fp32 where used, as engine.quant.act_quant's fp32(1/448)


# --- bf16 --------------------------------------------------------------------------------------------------------

@triton.jit
def bf16_bits(x):
    """fp32 -> int16 bit pattern of bf16(x), round to nearest even (finite x):
    u = bits(x), (u + 0x7FFF + ((u >> 16) & 1)) >> 16."""
    u = x.to(tl.int32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding bf16(x), round to nearest even (finite x): bf16_bits(x) << 16, kept as fp32."""
    u = x.to(tl.int32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def bf16_to_fp32(bits):
    """int16 bf16 bit patterns -> fp32 (exact): (bits & 0xFFFF) << 16."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


# --- FP8 / FP4 decode --------------------------------------------------------------------------------------------

@triton.jit
def e8m0_to_fp32(u8):
    """uint8 E8M0 codes -> fp32 2^(u - 127) (codes 1..254; weights never use 0 or the NaN code 255)."""
    return (u8.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_fp32(b):
    """int32 E4M3 codes (0..255, no NaN) -> fp32: (-1)^s 2^(e - 7) (1 + m/8), subnormal (e = 0) m 2^-9.
    The sign is applied by Triton's negation (0 - x), so code 0x80 gives +0.0 (engram_gather's decode keeps -0.0)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_to_fp32(c):
    """int32 E2M1 codes (0..15) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 with bit 3 the sign
    (e = (c >> 1) & 3, m = c & 1: e = 0 gives m / 2, else (2 + m) 2^(e - 2))."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (2.0 + m) * ((e + 125) << 23).to(tl.float32, bitcast=True))  # (2+m) 2^(e-2)
    return tl.where((c & 8) != 0, -mag, mag)


# --- FP8 encode --------------------------------------------------------------------------------------------------

@triton.jit
def round_e4m3(v):
    """fp32 in [-448, 448] -> the nearest E4M3 value (ties to even) as fp32, in exact integer/fp32 steps:
    |v| + 2^(e + 20 - 127) - 2^(e + 20 - 127) rounds |v| to the E4M3 quantum 2^(e - 127 - 3) of its binade e
    (e >= 121: subnormals share 2^-6's quantum 2^-9), then the sign is put back."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = tl.maximum(mag >> 23, 121)  # biased exponent; E4M3 subnormals share 2^-6's quantum 2^-9
    magic = ((e + 20) << 23).to(tl.float32, bitcast=True)  # ulp(magic) = the E4M3 quantum at exponent e
    r = (mag.to(tl.float32, bitcast=True) + magic) - magic  # |v| rounded to that quantum, RNE, exact
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(r):
    """E4M3-representable fp32 -> its uint8 code (sign, 4-bit exponent biased 7, 3-bit mantissa);
    below 2^-6 the subnormal code r 2^9."""
    rb = r.to(tl.int32, bitcast=True)
    mag = rb & 0x7FFFFFFF
    normal = (((mag >> 23) - 120) << 3) | ((mag >> 20) & 7)
    subnormal = (tl.minimum(mag, 121 << 23).to(tl.float32, bitcast=True) * 512.0).to(tl.int32)  # k 2^-9 -> k
    return (tl.where(mag >= (121 << 23), normal, subnormal) | ((rb >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def act_quant_blocks(x):
    """fp32 [R, G, 32] -> (E4M3 values as fp32 [R, G, 32], UE8M0 scales fp32 [R, G]): act_quant's math,
    s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) from the fp32 bits, q = e4m3(clamp(x / s, ±448)) RNE."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4)
    y = (amax * INV_FP8_MAX).to(tl.int32, bitcast=True)
    e = ((y >> 23) & 0xFF) + ((y & 0x7FFFFF) != 0).to(tl.int32)  # 2^ceil(log2 y) from the bits
    s = (e << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s exactly, so x * inv_s == x / s
    v = tl.minimum(tl.maximum(x * inv_s[:, :, None], -448.0), 448.0)
    return round_e4m3(v), s


# --- MoE ----------------------------------------------------------------------------------------------------------

@triton.jit
def swiglu(g, u, limit):
    """fp32 bf16-valued gate/up -> silu(min(g, L)) * clamp(u, -L, L) in fp32 (no clamp when L <= 0): the
    routed and shared experts' activation (engine.model.moe.Expert)."""
    if limit > 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    return g / (1.0 + tl.exp(-g)) * u


# --- RMSNorm and RoPE --------------------------------------------------------------------------------------------

@triton.jit
def rms_normalize(c, w_ptr, D, eps, BLOCK_D: tl.constexpr):
    """fp32 row c [BLOCK_D] (zero past D) -> fp32 w * (c * rsqrt(mean(c^2) + eps)) [BLOCK_D], w the bf16 weight
    [D] at w_ptr; Σc² in fp32, rsqrt as 1 / sqrt_rn."""
    dd = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(c * c, axis=0) / D + eps)
    return w * (c * rstd)


@triton.jit
def split16(c):
    """fp32 -> (hi, lo), hi = c's top 16 significant bits, lo = c - hi (<= 8 bits): a bf16 times either is exact."""
    hi = (c.to(tl.int32, bitcast=True) & -256).to(tl.float32, bitcast=True)
    return hi, c - hi


@triton.jit
def rotate_pair(e, o, c, s, INVERSE: tl.constexpr):
    """One complex product per pair, (e + i o) * (c ± i s), for bf16-valued e, o and fp32 c, s
    (INVERSE: the conjugate, c - i s). Returns (re, ro) in fp32.

    The products are split so that every one is exact in fp32: (e c_hi - o s_hi) + (e c_lo - o s_lo)
    carries an error of ~2^-24 of the result plus ~2^-40 of the terms, where a plain fp32 e c - o s has
    2^-24 of the terms: under heavy cancellation (|result| < ~2^-16 |e c|) that exceeded a bf16 ULP of
    the result. (An FMA contraction on the GPU changes nothing: the products are exact.)"""
    if INVERSE:
        s = -s
    c_hi, c_lo = split16(c)
    s_hi, s_lo = split16(s)
    re = (e * c_hi - o * s_hi) + (e * c_lo - o * s_lo)
    ro = (o * c_hi + e * s_hi) + (o * c_lo + e * s_lo)
    return re, ro


@triton.jit
def rms_norm_pairs(e, o, w_ptr, eps, D: tl.constexpr):
    """RMSNorm of each row given as pairs (e, o) = (x[2j], x[2j+1]), fp32 [R, D/2] each, bf16 weight (int16 view)
    -> bf16-rounded fp32 pairs: bf16((w * x) * 1/sqrt(mean(x^2) + eps)), w * x exact in fp32 (one rounding)."""
    j = tl.arange(0, D // 2)[None, :]
    we = bf16_to_fp32(tl.load(w_ptr + 2 * j))
    wo = bf16_to_fp32(tl.load(w_ptr + 2 * j + 1))
    ss = tl.sum(e * e, axis=1) + tl.sum(o * o, axis=1)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(ss / D + eps))[:, None]
    return round_bf16((we * e) * r), round_bf16((wo * o) * r)  # w * x is exact in fp32: one rounding


@triton.jit
def rope_pairs(e, o, pos, cs_ptr, mask, D: tl.constexpr, RD: tl.constexpr):
    """Rotate the last RD dims of rows given as pairs (fp32 [R, D/2]) at positions pos [R, 1] (int64) by the
    (cos, sin) table at cs_ptr (fp32 [L, RD/2, 2]) -> bf16-rounded fp32 pairs (rotate_pair, then round_bf16);
    the first (D - RD)/2 pairs pass unchanged."""
    t = tl.arange(0, D // 2)[None, :] - (D - RD) // 2  # pair index inside the rotated tail
    rot = t >= 0
    m = mask & rot
    c = tl.load(cs_ptr + pos * RD + 2 * t, mask=m, other=1.0)
    s = tl.load(cs_ptr + pos * RD + 2 * t + 1, mask=m, other=0.0)
    re, ro = rotate_pair(e, o, c, s, False)
    return tl.where(rot, round_bf16(re), e), tl.where(rot, round_bf16(ro), o)


# --- host side ---------------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def row_splits(num_rows: int, num_tiles: int, device: torch.device, num_splits: int | None = None,
               programs_per_sm: int = 4) -> tuple[int, int]:
    """A split-row reduction's launch: (programs per row, tiles per program). num_splits None: ~programs_per_sm
    programs per SM over the rows (4 SMs counted off the GPU); never more programs than tiles, none empty."""
    if num_splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        num_splits = cdiv(programs_per_sm * sms, num_rows)
    tiles_per_split = cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    return cdiv(num_tiles, tiles_per_split), tiles_per_split


def launch_sms(device: torch.device) -> int:
    """The SM count the launch shapes are sized by: the CUDA device's, or an H200's 132 elsewhere (the CPU
    interpreter then runs the grid the GPU would, except where a kernel picks an interpreter shape: fp8_linear, the
    expert GEMMs and the mHC kernels launch few large programs off the GPU, since the interpreter's cost is per op
    and program)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
