"""Named model configurations: the released DeepSeek-V4.1-Flash shape and a tiny one for tests.

The tiny preset (spec section 8) covers every layer role of the real model at CPU-friendly sizes and
keeps the real vocabulary, so it runs with the real tokenizer and the real Engram token map.
"""

from __future__ import annotations

from dataclasses import replace

from engine.config import ModelConfig


def full_config() -> ModelConfig:
    """DeepSeek-V4.1-Flash as released (HF revision dba1be0a…; spec section 2)."""
    return ModelConfig()


def tiny_config() -> ModelConfig:
    """Layers: 0-1 SWA (1 = Engram), 2 Full r2, 3 Reuse, 4 Full r2 + Engram (second ratio-2 source),
    5 Reuse, 6 Full r1 + candidate source + CED cut, 7 Reuse, 8 Reindex with candidates, 9 Reuse;
    DSpark stages 10-11 tapping the inputs of 7, 8, 9."""
    from engine.engram_tables import engram_primes  # the tiny tables' row counts follow from the primes

    engram_layer_ids = (1, 4)
    max_ngram, n_heads, vocab_start = 4, 2, 100
    primes = engram_primes(engram_layer_ids, max_ngram, n_heads, vocab_start)
    return replace(
        ModelConfig(),
        dim=256, moe_inter_dim=128, n_layers=10, n_mtp_layers=2,
        n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        window_size=16,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0),
        kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8),
        candidate_source_layer=6, candidate_topk_blocks=3, candidate_block_size=4,
        index_n_heads=4, index_head_dim=64, index_topk=8,
        n_routed_experts=8, n_activated_experts=2,
        original_seq_len=32, rope_factor=4.0, max_position_embeddings=4096,
        engram_layer_ids=engram_layer_ids, engram_num_embeddings=tuple(sum(p) for p in primes),
        engram_max_ngram_size=max_ngram, engram_vocab_size=vocab_start, engram_n_heads=n_heads,
        engram_head_dim=32,
        dspark_block_size=3, dspark_target_layer_ids=(7, 8, 9), dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_n_activated_experts=2,
        vision_n_layers=0,
    )


def tiny_vision_config() -> ModelConfig:
    """The tiny preset with a tiny vision tower (spec 8's optional second config): 2 ViT layers of dim 64, 4 heads,
    SwiGLU 128, the released patch 14 and 3x3 downsample, and small images (>= 112^2 pixels, <= 64 tokens: a
    544^2 image becomes 294^2 pixels, 21^2 patches, a 7 x 7 grid, 58 tokens)."""
    return replace(tiny_config(), vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=128,
                   vision_min_pixels=112 * 112, vision_max_n_token=64)


PRESETS = {"full": full_config, "tiny": tiny_config, "tiny-vision": tiny_vision_config}
