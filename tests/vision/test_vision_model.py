"""engine/model/vision.py, the golden ViT + aligner, against references written here from the spec (4.10: patch
embed Linear(3*14*14 -> dim, bias); blocks of RMSNorm(1e-6) -> MHA with fused wqkv (bias) and 2-D RoPE (theta,
half the rotary pairs for rows, half for columns) -> wo (bias); RMSNorm -> SwiGLU (w1 gate|up, w2, no bias); final
RMSNorm; aligner: 3x3 unfold -> w1 -> GELU -> w2), on small random bf16 weights and odd patch grids.

The references compute in float64 and round to bf16 where the reference implementation's bf16 ops round (after
every linear, norm, RoPE, attention, activation and residual add), but are written independently: patches cut
from the image by index, RoPE as a complex rotation with float64 angles theta^(-j/(hd/4)), attention head by head
with an explicit softmax, the downsample by loops, GELU from erf.

Tolerances, in bf16 ULPs of the reference (tests/kernels/numeric.py `assert_bf16_close`: 1 ULP + slack):
- patch embed, MLP, aligner (the same rounding points, no RoPE): 1 ULP (a float64 sum in another order can only
  move a value that lies on a rounding boundary), >= 99.9% bitwise; the downsample is data movement: bitwise.
- RoPE: the golden table's angles are fp32 (the reference's), the test's float64: 1 ULP, >= 99% bitwise.
- attention and the ViT: a q/k element one ULP apart (the RoPE angles) moves the output by a fraction of a ULP of
  its row's scale, which may flip later roundings: 1 ULP + 2^-8 * the row's rms, >= 99% bitwise; the tower with its
  aligner, a cosine similarity >= 0.9999 per row. Measured: every output here is bitwise equal to its reference.
"""

from __future__ import annotations

import io
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from engine.model.vision import (Aligner, Attention, MLP, PatchEmbed, ViT, apply_rope_2d, downsample, encode_image,
                                 rope_2d_table)
from engine.presets import tiny_config
from engine.vision.image_processing import process_image, to_patches
from tests.kernels.numeric import assert_bf16_close

CFG = replace(tiny_config(), vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=96,
              vision_rope_theta=100.0, vision_min_pixels=0, vision_max_n_token=64)
P, D, H, HD, R = CFG.vision_patch_size, CFG.vision_dim, CFG.vision_n_heads, CFG.vision_head_dim, 3
GRIDS = [(5, 7), (4, 3), (1, 1)]  # (n_vit_h, n_vit_w): both edges padded by the 3x3 cells, exact, a single patch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rb(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16, kept as float64."""
    return x.to(torch.bfloat16).double()


