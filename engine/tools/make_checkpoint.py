"""Write a random-weight checkpoint in exactly the released format, or print the full model's accounting.

    python -m engine.tools.make_checkpoint OUT --preset tiny [--seed N]
    python -m engine.tools.make_checkpoint --preset full      # writes nothing: parameter/byte/KV table
    python -m engine.tools.make_checkpoint --preset full --num-shards 8   # ... and the bytes each rank holds

A checkpoint directory holds `config.json` (HF form), `inference/config.json` (reference form),
`model-0000K-of-0000N.safetensors` shards (at least two) with `model.safetensors.index.json`, and the
V4.1 tokenizer files. Every tensor comes from its own generator seeded by (seed, tensor name), so the
bytes are the same across runs and processes and `unquantized_weight` can regenerate any weight.

Statistics follow DeepSeek's small-model recipe (tt-metal `reference/deepseek_v41/testing.py`, measured
on the release): embedding RMS 0.12; norm weights with per-owner means (attn_norm 0.025, ffn_norm 0.2,
q_norm 0.97, kv_norm 0.4, compressor.norm 0.6, k_norm 0.5, else 1) and 10% spread; projections
N(0, gain^2/fan_in) with per-name gains; other matrices N(0, 1/fan_in); 1-D tensors (attn_sink, mHC bases
and scales) N(0, 0.25); Engram tables N(0, 1). One deviation: router biases N(0, 0.05^2) (ROUTER_BIAS_STD).
A vision tower (`--preset tiny-vision`), which testing.py lacks: its matrices as projections, its linear
biases N(0, 0.02^2), the image span's delimiter rows `image_*` like the embedding.
Weights are then quantised with the checkpoint's own formats (engine.quant): FP8/E8M0 32x32 blocks,
FP4/E8M0 per 32 for routed experts, FP8 rows with E8M0 per 32 for Engram tables.

On a simplified fp32 forward of the tiny model (window attention only) greedy decoding from random
prompts gave 14-22 distinct tokens in 24, with Engram's n-gram values (RMS ~1.8) as the main
token-dependent signal, and tokens spread over the experts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoint.layout import (BF16, F32, FP4_PACKED, FP8, LAYER_COMPONENTS, TensorSpec, expected_tensors,
                                      parameter_report)
from engine.checkpoint.sharding import bytes_per_rank
from engine.parallel import ShardingError
from engine.config import ModelConfig
from engine.presets import PRESETS
from engine.quant import act_quant, quant_fp4_weight, quant_fp8_weight
from engine.tokenizer import write_tokenizer_files

EMBED_STD = 0.12
TABLE_STD = 1.0
VECTOR_STD = 0.5
# testing.py draws router biases like other vectors (std 0.5); that outweighs the spread of the random
# router's scores (~0.15), so every token would pick the same experts. Small biases keep routing
# token-dependent while still exercising the bias path.
ROUTER_BIAS_STD = 0.05
VISION_BIAS_STD = 0.02  # the tower's and the aligner's linear biases (not in testing.py, which has no tower)
NORM_SPREAD = 0.1
NORM_MEAN = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
             "k_norm": 0.5}
PROJECTION_GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5,
                   "w3": 1.5, "w2": 1.05}
DEFAULT_MAX_SHARD_BYTES = 64 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _owner(name: str) -> str:
    """`layers.0.attn.wq_a` for `layers.0.attn.wq_a.weight`; `layers.0` for `layers.0.hc_attn_fn`."""
    return name.rsplit(".", 1)[0]


def _norm_mean(owner: str) -> float:
    return next((m for k, m in NORM_MEAN.items() if owner == k or owner.endswith("." + k)), 1.0)


def _is_norm(name: str) -> bool:
    return name.endswith(".weight") and "norm" in _owner(name).rsplit(".", 1)[-1]


def _logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    return (spec.shape[0], 2 * spec.shape[1]) if spec.is_packed_fp4 else spec.shape


def unquantized_weight(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The fp32 weight of a `.weight`/parameter tensor before quantisation, logical shape ([out, in] for
    packed FP4). Engram tables are generated in bf16 (their quantiser's input dtype) and returned as fp32."""
    gen = _generator(seed, spec.name)
    shape = _logical_shape(spec)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    name, owner = spec.name, _owner(spec.name)
    if name.endswith("engram.embed.weight"):
        return (x * TABLE_STD).to(torch.bfloat16).float()
    if _is_norm(name):
        return x.mul_(NORM_SPREAD).add_(1.0).mul_(_norm_mean(owner))
    if name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
        return x.mul_(EMBED_STD)
    if len(shape) >= 2:
        return x.mul_(shape[-1] ** -0.5 * PROJECTION_GAIN.get(owner.rsplit(".", 1)[-1], 1.0))
    if name.endswith((".gate.bias", ".gate.bias_vl")):
        return x.mul_(ROUTER_BIAS_STD)
    if name.startswith(("vision.", "aligner.")):  # linear biases
        return x.mul_(VISION_BIAS_STD)
    if name.startswith("image_"):  # the image span's delimiter rows sit beside token embeddings
        return x.mul_(EMBED_STD)
    return x.mul_(VECTOR_STD)


