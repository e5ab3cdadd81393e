"""Output throughput at concurrency through LLMEngine (issue 23): C requests of --prompt-len random tokens, each
generating --output-len tokens (greedy, ignore_eos), all submitted at once, run to the end.

    python benchmarks/engine_throughput.py [--model real-width|released|tiny] [--layers 8] [--shards 1]
        [--concurrency 16,64,256] [--prompt-len 8K] [--output-len 1K] [--chunk 8192]

Per concurrency C (C requests at once into one engine, step budget --chunk, prefix caching off): wall time, output
tok/s over the whole run, decode tok/s once every prompt is in (the steady state: C tokens a step), mean and worst
TTFT, mean step time while decoding. The per-GPU figure is the measured rate x random_model.per_gpu_share: for L
real-width layers on one GPU, x L / 40 (the released model's 40 layers over 8 GPUs, an ideal split: each GPU 1/8 of
every layer); for rank 0 of N (--shards N, solo), x L / 40 / N (the ranks step together; collectives not counted).
Issue 23's target: >= 6,000 output tok/s per H200 at C = 256 (SGLang: 4,872 on 4xH200, 8K in / 1K out).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_ttft import parse_length  # noqa: E402
from benchmarks.random_model import add_model_arguments, bench_model, describe_model, per_gpu_share  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402

VOCAB_DRAWN = 120_000


@dataclass(frozen=True, slots=True)
class Run:
    concurrency: int
    wall_s: float
    output_tokens: int
    decode_tokens: int  # tokens drawn once every prompt was in
    decode_s: float  # from the step after the last first token to the end
    decode_steps: int
    ttft_s: np.ndarray  # per request

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def measure(engine: LLMEngine, concurrency: int, prompt_len: int, output_len: int, g: torch.Generator,
            tag: str = "run") -> Run:
    """One run: every request submitted at once, stepped to the end."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(concurrency):
        engine.add_request(f"{tag}-{i}", torch.randint(0, VOCAB_DRAWN, (prompt_len,), generator=g).tolist(),
                           params)
    first: dict[str, float] = {}
    outputs = decode_tokens = decode_steps = 0
    decode_from = None
    while engine.has_unfinished:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.new_token_ids)
            outputs += n
            if n and out.request_id not in first:
                first[out.request_id] = now - t0
            elif decode_from is not None:
                decode_tokens += n
        if decode_from is None and len(first) == concurrency:
            decode_from = now  # every prompt is in: what follows is decode alone
        elif decode_from is not None:
            decode_steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    return Run(concurrency, end - t0, outputs, decode_tokens, end - decode_from if decode_from else 0.0, decode_steps,
               np.array([first[k] for k in sorted(first)]))


def main(argv: list[str] | None = None) -> list[Run]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--concurrency", default="16,64,256")
    p.add_argument("--prompt-len", default="8K")
    p.add_argument("--output-len", default="1K")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens: the step's budget")
    p.add_argument("--cache-mib", type=int, default=8192)
    args = p.parse_args(argv)
    prompt_len, output_len = parse_length(args.prompt_len), parse_length(args.output_len)
    levels = [int(c) for c in args.concurrency.split(",")]
    t0 = time.perf_counter()
    model = bench_model(args.model, args.layers, prompt_len + output_len + 64, args.shards)
    what, share = describe_model(model, args.model), per_gpu_share(model)
    print(f"random model ({what}) built in {time.perf_counter() - t0:.0f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    # one engine for every level (a level of C submits C requests, so max_num_seqs = the largest C bounds none):
    # an engine per level kept the last one's cache and graph pools until the process ended (C = 64 ran out of
    # memory after C = 16 on an H100)
    config = EngineConfig(max_num_seqs=max(levels), max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                          cache_memory_bytes=args.cache_mib << 20, max_model_len=prompt_len + output_len + 64)
    engine = LLMEngine.local(model, config, eos_token_id=-1)
    measure(engine, 2, min(prompt_len, args.chunk), 2, g, "warm")  # compiles the step shapes' kernels
    runs = []
    for c in levels:
        runs.append(measure(engine, c, prompt_len, output_len, g, f"c{c}"))
        r = runs[-1]
        print(f"C={c}: {r.output_tok_s:,.0f} output tok/s over {r.wall_s:.1f} s; decode alone {r.decode_tok_s:,.0f} "
              f"tok/s; TTFT mean {r.ttft_s.mean() * 1e3:,.0f} ms", flush=True)
    engine.close()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, {what}, {prompt_len:,} in / {output_len:,} out, "
          f"step budget {args.chunk}")
    print("| concurrency | wall s | output tok/s | decode tok/s (all prompts in) | decode step ms | TTFT mean / max ms "
          f"| per GPU, the released model on 8 GPUs (x {share:.4g}) |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        step_ms = r.decode_s / r.decode_steps * 1e3 if r.decode_steps else float("nan")
        print(f"| {r.concurrency} | {r.wall_s:.1f} | {r.output_tok_s:,.0f} | {r.decode_tok_s:,.0f} | {step_ms:.2f} | "
              f"{r.ttft_s.mean() * 1e3:,.0f} / {r.ttft_s.max() * 1e3:,.0f} | "
              f"{r.output_tok_s * share:,.0f} |")
    return runs


if __name__ == "__main__":
    main()
