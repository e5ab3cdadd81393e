"""engine/config.py and engine/presets.py against the spec (sections 2, 5, 8), with expectations
transcribed by hand rather than derived from the code under test."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, ModelConfig, load_config
from engine.presets import PRESETS, full_config, tiny_config

# ---- spec 2.4, transcribed row by row -------------------------------------------------------------
# (layers, ratio, mode, main KV + index K from, top-k from); None = no compressed attention.
SPEC_2_4_ROWS: list[tuple[range, int, str, int | None, int | None]] = [
    (range(0, 1), 0, "swa", None, None),
    (range(1, 2), 0, "swa", None, None),
    (range(2, 3), 2, "full", 2, 2),
    (range(3, 8), 2, "reuse", 2, 2),
    (range(8, 9), 2, "full", 8, 8),
    (range(9, 14), 2, "reuse", 8, 8),
    (range(14, 15), 2, "full", 14, 14),
    (range(15, 20), 2, "reuse", 14, 14),
    (range(20, 21), 1, "full", 20, 20),
    (range(21, 24), 1, "reuse", 20, 20),
    (range(24, 25), 1, "reindex", 20, 24),
    (range(25, 28), 1, "reuse", 20, 24),
    (range(28, 29), 1, "reindex", 20, 28),
    (range(29, 32), 1, "reuse", 20, 28),
    (range(32, 33), 1, "reindex", 20, 32),
    (range(33, 36), 1, "reuse", 20, 32),
    (range(36, 37), 1, "reindex", 20, 36),
    (range(37, 40), 1, "reuse", 20, 36),
    (range(40, 43), 0, "dspark", None, None),
]
SPEC_ENGRAM = {1: 0, 14: 1}  # layer -> position in engram_layer_ids
SPEC_CANDIDATE_SOURCE = {20}
SPEC_USES_CANDIDATES = {24, 28, 32, 36}
SPEC_DECODER = set(range(20, 40))
SPEC_DSPARK_TAPS = {37, 38, 39}


def _expand(rows):
    table = {}
    for layers, ratio, mode, kv, idx in rows:
        for i in layers:
            assert i not in table, f"layer {i} transcribed twice"
            table[i] = (ratio, mode, kv, idx)
    return table


def test_full_layer_schedule_matches_spec_2_4():
    cfg = ModelConfig()
    table = _expand(SPEC_2_4_ROWS)
    assert sorted(table) == list(range(43))
    assert cfg.n_total_layers == 43
    assert len(cfg.roles) == 43
    assert cfg.ced_cut == 20
    assert list(cfg.compress_ratios) == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    for i in range(43):
        ratio, mode, kv, idx = table[i]
        r = cfg.layer_role(i)
        got = (r.layer_id, r.ratio, r.mode, r.kv_source, r.index_source, r.is_candidate_source,
               r.uses_candidates, r.engram_index, r.has_engram, r.is_decoder, r.is_dspark_tap,
               r.is_kv_source, r.is_index_source)
        want = (i, ratio, mode, kv, idx, i in SPEC_CANDIDATE_SOURCE, i in SPEC_USES_CANDIDATES,
                SPEC_ENGRAM.get(i), i in SPEC_ENGRAM, i in SPEC_DECODER, i in SPEC_DSPARK_TAPS,
                kv == i, idx == i)
        assert got == want, f"layer {i}: got {r}"


def test_moe_experts_backbone_and_dspark():
    cfg = ModelConfig()
    assert cfg.moe_experts(0) == (384, 6)
    assert cfg.moe_experts(39) == (384, 6)
    assert cfg.moe_experts(40) == (128, 3)
    assert cfg.moe_experts(42) == (128, 3)


# ---- spec 5: KV / state figures --------------------------------------------------------------------
def test_full_kv_figures():
    cfg = ModelConfig()
    assert cfg.swa_entry_bytes == 528
    assert cfg.main_kv_entry_bytes == 288
    assert cfg.index_k_entry_bytes == 68
    assert cfg.global_kv_bytes_per_token == 890
    # SWA per request (spec 5): 40 x 128 x 528 B, + DSpark 3 x 128 x 528 B
    assert cfg.n_layers * cfg.window_size * cfg.swa_entry_bytes == 2_703_360
    assert cfg.n_mtp_layers * cfg.window_size * cfg.swa_entry_bytes == 202_752


def test_tiny_kv_figures():
    cfg = tiny_config()
    # head_dim 64: FP4 main KV = 64/2 B + 64/16 E4M3 scales = 36; index_head_dim 64: MXFP4 = 32 + 2 = 34
    # SWA FP8 = 64 + 64/32 = 66. KV sources 2 (r2), 4 (r2), 6 (r1): 70/2 + 70/2 + 70/1 = 140.
    assert cfg.main_kv_entry_bytes == 36
    assert cfg.index_k_entry_bytes == 34
    assert cfg.swa_entry_bytes == 66
    assert cfg.global_kv_bytes_per_token == 140


# ---- spec 2.1-2.3: HF form -------------------------------------------------------------------------
def _released_hf_config() -> dict[str, Any]:
    """The released DeepSeek-V4.1-Flash config.json, written out from spec tables 2.1-2.3."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "transformers_version": "5.6.0",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": 129280,
            "hidden_size": 5120,
            "moe_intermediate_size": 2304,
            "num_hidden_layers": 40,
            "num_nextn_predict_layers": 3,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "max_position_embeddings": 1048576,
            "rope_theta": 10000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "original_max_position_embeddings": 65536,
            },
            "compress_rope_theta": 160000,
            "sliding_window": 128,
            "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
            "kv_source_layer_ids": [2, 8, 14, 20],
            "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "n_routed_experts": 384,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 16000000,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092,
            "dspark_block_size": 5,
            "dspark_noise_token_id": 128799,
            "dspark_target_layer_ids": [37, 38, 39],
            "dspark_markov_rank": 256,
            "dspark_n_routed_experts": 128,
            "dspark_num_experts_per_tok": 3,
        },
        "vision_config": {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": 32,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 2816,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        },
    }


