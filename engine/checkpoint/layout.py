"""Every tensor of a released DeepSeek-V4.1 checkpoint, derived from a ModelConfig (spec section 6).

Names are the reference's module attribute paths (no `model.` prefix), so the model loads them with no
renaming table. Storage formats follow the reference constructors:
- a Linear created with the default dtype is FP8 E4M3 `[out, in]` + E8M0 `.scale` `[ceil(out/32),
  ceil(in/32)]` (BF16 without a scale when `cfg.dtype == "bf16"`); `attn.wo_a` is such a Linear in the
  checkpoint even though the reference runs it in bf16;
- routed experts are packed FP4 E2M1 `[out, in/2]` (two codes per byte, label I8) + E8M0 `[out, in/32]`;
- Engram tables are FP8 rows + E8M0 `[rows, head_dim/32]`;
- norms, embeddings, the head, the router weight, compressors, `indexer.wk`/`weights_proj` and the
  DSpark heads are BF16; mHC parameters, `attn_sink` and router biases are F32.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

from engine.config import ModelConfig

BF16, F32, FP8, E8M0 = "BF16", "F32", "F8_E4M3", "F8_E8M0"
FP4_PACKED = "I8"  # what the released headers call packed E2M1 pairs; loaders also take U8 and F4
BLOCK = 32

_ITEM_BYTES = {BF16: 2, F32: 4, FP8: 1, E8M0: 1, FP4_PACKED: 1}

# Text-only serving never reads these (spec 6): the vision tower, the aligner, the image-span
# delimiters and the router bias used only for image tokens.
SKIPPED_PREFIXES = ("vision.", "aligner.", "image_")
SKIPPED_SUFFIXES = (".gate.bias_vl",)

Component = Literal[
    "embed + head", "attention", "routed experts", "shared experts", "gates, mHC, norms",
    "Engram tables", "Engram dense", "DSpark", "vision + aligner",
]
COMPONENTS: tuple[Component, ...] = (
    "embed + head", "attention", "routed experts", "shared experts", "gates, mHC, norms",
    "Engram tables", "Engram dense", "DSpark", "vision + aligner",
)
# the components stored inside `layers.*` (the spec's "backbone layers total" byte row)
LAYER_COMPONENTS: tuple[Component, ...] = ("attention", "routed experts", "shared experts", "gates, mHC, norms")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One checkpoint tensor: name, shape as stored, safetensors dtype label."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_packed_fp4(self) -> bool:
        return self.dtype == FP4_PACKED

    @property
    def num_params(self) -> int:
        """Model parameters stored: a packed FP4 byte holds two."""
        return self.numel * (2 if self.is_packed_fp4 else 1)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEM_BYTES[self.dtype]


class ReportRow(NamedTuple):
    component: str
    num_params: int
    num_bytes: int


def is_text_only_skippable(name: str) -> bool:
    """True for tensors text-only serving neither needs nor validates (vision, aligner, image_*, bias_vl)."""
    return name.startswith(SKIPPED_PREFIXES) or name.endswith(SKIPPED_SUFFIXES)


def component_of(name: str) -> Component:
    """The parameter-accounting row a checkpoint tensor belongs to (spec 6's table)."""
    if name.startswith("mtp."):
        return "DSpark"
    if name.startswith(SKIPPED_PREFIXES):
        return "vision + aligner"
    if name in ("embed.weight", "head.weight"):
        return "embed + head"
    if ".engram.embed." in name:
        return "Engram tables"
    if ".engram." in name:
        return "Engram dense"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_experts." in name:
        return "shared experts"
    if ".attn." in name:
        return "attention"
    return "gates, mHC, norms"  # norm.weight, attn_norm, ffn_norm, hc_*, ffn.gate.*


class _Layout:
    """Accumulates TensorSpecs; one method per storage kind."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.specs: dict[str, TensorSpec] = {}
        self.default = "fp8" if cfg.dtype == "fp8" else "bf16"
        self.expert = "fp4" if cfg.expert_dtype == "fp4" else self.default

    def add(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        assert name not in self.specs, name
        self.specs[name] = TensorSpec(name, tuple(int(s) for s in shape), dtype)

    def linear(self, prefix: str, in_features: int, out_features: int, fmt: str | None = None) -> None:
        """`prefix.weight` (+ `prefix.scale`) of a Linear(in_features -> out_features)."""
        fmt = fmt or self.default
        if fmt == "fp8":
            self.add(f"{prefix}.weight", (out_features, in_features), FP8)
            self.add(f"{prefix}.scale", (-(-out_features // BLOCK), -(-in_features // BLOCK)), E8M0)
        elif fmt == "fp4":
            assert in_features % BLOCK == 0, (prefix, in_features)
            self.add(f"{prefix}.weight", (out_features, in_features // 2), FP4_PACKED)
            self.add(f"{prefix}.scale", (out_features, in_features // BLOCK), E8M0)
        else:
            self.add(f"{prefix}.weight", (out_features, in_features), {"bf16": BF16, "f32": F32}[fmt])

    def norm(self, prefix: str, dim: int) -> None:
        self.add(f"{prefix}.weight", (dim,), BF16)

    def attention(self, p: str, layer_id: int) -> None:
        c, role = self.cfg, self.cfg.layer_role(layer_id)
        self.add(f"{p}.attn_sink", (c.n_heads,), F32)
        self.linear(f"{p}.wq_a", c.dim, c.q_lora_rank)
        self.norm(f"{p}.q_norm", c.q_lora_rank)
        self.linear(f"{p}.wq_b", c.q_lora_rank, c.n_heads * c.head_dim)
        self.linear(f"{p}.wkv", c.dim, c.head_dim)
        self.norm(f"{p}.kv_norm", c.head_dim)
        # block-diagonal over o_groups: [o_groups * o_lora_rank, n_heads * head_dim / o_groups]
        self.linear(f"{p}.wo_a", c.n_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank)
        self.linear(f"{p}.wo_b", c.o_groups * c.o_lora_rank, c.dim)
        if role.is_kv_source:
            self.linear(f"{p}.compressor.wkv", c.dim, c.head_dim, "bf16")
            if role.ratio > 1:
                self.linear(f"{p}.compressor.wgate", c.dim, c.head_dim, "bf16")
            self.norm(f"{p}.compressor.norm", c.head_dim)
        if role.is_index_source:
            self.linear(f"{p}.indexer.wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim)
            self.linear(f"{p}.indexer.weights_proj", c.dim, c.index_n_heads, "bf16")
            if role.is_kv_source:  # index keys derive from this layer's own compressed latent
                self.linear(f"{p}.indexer.wk", c.head_dim, c.index_head_dim, "bf16")
                self.norm(f"{p}.indexer.k_norm", c.index_head_dim)

    def moe(self, p: str, layer_id: int, with_bias_vl: bool) -> None:
        c = self.cfg
        n_experts, _ = c.moe_experts(layer_id)
        self.linear(f"{p}.gate", c.dim, n_experts, "bf16")
        self.add(f"{p}.gate.bias", (n_experts,), F32)
        if with_bias_vl:
            self.add(f"{p}.gate.bias_vl", (n_experts,), F32)
        for e in range(n_experts):
            self.expert_ffn(f"{p}.experts.{e}", self.expert)
        self.expert_ffn(f"{p}.shared_experts", self.default)

    def expert_ffn(self, p: str, fmt: str) -> None:
        c = self.cfg
        self.linear(f"{p}.w1", c.dim, c.moe_inter_dim, fmt)
        self.linear(f"{p}.w2", c.moe_inter_dim, c.dim, fmt)
        self.linear(f"{p}.w3", c.dim, c.moe_inter_dim, fmt)

    def engram(self, p: str, engram_index: int) -> None:
        c = self.cfg
        rows, hd = c.engram_num_embeddings[engram_index], c.engram_head_dim
        self.add(f"{p}.embed.weight", (rows, hd), FP8)  # always FP8, dequantised on lookup
        self.add(f"{p}.embed.scale", (rows, hd // BLOCK), E8M0)
        self.linear(f"{p}.wkv", c.n_hash_cols * hd, c.dim * (c.hc_mult + 1))
        self.add(f"{p}.q_weight", (c.hc_mult, c.dim), BF16)
        self.add(f"{p}.k_weight", (c.hc_mult, c.dim), BF16)

    def block(self, p: str, layer_id: int, with_bias_vl: bool) -> None:
        c = self.cfg
        self.attention(f"{p}.attn", layer_id)
        self.moe(f"{p}.ffn", layer_id, with_bias_vl)
        role = c.layer_role(layer_id)
        if role.has_engram:
            self.engram(f"{p}.engram", role.engram_index)
        self.norm(f"{p}.attn_norm", c.dim)
        self.norm(f"{p}.ffn_norm", c.dim)
        mix = (2 + c.hc_mult) * c.hc_mult
        for sub in ("attn", "ffn"):
            self.add(f"{p}.hc_{sub}_fn", (mix, c.hc_mult * c.dim), F32)
            self.add(f"{p}.hc_{sub}_base", (mix,), F32)
            self.add(f"{p}.hc_{sub}_scale", (3,), F32)

    def dspark_stage(self, stage: int, with_bias_vl: bool) -> None:
        c = self.cfg
        p = f"mtp.{stage}"
        self.block(p, c.n_layers + stage, with_bias_vl)
        if stage == 0:
            self.linear(f"{p}.main_proj", c.dim * len(c.dspark_target_layer_ids), c.dim)
            self.norm(f"{p}.main_norm", c.dim)
        if stage == c.n_mtp_layers - 1:
            self.norm(f"{p}.norm", c.dim)
            self.add(f"{p}.markov_head.embed.weight", (c.vocab_size, c.dspark_markov_rank), BF16)
            self.add(f"{p}.markov_head.head.weight", (c.vocab_size, c.dspark_markov_rank), BF16)
            self.add(f"{p}.confidence_head.proj.weight", (1, c.dim + c.dspark_markov_rank), BF16)

    def vision(self) -> None:
        """ViT + aligner + image-span delimiters (spec 4.10; reference vision.py), all BF16."""
        c = self.cfg
        vd, inter = c.vision_dim, c.vision_inter_dim
        self.add("vision.patch_embed.proj.weight", (vd, 3 * c.vision_patch_size**2), BF16)
        self.add("vision.patch_embed.proj.bias", (vd,), BF16)
        for i in range(c.vision_n_layers):
            p = f"vision.blocks.{i}"
            self.norm(f"{p}.norm1", vd)
            self.add(f"{p}.attn.wqkv.weight", (3 * vd, vd), BF16)
            self.add(f"{p}.attn.wqkv.bias", (3 * vd,), BF16)
            self.add(f"{p}.attn.wo.weight", (vd, vd), BF16)
            self.add(f"{p}.attn.wo.bias", (vd,), BF16)
            self.norm(f"{p}.norm2", vd)
            self.add(f"{p}.mlp.w1.weight", (2 * inter, vd), BF16)  # fused gate/up
            self.add(f"{p}.mlp.w2.weight", (vd, inter), BF16)
        self.norm("vision.norm", vd)
        aligner_in = vd * c.vision_downsample_ratio**2
        self.add("aligner.w1.weight", (c.dim, aligner_in), BF16)
        self.add("aligner.w1.bias", (c.dim,), BF16)
        self.add("aligner.w2.weight", (c.dim, c.dim), BF16)
        self.add("aligner.w2.bias", (c.dim,), BF16)
        for name in ("image_start", "image_end", "image_newline"):
            self.add(name, (c.dim,), BF16)


def expected_tensors(cfg: ModelConfig, *, include_vision: bool = False,
                     include_mtp: bool = True) -> dict[str, TensorSpec]:
    """name -> TensorSpec for every tensor of the released checkpoint format for `cfg`.

    include_vision adds the ViT/aligner/image_* tensors and `gate.bias_vl` (only if the config has a
    vision tower); include_mtp adds the DSpark stages `mtp.*`.
    """
    vision = include_vision and cfg.vision_n_layers > 0
    lay = _Layout(cfg)
    lay.add("embed.weight", (cfg.vocab_size, cfg.dim), BF16)
    for i in range(cfg.n_layers):
        lay.block(f"layers.{i}", i, vision)
    lay.norm("norm", cfg.dim)
    lay.add("head.weight", (cfg.vocab_size, cfg.dim), BF16)
    if include_mtp:
        for s in range(cfg.n_mtp_layers):
            lay.dspark_stage(s, vision)
    if vision:
        lay.vision()
    return lay.specs


def parameter_report(cfg: ModelConfig, *, include_vision: bool | None = None) -> list[ReportRow]:
    """Parameters and checkpoint bytes per component (spec 6's accounting), then a "total" row.

    Packed FP4 bytes count two parameters; scales count as bytes, not parameters. include_vision
    defaults to whether the config has a vision tower.
    """
    if include_vision is None:
        include_vision = cfg.vision_n_layers > 0
    params = dict.fromkeys(COMPONENTS, 0)
    nbytes = dict.fromkeys(COMPONENTS, 0)
    for spec in expected_tensors(cfg, include_vision=include_vision).values():
        comp = component_of(spec.name)
        nbytes[comp] += spec.nbytes
        if not spec.name.endswith(".scale"):
            params[comp] += spec.num_params
    rows = [ReportRow(c, params[c], nbytes[c]) for c in COMPONENTS if params[c] or nbytes[c]]
    rows.append(ReportRow("total", sum(params.values()), sum(nbytes.values())))
    return rows


_LAYER_RE = re.compile(r"^(layers|mtp)\.(\d+)\.")


def layer_of(name: str) -> tuple[str, int] | None:
    """("layers", 3) for `layers.3.…`, ("mtp", 0) for `mtp.0.…`, None for top-level tensors."""
    m = _LAYER_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None
