"""Engram conditional memory: hashed n-gram rows gated into the residual stream (spec 4.3)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import Linear, register


class EngramEmbedding(nn.Module):
    """FP8 rows with one E8M0 scale per 32; may stay in host memory (the real tables are ~98 GB each)."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        register(self, "weight", (rows, dim), torch.float8_e4m3fn)
        register(self, "scale", (rows, dim // 32), torch.float8_e8m0fnu)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> bf16 [..., dim] on ids' device (gathered where the table lives)."""
        host = ids.to(self.weight.device)
        rows = self.weight[host].float().unflatten(-1, (-1, 32)) * self.scale[host].float().unsqueeze(-1)
        return rows.flatten(-2).to(torch.bfloat16).to(ids.device)


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, engram_index: int):
        super().__init__()
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps
        self.embed = EngramEmbedding(cfg.engram_num_embeddings[engram_index], cfg.engram_head_dim)
        self.wkv = Linear(cfg.n_hash_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1),
                          "fp8" if cfg.dtype == "fp8" else "bf16")
        register(self, "q_weight", (cfg.hc_mult, cfg.dim), torch.bfloat16)
        register(self, "k_weight", (cfg.hc_mult, cfg.dim), torch.bfloat16)

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,S,hc,D] bf16 stream, hash_ids [B,S,n_hash_cols] -> stream with the gated value added to every copy."""
        kv = self.wkv(self.embed(hash_ids).flatten(-2))  # [B,S,(hc+1)*D]
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.double().unflatten(-1, (self.hc, self.dim))
        h = x.double()
        w = self.q_weight.double() * self.k_weight.double()  # only the product is ever used
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * w * key).sum(-1) * rstd * self.dim ** -0.5  # [B,S,hc]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # signed sqrt
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
        return (h + gate.unsqueeze(-1) * value.double().unsqueeze(-2)).to(x.dtype)
