"""Packed cache records (spec 4.7): what the paged pools store per entry, as raw bytes.

- SWA KV: 512 FP8 E4M3 values, then one UE8M0 scale byte per 32 (528 B at head_dim 512).
- main KV: E2M1 pairs (even element in the low nibble), then one E4M3 scale byte per 16 (288 B).
- index K: E2M1 pairs, then one UE8M0 scale byte per 32 (MXFP4, 68 B at index_head_dim 128).

`unpack_*(pack_*(x))` is bitwise the golden model's QDQ of x (act_quant_qdq / fp4_qdq): every code
times its power-of-two or E4M3 scale is exact in bf16. Rows are independent, so any leading shape works.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.quant import act_quant, e2m1_decode, fp4_quant, unpack_fp4

SWA_BLOCK = 32  # elements per UE8M0 scale in a SWA record
MAIN_KV_BLOCK = 16  # elements per E4M3 scale in a main-KV record
INDEX_K_BLOCK = 32  # elements per UE8M0 scale in an index-key record


def swa_record_bytes(dim: int) -> int:
    return dim + dim // SWA_BLOCK


def fp4_record_bytes(dim: int, block: int) -> int:
    return dim // 2 + dim // block


def pack_swa(x: Tensor) -> Tensor:
    """bf16 [..., D] -> uint8 [..., D + D/32]."""
    q, s = act_quant(x, SWA_BLOCK)
    return torch.cat([q.view(torch.uint8), s.to(torch.float8_e8m0fnu).view(torch.uint8)], dim=-1)


def unpack_swa(rec: Tensor, dim: int) -> Tensor:
    """uint8 [..., D + D/32] -> bf16 [..., D]."""
    _check(rec, swa_record_bytes(dim))
    q = rec[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
    s = rec[..., dim:].contiguous().view(torch.float8_e8m0fnu).float()
    return (q.unflatten(-1, (-1, SWA_BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def pack_main_kv(x: Tensor) -> Tensor:
    """bf16 [..., D] -> uint8 [..., D/2 + D/16] (NVFP4-style, no global scale)."""
    packed, s = fp4_quant(x, MAIN_KV_BLOCK, "e4m3")
    return torch.cat([packed, s.view(torch.uint8)], dim=-1)


def unpack_main_kv(rec: Tensor, dim: int) -> Tensor:
    """uint8 [..., D/2 + D/16] -> bf16 [..., D]."""
    return _unpack_fp4(rec, dim, MAIN_KV_BLOCK, torch.float8_e4m3fn)


def pack_index_k(x: Tensor) -> Tensor:
    """bf16 [..., D] -> uint8 [..., D/2 + D/32] (MXFP4)."""
    packed, s = fp4_quant(x, INDEX_K_BLOCK, "ue8m0")
    return torch.cat([packed, s.view(torch.uint8)], dim=-1)


def unpack_index_k(rec: Tensor, dim: int) -> Tensor:
    """uint8 [..., D/2 + D/32] -> bf16 [..., D]."""
    return _unpack_fp4(rec, dim, INDEX_K_BLOCK, torch.float8_e8m0fnu)


def _unpack_fp4(rec: Tensor, dim: int, block: int, scale_dtype: torch.dtype) -> Tensor:
    _check(rec, fp4_record_bytes(dim, block))
    codes = unpack_fp4(rec[..., :dim // 2])  # [..., D]
    s = rec[..., dim // 2:].contiguous().view(scale_dtype).float()
    return (e2m1_decode(codes).unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def _check(rec: Tensor, nbytes: int) -> None:
    assert rec.dtype == torch.uint8, f"cache records are uint8, got {rec.dtype}"
    assert rec.size(-1) == nbytes, f"record of {rec.size(-1)} bytes, expected {nbytes}"