def test_released_hf_config_parses_to_default():
    assert ModelConfig.from_hf(_released_hf_config()) == ModelConfig()
    assert full_config() == ModelConfig()


def test_rope_scaling_v4_type_spelling_accepted():
    d = _released_hf_config()
    rs = d["text_config"]["rope_scaling"]
    rs["type"] = rs.pop("rope_type")
    assert ModelConfig.from_hf(d) == ModelConfig()


_BF16 = replace(ModelConfig(), dtype="bf16", expert_dtype=None)


@pytest.mark.parametrize("make", [ModelConfig, tiny_config, lambda: _BF16], ids=["full", "tiny", "bf16"])
def test_round_trips(make):
    cfg = make()
    hf = json.loads(json.dumps(cfg.to_hf_dict()))  # through JSON, as on disk
    ref = json.loads(json.dumps(cfg.to_reference_dict()))
    assert ModelConfig.from_hf(hf) == cfg
    assert ModelConfig.from_reference(ref) == cfg
    assert "text_config" in hf and "quantization_config" in hf and "vision_config" in hf
    assert hf["text_config"]["rope_scaling"]["rope_type"] == "yarn"


def test_presets_registry():
    assert set(PRESETS) == {"full", "tiny", "tiny-vision"}
    assert PRESETS["full"]() == ModelConfig()
    assert PRESETS["tiny"]() == tiny_config()
    vision = PRESETS["tiny-vision"]()
    assert vision.has_vision and replace(vision, vision_n_layers=0) == replace(tiny_config(), **{
        k: getattr(vision, k) for k in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_min_pixels",
                                        "vision_max_n_token")})


def _write(path: Path, d: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d))


def test_load_config_hf_form(tmp_path):
    _write(tmp_path / "config.json", _released_hf_config())
    assert load_config(tmp_path) == ModelConfig()
    assert load_config(str(tmp_path)) == ModelConfig()


