"""One decoder layer: attention and MoE sublayers on the 4-copy stream with single-pass mHC (spec 4.2)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import LayerRole, ModelConfig
from engine.model.attention import Attention
from engine.model.engram import Engram
from engine.model.layers import RMSNorm, register
from engine.model.mhc import hc_mixes, hc_post, hc_pre
from engine.model.moe import MoE
from engine.parallel import SINGLE, ShardSpec


class Block(nn.Module):
    """One layer: attention and MoE sublayers on the 4-copy stream with single-pass mHC."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, attention_cls: type[Attention] = Attention,
                 shard: ShardSpec = SINGLE):
        super().__init__()
        self.cfg, self.role = cfg, role
        self.attn = attention_cls(cfg, role, shard)
        self.ffn = MoE(cfg, role.layer_id, shard)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mix, hc_dim = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        for part in ("attn", "ffn"):
            register(self, f"hc_{part}_fn", (mix, hc_dim), torch.float32)
            register(self, f"hc_{part}_base", (mix,), torch.float32)
            register(self, f"hc_{part}_scale", (3,), torch.float32)
        self.engram = Engram(cfg, role.engram_index) if role.has_engram else None

    def mixes(self, x: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return hc_mixes(x, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                        getattr(self, f"hc_{part}_base"), c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    def forward(self, X: torch.Tensor, pre_mix: torch.Tensor, attend, q_from: int | torch.Tensor = 0,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """X [B,S,hc,D], pre_mix [B,S,hc] (the previous sublayer's pre) -> (X' [B,R,hc,D], ffn pre).

        `attend(x_normed [B,S,D]) -> [B,R,D]` is the attention call; the stream keeps only the rows
        from q_from on, or the rows listed in a q_from index tensor (bounded replay's cut layer writes
        KV for all rows, continues on the tail). image_mask bool [B,S]: image-span rows (the router's bias_vl)."""
        y = attend(self.attn_norm(hc_pre(X, pre_mix)))
        R = X[:, q_from:] if isinstance(q_from, int) else X[:, q_from]
        if image_mask is not None:
            image_mask = image_mask[:, q_from:] if isinstance(q_from, int) else image_mask[:, q_from]
        a_pre, a_post, a_comb = self.mixes(R, "attn")
        X = hc_post(y, R, a_post, a_comb)
        f_pre, f_post, f_comb = self.mixes(X, "ffn")
        y = self.ffn(self.ffn_norm(hc_pre(X, a_pre)), image_mask)  # the FFN collapses with the attention sublayer's pre
        return hc_post(y, X, f_post, f_comb), f_pre
