"""The Engram gate (engine.model.engram.Engram.forward after wkv, spec 4.3), one launch:

    key, value = kv[n, :hc·D].view(hc, D), kv[n, hc·D:]                      kv bf16 [N, (hc+1)·D] (wkv's output)
    dot[c]  = Σ_d h[c]·w[c]·key[c] · rsqrt(mean h[c]² + eps) · rsqrt(mean key[c]² + eps) · D^-0.5,  w = q·k
    gate[c] = sigmoid(sign(dot)·sqrt(max(|dot|, 1e-6)))
    out[n, c, :] = bf16(h[c] + gate[c]·value)                                h bf16 [N, hc, D] (the stream)

in fp32 (engram_gate_ref is the same math in torch ops: it was the runner's implementation, ~28 launches per
Engram layer). One program per (row, copy) holds its D values in registers (BLOCK_D = next power of two >= D):
h[c], key[c], value and w[c] read once, out[c] written once. Memory traffic (the floor): per row
2·hc·D (h) + 2·(hc+1)·D (kv) + 2·hc·D (out) bytes, plus 4·hc·D (w, from L2 after the first rows).

Numerics vs engram_gate_ref: the same fp32 operations except the order of the three sums over D, so the gate
differs by a few fp32 ULPs and the bf16 output is the reference's or one bf16 ULP from it. The golden
(float64) is within the same bound. w = q·k is an exact fp32 product of two bf16 values.

Interpreter (TRITON_INTERPRET=1): inputs are upcast after loading, the output is written as integer bf16 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.norm import row_warps
from engine.kernels.triton_common import bf16_bits


@triton.jit
def _engram_gate_kernel(h_ptr, kv_ptr, q_ptr, k_ptr, out_ptr, D, eps, inv_sqrt_d, HC: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    ok = dd < D
    h = tl.load(h_ptr + (row * HC + c) * D + dd, mask=ok, other=0.0).to(tl.float32)
    key = tl.load(kv_ptr + row * (HC + 1) * D + c * D + dd, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(kv_ptr + row * (HC + 1) * D + HC * D + dd, mask=ok, other=0.0).to(tl.float32)
    w = (tl.load(q_ptr + c * D + dd, mask=ok, other=0.0).to(tl.float32)
         * tl.load(k_ptr + c * D + dd, mask=ok, other=0.0).to(tl.float32))
    rstd = (1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / D + eps)) * (1.0 / tl.sqrt_rn(tl.sum(key * key, axis=0) / D + eps))
    dot = tl.sum(h * w * key, axis=0) * rstd * inv_sqrt_d
    mag = tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-tl.where(dot < 0, -mag, mag)))
    tl.store(out_ptr + (row * HC + c) * D + dd, bf16_bits(h + gate * value), mask=ok)


def engram_gate(h: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """h bf16 [N, hc, D], kv bf16 [N, (hc+1)·D], q_weight / k_weight bf16 [hc, D] -> bf16 [N, hc, D]."""
    assert h.dtype == kv.dtype == q_weight.dtype == k_weight.dtype == torch.bfloat16, (
        f"bf16 expected: h {h.dtype}, kv {kv.dtype}, q {q_weight.dtype}, k {k_weight.dtype}")
    assert h.dim() == 3, f"h must be [N, hc, D], got {tuple(h.shape)}"
    n, hc, d = h.shape
    assert kv.shape == (n, (hc + 1) * d), f"kv must be [{n}, {(hc + 1) * d}], got {tuple(kv.shape)}"
    assert q_weight.shape == k_weight.shape == (hc, d), (
        f"q_weight, k_weight must be [{hc}, {d}], got {tuple(q_weight.shape)} {tuple(k_weight.shape)}")
    assert all(t.is_contiguous() for t in (h, kv, q_weight, k_weight)), "inputs must be contiguous"
    assert len({t.device for t in (h, kv, q_weight, k_weight)}) == 1, "inputs must be on one device"
    out = torch.empty_like(h)
    if n:
        block_d = triton.next_power_of_2(d)
        _engram_gate_kernel[(n, hc)](h, kv, q_weight, k_weight, out.view(torch.int16), d, float(eps), d ** -0.5,
                                     HC=hc, BLOCK_D=block_d, num_warps=row_warps(block_d))
    return out


def engram_gate_ref(h: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """The same math in fp32 torch ops (engine.model.engram's, which runs it in float64)."""
    hc, d = q_weight.shape
    key, value = kv.split([hc * d, d], dim=-1)
    key, hf = key.float().unflatten(-1, (hc, d)), h.float()
    w = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hf * w * key).sum(-1) * rstd * d ** -0.5  # [N, hc]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(h.dtype)
