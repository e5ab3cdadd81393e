"""DeepSeek-V4.1 model configuration: one frozen dataclass, read from a checkpoint's config.json.

Field names are the reference's `inference/config.json` keys (DeepSeek's ModelArgs), so the model reads
like the reference. `from_hf` maps the released HF form (nested `text_config`, `quantization_config`);
`from_reference` takes the reference form. Layer roles (KV source, Reuse, Reindex, ...) are derived from
the config by `layer_role`, never hard-coded to layer numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config.json that cannot describe a V4.1 model; the message names the key."""


CsaMode = Literal["swa", "full", "reuse", "reindex", "dspark"]


@dataclass(frozen=True, slots=True)
class LayerRole:
    """What one layer does, derived from the config (spec 2.4).

    kv_source / index_source: the layer whose main KV + index keys / whose top-k this layer reads
    (itself when it produces them); None on sliding-window-only layers.
    """

    layer_id: int
    ratio: int
    mode: CsaMode
    kv_source: int | None
    index_source: int | None
    is_candidate_source: bool
    uses_candidates: bool
    engram_index: int | None  # position in engram_layer_ids, or None
    is_decoder: bool  # at or after the CED cut
    is_dspark_tap: bool  # its INPUT stream feeds DSpark's main_hidden

    @property
    def is_kv_source(self) -> bool:
        return self.kv_source == self.layer_id

    @property
    def is_index_source(self) -> bool:
        return self.index_source == self.layer_id

    @property
    def has_engram(self) -> bool:
        return self.engram_index is not None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    norm_eps: float = 1e-20
    swiglu_limit: float = 10.0
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    # attention / CSA2
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20  # < 0: no candidate pre-filtering
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # RoPE: base rope_theta on ratio-0 layers; compress_rope_theta + YaRN on ratio > 0 layers
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    max_position_embeddings: int = 1048576
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # storage formats
    dtype: Literal["fp8", "bf16"] = "fp8"
    expert_dtype: Literal["fp4"] | None = "fp4"
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    # vision tower (spec 2.3, 4.10): ViT + aligner; vision_n_layers 0 = text-only (the HF form without a
    # vision_config). The last four size images: resolution >= vision_min_pixels, <= vision_max_n_token LLM
    # tokens per image span, and (when set) width <= vision_max_wh_ratio * height.
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936  # 544^2
    vision_max_wh_ratio: float | None = None

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def n_total_layers(self) -> int:
        """Backbone layers plus DSpark stages (mtp.*), which follow them in compress_ratios."""
        return self.n_layers + self.n_mtp_layers

    @property
    def ced_cut(self) -> int:
        """First decoder layer: the last KV source (vLLM: cut = max(kv_source_layer_ids))."""
        return max(self.kv_source_layers) if self.kv_source_layers else self.n_layers

    @property
    def has_vision(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def vision_head_dim(self) -> int:
        return self.vision_dim // self.vision_n_heads

    @property
    def n_hash_cols(self) -> int:
        """Engram rows fetched per token per Engram layer: orders 2..max_ngram x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def swa_entry_bytes(self) -> int:
        """FP8 E4M3 SWA record: head_dim bytes + one UE8M0 scale per 32."""
        return self.head_dim + self.head_dim // 32

    @property
    def main_kv_entry_bytes(self) -> int:
        """FP4 E2M1 main-KV record: head_dim/2 bytes + one E4M3 scale per 16."""
        return self.head_dim // 2 + self.head_dim // 16

    @property
    def index_k_entry_bytes(self) -> int:
        """MXFP4 index-key record: index_head_dim/2 bytes + one UE8M0 scale per 32."""
        return self.index_head_dim // 2 + self.index_head_dim // 32

    @property
    def global_kv_bytes_per_token(self) -> float:
        """Bytes of main KV + index keys one token adds across all KV sources (890 on the real config)."""
        per_entry = self.main_kv_entry_bytes + self.index_k_entry_bytes
        return sum(per_entry / self.compress_ratios[s] for s in self.kv_source_layers)

    def moe_experts(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, activated experts) of a backbone layer or a DSpark stage."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return self.dspark_n_routed_experts, self.dspark_n_activated_experts

    def layer_role(self, layer_id: int) -> LayerRole:
        return self._roles[layer_id]

    @cached_property
    def _roles(self) -> tuple[LayerRole, ...]:
        return tuple(_derive_role(self, i) for i in range(self.n_total_layers))

    @property
    def roles(self) -> tuple[LayerRole, ...]:
        return self._roles

    # ---- (de)serialisation ----------------------------------------------------------------------
    def to_reference_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The released HF config.json layout: text model nested under text_config."""
        text = {"model_type": "deepseek_v41_text"}
        for ref_key, hf_key in _REF_TO_HF.items():
            v = getattr(self, ref_key)
            text[hf_key] = list(v) if isinstance(v, tuple) else v
        text["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": self.rope_factor,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "original_max_position_embeddings": self.original_seq_len,
        }
        text.update(num_key_value_heads=1, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                    topk_method="noaux_tc", n_hash_layers=0)
        vision = {_VISION_TO_HF[k]: getattr(self, k) for k in _VISION_TO_HF}
        vision["model_type"] = "deepseek_v41_vision"
        quant = {
            "quant_method": "fp8" if self.dtype == "fp8" else "none",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": self.expert_dtype,
        }
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "quantization_config": quant,
            "text_config": text,
            "vision_config": vision,
        }

    @classmethod
    def from_reference(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - _REFERENCE_RUNTIME_KEYS
        if unknown:
            raise ConfigError(f"reference config: unknown keys {sorted(unknown)}")
        if d.get("n_hash_layers", 0):
            raise ConfigError(f"n_hash_layers: hash routing is not part of V4.1, got {d['n_hash_layers']}")
        kwargs = {k: _coerce(k, v) for k, v in d.items() if k in known}
        return cls(**kwargs)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        text = d.get("text_config", d)
        if not isinstance(text, dict):
            raise ConfigError("text_config: must be an object")
        kwargs: dict[str, Any] = {}
        for ref_key, hf_key in _REF_TO_HF.items():
            if hf_key in text:
                kwargs[ref_key] = _coerce(ref_key, text[hf_key], f"text_config.{hf_key}")
            elif ref_key in _HF_REQUIRED:
                raise ConfigError(f"text_config.{hf_key}: missing (required)")
        rs = text.get("rope_scaling")
        if rs is not None:
            if not isinstance(rs, dict):
                raise ConfigError("text_config.rope_scaling: must be an object")
            kind = rs.get("rope_type", rs.get("type"))
            if kind != "yarn":
                raise ConfigError(f"text_config.rope_scaling.rope_type: expected 'yarn', got {kind!r}")
            for ref_key, hf_key in (("rope_factor", "factor"), ("beta_fast", "beta_fast"),
                                    ("beta_slow", "beta_slow"), ("original_seq_len", "original_max_position_embeddings")):
                if hf_key not in rs:
                    raise ConfigError(f"text_config.rope_scaling.{hf_key}: missing")
                kwargs[ref_key] = _coerce(ref_key, rs[hf_key], f"text_config.rope_scaling.{hf_key}")
        else:
            kwargs["original_seq_len"] = 0
        if text.get("num_key_value_heads", 1) != 1:
            raise ConfigError(f"text_config.num_key_value_heads: V4.1 has one shared KV head, got {text['num_key_value_heads']}")
        for key in ("n_hash_layers", "num_hash_layers"):
            if text.get(key, 0):
                raise ConfigError(f"text_config.{key}: hash routing is not part of V4.1, got {text[key]}")
        q = d.get("quantization_config")
        if q is not None and not isinstance(q, dict):
            raise ConfigError("quantization_config: must be an object")
        if q is not None:
            if q.get("weight_block_size", [32, 32]) != [32, 32]:
                raise ConfigError(f"quantization_config.weight_block_size: expected [32, 32], got {q['weight_block_size']}")
            if q.get("scale_fmt", "ue8m0") != "ue8m0":
                raise ConfigError(f"quantization_config.scale_fmt: expected 'ue8m0', got {q['scale_fmt']!r}")
            kwargs["dtype"] = "fp8" if q.get("quant_method") == "fp8" else "bf16"
            kwargs["expert_dtype"] = q.get("expert_dtype")
        else:
            kwargs["dtype"] = "bf16"
            kwargs["expert_dtype"] = None
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            if key in d:
                kwargs[key] = _coerce(key, d[key])
        vision = d.get("vision_config")
        if vision is not None and not isinstance(vision, dict):
            raise ConfigError("vision_config: must be an object")
        if isinstance(vision, dict):
            for ref_key, hf_key in _VISION_TO_HF.items():
                if hf_key in vision:
                    kwargs[ref_key] = _coerce(ref_key, vision[hf_key], f"vision_config.{hf_key}")
        else:
            kwargs["vision_n_layers"] = 0
        return cls(**kwargs)


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """Read `config.json` (HF form or reference form), else `inference/config.json` (reference form)."""
    ckpt_dir = Path(ckpt_dir)
    for path in (ckpt_dir / "config.json", ckpt_dir / "inference" / "config.json"):
        if path.is_file():
            break
    else:
        raise FileNotFoundError(f"{ckpt_dir}: no config.json (nor inference/config.json)")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: top level must be an object")
    try:
        return ModelConfig.from_hf(d) if ("text_config" in d or "hidden_size" in d) else ModelConfig.from_reference(d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# ---- mapping tables -------------------------------------------------------------------------------
_REF_TO_HF: dict[str, str] = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "norm_eps": "rms_norm_eps",
    "swiglu_limit": "swiglu_limit",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "gate_temp": "gate_temp",
    "norm_topk_prob": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "window_size": "sliding_window",
    "compress_ratios": "compress_ratios",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_VISION_TO_HF = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}
# keys whose absence would silently change the model if defaulted
_HF_REQUIRED = {"vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "head_dim", "rope_head_dim",
                "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "n_activated_experts",
                "window_size", "compress_ratios", "index_n_heads", "index_head_dim", "index_topk"}
# runtime-only keys of the reference's config.json / ModelArgs
_REFERENCE_RUNTIME_KEYS = {"max_batch_size", "max_seq_len", "temperature", "n_hash_layers"}
_INT_TUPLES = {"compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
               "engram_num_embeddings", "dspark_target_layer_ids"}


def _coerce(key: str, value: Any, name: str | None = None) -> Any:
    """Check and convert a JSON value for field `key`; errors name the key as the file spells it (`name`)."""
    try:
        return _coerce_value(key, value)
    except ConfigError as e:
        raise ConfigError(str(e).replace(f"{key}:", f"{name or key}:", 1)) from None


def _coerce_value(key: str, value: Any) -> Any:
    if key in _INT_TUPLES:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
        return tuple(value)
    if key == "expert_dtype":
        return value
    if key == "vision_max_wh_ratio":  # a number or null (no limit)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ConfigError(f"{key}: expected a number or null, got {value!r}")
        return None if value is None else float(value)
    default = ModelConfig.__dataclass_fields__[key].default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected a boolean, got {value!r}")
    elif isinstance(default, int):
        if not isinstance(value, int) or isinstance(value, bool):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif isinstance(default, float):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    return value


def _latest_at_or_below(layers: tuple[int, ...], layer_id: int) -> int | None:
    below = [s for s in layers if s <= layer_id]
    return max(below) if below else None


def _derive_role(cfg: ModelConfig, i: int) -> LayerRole:
    ratio = cfg.compress_ratios[i]
    engram_index = cfg.engram_layer_ids.index(i) if i in cfg.engram_layer_ids else None
    common = dict(layer_id=i, ratio=ratio, engram_index=engram_index,
                  is_decoder=cfg.ced_cut <= i < cfg.n_layers, is_dspark_tap=i in cfg.dspark_target_layer_ids)
    if i >= cfg.n_layers:
        return LayerRole(mode="dspark", kv_source=None, index_source=None, is_candidate_source=False,
                         uses_candidates=False, **common)
    if ratio == 0:
        return LayerRole(mode="swa", kv_source=None, index_source=None, is_candidate_source=False,
                         uses_candidates=False, **common)
    kv_src = _latest_at_or_below(cfg.kv_source_layers, i)
    idx_src = _latest_at_or_below(cfg.index_source_layers, i)
    if i == kv_src:
        mode: CsaMode = "full"
    elif i == idx_src:
        mode = "reindex"
    else:
        mode = "reuse"
    cand = cfg.candidate_source_layer
    return LayerRole(mode=mode, kv_source=kv_src, index_source=idx_src, is_candidate_source=(i == cand),
                     uses_candidates=(i == idx_src and 0 <= cand < i), **common)


def _validate(c: ModelConfig) -> None:
    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {msg}")

    for key in ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "head_dim", "q_lora_rank",
                "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                "hc_mult", "n_routed_experts", "n_activated_experts"):
        need(getattr(c, key) > 0, key, f"must be positive, got {getattr(c, key)}")
    for key in ("dim", "moe_inter_dim", "head_dim", "q_lora_rank", "index_head_dim", "o_lora_rank"):
        need(getattr(c, key) % 32 == 0, key, f"must be a multiple of 32 (FP8/FP4 blocks), got {getattr(c, key)}")
    need(c.rope_head_dim % 2 == 0 and 0 < c.rope_head_dim <= min(c.head_dim, c.index_head_dim), "rope_head_dim",
         f"must be even and at most head_dim and index_head_dim, got {c.rope_head_dim}")
    need(c.n_heads % c.o_groups == 0, "o_groups", f"must divide n_heads={c.n_heads}, got {c.o_groups}")
    need((c.n_heads * c.head_dim // c.o_groups) % 32 == 0, "o_groups", "n_heads*head_dim/o_groups must be a multiple of 32")
    need(c.n_shared_experts == 1, "n_shared_experts", f"V4.1 has exactly one shared expert, got {c.n_shared_experts}")
    need(c.n_activated_experts <= c.n_routed_experts, "n_activated_experts", "exceeds n_routed_experts")
    need(c.score_func in ("sqrtsoftplus", "sigmoid", "softmax"), "score_func", f"unknown {c.score_func!r}")
    need(c.dtype in ("fp8", "bf16"), "dtype", f"expected 'fp8' or 'bf16', got {c.dtype!r}")
    need(c.expert_dtype in ("fp4", None), "expert_dtype", f"expected 'fp4' or null, got {c.expert_dtype!r}")
    need(c.n_mtp_layers >= 0, "n_mtp_layers", "must be >= 0")
    need(len(c.compress_ratios) == c.n_total_layers, "compress_ratios",
         f"needs n_layers + n_mtp_layers = {c.n_total_layers} entries, got {len(c.compress_ratios)}")
    need(all(r >= 0 for r in c.compress_ratios), "compress_ratios", "entries must be >= 0")
    need(all(r == 0 for r in c.compress_ratios[c.n_layers:]), "compress_ratios", "DSpark stages must have ratio 0")
    for key in ("kv_source_layers", "index_source_layers"):
        layers = getattr(c, key)
        need(list(layers) == sorted(set(layers)), key, "must be strictly increasing")
        need(all(0 <= s < c.n_layers and c.compress_ratios[s] > 0 for s in layers), key,
             "every entry must be a backbone layer with compress ratio > 0")
    for i in range(c.n_layers):
        r = c.compress_ratios[i]
        if r == 0:
            continue
        kv_src = _latest_at_or_below(c.kv_source_layers, i)
        idx_src = _latest_at_or_below(c.index_source_layers, i)
        need(kv_src is not None and c.compress_ratios[kv_src] == r, "kv_source_layers",
             f"layer {i} (ratio {r}) has no KV source of the same ratio at or below it")
        need(idx_src is not None and c.compress_ratios[idx_src] == r and idx_src >= kv_src, "index_source_layers",
             f"layer {i} (ratio {r}) has no index source of the same ratio at or after its KV source {kv_src}")
    if c.candidate_source_layer >= 0:
        cs = c.candidate_source_layer
        need(cs in c.kv_source_layers and cs in c.index_source_layers, "candidate_source_layer",
             f"layer {cs} must be both a KV source and an index source")
        need(c.candidate_topk_blocks > 0 and c.candidate_block_size > 0, "candidate_topk_blocks",
             "candidate_topk_blocks and candidate_block_size must be positive")
    need(len(c.engram_num_embeddings) == len(c.engram_layer_ids), "engram_num_embeddings",
         f"needs one entry per engram layer ({len(c.engram_layer_ids)}), got {len(c.engram_num_embeddings)}")
    if c.engram_layer_ids:
        need(all(0 <= i < c.n_layers for i in c.engram_layer_ids), "engram_layer_ids", "must be backbone layers")
        need(c.engram_max_ngram_size >= 2 and c.engram_n_heads > 0, "engram_max_ngram_size", "needs n-grams of order >= 2")
        need(c.engram_head_dim % 32 == 0, "engram_head_dim", "must be a multiple of 32")
        need(c.engram_compressed_vocab_size > 0, "engram_compressed_vocab_size", "must be positive")
    if c.n_mtp_layers:
        need(c.dspark_block_size > 0, "dspark_block_size", "must be positive when DSpark stages exist")
        need(len(c.dspark_target_layer_ids) > 0 and all(0 <= i < c.n_layers for i in c.dspark_target_layer_ids),
             "dspark_target_layer_ids", "must name backbone layers")
        need(0 <= c.dspark_noise_token_id < c.vocab_size, "dspark_noise_token_id", "outside the vocabulary")
        need(0 < c.dspark_n_activated_experts <= c.dspark_n_routed_experts, "dspark_n_activated_experts",
             "must be in 1..dspark_n_routed_experts")
    need(c.vision_n_layers >= 0, "vision_n_layers", f"must be >= 0, got {c.vision_n_layers}")
    if c.has_vision:
        for key in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size", "vision_downsample_ratio"):
            need(getattr(c, key) > 0, key, f"must be positive, got {getattr(c, key)}")
        need(c.vision_dim % c.vision_n_heads == 0 and c.vision_head_dim % 4 == 0, "vision_n_heads",
             f"vision_dim / vision_n_heads must be a multiple of 4 (2-D RoPE: half the pairs rows, half columns), "
             f"got {c.vision_dim} / {c.vision_n_heads}")
        need(c.vision_max_n_token >= 4, "vision_max_n_token",
             f"must be >= 4 (the smallest span: start, one image token, a newline, end), got {c.vision_max_n_token}")
        need(c.vision_min_pixels >= 0, "vision_min_pixels", f"must be >= 0, got {c.vision_min_pixels}")
        need(c.vision_max_wh_ratio is None or c.vision_max_wh_ratio > 0, "vision_max_wh_ratio",
             f"must be positive or null, got {c.vision_max_wh_ratio}")
        need(c.vision_rope_theta > 0, "vision_rope_theta", f"must be positive, got {c.vision_rope_theta}")
