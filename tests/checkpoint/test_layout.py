"""The checkpoint layout against spec section 6, whose rows are copied here by hand (not derived from code)."""

import pytest

from engine.checkpoint.layout import (
    TensorSpec,
    component_of,
    expected_tensors,
    is_text_only_skippable,
    parameter_report,
)
from engine.presets import full_config

FP8, E8M0, BF16, F32, FP4 = "F8_E4M3", "F8_E8M0", "BF16", "F32", "I8"

# spec 6 "Representative tensors", released DeepSeek-V4.1-Flash
FULL_ROWS = [
    ("embed.weight", (129280, 5120), BF16),
    ("head.weight", (129280, 5120), BF16),
    ("norm.weight", (5120,), BF16),
    ("layers.{L}.attn.wq_a.weight", (1280, 5120), FP8),
    ("layers.{L}.attn.wq_a.scale", (40, 160), E8M0),
    ("layers.{L}.attn.q_norm.weight", (1280,), BF16),
    ("layers.{L}.attn.wq_b.weight", (32768, 1280), FP8),
    ("layers.{L}.attn.wq_b.scale", (1024, 40), E8M0),
    ("layers.{L}.attn.wkv.weight", (512, 5120), FP8),
    ("layers.{L}.attn.wkv.scale", (16, 160), E8M0),
    ("layers.{L}.attn.kv_norm.weight", (512,), BF16),
    ("layers.{L}.attn.wo_a.weight", (8192, 4096), FP8),
    ("layers.{L}.attn.wo_a.scale", (256, 128), E8M0),
    ("layers.{L}.attn.wo_b.weight", (5120, 8192), FP8),
    ("layers.{L}.attn.wo_b.scale", (160, 256), E8M0),
    ("layers.{L}.attn.attn_sink", (64,), F32),
    ("layers.{L}.attn_norm.weight", (5120,), BF16),
    ("layers.{L}.ffn_norm.weight", (5120,), BF16),
    ("layers.{L}.hc_attn_fn", (24, 20480), F32),
    ("layers.{L}.hc_ffn_fn", (24, 20480), F32),
    ("layers.{L}.hc_attn_base", (24,), F32),
    ("layers.{L}.hc_ffn_base", (24,), F32),
    ("layers.{L}.hc_attn_scale", (3,), F32),
    ("layers.{L}.hc_ffn_scale", (3,), F32),
    ("layers.{L}.ffn.gate.weight", (384, 5120), BF16),
    ("layers.{L}.ffn.gate.bias", (384,), F32),
    ("layers.{L}.ffn.experts.{E}.w1.weight", (2304, 2560), FP4),
    ("layers.{L}.ffn.experts.{E}.w1.scale", (2304, 160), E8M0),
    ("layers.{L}.ffn.experts.{E}.w3.weight", (2304, 2560), FP4),
    ("layers.{L}.ffn.experts.{E}.w3.scale", (2304, 160), E8M0),
    ("layers.{L}.ffn.experts.{E}.w2.weight", (5120, 1152), FP4),
    ("layers.{L}.ffn.experts.{E}.w2.scale", (5120, 72), E8M0),
    ("layers.{L}.ffn.shared_experts.w1.weight", (2304, 5120), FP8),
    ("layers.{L}.ffn.shared_experts.w1.scale", (72, 160), E8M0),
    ("layers.{L}.ffn.shared_experts.w3.weight", (2304, 5120), FP8),
    ("layers.{L}.ffn.shared_experts.w3.scale", (72, 160), E8M0),
    ("layers.{L}.ffn.shared_experts.w2.weight", (5120, 2304), FP8),
]
KV_SOURCE_ROWS = [
    ("attn.compressor.wkv.weight", (512, 5120), BF16),
    ("attn.compressor.norm.weight", (512,), BF16),
    ("attn.indexer.wk.weight", (128, 512), BF16),
    ("attn.indexer.k_norm.weight", (128,), BF16),
]
INDEX_SOURCE_ROWS = [
    ("attn.indexer.wq_b.weight", (4096, 1280), FP8),
    ("attn.indexer.wq_b.scale", (128, 40), E8M0),
    ("attn.indexer.weights_proj.weight", (32, 5120), BF16),
]
ENGRAM_ROWS = [
    ("engram.wkv.weight", (25600, 6144), FP8),
    ("engram.wkv.scale", (800, 192), E8M0),
    ("engram.q_weight", (4, 5120), BF16),
    ("engram.k_weight", (4, 5120), BF16),
]
DSPARK_ROWS = [
    ("mtp.0.main_proj.weight", (5120, 15360), FP8),
    ("mtp.0.main_proj.scale", (160, 480), E8M0),
    ("mtp.0.main_norm.weight", (5120,), BF16),
    ("mtp.2.norm.weight", (5120,), BF16),
    ("mtp.2.markov_head.embed.weight", (129280, 256), BF16),
    ("mtp.2.markov_head.head.weight", (129280, 256), BF16),
    ("mtp.2.confidence_head.proj.weight", (1, 5376), BF16),
]
VISION_ROWS = [
    ("vision.blocks.0.attn.wqkv.weight", (3072, 1024), BF16),
    ("vision.blocks.31.mlp.w1.weight", (5632, 1024), BF16),
    ("aligner.w1.weight", (5120, 9216), BF16),
    ("aligner.w2.weight", (5120, 5120), BF16),
    ("image_start", (5120,), BF16),
    ("image_end", (5120,), BF16),
    ("image_newline", (5120,), BF16),
]
KV_SOURCES, INDEX_SOURCES, ENGRAM_LAYERS = (2, 8, 14, 20), (2, 8, 14, 20, 24, 28, 32, 36), (1, 14)