def fill_random(module: torch.nn.Module, seed: int) -> None:
    """Every buffer bf16: weights N(0, 1/in), biases N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, buf in module.named_buffers():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
            val = 1 + 0.1 * torch.randn(buf.shape, generator=g)
        elif name.endswith("bias"):
            val = 0.1 * torch.randn(buf.shape, generator=g)
        else:
            val = torch.randn(buf.shape, generator=g) / math.sqrt(buf.shape[-1])
        buf.copy_(val.to(buf.dtype))


def built(cls, seed: int = 0):
    m = cls(CFG)
    fill_random(m, seed)
    return m


def rand_bf16(*shape: int, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).bfloat16()


# --- references from the spec --------------------------------------------------------------------------------------

def ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.einsum("ni,oi->no", x.double(), w.double())
    return rb(y + b.double() if b is not None else y)


def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return rb(w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def ref_rope(x: torch.Tensor, n_h: int, n_w: int, theta: float) -> torch.Tensor:
    """x [N, H, hd]: position (row, col) = divmod(n, n_w); pair j (dims j and j + hd/2) turns by row * f_j for
    j < hd/4 and col * f_(j - hd/4) after, f_j = theta^(-j / (hd/4))."""
    n, _, hd = x.shape
    q = hd // 4
    out = torch.empty(x.shape, dtype=torch.float64)
    for pos in range(n):
        row, col = divmod(pos, n_w)
        for j in range(hd // 2):
            angle = (row if j < q else col) * theta ** (-(j % q) / q)
            z = torch.complex(x[pos, :, j].double(), x[pos, :, j + hd // 2].double()) * complex(math.cos(angle),
                                                                                                math.sin(angle))
            out[pos, :, j], out[pos, :, j + hd // 2] = z.real, z.imag
    return rb(out)


def ref_attention(x: torch.Tensor, a: Attention, n_h: int, n_w: int) -> torch.Tensor:
    n = x.size(0)
    qkv = ref_linear(x, a.wqkv.weight, a.wqkv.bias)
    q, k, v = (qkv[:, i * D:(i + 1) * D].reshape(n, H, HD) for i in range(3))
    q, k = ref_rope(q, n_h, n_w, CFG.vision_rope_theta), ref_rope(k, n_h, n_w, CFG.vision_rope_theta)
    o = torch.empty(n, H, HD, dtype=torch.float64)
    for h in range(H):
        s = q[:, h] @ k[:, h].T / math.sqrt(HD)
        p = torch.exp(s - s.max(dim=1, keepdim=True).values)
        o[:, h] = (p / p.sum(dim=1, keepdim=True)) @ v[:, h]
    return ref_linear(rb(o).reshape(n, D), a.wo.weight, a.wo.bias)


def ref_mlp(x: torch.Tensor, m: MLP) -> torch.Tensor:
    gu = ref_linear(x, m.w1.weight)
    gate, up = gu[:, :CFG.vision_inter_dim], gu[:, CFG.vision_inter_dim:]
    return ref_linear(rb(rb(gate / (1 + torch.exp(-gate))) * up), m.w2.weight)


def ref_vit(patches_img: torch.Tensor, vit: ViT, n_h: int, n_w: int) -> torch.Tensor:
    """patches_img: bf16 [3, n_h * P, n_w * P], the image itself."""
    rows = [patches_img[:, i * P:(i + 1) * P, j * P:(j + 1) * P].reshape(-1) for i in range(n_h) for j in range(n_w)]
    x = ref_linear(torch.stack(rows), vit.patch_embed.proj.weight, vit.patch_embed.proj.bias)
    for blk in vit.blocks:
        x = rb(x + ref_attention(ref_rmsnorm(x, blk.norm1.weight), blk.attn, n_h, n_w))
        x = rb(x + ref_mlp(ref_rmsnorm(x, blk.norm2.weight), blk.mlp))
    return ref_rmsnorm(x, vit.norm.weight)


def ref_downsample(x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    c = x.size(1)
    cells_h, cells_w = -(-n_h // R), -(-n_w // R)
    out = torch.zeros(cells_h * cells_w, c * R * R, dtype=x.dtype)
    for bi in range(cells_h):
        for bj in range(cells_w):
            for dy in range(R):
                for dx in range(R):
                    i, j = bi * R + dy, bj * R + dx
                    if i < n_h and j < n_w:
                        out[bi * cells_w + bj, torch.arange(c) * R * R + dy * R + dx] = x[i * n_w + j]
    return out


def ref_aligner(x: torch.Tensor, al: Aligner, n_h: int, n_w: int) -> torch.Tensor:
    h = ref_linear(ref_downsample(x, n_h, n_w), al.w1.weight, al.w1.bias)
    return ref_linear(rb(0.5 * h * (1 + torch.erf(h / math.sqrt(2)))), al.w2.weight, al.w2.bias)


def row_rms(ref: torch.Tensor) -> torch.Tensor:
    return ref.double().square().mean(-1, keepdim=True).sqrt().expand(ref.shape)


# --- the pieces ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_h,n_w", GRIDS)
def test_patch_embed(n_h, n_w):
    pe = built(PatchEmbed)
    img = rand_bf16(3, n_h * P, n_w * P)
    rows = [img[:, i * P:(i + 1) * P, j * P:(j + 1) * P].reshape(-1) for i in range(n_h) for j in range(n_w)]
    ref = ref_linear(torch.stack(rows), pe.proj.weight, pe.proj.bias)
    assert_bf16_close(pe(to_patches(img, P)), ref.bfloat16(), 0.0, f"patch embed {n_h}x{n_w}", min_equal=0.999)


@pytest.mark.parametrize("n_h,n_w", GRIDS)
@pytest.mark.parametrize("theta", [10000.0, 100.0])
def test_rope_2d(n_h, n_w, theta):
    x = rand_bf16(n_h * n_w, H, HD, seed=2)
    got = apply_rope_2d(x, *rope_2d_table(n_h, n_w, HD, theta))
    assert_bf16_close(got, ref_rope(x, n_h, n_w, theta).bfloat16(), 0.0, f"rope {n_h}x{n_w} theta {theta}",
                      min_equal=0.99)


def test_rope_2d_depends_on_the_offset_only():
    """q(row, col) . k(row', col') after RoPE is a function of (row' - row, col' - col) (float64, before rounding)."""
    cos, sin = rope_2d_table(4, 5, HD, 10000.0)
    q = torch.randn(1, 1, HD, dtype=torch.float64).expand(20, 1, HD)
    k = torch.randn(1, 1, HD, dtype=torch.float64).expand(20, 1, HD)
    c, s = cos.double()[:, None], sin.double()[:, None]

    def turn(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)[:, 0]

    dots = turn(q) @ turn(k).T  # [20, 20]
    pos = [divmod(n, 5) for n in range(20)]
    by_offset: dict[tuple[int, int], float] = {}
    for a in range(20):
        for b in range(20):
            off = (pos[b][0] - pos[a][0], pos[b][1] - pos[a][1])
            want = by_offset.setdefault(off, dots[a, b].item())
            assert abs(dots[a, b].item() - want) < 1e-5, off  # fp32 angles: ~1e-7 relative


@pytest.mark.parametrize("n_h,n_w", GRIDS)
def test_attention(n_h, n_w):
    at = built(Attention, seed=3)
    x = rand_bf16(n_h * n_w, D, seed=4)
    got = at(x, *rope_2d_table(n_h, n_w, HD, CFG.vision_rope_theta))
    ref = ref_attention(x, at, n_h, n_w)
    assert_bf16_close(got, ref.bfloat16(), 2.0**-8 * row_rms(ref), f"attention {n_h}x{n_w}", min_equal=0.99)


def test_mlp():
    m = built(MLP, seed=5)
    x = rand_bf16(37, D, seed=6)
    assert_bf16_close(m(x), ref_mlp(x, m).bfloat16(), 0.0, "mlp", min_equal=0.999)


@pytest.mark.parametrize("n_h,n_w", GRIDS)
def test_downsample_is_a_3x3_unfold(n_h, n_w):
    x = rand_bf16(n_h * n_w, D, seed=7)
    got = downsample(x, n_h, n_w, R)
    assert got.shape == (-(-n_h // R) * -(-n_w // R), D * R * R)
    assert torch.equal(got.view(torch.int16), ref_downsample(x, n_h, n_w).view(torch.int16))


@pytest.mark.parametrize("n_h,n_w", GRIDS)
def test_aligner(n_h, n_w):
    al = built(Aligner, seed=8)
    x = rand_bf16(n_h * n_w, D, seed=9)
    got = al(x, n_h, n_w)
    assert got.shape == (-(-n_h // R) * -(-n_w // R), CFG.dim)
    assert_bf16_close(got, ref_aligner(x, al, n_h, n_w).bfloat16(), 0.0, f"aligner {n_h}x{n_w}", min_equal=0.999)


# --- the whole tower -----------------------------------------------------------------------------------------------

def assert_rows_cosine(got: torch.Tensor, ref: torch.Tensor, what: str, min_cos: float = 0.9999) -> None:
    cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
    worst = int(cos.argmin())
    assert cos.min() >= min_cos, f"{what}: row {worst} cosine {cos[worst].item():.6f} < {min_cos}"


@pytest.mark.parametrize("n_h,n_w", GRIDS[:2])
def test_vit_and_aligner(n_h, n_w):
    vit, al = built(ViT, seed=10), built(Aligner, seed=11)
    img = rand_bf16(3, n_h * P, n_w * P, seed=12)
    feats = vit(to_patches(img, P), n_h, n_w)
    ref_feats = ref_vit(img, vit, n_h, n_w)
    assert_rows_cosine(feats, ref_feats, f"vit {n_h}x{n_w}")
    assert_bf16_close(feats, ref_feats.bfloat16(), 2.0**-8 * row_rms(ref_feats), f"vit {n_h}x{n_w}",
                      min_equal=0.99)
    rows = encode_image(vit, al, to_patches(img, P), n_h, n_w)
    assert rows.dtype == torch.bfloat16 and rows.shape == (-(-n_h // R) * -(-n_w // R), CFG.dim)
    assert_rows_cosine(rows, ref_aligner(ref_feats.bfloat16(), al, n_h, n_w), f"tower {n_h}x{n_w}")


def test_image_bytes_to_llm_rows():
    """A PNG through the processor and the tower: one aligner row per IMAGE position of its span."""
    vit, al = built(ViT, seed=13), built(Aligner, seed=14)
    pixels = np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    image = process_image(buf.getvalue(), CFG)
    g = image.grid  # 60 x 90 -> 70 x 98 px with 64 tokens at most: 5 x 7 patches, 2 x 3 rows, 2 * 4 + 2 = 10
    assert (g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w, g.num_tokens) == (5, 7, 2, 3, 10)
    rows = encode_image(vit, al, image.patches, g.n_vit_h, g.n_vit_w)
    assert rows.shape == (g.n_llm_h * g.n_llm_w, CFG.dim) and torch.isfinite(rows.float()).all()
