"""A MoE layer at the released shapes with random weight codes, for GPU tests and benchmarks.

Codes are drawn directly (no quantisation pass, so the 384 x 3 FP4 matrices, 7.2 GB, are built in
seconds on the device): FP4 nibbles uniform, FP8 codes uniform without the E4M3 NaN codes, E8M0 scales
in 2^-12..2^-6; the router's weight ~ N(0, 0.02) bf16 and its bias ~ N(0, 0.02).
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kernels.moe import ExpertWeights, stack_experts
from engine.model.layers import Linear
from engine.model.moe import MoE


def random_moe(cfg: ModelConfig, layer_id: int = 0, device: str = "cuda", seed: int = 0
               ) -> tuple[MoE, ExpertWeights]:
    """The layer's MoE on `device` with random codes, and its experts stacked (stack_experts)."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        moe = MoE(cfg, layer_id)
    for m in moe.modules():
        if isinstance(m, Linear):
            m.weight.view(torch.uint8).copy_(torch.randint(0, 256, m.weight.shape, generator=g, device=device,
                                                           dtype=torch.uint8))
            if m.fmt == "fp8":
                m.weight.view(torch.uint8).bitwise_and_(0xF7)  # no E4M3 NaN codes (0x7F / 0xFF)
            m.scale.view(torch.uint8).copy_(torch.randint(115, 122, m.scale.shape, generator=g, device=device,
                                                          dtype=torch.uint8))
    moe.gate.weight.copy_((torch.randn(moe.gate.weight.shape, generator=g, device=device) * 0.02).bfloat16())
    moe.gate.bias.copy_(torch.randn(moe.gate.bias.shape, generator=g, device=device) * 0.02)
    return moe, stack_experts(moe)
