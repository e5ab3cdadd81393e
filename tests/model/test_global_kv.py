"""Main-KV entries recomputed by hand from a KV source's attention input (spec 4.4): the group pooling,
the norm, RoPE stamped at the group's FIRST token with the layer's YaRN table, and FP4 QDQ."""

from __future__ import annotations

import math

import pytest
import torch

from engine.quant import fp4_qdq


def rotate_by_hand(v: torch.Tensor, pos: int, cfg) -> torch.Tensor:
    """Interleaved rotation of the last rope_head_dim dims at `pos`, YaRN frequencies from the spec formula."""
    rd, base = cfg.rope_head_dim, cfg.compress_rope_theta
    def corr(r: float) -> float:
        return rd * math.log(cfg.original_seq_len / (2 * math.pi * r)) / (2 * math.log(base))
    low, high = max(math.floor(corr(cfg.beta_fast)), 0), min(math.ceil(corr(cfg.beta_slow)), rd - 1)
    out = v.double().clone()
    for i in range(rd // 2):
        f = base ** (-2 * i / rd)
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        f = f / cfg.rope_factor * ramp + f * (1 - ramp)
        ang = torch.tensor(pos * torch.tensor(f, dtype=torch.float32).item(), dtype=torch.float32).double()
        c, s = torch.cos(ang), torch.sin(ang)
        k = v.size(-1) - rd + 2 * i
        x0, x1 = v[..., k].double(), v[..., k + 1].double()
        out[..., k], out[..., k + 1] = x0 * c - x1 * s, x0 * s + x1 * c
    return out.to(v.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return (w.double() * xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("layer_id", [2, 6])  # a ratio-2 source and the ratio-1 decoder source
def test_main_kv_entries_by_hand(golden, layer_id):
    cfg, model = golden.cfg, golden.model
    attn = model.layers[layer_id].attn
    seen = {}
    hook = attn.register_forward_hook(lambda mod, args, out: seen.setdefault("x", args[0].detach().clone()))
    ids = torch.tensor([golden.tokenizer.encode("A small test of the compressed cache, with some words in it.")[:21]])
    cache = model.new_cache(1, 32)
    try:
        model(ids, 0, cache)
    finally:
        hook.remove()
    x = seen["x"][0]  # [S, D] attention input of the KV source
    r = cfg.compress_ratios[layer_id]
    comp = attn.compressor
    kv = x.double() @ comp.wkv.weight.double().T
    for j in range(x.size(0) // r):
        group = slice(j * r, j * r + r)
        if r == 1:
            pooled = kv[group][0].to(torch.bfloat16)
        else:
            kv32 = kv[group].float().double()  # the reference keeps the projections in fp32
            score = (x[group].double() @ comp.wgate.weight.double().T).float().double()
            pooled = (kv32 * torch.softmax(score, dim=0)).sum(0).to(torch.bfloat16)
        latent = rms_norm(pooled, comp.norm.weight, cfg.norm_eps)
        want = fp4_qdq(rotate_by_hand(latent, j * r, cfg)[None], 16, "e4m3")[0]
        got = cache.sources[layer_id].main_kv[0, j]
        assert torch.equal(got, want), f"layer {layer_id} entry {j}: max diff {(got.float() - want.float()).abs().max()}"
    assert not cache.sources[layer_id].main_kv[0, x.size(0) // r].any(), "an incomplete group must not be stored"