def test_load_config_reference_form(tmp_path):
    tiny = tiny_config()
    _write(tmp_path / "config.json", tiny.to_reference_dict())
    assert load_config(tmp_path) == tiny


def test_load_config_falls_back_to_inference_config(tmp_path):
    tiny = tiny_config()
    _write(tmp_path / "inference" / "config.json", tiny.to_reference_dict())
    assert load_config(tmp_path) == tiny


def test_load_config_prefers_top_level_config(tmp_path):
    _write(tmp_path / "config.json", _released_hf_config())
    _write(tmp_path / "inference" / "config.json", tiny_config().to_reference_dict())
    assert load_config(tmp_path) == ModelConfig()


def test_reference_runtime_keys_accepted():
    d = ModelConfig().to_reference_dict()
    d.update(max_batch_size=4, max_seq_len=4096, temperature=0.6)
    assert ModelConfig.from_reference(d) == ModelConfig()


# ---- errors ----------------------------------------------------------------------------------------
def _hf_with(**text_changes: Any) -> dict[str, Any]:
    d = _released_hf_config()
    d["text_config"].update(text_changes)
    return d


def _raises_naming(key: str, fn, *args, **kwargs):
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kwargs)
    assert key in str(ei.value), f"message {str(ei.value)!r} does not name {key!r}"


def test_missing_required_hf_key():
    d = _released_hf_config()
    del d["text_config"]["hidden_size"]
    _raises_naming("hidden_size", ModelConfig.from_hf, d)


def test_wrong_type_names_the_hf_key():
    # The user wrote num_hidden_layers; the message must name that key, not only the reference field.
    _raises_naming("num_hidden_layers", ModelConfig.from_hf, _hf_with(num_hidden_layers="40"))


def test_wrong_type_in_reference_form():
    d = ModelConfig().to_reference_dict()
    d["n_layers"] = "40"
    _raises_naming("n_layers", ModelConfig.from_reference, d)


def test_compress_ratios_wrong_length():
    bad = [0, 0] + [2] * 18 + [1] * 20 + [0, 0]  # 42 entries for 40 + 3 layers
    _raises_naming("compress_ratios", ModelConfig.from_hf, _hf_with(compress_ratios=bad))


def test_kv_source_with_ratio_zero():
    _raises_naming("kv_source_layers", replace, ModelConfig(), kv_source_layers=(1, 2, 8, 14, 20))


def test_ratio2_layer_whose_latest_kv_source_is_ratio1():
    # layer 21 turned into ratio 2: its latest KV source (20) has ratio 1
    ratios = list(ModelConfig().compress_ratios)
    ratios[21] = 2
    with pytest.raises(ConfigError, match=r"kv_source_layers: layer 21\b"):
        replace(ModelConfig(), compress_ratios=tuple(ratios))


def test_candidate_source_not_a_kv_source():
    # 24 is an index source but not a KV source
    _raises_naming("candidate_source_layer", replace, ModelConfig(), candidate_source_layer=24)


def test_weight_block_size_128():
    d = _released_hf_config()
    d["quantization_config"]["weight_block_size"] = [128, 128]
    _raises_naming("weight_block_size", ModelConfig.from_hf, d)


def test_scale_fmt_not_ue8m0():
    d = _released_hf_config()
    d["quantization_config"]["scale_fmt"] = "fp32"
    _raises_naming("scale_fmt", ModelConfig.from_hf, d)


def test_num_key_value_heads_2():
    _raises_naming("num_key_value_heads", ModelConfig.from_hf, _hf_with(num_key_value_heads=2))


def test_n_hash_layers_3_hf_form():
    _raises_naming("n_hash_layers", ModelConfig.from_hf, _hf_with(n_hash_layers=3))


def test_n_hash_layers_3_reference_form():
    # n_hash_layers is a reference-form key (spec 2.2: 0 in V4.1, 3 in V4-Flash); a nonzero value
    # describes hash routing this engine does not implement and must not be dropped silently.
    d = ModelConfig().to_reference_dict()
    d["n_hash_layers"] = 3
    _raises_naming("n_hash_layers", ModelConfig.from_reference, d)


