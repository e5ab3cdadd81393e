"""The kernel path's vision tower (spec 4.10): engine/model/vision.py's ViT and aligner in the reference's own
precision, bf16 on the device, the images of one patch grid run as one batch.

The golden tower rounds to bf16 where the reference's bf16 ops round and computes in float64 between. Here each of
those ops is one bf16 op with fp32 math inside and one rounding: F.linear (a bf16 tensor-core GEMM with fp32
accumulation on CUDA, its bias added before the rounding), RMSNorm (engine.kernels.norm), the 2-D RoPE products (fp32
torch), F.scaled_dot_product_attention (flash attention on CUDA: fp32 softmax and accumulation, its output rounded
once), SiLU, GELU, the SwiGLU product and the residual adds (bf16 torch). So each op's output is the golden's or a
bf16 ULP or so from it, and the tower's output differs from the golden's by rounding noise that the layers carry
forward (tests/core/test_kernel_vision.py states the bound).

Weights: taken once, at construction, from the model's modules as contiguous bf16 on the device (`ViTWeights`); the
RoPE tables of each patch grid are made once on the device.

Memory per image of N patches (released shapes, N <= 8649 at 1302 x 1302 pixels): the stream 2 N dim bytes, the MLP's
gate|up 4 N inter bytes (~97 MB at N = 8649), attention O(N) (flash); weights ~0.8 GB (32 layers).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.image_spans import image_patches
from engine.core.kernel_ops import OPS, rms_norm_torch
from engine.model.transformer import Transformer
from engine.model.vision import VISION_NORM_EPS, downsample, rope_2d_table, span_layout
from engine.vision.inputs import ImageInput
from engine.vision.layout import ImageGrid

MAX_ROPE_TABLES = 8  # patch grids whose RoPE tables stay on the device (<= 2.2 MB each at the released shapes)

@dataclass(frozen=True, slots=True)
class ViTWeights:
    """One ViT block's tensors, bf16 on the device (checkpoint names under vision.blocks.N)."""

    norm1: Tensor  # [dim]
    wqkv: Tensor  # [3 dim, dim]
    bqkv: Tensor  # [3 dim]
    wo: Tensor  # [dim, dim]
    bo: Tensor  # [dim]
    norm2: Tensor  # [dim]
    w1: Tensor  # [2 inter, dim]: gate | up
    w2: Tensor  # [dim, inter]


