"""One rank of the N-way split model alone on one GPU: its decode step, bytes, layer times and the projected step.

Issue 21's measurement: rank r of DeepSeek-V4.1-Flash split N ways runs its decode step through the engine's graph
path at T = 1 and T = 6 tokens; printed with time per layer, bytes per rank and the projected N-GPU step.

    python benchmarks/rank_decode.py [--num-shards 8] [--rank 0] [--tokens 1,6] [--steps 50] [--layer-sum]
    python benchmarks/rank_decode.py --preset tiny --device cpu --num-shards 2 --tokens 1 --steps 1 --warmup 0

The model: the released 40-layer config (benchmarks/random_model.py `released_config`: Engram hashes into small
tables, a lookup costs the same), random weights in the checkpoint's formats built on the device, only rank r's
slices (random_model(shard=...): ~39 GB at N = 8, rank 0). The shard is `solo` (engine/parallel.py), a measurement
mode that never serves: no other rank exists, each layer's 2 all-reduces (wo_b, the MoE) return their input at no
cost and the draw's two small all-gathers (each rank's maxima, engine/core/sharded_draw.py: greedy rows, the
benchmark's) tile the rank's values. So the measured step is the rank's own work, and the projection adds the
collectives as issue 21 states it:

    projected step = measured step + 2 * n_layers all-reduces x L,  L = 7 .. 13 us (--allreduce-us: the published
                     one-shot all-reduce latency for decode-sized messages on NVLink)

(the draw's all-gathers, 32 bytes per token per rank, are not in the formula; a draw with logprobs or top-k / top-p
gathers the logits instead, T * vocab * 4 bytes, printed beside it). Target: the
T = 6 step (DSpark verify) <= 2.7 ms including collectives: >= 2,060 tok/s at 5.6 accepted tokens a step, >= 1,300
at 3.5. T tokens are T requests of one decode token each (the decode step's batch: a verify step of 6 tokens of one
request reads the same weights and a sixth of the KV).

Printed: bytes per rank by component (the layout's, engine/checkpoint/sharding.py) against what the built model
holds on the device; the engine's start-up (graph capture time and memory); per T the step ms (--steps back to back,
wall / steps), GPU busy ms, with --layer-sum each layer's own CUDA-graph time and the head's against the step's
graph (benchmarks/engine_decode.py's machinery), and the projection table. On the CPU (--device cpu, the tiny
preset: a smoke run of this harness) the same step runs eagerly, without GPU timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_decode import measure  # noqa: E402
from benchmarks.random_model import random_model, released_config  # noqa: E402
from engine.checkpoint.sharding import bytes_per_rank, check_shardable  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.model.engram import EngramEmbedding  # noqa: E402
from engine.parallel import ShardSpec  # noqa: E402
from engine.presets import tiny_config  # noqa: E402

ACCEPTED = (5.6, 3.5)  # DSpark accepted tokens per verify step: Baseten's, and the real-data accept length
TARGET_MS = 2.7  # the T = 6 step, collectives included


def model_config(preset: str, max_model_len: int) -> ModelConfig:
    if preset == "tiny":
        return replace(tiny_config(), max_position_embeddings=max_model_len)
    return released_config(max_model_len)


def device_bytes(model: torch.nn.Module) -> int:
    """Bytes of every buffer but the Engram tables (those stay in host memory)."""
    return sum(b.numel() * b.element_size() for m in model.modules() if not isinstance(m, EngramEmbedding)
               for b in m.buffers(recurse=False))


def bytes_report(cfg: ModelConfig, num_shards: int, model: torch.nn.Module) -> str:
    layout = bytes_per_rank(cfg, num_shards, include_mtp=False)
    lines = [f"bytes per rank at N = {num_shards} (the layout, no DSpark stages):"]
    lines += [f"  {c:<24}{b / 1e9:9.3f} GB" for c, b in layout.items()]
    weights = sum(b for c, b in layout.items() if c != "Engram tables")
    lines.append(f"  {'device weights':<24}{weights / 1e9:9.3f} GB; built on the device: "
                 f"{device_bytes(model) / 1e9:.3f} GB")
    return "\n".join(lines)


def projection(rows: list[tuple[int, float, float]], cfg: ModelConfig, latencies: list[float]) -> str:
    """The projected N-GPU step per T: the measured rank step + 2 * n_layers all-reduces at each latency."""
    n = 2 * cfg.n_layers
    head = [f"+ {n} x {lat:g} us" for lat in latencies]
    lines = [f"| T | rank step ms | GPU busy ms | {' | '.join(head)} | logits all-gather (logprobs, top-k/p) | tok/s at the slowest |",
             "|---|---|---|" + "---|" * len(latencies) + "---|---|"]
    for t, step_ms, busy in rows:
        projected = [step_ms + n * lat / 1000 for lat in latencies]
        worst = max(projected)
        rate = (f"{1000 / worst:,.0f}" if t == 1 else
                " / ".join(f"{a * 1000 / worst:,.0f} at {a}" for a in ACCEPTED))
        busy_s = "-" if busy != busy else f"{busy:.3f}"
        lines.append(f"| {t} | {step_ms:.3f} | {busy_s} | {' | '.join(f'{p:.3f}' for p in projected)} | "
                     f"{t * cfg.vocab_size * 4 / 1e6:.2f} MB | {rate} |")
        if t == 6:
            verdict = "meets" if worst <= TARGET_MS else "misses"
            lines.append(f"T = 6 target: <= {TARGET_MS} ms with collectives: {verdict} it ({worst:.3f} ms at "
                         f"{max(latencies):g} us per all-reduce)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("released", "tiny"), default="released")
    p.add_argument("--num-shards", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tokens", default="1,6", help="decode batch sizes T to time")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-mib", type=int, default=4096)
    p.add_argument("--allreduce-us", default="7,13", help="all-reduce latencies (us) for the projection")
    p.add_argument("--layer-sum", action="store_true", help="time each layer's graph at every T (CUDA)")
    p.add_argument("--top-kernels", type=int, default=0, help="print the N most costly kernels of each T")
    p.add_argument("--profile-host", type=int, default=0, help="print cProfile's N most costly functions of each T")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    args.layer_sum = set(tokens) if args.layer_sum else set()
    latencies = [float(x) for x in args.allreduce_us.split(",")]
    max_tokens = args.prompt_len + args.warmup + args.steps + 64
    cfg = model_config(args.preset, max_tokens)
    check_shardable(cfg, args.num_shards)
    shard = ShardSpec(args.rank, args.num_shards, solo=True)
    cuda = torch.device(args.device).type == "cuda"

    t0 = time.perf_counter()
    model = random_model(cfg, args.device, args.seed, shard=shard)
    mem = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated" if cuda else ""
    print(f"rank {args.rank} of {args.num_shards} ({args.preset}, {cfg.n_layers} layers, solo) built in "
          f"{time.perf_counter() - t0:.0f} s{mem}", flush=True)
    print(bytes_report(cfg, args.num_shards, model), flush=True)

    config = EngineConfig(max_num_seqs=max(tokens), max_num_batched_tokens=max(512, max(tokens)),
                          enable_prefix_caching=False, cache_memory_bytes=args.cache_mib << 20,
                          max_model_len=max_tokens, runner="kernels", decode_step=True, cuda_graphs=cuda)
    t0 = time.perf_counter()
    engine = LLMEngine.local(model, config, progress=True, eos_token_id=-1)
    mem = f", {torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved" if cuda else ""
    print(f"engine ready in {time.perf_counter() - t0:.1f} s{mem}", flush=True)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    rows = []
    for t in tokens:
        step_ms, busy_ms = measure(engine, t, args, params)
        rows.append((t, step_ms, busy_ms))
        print(f"T = {t}: {step_ms:.3f} ms/step, GPU busy {busy_ms:.3f} ms", flush=True)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\n{name}, rank {args.rank} of {args.num_shards}, prompt {args.prompt_len}, {args.steps} steps")
    print(projection(rows, cfg, latencies))


if __name__ == "__main__":
    main()
