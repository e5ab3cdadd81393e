"""Interleaved RoPE on the last `rd` dims (spec 3), the kernel form of engine.model.rope.apply_rotary.

    out[..., D-rd+2j]   = bf16(x_e * c_j - x_o * s_j)        x_e = x[..., D-rd+2j], x_o = x[..., D-rd+2j+1]
    out[..., D-rd+2j+1] = bf16(x_o * c_j + x_e * s_j)        (c, s) = the complex64 table at the position
    inverse: s -> -s (the conjugate). The first D-rd dims are copied unchanged.

fp32 math (the reference's), with each product made exact by splitting cos/sin (see triton_common.rotate_pair);
the golden does the product in float64, so a result can differ by one bf16 ULP only where the fp32 sum lands within
~2^-24 of a bf16 rounding tie (fp32 -> bf16 double rounding).
The (cos, sin) table is the golden's complex64 table, viewed as real: fp32 [L, rd/2, 2].

Memory traffic: in place, 2 * 2 * rd bytes per (token, head) (read + write the rotated tail) plus the
table rows (rd * 4 bytes per token, shared by its heads); out of place, 2 * 2 * D bytes per (token, head).

Interpreter notes: bf16 values are moved as int16 bits and widened with a shift (no bf16 arithmetic),
and rounded back with integer round-to-nearest-even, so the CPU interpreter gives the GPU's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import bf16_bits, bf16_to_fp32, rotate_pair
from engine.model.rope import RotaryTable, apply_rotary


@dataclass(frozen=True)
class RopeTable:
    """cs: fp32 [length, rd/2, 2] = (cos, sin) of the golden complex64 table for positions 0..length-1."""

    cs: Tensor
    rd: int

    @property
    def length(self) -> int:
        return self.cs.size(0)


def rope_table(rotary: RotaryTable, device: torch.device | str, length: int) -> RopeTable:
    """The layer's rotation table for positions 0..length-1 on `device` (exactly the golden's values)."""
    cis = rotary.at(torch.arange(length, device=device))  # complex64 [length, rd/2]
    return RopeTable(torch.view_as_real(cis).contiguous(), rotary.dim)


def check_positions(positions: Tensor, n: int, table: RopeTable, device: torch.device) -> Tensor:
    """Shape/dtype contract of a positions vector; the range is checked only for CPU tensors (no device sync)."""
    assert positions.dim() == 1 and positions.numel() == n, f"positions must be [{n}], got {tuple(positions.shape)}"
    assert positions.dtype in (torch.int32, torch.int64), f"positions must be int32/int64, got {positions.dtype}"
    assert table.cs.device == device, f"rope table on {table.cs.device}, data on {device}"
    if positions.device.type == "cpu" and n:
        lo, hi = int(positions.min()), int(positions.max())
        assert 0 <= lo and hi < table.length, f"positions {lo}..{hi} outside the table's 0..{table.length - 1}"
    return positions.to(device).contiguous()


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, cs_ptr, H,
                 D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_P2: tl.constexpr,
                 INVERSE: tl.constexpr, COPY_HEAD: tl.constexpr):
    """Program (token n, head block): rotate the last RD dims of BLOCK_H heads; x, out int16 views [N, H, D]."""
    n = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (heads < H)[:, None]
    row = (n * H + heads).to(tl.int64)[:, None] * D  # [BH, 1]
    pos = tl.load(pos_ptr + n).to(tl.int64)
    j = tl.arange(0, RD // 2)
    c = tl.load(cs_ptr + pos * RD + 2 * j)[None, :]
    s = tl.load(cs_ptr + pos * RD + 2 * j + 1)[None, :]
    col = D - RD + 2 * j[None, :]
    e = bf16_to_fp32(tl.load(x_ptr + row + col, mask=hm, other=0))
    o = bf16_to_fp32(tl.load(x_ptr + row + col + 1, mask=hm, other=0))
    re, ro = rotate_pair(e, o, c, s, INVERSE)
    tl.store(out_ptr + row + col, bf16_bits(re), mask=hm)
    tl.store(out_ptr + row + col + 1, bf16_bits(ro), mask=hm)
    if COPY_HEAD:
        hc = tl.arange(0, HEAD_P2)[None, :]
        hmask = hm & (hc < D - RD)
        tl.store(out_ptr + row + hc, tl.load(x_ptr + row + hc, mask=hmask, other=0), mask=hmask)


def apply_rope(x: Tensor, positions: Tensor, table: RopeTable, inverse: bool = False, inplace: bool = False) -> Tensor:
    """Rotate the last table.rd dims of x bf16 [N, H, D] or [N, D] (contiguous) at positions int [N].

    Returns a new tensor (inplace=False: the first D - rd dims copied) or x itself, rotated in place
    (inplace=True: only the rotated dims are read and written). Same bits as the golden apply_rotary
    except a rare 1-ULP difference (module docstring).
    """
    assert x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}"
    assert x.dim() in (2, 3), f"x must be [N, H, D] or [N, D], got {tuple(x.shape)}"
    assert x.is_contiguous(), f"x must be contiguous, got strides {x.stride()}"
    n, d = x.size(0), x.size(-1)
    h = x.size(1) if x.dim() == 3 else 1
    rd = table.rd
    assert rd % 2 == 0 and rd <= d and rd & (rd - 1) == 0, f"rope dim {rd} must be a power of two <= D = {d}"
    pos = check_positions(positions, n, table, x.device)
    out = x if inplace else torch.empty_like(x)
    if n and h:
        block_h = min(triton.next_power_of_2(h), max(1, 4096 // d))
        head_p2 = triton.next_power_of_2(max(d - rd, 1))
        _rope_kernel[(n, triton.cdiv(h, block_h))](
            x.view(torch.int16), out.view(torch.int16), pos, table.cs, h,
            D=d, RD=rd, BLOCK_H=block_h, HEAD_P2=head_p2, INVERSE=inverse, COPY_HEAD=not inplace and d > rd)
    return out


def apply_rope_ref(x: Tensor, positions: Tensor, rotary: RotaryTable, inverse: bool = False) -> Tensor:
    """The oracle: the golden apply_rotary (float64 complex product) on [N, H, D] or [N, D]."""
    cis = rotary.at(positions.to(x.device))  # [N, rd/2], broadcast over the heads
    return apply_rotary(x.unsqueeze(0), cis.unsqueeze(0), inverse)[0]
