"""engine.kernels.engram_gate against its fp32 torch reference and the golden's float64 math (engine.model.engram).

Tolerance: the kernel and engram_gate_ref differ only in the order of three fp32 sums over D, so the gate is
within a few fp32 ULPs and out = bf16(h + gate·value) within 1 bf16 ULP + 2^-18·|value| of either reference;
>= 99% of the elements bitwise equal to the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.engram_gate import engram_gate, engram_gate_ref
from engine.presets import full_config
from tests.kernels.numeric import assert_bf16_close

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-20  # the config's norm_eps


def _problem(n: int, hc: int, d: int, seed: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """Random stream, wkv output and weights; row 0 has h = 0 (dot = 0: gate = sigmoid(1e-3)), row 1 value = 0
    (out = h bitwise); the weights' signs mix so that dot takes both signs."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hc, d, generator=g) * 3).bfloat16()
    kv = torch.randn(n, (hc + 1) * d, generator=g).bfloat16()
    q = (torch.randn(hc, d, generator=g) * 0.5 + 0.3).bfloat16()
    k = torch.randn(hc, d, generator=g).bfloat16()
    if n > 0:
        h[0] = 0
    if n > 1:
        kv[1, hc * d:] = 0
    return tuple(t.to(device) for t in (h, kv, q, k))


def _golden(h, kv, q, k, eps) -> torch.Tensor:
    """engine.model.engram.Engram.forward after wkv, in float64."""
    hc, d = q.shape
    key, value = kv.double().split([hc * d, d], dim=-1)
    key, hd = key.unflatten(-1, (hc, d)), h.double()
    rstd = torch.rsqrt(hd.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hd * (q.double() * k.double()) * key).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hd + gate.unsqueeze(-1) * value.unsqueeze(1)).to(torch.bfloat16)


def _check(n: int, hc: int, d: int, seed: int, device="cpu") -> None:
    h, kv, q, k = _problem(n, hc, d, seed, device)
    out = engram_gate(h, kv, q, k, EPS)
    slack = 2.0**-18 * kv[:, hc * d:].double().abs().unsqueeze(1).expand(-1, hc, -1)
    what = f"N={n} hc={hc} D={d}"
    assert_bf16_close(out, engram_gate_ref(h, kv, q, k, EPS), slack, f"{what} vs the fp32 reference")
    assert_bf16_close(out, _golden(h, kv, q, k, EPS), slack, f"{what} vs the golden", min_equal=0.98)
    if n > 1:
        assert torch.equal(out[1].view(torch.int16), h[1].view(torch.int16)), "value = 0 must leave h unchanged"


@pytest.mark.parametrize("n,hc,d", [(3, 4, 96), (5, 4, 256), (2, 2, 40)])
def test_engram_gate_matches_references(n, hc, d):
    _check(n, hc, d, seed=n * 100 + d)


def test_engram_gate_empty_and_contract():
    h, kv, q, k = _problem(0, 4, 64, 1)
    assert engram_gate(h, kv, q, k, EPS).shape == (0, 4, 64)
    h, kv, q, k = _problem(2, 4, 64, 2)
    with pytest.raises(AssertionError, match="kv must be"):
        engram_gate(h, kv[:, :-1].contiguous(), q, k, EPS)
    with pytest.raises(AssertionError, match="bf16 expected"):
        engram_gate(h.float(), kv, q, k, EPS)
    with pytest.raises(AssertionError, match="q_weight, k_weight"):
        engram_gate(h, kv, q[:3].contiguous(), k, EPS)


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 6, 64])
def test_engram_gate_real_shape_gpu(n):
    cfg = full_config()
    _check(n, cfg.hc_mult, cfg.dim, seed=n, device="cuda")
