"""Mixture of experts: sqrt-softplus router with aux-free bias, clamped SwiGLU experts (spec 4.5).

Expert-parallel: a rank holds the routed experts `local_experts` (n_routed_experts / N contiguous ids; the
others are not instantiated: `experts[e]` is None), the router is replicated (every rank routes every token alike), and
the shared expert is tensor-parallel over its intermediate dim. Each rank's float64 partial sums, routed
and shared, are summed over the ranks in one all-reduce before their roundings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import ColumnParallelLinear, RowParallelLinear, register
from engine.parallel import SINGLE, ShardSpec, all_reduce_sum
from engine.quant import round_product


class Gate(nn.Module):
    """Scores from the bf16 weight (the reference's fp32 math, in float64); the bias only selects,
    the weights come from the raw scores. With a vision tower the gate also holds `bias_vl`, the bias image
    tokens select with (spec 4.5)."""

    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.score_func, self.temp = topk, cfg.score_func, cfg.gate_temp
        self.norm_topk, self.route_scale = cfg.norm_topk_prob, cfg.route_scale
        register(self, "weight", (n_experts, cfg.dim), torch.bfloat16)
        register(self, "bias", (n_experts,), torch.float32)
        if cfg.has_vision:
            register(self, "bias_vl", (n_experts,), torch.float32)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T,D], image_mask bool [T] (True: an image-span token, which selects with bias_vl)
        -> (weights float64 [T,k], expert ids [T,k])."""
        scores = (x.double() @ self.weight.double().T) / self.temp
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(scores).sqrt()
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = scores.softmax(dim=-1)
        bias = self.bias
        if image_mask is not None:
            bias = torch.where(image_mask[:, None], self.bias_vl, self.bias)  # [T, n_experts]
        ids = (scores + bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids


class Expert(nn.Module):
    """SwiGLU with the training clamps: up clamped to +-limit, gate only from above; the routing
    weight multiplies the activation (fp32) before w2.

    A routed expert is whole on its rank (shard SINGLE); the shared expert passes the model's shard and is
    tensor-parallel over `inter`: w1 / w3 column-parallel, w2 row-parallel (`partial` is this rank's share)."""

    def __init__(self, dim: int, inter: int, fmt: str, limit: float, shard: ShardSpec = SINGLE):
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, inter, fmt, shard, "moe_inter_dim")
        self.w2 = RowParallelLinear(inter, dim, fmt, shard, "moe_inter_dim")
        self.w3 = ColumnParallelLinear(dim, inter, fmt, shard, "moe_inter_dim")
        self.limit = limit

    def hidden(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [T,D] bf16 -> the (weighted) activation [T, inter_local] that w2 reads, bf16."""
        gate, up = self.w1(x).double(), self.w3(x).double()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return h.to(x.dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(self.hidden(x, weights))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's float64 share of the output [T,D], unrounded (summed over the ranks, then rounded)."""
        return self.w2.partial(self.hidden(x))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, shard: ShardSpec = SINGLE):
        super().__init__()
        n_experts, topk = cfg.moe_experts(layer_id)
        routed = "fp4" if cfg.expert_dtype == "fp4" else ("fp8" if cfg.dtype == "fp8" else "bf16")
        self.shard = shard
        self.local_experts = shard.local_range(n_experts, "n_routed_experts" if layer_id < cfg.n_layers
                                               else "dspark_n_routed_experts")
        self.gate = Gate(cfg, n_experts, topk)
        # checkpoint names keep the global expert index: experts.{e} exists on the rank that owns e
        self.experts = nn.ModuleList(Expert(cfg.dim, cfg.moe_inter_dim, routed, cfg.swiglu_limit)
                                     if e in self.local_experts else None for e in range(n_experts))
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, "fp8" if cfg.dtype == "fp8" else "bf16",
                                     cfg.swiglu_limit, shard)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [...,D] bf16 (image_mask bool [...]: image-span tokens) -> [...,D] bf16: the routed outputs (each
        bf16) summed in float64, plus the shared expert's output rounded to bf16, rounded once. Sums of bf16
        values in float64 are exact here, so the ranks' split of the experts changes no bit."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        y = torch.zeros_like(x, dtype=torch.float64)
        for e in torch.unique(ids).tolist():
            if e not in self.local_experts:
                continue
            rows, slot = torch.where(ids == e)
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None]).double()
        shared = self.shared_experts.partial(x)
        y, shared = all_reduce_sum(torch.stack([y, shared]), self.shard)  # one all-reduce: [2,T,D] float64
        y += round_product(shared, self.shared_experts.w2.weight).double()
        return y.to(x.dtype).view(shape)
