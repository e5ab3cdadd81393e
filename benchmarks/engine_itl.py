"""Inter-token latency of decoding requests while a long prompt prefills beside them, with and without a cap on the
prefill positions a step with decodes may take (EngineConfig.max_prefill_beside_decode; issue 23).

    python benchmarks/engine_itl.py [--layers 8] [--decodes 16] [--prompt 32K] [--chunk 8192] [--caps none,2048,512]

Through LLMEngine on a real-width random model (benchmarks/random_model.bench_model; --model tiny for the CPU):
--decodes requests with short prompts decode (greedy, ignore_eos); their inter-token gaps are collected over
ALONE_STEPS steps of decode alone, then from the long prompt's arrival until its first token. The whole scenario runs
twice on one engine (three times with --profile: the third under torch.profiler) and the second is reported: the first compiles the kernels at the capped chunk's shapes (a
compile inside the window read as a 1.8 s gap on the H200). Per cap: ITL p50 / p99 / max over every decoding
request's gaps, decode alone and beside the prefill, and the long prompt's TTFT (the price of the cap).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_ttft import parse_length  # noqa: E402
from benchmarks.random_model import add_model_arguments, bench_model, describe_model  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402

DECODE_PROMPT = 128
ALONE_STEPS = 16


def measure(model, args, cap: int | None, split: bool, g: torch.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """(the decoding requests' inter-token gaps in seconds decoding alone, and while the long prompt was in flight;
    its TTFT), from the second of two rounds."""
    config = EngineConfig(max_num_seqs=args.decodes + 1, max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                          cache_memory_bytes=args.cache_mib << 20, max_model_len=args.prompt + 64,
                          max_prefill_beside_decode=cap, split_mixed_steps=split)
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

    def gaps_until(done) -> list[float]:
        gaps = []
        while not done():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id in last and out.new_token_ids:
                    gaps.append(now - last[out.request_id])
                    last[out.request_id] = now
                elif out.new_token_ids:
                    first_tokens[out.request_id] = now
        return gaps

    first_tokens: dict[str, float] = {}
    for round_ in range(3 if args.profile else 2):
        steps = iter(range(ALONE_STEPS + 1))
        gaps_until(lambda: next(steps) == ALONE_STEPS)  # steady decode (the first gaps span the warm-up's end)
        steps = iter(range(ALONE_STEPS + 1))
        with profiled(round_ == 2, "decode alone", ALONE_STEPS):
            gaps = gaps_until(lambda: next(steps) == ALONE_STEPS)
        t0 = time.perf_counter()
        engine.add_request(f"long{round_}", tokens(args.prompt), SamplingParams(max_tokens=1, ignore_eos=True))
        with profiled(round_ == 2, "beside the prefill", None), sync_sites(args.sync_sites and round_ == 0):
            beside_gaps = gaps_until(lambda: f"long{round_}" in first_tokens)
        if round_ < 2:
            alone, beside, ttft = gaps, beside_gaps, first_tokens[f"long{round_}"] - t0
    for rid in list(last):
        engine.abort(rid)
    engine.close()
    return np.array(alone), np.array(beside), ttft


@contextmanager
def sync_sites(on: bool):
    """--sync-sites: the window under torch's CUDA sync debug mode ("warn"); prints where the host waited for the
    device (each synchronizing call's Python file and line, with its count). In the first round, which is not
    reported: the warnings cost host time."""
    if not on or not torch.cuda.is_available():
        yield
        return
    import warnings
    from collections import Counter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"\n--- synchronizing CUDA calls beside the prefill: {sum(sites.values())}")
    for site, n in sites.most_common(25):
        print(f"  {n:6d}  {site}")


@contextmanager
def profiled(on: bool, what: str, steps: int | None):
    """--profile: the window under torch.profiler (CPU ops and CUDA kernels), its top ops printed."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6 if torch.cuda.is_available() else 0.0
    print(f"\n--- profile: {what}: wall {wall * 1e3:.1f} ms, kernels' total {busy * 1e3:.1f} ms"
          + (f" over {steps} steps" if steps else ""))
    if torch.cuda.is_available():
        print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--decodes", type=int, default=16, help="requests decoding beside the long prompt")
    p.add_argument("--prompt", default="32K", help="the long prompt's tokens")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens: the step's budget")
    p.add_argument("--caps", default="none,2048,512", help="max_prefill_beside_decode values (none: no cap)")
    p.add_argument("--cache-mib", type=int, default=2048)
    p.add_argument("--split", choices=["on", "off", "both"], default="on",
                   help="split_mixed_steps: a mixed step's decodes through the decode step (both: each cap twice)")
    p.add_argument("--sync-sites", action="store_true",
                   help="count the synchronizing CUDA calls beside the prefill by Python file and line")
    p.add_argument("--profile", action="store_true",
                   help="a third round under torch.profiler: the top CUDA kernels and CPU ops, alone and beside")
    args = p.parse_args()
    args.prompt = parse_length(args.prompt)
    t0 = time.perf_counter()
    model = bench_model(args.model, args.layers, args.prompt + 64, args.shards)
    what = describe_model(model, args.model)
    print(f"random model ({what}) built in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for text, split in ((c, s) for c in args.caps.split(",") for s in {"on": [True], "off": [False],
                                                                       "both": [False, True]}[args.split]):
        cap = None if text == "none" else int(text)
        alone, gaps, ttft = measure(model, args, cap, split, torch.Generator().manual_seed(0))
        text = f"{text}, split {'on' if split else 'off'}"
        ms, alone_ms = gaps * 1e3, alone * 1e3
        rows.append((text, np.percentile(alone_ms, 50), np.percentile(alone_ms, 99), np.percentile(ms, 50),
                     np.percentile(ms, 99), ms.max(), len(ms), ttft))
        print(f"cap {text}: decode alone ITL p50 {rows[-1][1]:.2f} ms, p99 {rows[-1][2]:.2f} ms; beside the prefill "
              f"p50 {rows[-1][3]:.2f} ms, p99 {rows[-1][4]:.2f} ms, max {rows[-1][5]:.2f} ms ({len(ms)} gaps); "
              f"long prompt TTFT {ttft * 1e3:.0f} ms", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, {what}, {args.decodes} decoding requests, "
          f"a {args.prompt:,}-token prompt arriving, step budget {args.chunk}")
    print("| max_prefill_beside_decode, split | alone ITL p50 / p99 ms | beside ITL p50 ms | beside ITL p99 ms "
          "| p99 beside / alone | ITL max ms | gaps | long prompt TTFT ms |")
    print("|---|---|---|---|---|---|---|---|")
    for text, a50, a99, p50, p99, worst, n, ttft in rows:
        print(f"| {text} | {a50:.2f} / {a99:.2f} | {p50:.2f} | {p99:.2f} | {p99 / a99:.1f}x | {worst:.2f} | {n} "
              f"| {ttft * 1e3:,.0f} |")


if __name__ == "__main__":
    main()
