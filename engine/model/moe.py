"""Mixture of experts: sqrt-softplus router with aux-free bias, clamped SwiGLU experts (spec 4.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import Linear, register


class Gate(nn.Module):
    """Scores from the bf16 weight (the reference's fp32 math, in float64); the bias only selects,
    the weights come from the raw scores."""

    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.score_func, self.temp = topk, cfg.score_func, cfg.gate_temp
        self.norm_topk, self.route_scale = cfg.norm_topk_prob, cfg.route_scale
        register(self, "weight", (n_experts, cfg.dim), torch.bfloat16)
        register(self, "bias", (n_experts,), torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T,D] -> (weights float64 [T,k], expert ids [T,k])."""
        scores = (x.double() @ self.weight.double().T) / self.temp
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(scores).sqrt()
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = scores.softmax(dim=-1)
        ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids


class Expert(nn.Module):
    """SwiGLU with the training clamps: up clamped to +-limit, gate only from above; the routing
    weight multiplies the activation (fp32) before w2."""

    def __init__(self, dim: int, inter: int, fmt: str, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter, fmt), Linear(inter, dim, fmt), Linear(dim, inter, fmt)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).double(), self.w3(x).double()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        n_experts, topk = cfg.moe_experts(layer_id)
        routed = "fp4" if cfg.expert_dtype == "fp4" else ("fp8" if cfg.dtype == "fp8" else "bf16")
        self.gate = Gate(cfg, n_experts, topk)
        self.experts = nn.ModuleList(Expert(cfg.dim, cfg.moe_inter_dim, routed, cfg.swiglu_limit) for _ in range(n_experts))
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, "fp8" if cfg.dtype == "fp8" else "bf16", cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [...,D] bf16 -> [...,D] bf16; routed outputs summed in fp32 in expert order, then shared."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        y = torch.zeros_like(x, dtype=torch.float64)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None]).double()
        y += self.shared_experts(x).double()
        return y.to(x.dtype).view(shape)