@pytest.fixture(scope="module")
def full():
    return expected_tensors(full_config())


@pytest.fixture(scope="module")
def full_vl():
    return expected_tensors(full_config(), include_vision=True)


def _check(layout: dict[str, TensorSpec], name: str, shape: tuple[int, ...], dtype: str) -> None:
    assert name in layout, f"{name} missing from the layout"
    spec = layout[name]
    assert (spec.shape, spec.dtype) == (shape, dtype), (
        f"{name}: got {spec.shape} {spec.dtype}, spec 6 says {shape} {dtype}")


@pytest.mark.parametrize("layer", [0, 1, 2, 13, 20, 39])
def test_full_layer_rows_match_spec(full, layer):
    for name, shape, dtype in FULL_ROWS:
        for e in (0, 383):
            _check(full, name.format(L=layer, E=e), shape, dtype)


def test_full_source_rows_match_spec(full):
    for layer in range(40):
        for suffix, shape, dtype in KV_SOURCE_ROWS:
            name = f"layers.{layer}.{suffix}"
            if layer in KV_SOURCES:
                _check(full, name, shape, dtype)
            else:
                assert name not in full
        for suffix, shape, dtype in INDEX_SOURCE_ROWS:
            name = f"layers.{layer}.{suffix}"
            if layer in INDEX_SOURCES:
                _check(full, name, shape, dtype)
            else:
                assert name not in full
        wgate = f"layers.{layer}.attn.compressor.wgate.weight"
        if layer in (2, 8, 14):  # ratio 2 only
            _check(full, wgate, (512, 5120), BF16)
        else:
            assert wgate not in full


def test_full_engram_rows_match_spec(full):
    _check(full, "layers.1.engram.embed.weight", (384006168, 256), FP8)
    _check(full, "layers.1.engram.embed.scale", (384006168, 8), E8M0)
    _check(full, "layers.14.engram.embed.weight", (384016682, 256), FP8)
    _check(full, "layers.14.engram.embed.scale", (384016682, 8), E8M0)
    for layer in range(40):
        for suffix, shape, dtype in ENGRAM_ROWS:
            if layer in ENGRAM_LAYERS:
                _check(full, f"layers.{layer}.{suffix}", shape, dtype)
            else:
                assert f"layers.{layer}.{suffix}" not in full


def test_full_dspark_rows_match_spec(full):
    for name, shape, dtype in DSPARK_ROWS:
        _check(full, name, shape, dtype)
    for stage in range(3):
        p = f"mtp.{stage}"
        _check(full, f"{p}.attn.wq_a.weight", (1280, 5120), FP8)
        _check(full, f"{p}.attn.wo_a.weight", (8192, 4096), FP8)
        _check(full, f"{p}.ffn.gate.weight", (128, 5120), BF16)
        _check(full, f"{p}.ffn.experts.127.w2.weight", (5120, 1152), FP4)
        _check(full, f"{p}.ffn.shared_experts.w1.weight", (2304, 5120), FP8)
        _check(full, f"{p}.hc_ffn_fn", (24, 20480), F32)
        assert f"{p}.ffn.experts.128.w1.weight" not in full
        assert not any(n.startswith(f"{p}.attn.compressor") or n.startswith(f"{p}.attn.indexer")
                       or n.startswith(f"{p}.engram") for n in full)
    assert "mtp.1.main_proj.weight" not in full and "mtp.1.norm.weight" not in full
    assert "mtp.0.markov_head.embed.weight" not in full and "mtp.3.attn.wq_a.weight" not in full


def test_full_tensor_count(full, full_vl):
    # per layer: attention 13 + MoE (gate 2 + 384 x 6 + shared 6) + norms 2 + mHC 6 = 2333;
    # compressors 4 x 2 + 3 wgate = 11; indexers 8 x 3 + 4 x 2 = 32; Engram 2 x 6 = 12;
    # top level 3; DSpark 3 x (13 + 2 + 128 x 6 + 6 + 2 + 6) + main_proj 2 + main_norm + norm + markov 2 + conf
    assert len(full) == 40 * 2333 + 11 + 32 + 12 + 3 + 3 * 797 + 7
    # vision: bias_vl on 43 routers; patch embed 2 + 32 blocks x 8 + norm + aligner 4 + image_* 3
    assert len(full_vl) - len(full) == 43 + 2 + 32 * 8 + 1 + 4 + 3
    assert len(expected_tensors(full_config(), include_mtp=False)) == len(full) - (3 * 797 + 7)


