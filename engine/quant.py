"""Bit-exact FP8 / FP4 quantisation numerics of DeepSeek-V4.1, in plain torch (CPU and CUDA).

This is the reference the golden model and the Triton kernels are tested against. Semantics follow
DeepSeek's `inference/kernel.py` (read through Tenstorrent's CPU port `kernel_cpu.py`) and spec §3:

- FP8 activations (`act_quant`): per 32 contiguous elements, amax >= 1e-4, scale
  s = 2^ceil(log2(amax * fp32(1/448))) taken from the fp32 bit pattern, q = e4m3(clamp(x/s, ±448)) RNE.
- FP4 (`fp4_quant`): MXFP4 (UE8M0 scale, amax >= 6·2^-126, s = 2^ceil(log2(amax * fp32(1/6)))) or
  NVFP4 without global scale (E4M3 scale, amax >= 6·2^-9, s = e4m3(amax / 6) RNE saturating);
  then e2m1(clamp(x/s, ±6)) RNE; two codes per byte, the even element in the low nibble.
- Weights: FP8 E4M3 with one E8M0 scale per 32x32 block, or packed FP4 with one E8M0 scale per 32
  along `in`.

Every quantised value times its scale is exactly representable in bf16 (and fp32), which is what makes
the QDQ ("in-place") forms and the dequantise-then-matmul `linear` exact up to summation order.
"""

from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
# E2M1 magnitudes by 3-bit code; code bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive E2M1 magnitudes; midpoint j separates code j from code j + 1.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_PACKED_FP4_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)

ScaleFmt = Literal["ue8m0", "e4m3"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=None)
def _fp32(v: float) -> float:
    """The nearest fp32 value, as a Python float (the kernels multiply by fp32 constants)."""
    return torch.tensor(v, dtype=torch.float32).item()


def _to_e4m3(x: Tensor) -> Tensor:
    # torch's fp32 -> e4m3fn cast rounds to nearest even, but its overflow behaviour is not the
    # kernels' `satfinite` on every device/version: clamp first so saturation is explicit.
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def ue8m0_scale(amax: Tensor, inv_qmax: float) -> Tensor:
    """fp32 power of two 2^ceil(log2(amax * fp32(inv_qmax))), same shape as `amax`.

    Computed like the kernels' `fast_round_scale`: from the fp32 bits of y = amax * fp32(inv_qmax),
    the biased exponent plus one if any mantissa bit is set. So an exact power of two maps to itself,
    anything above it to the next power. (For subnormal y this yields 2^-126; callers' amax clamps
    keep y normal.)
    """
    y = (amax.float() * _fp32(inv_qmax)).contiguous()
    bits = y.view(torch.int32)
    biased_exp = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    return ((biased_exp + has_mantissa.to(torch.int32)) << 23).view(torch.float32)


def act_quant(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """FP8 activation quantisation with UE8M0 scales.

    x bf16 [..., K] (K % block == 0) -> (q float8_e4m3fn [..., K], s fp32 [..., K // block]),
    where x ≈ q * s per block and s is a power of two.
    """
    assert x.dtype == torch.bfloat16, f"act_quant takes bf16 input (the kernel's in_dtype), got {x.dtype}"
    assert x.size(-1) % block == 0, f"last dim {x.size(-1)} is not a multiple of block {block}"
    xg = x.float().unflatten(-1, (-1, block))  # [..., K/block, block]
    amax = xg.abs().amax(dim=-1).clamp_min(1e-4)
    s = ue8m0_scale(amax, 1.0 / FP8_MAX)  # [..., K/block]
    q = _to_e4m3(xg / s.unsqueeze(-1))
    return q.flatten(-2), s


def act_quant_qdq(x: Tensor, block: int = BLOCK) -> Tensor:
    """bf16 [..., K] -> bf16 [..., K] holding exactly q * s (the reference's in-place act_quant)."""
    return act_dequant(*act_quant(x, block), block).to(torch.bfloat16)


def act_dequant(q: Tensor, s: Tensor, block: int) -> Tensor:
    """float8_e4m3fn [..., K] and fp32 scales [..., K // block] -> fp32 [..., K] (exact)."""
    return (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2)


@lru_cache(maxsize=None)
def _e2m1_midpoints(device: torch.device) -> Tensor:
    return torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=device)


