"""Interleaved rotary embedding on the last `rope_head_dim` dims, with YaRN on compressed layers (spec 3).

Adjacent element pairs form one complex number. ratio-0 layers use `rope_theta` without YaRN; ratio > 0
layers use `compress_rope_theta` with YaRN for everything they rotate. No YaRN mscale is applied.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def yarn_inv_freq(dim: int, base: float, original_seq_len: int, factor: float, beta_fast: int,
                  beta_slow: int) -> torch.Tensor:
    """fp32 [dim/2] rotation frequencies; YaRN-blended when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


@lru_cache(maxsize=8)
def _cis_table(dim: int, length: int, base: float, original_seq_len: int, factor: float, beta_fast: int,
               beta_slow: int) -> torch.Tensor:
    freqs = yarn_inv_freq(dim, base, original_seq_len, factor, beta_fast, beta_slow)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [length, dim/2]


class RotaryTable:
    """Complex rotations for one layer kind, grown on demand (positions are absolute)."""

    def __init__(self, dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                 beta_fast: int = 32, beta_slow: int = 1):
        self.args = (dim, base, original_seq_len, factor, beta_fast, beta_slow)
        self.dim = dim
        self._on_device: dict[torch.device, torch.Tensor] = {}  # the table's copy per device

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """complex64 [..., dim/2] for integer positions of any shape."""
        need = int(positions.max().item()) + 1 if positions.numel() else 1
        table = self._on_device.get(positions.device)
        if table is None or table.size(0) < need:
            length = 1 << max(need - 1, 1).bit_length()
            table = _cis_table(self.args[0], length, *self.args[1:]).to(positions.device)
            self._on_device[positions.device] = table
        return table[positions.long()]


def apply_rotary(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2*cis.shape[-1]` dims of x (pairs interleaved); the reference's fp32 complex
    product done in float64 (the complex64 table is the reference's), rounded to x's dtype.

    x: [B, S, ..., d]; cis: [B or 1, S, d_rot/2] broadcast over any head dims between S and d.
    """
    rd = cis.shape[-1] * 2
    head = x[..., :-rd]
    tail = torch.view_as_complex(x[..., -rd:].double().unflatten(-1, (-1, 2)).contiguous())
    cis = cis.to(torch.complex128)
    if inverse:
        cis = cis.conj()
    while cis.dim() < tail.dim():
        cis = cis.unsqueeze(-2)
    rotated = torch.view_as_real(tail * cis).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)