def test_vision_rows_only_with_vision(full, full_vl):
    for name, shape, dtype in VISION_ROWS:
        _check(full_vl, name, shape, dtype)
        assert name not in full
    _check(full_vl, "layers.7.ffn.gate.bias_vl", (384,), F32)
    _check(full_vl, "mtp.0.ffn.gate.bias_vl", (128,), F32)
    assert "layers.7.ffn.gate.bias_vl" not in full


def test_text_only_skippable(full, full_vl):
    for name in ("vision.blocks.0.attn.wqkv.weight", "aligner.w1.bias", "image_newline", "layers.3.ffn.gate.bias_vl",
                 "mtp.1.ffn.gate.bias_vl"):
        assert is_text_only_skippable(name)
    assert not any(is_text_only_skippable(n) for n in full)
    assert {n for n in full_vl if not is_text_only_skippable(n)} == set(full)


def test_tiny_layout_covers_every_role(tiny_cfg):
    t = expected_tensors(tiny_cfg)
    assert t["layers.1.engram.embed.weight"].shape == (660, 32)  # sum of the tiny config's 6 primes
    assert t["layers.4.engram.wkv.weight"].shape == (256 * 5, 6 * 32)
    assert "layers.2.attn.compressor.wgate.weight" in t and "layers.6.attn.compressor.wgate.weight" not in t
    assert "layers.8.attn.indexer.wq_b.weight" in t and "layers.8.attn.indexer.wk.weight" not in t
    assert "layers.3.attn.indexer.wq_b.weight" not in t
    assert t["layers.0.ffn.experts.7.w1.weight"] == TensorSpec("layers.0.ffn.experts.7.w1.weight", (128, 128), FP4)
    assert t["mtp.1.ffn.gate.weight"].shape == (4, 256)
    assert t["mtp.1.markov_head.head.weight"].shape == (129280, 32)
    assert t["mtp.0.main_proj.weight"].shape == (256, 768)
    # wo_a: [o_groups * o_lora_rank, n_heads * head_dim / o_groups] = [128, 128] -> scale [4, 4]
    assert t["layers.0.attn.wo_a.scale"].shape == (4, 4)


def test_tensor_spec_accounting():
    packed = TensorSpec("x.weight", (2304, 2560), FP4)
    assert (packed.numel, packed.num_params, packed.nbytes) == (2304 * 2560, 2304 * 5120, 2304 * 2560)
    fp32 = TensorSpec("y", (24, 20480), F32)
    assert (fp32.num_params, fp32.nbytes) == (24 * 20480, 24 * 20480 * 4)
    assert component_of("layers.3.ffn.experts.1.w2.scale") == "routed experts"
    assert component_of("layers.1.engram.embed.scale") == "Engram tables"
    assert component_of("layers.1.engram.wkv.weight") == "Engram dense"
    assert component_of("layers.2.attn.indexer.wk.weight") == "attention"
    assert component_of("layers.2.hc_ffn_fn") == "gates, mHC, norms"
    assert component_of("mtp.2.markov_head.head.weight") == "DSpark"


def test_full_parameter_report_matches_spec():
    rows = {r.component: r for r in parameter_report(full_config())}
    params = {k: round(r.num_params / 1e9, 2) for k, r in rows.items()}
    gbytes = {k: r.num_bytes / 1e9 for k, r in rows.items()}
    # spec 6 accounting table (params in B, checkpoint bytes in GB)
    assert params["embed + head"] == 1.32 and round(gbytes["embed + head"], 2) == 2.65
    assert params["attention"] == 5.13
    assert params["routed experts"] == 543.58 and round(gbytes["routed experts"], 1) == 288.8
    assert params["shared experts"] == 1.42
    assert params["gates, mHC, norms"] == 0.12
    assert params["Engram tables"] == 196.61 and round(gbytes["Engram tables"], 2) == 202.76
    assert params["Engram dense"] == 0.31 and round(gbytes["Engram dense"], 2) == 0.32
    assert params["DSpark"] == 14.23 and round(gbytes["DSpark"], 1) == 7.9
    assert params["vision + aligner"] == 0.49 and round(gbytes["vision + aligner"], 1) == 1.0
    assert round(rows["total"].num_params / 1e9, 1) == 763.2 and round(gbytes["total"]) == 510
    layers_gb = sum(gbytes[c] for c in ("attention", "routed experts", "shared experts", "gates, mHC, norms"))
    assert round(layers_gb, 1) == 295.7
    backbone = rows["total"].num_params - rows["Engram tables"].num_params - rows["DSpark"].num_params
    assert round(backbone / 1e9, 1) == 552.4
    # exact counts from first principles
    assert rows["routed experts"].num_params == 40 * 384 * 3 * 2304 * 5120
    assert rows["Engram tables"].num_params == (384006168 + 384016682) * 256
    assert rows["total"].num_params == sum(r.num_params for k, r in rows.items() if k != "total")


def test_text_only_report_drops_vision():
    rows = {r.component: r for r in parameter_report(full_config(), include_vision=False)}
    assert "vision + aligner" not in rows
    assert round(rows["total"].num_params / 1e9, 2) == 762.72
