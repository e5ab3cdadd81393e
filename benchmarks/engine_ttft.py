"""Time to first token through LLMEngine on a random model (issue 23): one request per prompt length, prefilled in
chunks of --chunk tokens, timed from add_request to its first token.

    python benchmarks/engine_ttft.py [--model real-width|released|tiny] [--layers 8] [--shards 1]
        [--lengths 1K,8K,32K] [--chunk 8192] [--runs 2]

The model is benchmarks/random_model.bench_model's (default real_width_config(--layers) built on the GPU: random
weights, the release's widths; --model released --shards 8: rank 0 of the released 40 layers split 8 ways, solo,
one GPU's work in an 8-GPU deployment); the prompt is random token ids. Per length: the fastest of --runs TTFTs
(after one warm-up request of the chunk's length, so the Triton kernels are compiled), prompt tokens/s, ms per layer
per 1K prompt tokens (TTFT / layers, the head left in), and the released model's TTFT on 8 GPUs projected from it:
TTFT / (8 x random_model.per_gpu_share) (an ideal split for a whole model; the rank's own time, collectives not
counted, for rank 0 of 8). Prefix caching is off, so every run computes the whole prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.random_model import add_model_arguments, bench_model, describe_model, per_gpu_share  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402


def parse_length(text: str) -> int:
    return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def ttft_s(engine: LLMEngine, prompt: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished:
        for out in engine.step():
            if out.new_token_ids:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
    while engine.has_unfinished:
        engine.step()
    return first


def main(argv: list[str] | None = None) -> list[tuple[int, float]]:
    """Returns (prompt tokens, best TTFT s) per length."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--lengths", default="1K,8K")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens: prefill chunk size")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--cache-mib", type=int, default=4096)
    args = p.parse_args(argv)
    lengths = [parse_length(t) for t in args.lengths.split(",")]
    t0 = time.perf_counter()
    model = bench_model(args.model, args.layers, max(lengths) + 64, args.shards)
    what, layers, share = describe_model(model, args.model), model.cfg.n_layers, per_gpu_share(model)
    gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(f"random model ({what}) built in {time.perf_counter() - t0:.0f} s, {gib:.1f} GiB", flush=True)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                          cache_memory_bytes=args.cache_mib << 20, max_model_len=max(lengths) + 64)
    engine = LLMEngine.local(model, config, eos_token_id=-1)
    g = torch.Generator().manual_seed(0)
    ttft_s(engine, torch.randint(0, 120000, (min(args.chunk, max(lengths)),), generator=g).tolist(), "warm")
    rows = []
    for n in lengths:
        prompt = torch.randint(0, 120000, (n,), generator=g).tolist()
        best = min(ttft_s(engine, prompt, f"r{n}-{i}") for i in range(args.runs))
        rows.append((n, best))
        print(f"{n} tokens: TTFT {best * 1e3:.1f} ms", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, {what}, chunk {args.chunk}, best of {args.runs}")
    print("| prompt tokens | TTFT ms | prompt tok/s | ms per layer per 1K tokens | released model on 8 GPUs, projected ms |")
    print("|---|---|---|---|---|")
    for n, s in rows:
        per_layer_k = s * 1e3 / layers / (n / 1024)
        print(f"| {n:,} | {s * 1e3:.1f} | {n / s:,.0f} | {per_layer_k:.2f} | {s * 1e3 / (8 * share):,.0f} |")
    return rows


if __name__ == "__main__":
    main()