@lru_cache(maxsize=None)
def _e2m1_table(device: torch.device) -> Tensor:
    """fp32 [16]: value of each 4-bit code; codes 8..15 are the negatives (code 8 is -0.0)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


@lru_cache(maxsize=None)
def fp4_byte_table(device: torch.device) -> Tensor:
    """fp32 [256, 2]: both values of a packed byte, (low nibble, high nibble) = (even, odd) element."""
    byte = torch.arange(256, device=device).to(torch.uint8)
    return e2m1_decode(torch.stack([byte & 0x0F, byte >> 4], dim=-1))


def e2m1_encode(v: Tensor) -> Tensor:
    """fp32 values already divided by their scale and clamped to ±6 -> uint8 E2M1 codes (0..15).

    Round to nearest, ties to the even code (= IEEE RNE): 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4. Bit 3 is the sign bit of `v`, so -0.0 and small negatives give code 8.
    Magnitudes above 6 saturate to 6; NaN gives a signed zero, as the reference's comparisons do.
    """
    mag = v.float().abs()
    mids = _e2m1_midpoints(v.device)
    below = torch.bucketize(mag, mids)  # number of midpoints strictly below mag
    is_tie = mag == mids[below.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = below + (is_tie & (below % 2 == 1)).to(below.dtype)  # a tie at an odd midpoint goes up
    code = torch.where(torch.isnan(mag), 0, code)
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 E2M1 codes (0..15) -> fp32 values, same shape."""
    return _e2m1_table(codes.device)[codes.int()]


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 codes [..., K] (each < 16, K even) -> uint8 [..., K // 2]; element 2i in the low nibble."""
    assert codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}"
    assert codes.size(-1) % 2 == 0, f"last dim {codes.size(-1)} is odd"
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Packed FP4 [..., K // 2] (uint8, int8 or float4_e2m1fn_x2) -> uint8 codes [..., K]."""
    b = _as_fp4_bytes(packed)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def _as_fp4_bytes(packed: Tensor) -> Tensor:
    if packed.dtype not in _PACKED_FP4_DTYPES:
        raise ValueError(f"packed FP4 must be uint8, int8 or float4_e2m1fn_x2, got {packed.dtype}")
    return packed.view(torch.uint8)


def _fp4_codes_and_scales(xg: Tensor, scale_fmt: ScaleFmt) -> tuple[Tensor, Tensor]:
    """fp32 [..., G, block] -> (uint8 codes [..., G, block], fp32 scales [..., G])."""
    amax = xg.abs().amax(dim=-1)
    if scale_fmt == "ue8m0":
        s = ue8m0_scale(amax.clamp_min(6 * 2.0**-126), 1.0 / FP4_MAX)
    elif scale_fmt == "e4m3":
        # true division by 6 (not a reciprocal multiply), then RNE + saturation to E4M3
        s = _to_e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX).float()
    else:
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'e4m3', got {scale_fmt!r}")
    v = (xg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return e2m1_encode(v), s


def _fp4_groups(x: Tensor, block: int) -> Tensor:
    assert x.dtype == torch.bfloat16, f"fp4_quant takes bf16 input (the kernel's in_dtype), got {x.dtype}"
    assert x.size(-1) % block == 0, f"last dim {x.size(-1)} is not a multiple of block {block}"
    return x.float().unflatten(-1, (-1, block))


def fp4_quant(x: Tensor, block: int, scale_fmt: ScaleFmt) -> tuple[Tensor, Tensor]:
    """FP4 activation quantisation (MXFP4 with scale_fmt="ue8m0", NVFP4-style with "e4m3").

    x bf16 [..., K] -> (packed uint8 [..., K // 2], scales [..., K // block] as float8_e8m0fnu for
    "ue8m0" or float8_e4m3fn for "e4m3").
    """
    codes, s = _fp4_codes_and_scales(_fp4_groups(x, block), scale_fmt)
    scale_dtype = torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float8_e4m3fn
    return pack_fp4(codes.flatten(-2)), s.to(scale_dtype)


def fp4_qdq(x: Tensor, block: int, scale_fmt: ScaleFmt) -> Tensor:
    """bf16 [..., K] -> bf16 [..., K] holding exactly e2m1(v) * s (the reference's in-place mode)."""
    codes, s = _fp4_codes_and_scales(_fp4_groups(x, block), scale_fmt)
    return (e2m1_decode(codes) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def _check_scale_dtype(scale: Tensor) -> None:
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"weight scale must be float8_e8m0fnu or float32, got {scale.dtype}")


def _fp8_scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return _ceil_div(out_features, BLOCK), _ceil_div(in_features, BLOCK)


def dequant_fp8_weight(w: Tensor, scale: Tensor) -> Tensor:
    """float8_e4m3fn [out, in] + scale [ceil(out/32), ceil(in/32)] (E8M0 or fp32) -> fp32 [out, in].

    Edge blocks of a dimension that is not a multiple of 32 are partial. Materialises one fp32 weight
    (the scale is expanded along rows only, 1/32 of the weight's size).
    """
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D float8_e4m3fn, got {w.dtype} {tuple(w.shape)}")
    _check_scale_dtype(scale)
    out_features, in_features = w.shape
    if tuple(scale.shape) != _fp8_scale_shape(out_features, in_features):
        raise ValueError(
            f"FP8 weight {tuple(w.shape)} needs scale {_fp8_scale_shape(out_features, in_features)}, "
            f"got {tuple(scale.shape)}"
        )
    y = w.float()
    s_rows = scale.float().repeat_interleave(BLOCK, dim=0)[:out_features]  # [out, ceil(in/32)]
    num_full = in_features // BLOCK
    if num_full:
        y[:, : num_full * BLOCK].unflatten(1, (num_full, BLOCK)).mul_(s_rows[:, :num_full, None])
    if in_features % BLOCK:
        y[:, num_full * BLOCK :].mul_(s_rows[:, num_full:])
    return y


def dequant_fp4_weight(w: Tensor, scale: Tensor) -> Tensor:
    """Packed FP4 [out, in // 2] (uint8, int8 or float4_e2m1fn_x2) + scale [out, in // 32] -> fp32 [out, in]."""
    b = _as_fp4_bytes(w)
    _check_scale_dtype(scale)
    if b.dim() != 2 or (2 * b.size(1)) % BLOCK:
        raise ValueError(f"packed FP4 weight must be [out, in / 2] with in % 32 == 0, got {tuple(w.shape)}")
    out_features, in_features = b.size(0), 2 * b.size(1)
    if tuple(scale.shape) != (out_features, in_features // BLOCK):
        raise ValueError(
            f"packed FP4 weight {tuple(w.shape)} (in = {in_features}) needs scale "
            f"{(out_features, in_features // BLOCK)} = [out, in / 32], got {tuple(scale.shape)}"
            " (an FP8 weight must have dtype float8_e4m3fn)"
        )
    y = fp4_byte_table(w.device)[b.int()].view(out_features, in_features)  # the one fp32 copy
    y.unflatten(1, (-1, BLOCK)).mul_(scale.float().unsqueeze(-1))
    return y


def quant_fp8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """fp32/bf16 [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/32), ceil(in/32)]).

    Per 32x32 block (edge blocks partial): amax >= 1e-4, s = 2^ceil(log2(amax * fp32(1/448))),
    q = e4m3(clamp(w / s, ±448)) RNE, as in `act_quant`. For writing checkpoints.
    """
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight must be 2-D fp32 or bf16, got {w.dtype} {tuple(w.shape)}")
    out_features, in_features = w.shape
    num_ob, num_ib = _fp8_scale_shape(out_features, in_features)
    # zero padding cannot change a block's amax
    wp = F.pad(w.float(), (0, num_ib * BLOCK - in_features, 0, num_ob * BLOCK - out_features))
    blocks = wp.view(num_ob, BLOCK, num_ib, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)  # [num_ob, num_ib]
    s = ue8m0_scale(amax, 1.0 / FP8_MAX)
    q = _to_e4m3(blocks / s[:, None, :, None]).view(num_ob * BLOCK, num_ib * BLOCK)
    return q[:out_features, :in_features].contiguous(), s.to(torch.float8_e8m0fnu)


def quant_fp4_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """fp32/bf16 [out, in] (in % 32 == 0) -> (uint8 [out, in // 2], float8_e8m0fnu [out, in // 32]), MXFP4."""
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16) or w.size(1) % BLOCK:
        raise ValueError(f"weight must be 2-D fp32 or bf16 with in % 32 == 0, got {w.dtype} {tuple(w.shape)}")
    codes, s = _fp4_codes_and_scales(w.float().unflatten(-1, (-1, BLOCK)), "ue8m0")
    return pack_fp4(codes.flatten(-2)), s.to(torch.float8_e8m0fnu)


def cat_8bit(a: Tensor, b: Tensor) -> Tensor:
    """torch.cat([a, b]) of two tensors of one 8-bit dtype (FP8, E8M0, packed FP4) along dim 0, through uint8
    views: cat of the 8-bit float types is not implemented on every device."""
    assert a.dtype == b.dtype and a.element_size() == 1, f"one 8-bit dtype, got {a.dtype} and {b.dtype}"
    return torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(a.dtype)


def exact_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b computed in float64 and returned in float32 (callers round further as they need).

    The golden model's products: the exact dot product rounded once, which every fp32-accumulating
    kernel approximates, and which does not depend on how many rows are in the batch (fp32 GEMM
    libraries switch between gemv and blocked gemm by M, changing summation order; after bf16
    rounding that made a prefill and a decode step of the same position differ).
    """
    return (a.double() @ b.double()).float()


def round_product(y: Tensor, weight: Tensor) -> Tensor:
    """A float64 product of `linear_f64` rounded as `linear` rounds it: to fp32, then to the output dtype
    (bf16 for a quantised weight, else the weight's dtype). A row-parallel linear sums its ranks' float64
    partial products first, so N shards round what one shard rounds."""
    quantised = weight.dtype == torch.float8_e4m3fn or weight.dtype in _PACKED_FP4_DTYPES
    return y.float().to(torch.bfloat16 if quantised else weight.dtype)


def check_fp8_linear_args(x: Tensor, weight: Tensor, scale: Tensor) -> None:
    """The FP8 linear kernels' contract: x bf16 [..., K]; weight float8_e4m3fn [N, K] with K a positive
    multiple of 32; scale float8_e8m0fnu [ceil(N/32), K/32]; all contiguous and on one device."""
    assert x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}"
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, (
        f"weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    assert scale.dtype == torch.float8_e8m0fnu, f"scale must be float8_e8m0fnu, got {scale.dtype}"
    n, k = weight.shape
    assert x.size(-1) == k, f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}"
    assert k % BLOCK == 0 and k > 0, f"K = {k} is not a positive multiple of {BLOCK}"
    blocks = (-(-n // BLOCK), k // BLOCK)
    assert tuple(scale.shape) == blocks, f"weight {tuple(weight.shape)} needs scale {blocks}, got {tuple(scale.shape)}"
    assert x.is_contiguous() and weight.is_contiguous() and scale.is_contiguous(), "x, weight, scale must be contiguous"
    assert x.device == weight.device == scale.device, f"devices differ: {x.device} {weight.device} {scale.device}"


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """y = x @ weight^T, dispatched on the weight's storage like the reference `linear()`.

    - float8_e4m3fn weight [out, in] + scale [ceil(out/32), ceil(in/32)]: FP8 weight.
    - uint8 / int8 / float4_e2m1fn_x2 weight [out, in/2] + scale [out, in/32]: packed FP4 weight.
      An 8-bit weight is FP8 only when its dtype says so; raw FP8 bytes must be viewed as
      float8_e4m3fn first. The scale's shape is checked against the dtype's layout (ValueError).
    - bf16 / fp32 weight, no scale: the product in float64, rounded to the weight's dtype.
    For both quantised kinds x (bf16 [..., in], in % 32 == 0) is quantised with `act_quant(x, 32)`
    and the result is bf16 [..., out]. Implementation: both operands are dequantised to fp32 (exact,
    all scales are powers of two) and multiplied in float64 (`linear_f64`), then rounded once
    (`round_product`). That equals the kernels' per-32-block scaled sum accumulated in fp32 up to fp32
    summation order (rarely 1 bf16 ULP), and is independent of the batch size.
    """
    return round_product(linear_f64(x, weight, scale), weight)


def linear_f64(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """`linear`'s product before its rounding: float64 [..., out] (see `linear` for the weight kinds)."""
    if weight.dtype == torch.float8_e4m3fn:
        in_features = weight.size(-1)
    elif weight.dtype in _PACKED_FP4_DTYPES:
        in_features = 2 * weight.size(-1)
    else:
        if scale is not None:
            raise ValueError(f"a {weight.dtype} weight takes no scale, got one of shape {tuple(scale.shape)}")
        y = x.reshape(-1, x.size(-1)).double() @ weight.T.double()
        return y.view(*x.shape[:-1], weight.size(0))
    if scale is None:
        raise ValueError(f"a {weight.dtype} weight {tuple(weight.shape)} needs a scale")
    if x.size(-1) != in_features or in_features % BLOCK:
        raise ValueError(
            f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (in = {in_features}, "
            f"which must also be a multiple of {BLOCK})"
        )
    if x.dtype != torch.bfloat16:
        raise ValueError(f"quantised linear takes bf16 activations, got {x.dtype}")
    if weight.dtype == torch.float8_e4m3fn:
        w = dequant_fp8_weight(weight, scale)  # [out, in] fp32
    else:
        w = dequant_fp4_weight(weight, scale)  # [out, in] fp32
    a = act_dequant(*act_quant(x, BLOCK), BLOCK)  # [..., in] fp32
    y = a.reshape(-1, in_features).double() @ w.T.double()  # [M, out]
    return y.view(*x.shape[:-1], w.size(0))
