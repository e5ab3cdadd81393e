"""Offline engine throughput on a checkpoint (default: the tiny random-weight one, generated if missing),
and the cache bytes a request needs on the real DeepSeek-V4.1-Flash config.

    .venv/bin/python benchmarks/engine_offline.py [--ckpt DIR] [--requests 16] [--prompt-len 48]
        [--output-len 16] [--max-batch-tokens 512] [--max-seqs 16] [--device cpu]

Prints one table: requests, prompt/output tokens, steps, wall time, prompt and output tok/s, mean
running batch; then bytes per token (global KV), per-request window KV and compressor state, and the
engine's allocated bytes for a 128K-token request, all from the cache layout code the engine uses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.kv_cache import (DEFAULT_GLOBAL_BLOCK, DEFAULT_SWA_BLOCK, global_bytes_per_block,  # noqa: E402
                                  pending_bytes_per_slot, swa_bytes_per_block)
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.presets import full_config, tiny_config  # noqa: E402


def tiny_checkpoint() -> Path:
    from engine.tools.make_checkpoint import make_checkpoint

    path = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
    if not (path / "config.json").exists():
        make_checkpoint(path, tiny_config(), seed=0)
    return path


def throughput(args: argparse.Namespace) -> None:
    ckpt = Path(args.ckpt) if args.ckpt else tiny_checkpoint()
    config = EngineConfig(max_num_seqs=args.max_seqs, max_num_batched_tokens=args.max_batch_tokens,
                          enable_prefix_caching=False)
    engine = LLMEngine.from_checkpoint(ckpt, config, device=args.device)
    engine.eos_token_id = -1  # fixed output lengths
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 120000, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    engine.stats.num_steps = 0
    running = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=args.output_len))
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        running.append(len(engine.scheduler.running))
    wall = time.perf_counter() - t0
    n_prompt, n_out = args.requests * args.prompt_len, args.requests * args.output_len
    print(f"| {args.requests} | {args.prompt_len} | {args.output_len} | {steps} | {wall:.2f} s | "
          f"{n_prompt / wall:.1f} | {n_out / wall:.1f} | {(n_prompt + n_out) / wall:.1f} | "
          f"{sum(running) / len(running):.1f} |")


def cache_bytes() -> None:
    cfg = full_config()
    G, S = DEFAULT_GLOBAL_BLOCK, DEFAULT_SWA_BLOCK
    per_token = global_bytes_per_block(cfg, G) / G
    window_blocks = -(-cfg.window_size // S) + 1
    swa_exact = swa_bytes_per_block(cfg, 1) * cfg.window_size
    swa_alloc = swa_bytes_per_block(cfg, S) * window_blocks
    n = 128 * 1024
    print(f"real config: global KV {per_token:.0f} B/token (spec: 890); window KV {swa_exact:,} B/request "
          f"(spec: 2,703,360; allocated in {S}-token blocks: {swa_alloc:,} B); compressor state "
          f"{pending_bytes_per_slot(cfg):,} B/request; a {n:,}-token request: "
          f"{per_token * n / 2**20:.1f} MiB global + {swa_alloc / 2**20:.2f} MiB window")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    cache_bytes()
    print("| requests | prompt | output | steps | wall | prompt tok/s | output tok/s | total tok/s | mean running |")
    print("|---|---|---|---|---|---|---|---|---|")
    throughput(args)


if __name__ == "__main__":
    main()