def test_unknown_reference_key():
    d = ModelConfig().to_reference_dict()
    d["n_dense_layers"] = 3
    _raises_naming("n_dense_layers", ModelConfig.from_reference, d)


@pytest.mark.parametrize("key,value", [("dim", 5000), ("moe_inter_dim", 2300), ("head_dim", 500),
                                       ("q_lora_rank", 1000), ("index_head_dim", 100), ("o_lora_rank", 1000)])
def test_dims_not_multiple_of_32(key, value):
    _raises_naming(key, replace, ModelConfig(), **{key: value})


def test_engram_num_embeddings_length_mismatch():
    _raises_naming("engram_num_embeddings", ModelConfig.from_hf, _hf_with(engram_num_embeddings=[384006168]))


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"text_config": {')
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path)


def test_load_config_error_names_file_and_key(tmp_path):
    d = _released_hf_config()
    del d["text_config"]["sliding_window"]
    _write(tmp_path / "config.json", d)
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    assert "config.json" in str(ei.value) and "sliding_window" in str(ei.value)


def test_errors_do_not_mutate_input():
    d = _hf_with(num_key_value_heads=2)
    before = copy.deepcopy(d)
    with pytest.raises(ConfigError):
        ModelConfig.from_hf(d)
    assert d == before


# ---- spec 8: the tiny preset covers every role -----------------------------------------------------
# Hand transcription of spec 8's "role coverage" paragraph: (ratio, mode, kv_source, index_source).
SPEC_8_ROWS = [
    (range(0, 2), 0, "swa", None, None),
    (range(2, 3), 2, "full", 2, 2),
    (range(3, 4), 2, "reuse", 2, 2),
    (range(4, 5), 2, "full", 4, 4),
    (range(5, 6), 2, "reuse", 4, 4),
    (range(6, 7), 1, "full", 6, 6),
    (range(7, 8), 1, "reuse", 6, 6),
    (range(8, 9), 1, "reindex", 6, 8),
    (range(9, 10), 1, "reuse", 6, 8),
    (range(10, 12), 0, "dspark", None, None),
]


def test_tiny_schedule_matches_spec_8():
    cfg = tiny_config()
    table = _expand(SPEC_8_ROWS)
    assert sorted(table) == list(range(cfg.n_total_layers)) == list(range(12))
    assert cfg.ced_cut == 6
    for i, (ratio, mode, kv, idx) in table.items():
        r = cfg.layer_role(i)
        got = (r.ratio, r.mode, r.kv_source, r.index_source, r.is_candidate_source, r.uses_candidates,
               r.engram_index, r.is_decoder, r.is_dspark_tap)
        want = (ratio, mode, kv, idx, i == 6, i == 8, {1: 0, 4: 1}.get(i), 6 <= i < 10, i in (7, 8, 9))
        assert got == want, f"layer {i}: got {r}"


def test_tiny_covers_every_role():
    cfg = tiny_config()
    roles = cfg.roles
    backbone = roles[: cfg.n_layers]
    # two ratio-2 KV sources (source switch inside the encoder) and a ratio-1 decoder source
    assert len([r for r in backbone if r.is_kv_source and r.ratio == 2]) >= 2
    assert any(r.is_kv_source and r.ratio == 1 for r in backbone)
    # Reuse layers at both ratios
    assert {r.ratio for r in backbone if r.mode == "reuse"} >= {1, 2}
    # a candidate source, and a Reindex layer restricted to its candidates
    assert any(r.is_candidate_source for r in backbone)
    reindex = [r for r in backbone if r.mode == "reindex" and r.uses_candidates]
    assert reindex
    # a Reuse layer after the Reindex reads the Reindex layer's top-k
    assert any(r.mode == "reuse" and r.index_source == reindex[0].layer_id for r in backbone)
    # Engram on an SWA layer and on a Full layer
    assert {r.mode for r in backbone if r.has_engram} == {"swa", "full"}
    # DSpark taps in the decoder, and at least two stages (stage 0 main_proj, last stage heads)
    taps = [r for r in backbone if r.is_dspark_tap]
    assert taps and all(r.is_decoder for r in taps)
    assert cfg.n_mtp_layers >= 2 and all(r.mode == "dspark" for r in roles[cfg.n_layers:])
    # candidate pool (blocks x block size) larger than index_topk: the restriction is not trivial
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size > cfg.index_topk
    # every quantised dim a multiple of 32 (FP8 32x32 blocks, FP4 groups of 32)
    for key in ("dim", "moe_inter_dim", "head_dim", "q_lora_rank", "o_lora_rank", "index_head_dim",
                "engram_head_dim"):
        assert getattr(cfg, key) % 32 == 0, key
    assert cfg.n_heads * cfg.head_dim // cfg.o_groups % 32 == 0


