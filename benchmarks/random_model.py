"""Random-weight models built on the device in the checkpoint's storage formats (FP8 dense, FP4 routed experts,
bf16 norms and router, FP8 Engram rows in host memory): the fixtures of the GPU benchmarks, for shapes no
checkpoint on this machine's disk could hold (ten real-width layers are ~75 GB).

    randomize(module, generator)   # every buffer of module and its children, in place
    real_width_config(n_layers=10) # DeepSeek-V4.1-Flash's widths, every layer role of the tiny preset's order
    real_width_config(n_layers=8)  # the same roles less the second ratio-2 source (fits one 80 GB GPU)
    real_width_config(n_layers=6)  # fewer roles, DSpark's taps after the CED cut (fits one with the DSpark stages)
    released_config()              # the released 40 layers in their own role order (Engram tables shrunk)
    random_model(cfg, device)      # a Transformer (no DSpark stages) with random weights and Engram tables
    random_model(cfg, device, with_mtp=True)  # ... with the DSpark stages too (speculative decoding)
    random_model(cfg, device, shard=ShardSpec(0, 8, solo=True))  # rank 0's slices of it only (~39 GB of 40 layers)
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.parallel import SINGLE, ShardSpec
from engine.engram_tables import engram_primes
from engine.load import build_engram_tables
from engine.model.engram import EngramEmbedding
from engine.model.layers import Linear, RMSNorm
from engine.model.transformer import Transformer
from engine.presets import full_config, tiny_config
from engine.quant import quant_fp4_weight, quant_fp8_weight
from engine.tokenizer import load_tokenizer, write_tokenizer_files

ENGRAM_VOCAB = 1 << 16  # Engram's hash vocabulary here (16M in the release): 1.6M rows per table, not 384M


def randomize(module: torch.nn.Module, g: torch.Generator, engram_rows: int | None = None) -> None:
    """Replace every buffer of module (and its children) by random values on g's device in its storage format:
    linears N(0, 1/fan_in) quantised to their format, norms 1 + N(0, 0.1^2), other matrices N(0, 1/cols), vectors
    N(0, 0.5^2) (biases, the router's bias and bias_vl among them, N(0, 0.05^2)). Engram tables stay on the host:
    FP8 rows with E8M0 scales near 1 (engram_rows of them if given, else the module's)."""
    device = g.device

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device)

    for mod in module.modules():
        if isinstance(mod, EngramEmbedding):
            rows, dim = engram_rows or mod.weight.size(0), mod.weight.size(1)
            host = torch.Generator().manual_seed(int(torch.randint(1 << 62, (1,), generator=g, device=device)))
            mod.weight = torch.randn(rows, dim, generator=host).clamp(-448, 448).to(torch.float8_e4m3fn)
            mod.scale = torch.randint(120, 128, (rows, dim // 32), dtype=torch.uint8,
                                      generator=host).view(torch.float8_e8m0fnu)
            continue
        for name, buf in list(mod.named_buffers(recurse=False)):
            if isinstance(mod, Linear) and name == "scale":
                continue  # made with its weight
            if isinstance(mod, Linear) and name == "weight":
                w = randn(mod.out_features, mod.in_features) * mod.in_features ** -0.5
                if mod.fmt == "fp8":
                    mod.weight, mod.scale = quant_fp8_weight(w)
                elif mod.fmt == "fp4":
                    mod.weight, mod.scale = quant_fp4_weight(w)
                else:
                    mod.weight = w.to(buf.dtype)
            elif isinstance(mod, RMSNorm):
                mod.weight = (1 + 0.1 * randn(*buf.shape)).to(buf.dtype)
            elif buf.dim() == 2:
                setattr(mod, name, (randn(*buf.shape) * buf.size(-1) ** -0.5).to(buf.dtype))
            else:
                setattr(mod, name, (randn(*buf.shape) * (0.05 if name in ("bias", "bias_vl") else 0.5)).to(buf.dtype))


ROLE_ORDERS = {  # layers: (Engram layers, compress ratios, KV sources, index sources, candidate source)
    10: ((1, 4), (0, 0, 2, 2, 2, 2, 1, 1, 1, 1), (2, 4, 6), (2, 4, 6, 8), 6),
    8: ((1,), (0, 0, 2, 2, 1, 1, 1, 1), (2, 4), (2, 4, 6), 4),
    6: ((1,), (0, 2, 1, 1, 1, 1), (1, 2), (1, 2, 4), 2),
}


def real_width_config(n_layers: int = 10, max_model_len: int | None = None) -> ModelConfig:
    """The release's widths (dim, heads, experts, indexer, Engram heads, vocabulary) over the tiny preset's
    role order: 0-1 SWA (1 = Engram), 2 Full r2, 3 Reuse, 4 Full r2 + Engram, 5 Reuse, 6 Full r1 + candidate
    source + CED cut, 7 Reuse, 8 Reindex with candidates, 9 Reuse. n_layers=8 (~58 GiB: fits one 80 GB GPU,
    without the DSpark stages) drops layers 4-5 (the second ratio-2 source, the second Engram layer and a Reuse):
    0-1 SWA (1 = Engram), 2 Full r2, 3 Reuse, 4 Full r1 + candidate source + CED cut, 5 Reuse, 6 Reindex with
    candidates, 7 Reuse. n_layers=6 (~51 GiB: fits one with the DSpark stages, whose three taps must follow the
    CED cut): 0 SWA, 1 Full r2 + Engram, 2 Full r1 + candidate source + CED cut, 3 Reuse, 4 Reindex with
    candidates, 5 Reuse (no SWA + Engram layer, no ratio-2 Reuse). Engram hashes into ENGRAM_VOCAB-sized
    tables. Text-only (no vision tower)."""
    assert n_layers in ROLE_ORDERS, f"n_layers: the role orders are of {sorted(ROLE_ORDERS)} layers, got {n_layers}"
    cfg = full_config()
    ids, ratios, kv, index, cand = ROLE_ORDERS[n_layers]
    primes = engram_primes(ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, ENGRAM_VOCAB)
    return replace(cfg, n_layers=n_layers, compress_ratios=ratios + (0,) * cfg.n_mtp_layers,
                   kv_source_layers=kv, index_source_layers=index, candidate_source_layer=cand,
                   engram_layer_ids=ids, engram_num_embeddings=tuple(sum(p) for p in primes),
                   engram_vocab_size=ENGRAM_VOCAB, dspark_target_layer_ids=tuple(range(n_layers - 3, n_layers)),
                   max_position_embeddings=max_model_len or cfg.max_position_embeddings,
                   vision_n_layers=0)  # text-only: no vision tower to build


def released_config(max_model_len: int | None = None) -> ModelConfig:
    """DeepSeek-V4.1-Flash as released (40 layers, their roles, widths, experts), with Engram hashing into
    ENGRAM_VOCAB-sized tables (the released tables are ~98 GB each in host memory; a lookup costs the same)."""
    cfg = full_config()
    primes = engram_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, ENGRAM_VOCAB)
    return replace(cfg, engram_num_embeddings=tuple(sum(p) for p in primes), engram_vocab_size=ENGRAM_VOCAB,
                   max_position_embeddings=max_model_len or cfg.max_position_embeddings)


def random_model(cfg: ModelConfig, device: str | torch.device, seed: int = 0, shard: ShardSpec = SINGLE,
                 with_mtp: bool = False) -> Transformer:
    """A Transformer for cfg (its DSpark stages only with_mtp) with random weights on device (Engram tables on the
    host) and the real Engram hashing tables (from the V4.1 tokenizer's compressed token map, as engine.load builds
    them). With a shard: only that rank's slices exist (the model classes' split), random like the rest; a solo
    shard (engine/parallel.py) runs alone, for measurement."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(Path(tmp))
        tables = build_engram_tables(cfg, load_tokenizer(Path(tmp)))
    with torch.device("meta"):
        model = Transformer(cfg, tables, with_mtp=with_mtp, shard=shard)
    randomize(model, torch.Generator(device=device).manual_seed(seed))
    if tables is not None:
        model.engram_tables = tables.to(device)
    return model.eval()


MODELS = ("real-width", "released", "tiny")
RELEASED_LAYERS = 40  # DeepSeek-V4.1-Flash's layers


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --layers and --shards of the engine benchmarks (bench_model's arguments)."""
    p.add_argument("--model", choices=MODELS, default="real-width",
                   help="real-width: real_width_config(--layers) on the GPU; released: the released 40 layers (with "
                        "--shards 8, rank 0's slices: ~39 GB); tiny: the tiny config (CPU works)")
    p.add_argument("--layers", type=int, default=8, help="real_width_config's role order (6, 8 or 10 layers)")
    p.add_argument("--shards", type=int, default=1,
                   help="build only rank 0 of the model split this many ways, solo (engine/parallel.py: a measurement "
                        "mode whose collectives cost nothing): one GPU's work in an N-GPU deployment")


def bench_model(name: str, n_layers: int, max_model_len: int, shards: int = 1) -> Transformer:
    """The model an engine benchmark runs: "real-width" (real_width_config(n_layers), on the GPU), "released"
    (released_config, on the GPU) or "tiny" (the tiny config, on the GPU if there is one, else the CPU: a quick
    check of the benchmark itself); with shards > 1 only rank 0 of it split that many ways, solo."""
    shard = ShardSpec(0, shards, solo=True) if shards > 1 else SINGLE
    if name in ("real-width", "released"):
        assert torch.cuda.is_available(), f"a {name} model needs a GPU (use the tiny model on the CPU)"
        cfg = real_width_config(n_layers, max_model_len) if name == "real-width" else released_config(max_model_len)
        return random_model(cfg, "cuda", shard=shard)
    assert name == "tiny", f"unknown model {name!r}"
    return random_model(replace(tiny_config(), max_position_embeddings=max_model_len),
                        "cuda" if torch.cuda.is_available() else "cpu", shard=shard)


def describe_model(model: Transformer, name: str) -> str:
    """How a benchmark names its model: "8 real-width layers", "rank 0 of 8 (solo) of 40 released layers", ..."""
    what = f"{model.cfg.n_layers} {name} layers"
    n = model.shard.world_size
    return f"rank 0 of {n} (solo) of {what}" if n > 1 else what


def per_gpu_share(model: Transformer) -> float:
    """One GPU's share of the released model's rate on 8 GPUs, per unit of this model's measured rate:
    n_layers / 40 / N. A whole model (N = 1) of L layers: the 40 layers over 8 ideal shards, each GPU 1/8 of
    every layer, run at L / 40 of it per GPU. Rank 0 of N: the N ranks step together, so the group's rate is the
    rank's (x L / 40) and a GPU's 1 / N of it."""
    return model.cfg.n_layers / RELEASED_LAYERS / model.shard.world_size
