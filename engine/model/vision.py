"""The golden V4.1 vision tower (spec 4.10; DeepSeek's reference `vision.py`): a ViT over one image's
patches with 2-D RoPE, and the aligner that downsamples its output r x r into LLM rows.

Attribute paths are the checkpoint's tensor names under `vision.` and `aligner.` (`image_start`,
`image_end`, `image_newline` belong to the transformer). Every weight is bf16 as released.

Numerics: the reference runs the tower in bf16 (PyTorch eager ops, each rounding its result to bf16;
RMSNorm, RoPE and the linears' accumulation in fp32). Here every op rounds to bf16 exactly where the
reference's does, and computes in float64 what it computes in fp32 (linears with their bias, RMSNorm,
the RoPE products, the whole attention softmax(q k^T / sqrt(d)) v, SiLU, GELU). The RoPE angles are the
reference's fp32 table.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import RMSNorm, register
from engine.vision.layout import ImageGrid

VISION_NORM_EPS = 1e-6  # the ViT keeps 1e-6 (the text model uses 1e-20)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


class VisionLinear(nn.Module):
    """y = x W^T (+ b), bf16 weight and bias; the product and the bias added in float64, rounded once to bf16."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        register(self, "weight", (out_features, in_features), torch.bfloat16)
        if bias:
            register(self, "bias", (out_features,), torch.bfloat16)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.double() @ self.weight.double().T
        if self.bias is not None:
            y = y + self.bias.double()
        return bf16(y)


@lru_cache(maxsize=8)
def rope_2d_table(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [n_h * n_w, head_dim / 2] for the patch grid in reading order (the reference's table).

    head_dim / 2 rotation pairs: the first head_dim / 4 turn with the patch's row at frequencies
    theta^(-2i / (head_dim / 2)), the last head_dim / 4 with its column at the same frequencies."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))  # [head_dim/4]
    rows = torch.arange(n_h).repeat_interleave(n_w).float()  # [N]
    cols = torch.arange(n_w).repeat(n_h).float()
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [N, head_dim/2]
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x bf16 [N, H, head_dim]: pair (x[i], x[i + head_dim/2]) rotated by angle i (rotate-half layout),
    in float64, rounded to bf16."""
    x1, x2 = x.double().chunk(2, dim=-1)  # [N, H, head_dim/2] each
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    return bf16(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = VisionLinear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches bf16 [N, 3*p*p] (channel-major) -> bf16 [N, vision_dim]."""
        return self.proj(patches.flatten(1))


class Attention(nn.Module):
    """Bidirectional multi-head attention over one image's patches, fused wqkv, 2-D RoPE on q and k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.vision_n_heads, cfg.vision_head_dim
        self.wqkv = VisionLinear(cfg.vision_dim, 3 * cfg.vision_dim, bias=True)
        self.wo = VisionLinear(cfg.vision_dim, cfg.vision_dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))  # [N, H, hd]
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) / math.sqrt(self.head_dim)  # [H, N, N]
        o = torch.einsum("hnm,mhd->nhd", scores.softmax(dim=-1), v.double())  # [N, H, hd]
        return self.wo(bf16(o).flatten(1))


class MLP(nn.Module):
    """SwiGLU without bias or clamp; w1 holds gate and up stacked ([2 * inter, dim])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = VisionLinear(cfg.vision_dim, 2 * cfg.vision_inter_dim, bias=False)
        self.w2 = VisionLinear(cfg.vision_inter_dim, cfg.vision_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        act = bf16(F.silu(gate.double()))
        return self.w2(bf16(act.double() * up.double()))


class VisionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = bf16(x.double() + self.attn(self.norm1(x), cos, sin).double())
        return bf16(x.double() + self.mlp(self.norm2(x)).double())


class ViT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.rope_theta = cfg.vision_head_dim, cfg.vision_rope_theta
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_n_layers))
        self.norm = RMSNorm(cfg.vision_dim, VISION_NORM_EPS)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """patches bf16 [n_vit_h * n_vit_w, 3*p*p] in reading order -> bf16 [n_vit_h * n_vit_w, vision_dim]."""
        assert patches.size(0) == n_vit_h * n_vit_w, (tuple(patches.shape), n_vit_h, n_vit_w)
        cos, sin = rope_2d_table(n_vit_h, n_vit_w, self.head_dim, self.rope_theta)
        cos, sin = cos.to(patches.device), sin.to(patches.device)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def downsample(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[..., n_h * n_w, C] (reading order, at most one leading batch dim) -> [..., ceil(n_h/r) * ceil(n_w/r), C * r * r]:
    each r x r cell of the grid, the bottom/right edge zero-padded, becomes one row laid out (c, dy, dx) (F.unfold's
    order)."""
    batch = x.view(-1, n_h, n_w, x.size(-1)).permute(0, 3, 1, 2)  # [B, C, n_h, n_w]
    batch = F.pad(batch, (0, -n_w % r, 0, -n_h % r))
    cells = F.unfold(batch, r, stride=r).transpose(1, 2)  # [B, cells, C*r*r]
    return cells if x.dim() == 3 else cells[0]


class Aligner(nn.Module):
    """r x r downsample of the ViT grid, then w2(GELU(w1(.))) into the LLM's dim."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.r = cfg.vision_downsample_ratio
        self.w1 = VisionLinear(cfg.vision_dim * self.r ** 2, cfg.dim, bias=True)
        self.w2 = VisionLinear(cfg.dim, cfg.dim, bias=True)

    def forward(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """bf16 [n_vit_h * n_vit_w, vision_dim] -> bf16 [n_llm_h * n_llm_w, dim] (reading order)."""
        h = self.w1(downsample(x, n_vit_h, n_vit_w, self.r))
        return self.w2(bf16(F.gelu(h.double())))


def encode_image(vision: ViT, aligner: Aligner, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
    """One image's IMAGE rows: bf16 [n_llm_h * n_llm_w, dim]."""
    return aligner(vision(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)


def span_layout(rows: torch.Tensor, grid: ImageGrid, image_start: torch.Tensor, image_newline: torch.Tensor,
                image_end: torch.Tensor) -> torch.Tensor:
    """An image's span in the LLM's stream, bf16 [grid.num_tokens, dim], from its IMAGE rows [n_llm_h * n_llm_w, dim]
    and the learned delimiters [dim]: image_start, then per aligner row its n_llm_w rows and image_newline, then
    image_end (spec 4.10)."""
    grid_rows = rows.view(grid.n_llm_h, grid.n_llm_w, -1)
    newline = image_newline.view(1, 1, -1).expand(grid.n_llm_h, 1, -1)
    body = torch.cat([grid_rows, newline], dim=1).flatten(0, 1)  # [n_llm_h*(n_llm_w+1), dim]
    return torch.cat([image_start[None], body, image_end[None]])