class VisionTower:
    """The model's ViT + aligner on `device` in bf16; `span_rows` is engine/core/image_spans.SpanCache's encoder."""

    def __init__(self, model: Transformer, device: torch.device | str):
        cfg = model.cfg
        assert cfg.has_vision, "the model has no vision tower"
        self.device = torch.device(device)

        def w(t: Tensor) -> Tensor:
            return t.to(self.device, torch.bfloat16).contiguous()

        vit, al = model.vision, model.aligner
        self.n_heads, self.head_dim, self.theta = cfg.vision_n_heads, cfg.vision_head_dim, cfg.vision_rope_theta
        self.r = cfg.vision_downsample_ratio
        self.patch_w, self.patch_b = w(vit.patch_embed.proj.weight), w(vit.patch_embed.proj.bias)
        self.blocks = [ViTWeights(w(b.norm1.weight), w(b.attn.wqkv.weight), w(b.attn.wqkv.bias), w(b.attn.wo.weight),
                                  w(b.attn.wo.bias), w(b.norm2.weight), w(b.mlp.w1.weight), w(b.mlp.w2.weight))
                       for b in vit.blocks]
        self.norm = w(vit.norm.weight)
        self.al_w1, self.al_b1, self.al_w2, self.al_b2 = w(al.w1.weight), w(al.w1.bias), w(al.w2.weight), w(al.w2.bias)
        self.delimiters = (w(model.image_start), w(model.image_newline), w(model.image_end))
        self._tables: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def span_rows(self, images: list[ImageInput]) -> list[Tensor]:
        """Each image's span rows bf16 [grid.num_tokens, dim] (its aligner rows between the learned delimiters);
        images of one grid in one batch."""
        by_grid: dict[ImageGrid, list[int]] = defaultdict(list)
        for i, im in enumerate(images):
            by_grid[im.grid].append(i)
        out: list[Tensor | None] = [None] * len(images)
        for grid, which in by_grid.items():
            patches = torch.stack([image_patches(images[i]) for i in which]).to(self.device, non_blocking=True)
            rows = self.encode(patches, grid.n_vit_h, grid.n_vit_w)  # [B, n_llm_h * n_llm_w, dim]
            for j, i in enumerate(which):
                out[i] = span_layout(rows[j], grid, *self.delimiters)
        return out

    def encode(self, patches: Tensor, n_vit_h: int, n_vit_w: int) -> Tensor:
        """patches bf16 [B, n_vit_h * n_vit_w, 3 p p] (reading order) -> IMAGE rows bf16 [B, n_llm_h * n_llm_w, dim]."""
        assert patches.dtype == torch.bfloat16 and patches.dim() == 3 and patches.size(1) == n_vit_h * n_vit_w, (
            f"patches {patches.dtype} {tuple(patches.shape)} for a {n_vit_h} x {n_vit_w} grid")
        cos, sin = self._rope_table(n_vit_h, n_vit_w)
        x = F.linear(patches, self.patch_w, self.patch_b)  # [B, N, dim]
        for blk in self.blocks:
            x = x + self._attention(self._norm(x, blk.norm1), blk, cos, sin)
            x = x + self._mlp(self._norm(x, blk.norm2), blk)
        cells = downsample(self._norm(x, self.norm), n_vit_h, n_vit_w, self.r)  # [B, cells, dim r r]
        return F.linear(F.gelu(F.linear(cells, self.al_w1, self.al_b1)), self.al_w2, self.al_b2)

    @staticmethod
    def _norm(x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm in fp32: engine.kernels.norm on CUDA; fp32 torch on the CPU (the tests: the Triton interpreter
        takes seconds per call at a few hundred rows)."""
        if not x.is_cuda:
            return rms_norm_torch(x, weight, VISION_NORM_EPS)
        return OPS.rms_norm(x.reshape(-1, x.size(-1)), weight, VISION_NORM_EPS).view(x.shape)

    def _attention(self, x: Tensor, blk: ViTWeights, cos: Tensor, sin: Tensor) -> Tensor:
        B, N, dim = x.shape
        qkv = F.linear(x, blk.wqkv, blk.bqkv).view(B, N, 3, self.n_heads, self.head_dim)
        q, k = (self._rope(qkv[:, :, i], cos, sin).transpose(1, 2) for i in (0, 1))  # [B, H, N, hd]
        o = F.scaled_dot_product_attention(q, k, qkv[:, :, 2].transpose(1, 2))  # [B, H, N, hd], scale hd^-0.5
        return F.linear(o.transpose(1, 2).reshape(B, N, dim), blk.wo, blk.bo)

    @staticmethod
    def _mlp(x: Tensor, blk: ViTWeights) -> Tensor:
        gate, up = F.linear(x, blk.w1).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, blk.w2)

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x bf16 [B, N, H, hd]: pairs (i, i + hd/2) turned by the grid's angles, fp32 products, rounded to bf16."""
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, hd/2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16)

    def _rope_table(self, n_h: int, n_w: int) -> tuple[Tensor, Tensor]:
        """The golden's fp32 (cos, sin) [n_h * n_w, hd/2] of a patch grid, on the device (made once per grid)."""
        table = self._tables.get((n_h, n_w))
        if table is None:
            if len(self._tables) >= MAX_ROPE_TABLES:
                self._tables.pop(next(iter(self._tables)))  # the oldest grid's
            cos, sin = rope_2d_table(n_h, n_w, self.head_dim, self.theta)
            table = self._tables[(n_h, n_w)] = (cos.to(self.device), sin.to(self.device))
        return table