# ---- vision_config (spec 2.3) ------------------------------------------------------------------------
def test_vision_fields_from_hf_and_text_only():
    d = _released_hf_config()
    d["vision_config"].update(max_image_tokens=256, min_pixels=1000, max_wh_ratio=4, rope_theta=500)
    cfg = ModelConfig.from_hf(d)
    assert (cfg.vision_max_n_token, cfg.vision_min_pixels, cfg.vision_max_wh_ratio, cfg.vision_rope_theta) == (
        256, 1000, 4.0, 500.0)
    assert cfg.has_vision and cfg.vision_head_dim == 64
    del d["vision_config"]
    text_only = ModelConfig.from_hf(d)
    assert not text_only.has_vision and text_only.vision_n_layers == 0


def test_vision_errors_name_the_key():
    d = _released_hf_config()
    d["vision_config"]["max_wh_ratio"] = "wide"
    _raises_naming("vision_config.max_wh_ratio", ModelConfig.from_hf, d)
    _raises_naming("vision_n_heads", replace, ModelConfig(), vision_dim=1020, vision_n_heads=10)  # head_dim 102: odd pairs
    _raises_naming("vision_max_n_token", replace, ModelConfig(), vision_max_n_token=3)
    replace(tiny_config(), vision_max_n_token=3)  # a text-only config checks no vision field


@pytest.mark.parametrize("n_layers", [6, 8, 10])
def test_real_width_configs_keep_every_layer_role(n_layers):
    """The benchmarks' real-width models (benchmarks/random_model.py): the release's widths, and every role the
    released 40 layers have (SWA, SWA + Engram, ratio-2 source and its Reuse, the ratio-1 candidate source at the
    CED cut, its Reuse, a Reindex with candidates; 6 layers have Engram on the ratio-2 source instead of an SWA layer,
    and no ratio-2 Reuse), DSpark tapping the last three layers."""
    from benchmarks.random_model import real_width_config

    cfg = real_width_config(n_layers)
    full = full_config()
    assert (cfg.dim, cfg.n_heads, cfg.n_routed_experts, cfg.vocab_size) == (
        full.dim, full.n_heads, full.n_routed_experts, full.vocab_size)

    def kind(r):
        return (r.mode, r.ratio, r.has_engram, r.is_candidate_source, r.uses_candidates, r.is_decoder)

    kinds = {kind(r) for r in cfg.roles[:n_layers]}
    released = {kind(r) for r in full.roles[:full.n_layers]}
    assert kinds <= released, f"roles the release does not have: {kinds - released}"
    for role in [("swa", 0, False, False, False, False), ("full", 1, False, True, False, True),
                 ("reuse", 1, False, False, False, True), ("reindex", 1, False, False, True, True)]:
        assert role in kinds, f"{n_layers} layers lack the role {role}"
    for role in [("swa", 0, True, False, False, False), ("reuse", 2, False, False, False, False)]:
        assert (role in kinds) == (n_layers > 6), f"{n_layers} layers: {role}"
    assert ("full", 2, n_layers == 6, False, False, False) in kinds  # ratio-2 source, with Engram at 6 layers
    assert [r.layer_id for r in cfg.roles if r.is_dspark_tap] == list(range(n_layers - 3, n_layers))
