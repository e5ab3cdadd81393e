"""Inter-token latency of decoding requests while a long prompt prefills beside them, with and without a cap on the
prefill positions a step with decodes may take (EngineConfig.max_prefill_beside_decode; issue 23).

    python benchmarks/engine_itl.py [--layers 8] [--decodes 16] [--prompt 32K] [--chunk 8192] [--caps none,2048,512]

Through LLMEngine on a real-width random model (benchmarks/random_model.bench_model; --model tiny for the CPU):
--decodes requests with short prompts decode (greedy, ignore_eos) until the long prompt has been admitted and its
first token drawn; the gaps between consecutive tokens of each decoding request are collected over that window. Per
cap: ITL p50 / p99 / max over every decoding request's gaps, and the long prompt's TTFT (the price of the cap).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_ttft import parse_length  # noqa: E402
from benchmarks.random_model import bench_model  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402

DECODE_PROMPT = 128


def measure(model, args, cap: int | None, g: torch.Generator) -> tuple[np.ndarray, float]:
    """(every decoding request's inter-token gaps in seconds while the long prompt was in flight, its TTFT)."""
    config = EngineConfig(max_num_seqs=args.decodes + 1, max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                          cache_memory_bytes=args.cache_mib << 20, max_model_len=args.prompt + 64,
                          max_prefill_beside_decode=cap)
    engine = LLMEngine.local(model, config, eos_token_id=-1)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 120000, (n,), generator=g).tolist()

    engine.add_request("warm", tokens(min(args.chunk, args.prompt)), SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    for i in range(args.decodes):
        engine.add_request(f"d{i}", tokens(DECODE_PROMPT), SamplingParams(max_tokens=100_000, ignore_eos=True))
    last: dict[str, float] = {}
    while len(last) < args.decodes:  # every decoding request has its first token
        for out in engine.step():
            if out.new_token_ids:
                last[out.request_id] = time.perf_counter()
    for _ in range(5):  # steady decode
        engine.step()
    last = {rid: time.perf_counter() for rid in last}
    t0 = time.perf_counter()
    engine.add_request("long", tokens(args.prompt), SamplingParams(max_tokens=1, ignore_eos=True))
    gaps, ttft = [], None
    while ttft is None:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == "long" and out.new_token_ids:
                ttft = now - t0
            elif out.new_token_ids:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for rid in list(last):
        engine.abort(rid)
    engine.close()
    return np.array(gaps), ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["real-width", "tiny"], default="real-width",
                   help="real-width: real_width_config(--layers) on the GPU; tiny: the tiny config (CPU works)")
    p.add_argument("--layers", type=int, default=8, help="real_width_config's role order (6, 8 or 10 layers)")
    p.add_argument("--decodes", type=int, default=16, help="requests decoding beside the long prompt")
    p.add_argument("--prompt", default="32K", help="the long prompt's tokens")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens: the step's budget")
    p.add_argument("--caps", default="none,2048,512", help="max_prefill_beside_decode values (none: no cap)")
    p.add_argument("--cache-mib", type=int, default=2048)
    args = p.parse_args()
    args.prompt = parse_length(args.prompt)
    t0 = time.perf_counter()
    model = bench_model(args.model, args.layers, args.prompt + 64)
    print(f"random {args.model} model built in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for text in args.caps.split(","):
        cap = None if text == "none" else int(text)
        gaps, ttft = measure(model, args, cap, torch.Generator().manual_seed(0))
        ms = gaps * 1e3
        rows.append((text, np.percentile(ms, 50), np.percentile(ms, 99), ms.max(), len(ms), ttft))
        print(f"cap {text}: ITL p50 {rows[-1][1]:.2f} ms, p99 {rows[-1][2]:.2f} ms, max {rows[-1][3]:.2f} ms "
              f"({len(ms)} gaps); long prompt TTFT {ttft * 1e3:.0f} ms", flush=True)
    what = f"{args.layers} real-width layers" if args.model == "real-width" else "tiny model"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, {what}, {args.decodes} decoding requests, "
          f"a {args.prompt:,}-token prompt arriving, step budget {args.chunk}")
    print("| max_prefill_beside_decode | ITL p50 ms | ITL p99 ms | ITL max ms | gaps | long prompt TTFT ms |")
    print("|---|---|---|---|---|---|")
    for text, p50, p99, worst, n, ttft in rows:
        print(f"| {text} | {p50:.2f} | {p99:.2f} | {worst:.2f} | {n} | {ttft * 1e3:,.0f} |")


if __name__ == "__main__":
    main()