@contextmanager
def _one_thread() -> Iterator[None]:
    # Thousands of tiny quantisations: on a busy 2-core machine torch's intra-op thread barrier makes
    # each one ~20x slower, and one thread loses nothing on tensors this small.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def generate_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """name -> tensor in its checkpoint storage dtype, for every tensor of `expected_tensors(cfg)`
    (vision included if the config has a tower). Packed FP4 is int8 (label I8, as released)."""
    with _one_thread():
        return _generate(cfg, seed)


def _generate(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    specs = expected_tensors(cfg, include_vision=cfg.vision_n_layers > 0, include_mtp=True)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if name.endswith(".scale"):
            continue  # written with its weight
        w = unquantized_weight(spec, seed)
        if spec.dtype == FP8 and name.endswith("engram.embed.weight"):
            q, s = act_quant(w.to(torch.bfloat16))  # one E8M0 scale per 32 along each row
            out[name], out[_scale_name(name)] = q, s.to(torch.float8_e8m0fnu)
        elif spec.dtype == FP8:
            out[name], out[_scale_name(name)] = quant_fp8_weight(w)
        elif spec.dtype == FP4_PACKED:
            q, s = quant_fp4_weight(w)
            out[name], out[_scale_name(name)] = q.view(torch.int8), s
        else:
            out[name] = w.to({BF16: torch.bfloat16, F32: torch.float32}[spec.dtype])
    for name, spec in specs.items():  # the layout is the contract: check it before writing
        t = out[name]
        assert tuple(t.shape) == spec.shape, (name, tuple(t.shape), spec.shape)
    return out


def _scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def split_shards(names: list[str], sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive runs of tensors, each under max_shard_bytes unless one tensor is larger; at least two."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    if len(shards) == 1 and len(names) > 1:
        half = len(names) // 2
        shards = [names[:half], names[half:]]
    return shards


def make_checkpoint(out_dir: str | Path, cfg: ModelConfig, seed: int = 0, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a random-weight checkpoint for `cfg` into out_dir (created); returns its path."""
    out_dir = Path(out_dir)
    (out_dir / "inference").mkdir(parents=True, exist_ok=True)
    tensors = generate_tensors(cfg, seed)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    shards = split_shards(list(tensors), sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
        os.chmod(out_dir / fname, 0o644)  # save_file creates 0600; the other files are 0644
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    _write_json(out_dir / INDEX_FILE, index)
    _write_json(out_dir / "config.json", cfg.to_hf_dict())
    _write_json(out_dir / "inference" / "config.json", cfg.to_reference_dict())
    write_tokenizer_files(out_dir)
    return out_dir


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def format_report(cfg: ModelConfig) -> str:
    """The parameter/byte table (spec 6) and the KV figures (spec 5) of a config, as printed text."""
    rows = parameter_report(cfg)
    by = {r.component: r for r in rows}
    lines = [f"{'component':<24}{'params':>16}{'checkpoint bytes':>20}"]
    for r in rows:
        if r.component == "total":
            layer_bytes = sum(by[c].num_bytes for c in LAYER_COMPONENTS if c in by)
            lines.append(f"{'backbone layers total':<24}{'':>16}{layer_bytes / 1e9:>17.2f} GB")
        lines.append(f"{r.component:<24}{r.num_params / 1e9:>14.2f} B{r.num_bytes / 1e9:>17.2f} GB")
    total = by["total"].num_params
    backbone = total - sum(by[c].num_params for c in ("Engram tables", "DSpark") if c in by)
    lines.append(f"{'backbone = total - Engram tables - DSpark':<42}{backbone / 1e9:.2f} B")
    lines.append(f"total parameters: {total / 1e9:.1f} B ({total:,}); checkpoint {by['total'].num_bytes / 1e9:.1f} GB")
    window, entry = cfg.window_size, cfg.swa_entry_bytes
    lines += [
        "",
        f"global KV bytes per token: {cfg.global_kv_bytes_per_token:g} "
        f"(main KV {cfg.main_kv_entry_bytes} B + index K {cfg.index_k_entry_bytes} B per entry, "
        f"sources {list(cfg.kv_source_layers)} at ratios {[cfg.compress_ratios[s] for s in cfg.kv_source_layers]})",
        f"SWA KV bytes per request: {cfg.n_layers} layers x {window} x {entry} B = {cfg.n_layers * window * entry:,}"
        f" + DSpark {cfg.n_mtp_layers} x {window} x {entry} B = {cfg.n_mtp_layers * window * entry:,}",
    ]
    return "\n".join(lines)


KV_CONTEXTS = {"128K": 128 * 1024, "1M": 1024 * 1024}


def format_shard_report(cfg: ModelConfig, num_shards: int) -> str:
    """Bytes one rank holds when the model is split over num_shards (engine/checkpoint/sharding.py's layout,
    text-only, DSpark included), against the whole model; and one request's KV, which every rank holds."""
    whole, part = bytes_per_rank(cfg, 1), bytes_per_rank(cfg, num_shards)
    lines = [f"per rank at --num-shards {num_shards} (text-only, DSpark stages included)",
             f"{'component':<24}{'whole':>14}{'per rank':>14}"]
    lines += [f"{c:<24}{whole[c] / 1e9:>11.2f} GB{part[c] / 1e9:>11.2f} GB" for c in whole]
    device = {c: b for c, b in part.items() if c != "Engram tables"}
    lines.append(f"{'device weights':<24}{sum(v for c, v in whole.items() if c != 'Engram tables') / 1e9:>11.2f} GB"
                 f"{sum(device.values()) / 1e9:>11.2f} GB")
    lines.append(f"Engram tables stay in host memory: {part.get('Engram tables', 0) / 1e9:.2f} GB, one copy per node "
                 f"that its {num_shards} ranks map (engine/shared_tables.py)")
    swa = cfg.n_total_layers * cfg.window_size * cfg.swa_entry_bytes
    for label, ctx in KV_CONTEXTS.items():
        kv = ctx * cfg.global_kv_bytes_per_token + swa
        lines.append(f"KV of one {label}-token request, on every rank (replicated): {kv / 1e9:.2f} GB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.make_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="output directory (not used with --preset full)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=1,
                        help="with --preset full: also print the bytes each of N model-parallel ranks holds")
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset]()
    if args.preset == "full":
        print(f"DeepSeek-V4.1-Flash ({args.preset} preset): no checkpoint written\n")
        print(format_report(cfg))
        if args.num_shards > 1:
            try:
                print("\n" + format_shard_report(cfg, args.num_shards))
            except ShardingError as e:
                parser.error(str(e))
        return 0
    if args.out is None:
        parser.error("OUT is required for a preset that writes a checkpoint")
    path = make_checkpoint(args.out, cfg, args.seed)
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({total / 1e6:.1f} MB of weights, seed {args.seed})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
