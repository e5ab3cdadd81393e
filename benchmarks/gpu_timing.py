"""GPU timing shared by the kernel benchmarks (benchmarks/kernels.py and benchmarks/kernel_benches/).

Timing: one CUDA graph holds many back-to-back calls, each reading its own copy of the inputs (enough
copies to exceed 4x the L2, so weights stream from HBM as in a decode step); per-call time = median graph
replay time / calls. Rates are reported against the device-to-device copy bandwidth measured in the run.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch


def graph_time_us(calls: list[Callable[[], object]], replays: int = 10,
                  before_replay: Callable[[], object] | None = None) -> float:
    """Median per-call time of `calls` captured back to back in one CUDA graph (microseconds).
    before_replay runs (untimed) before each timed replay, e.g. to overwrite the L2."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, allocate, pick algorithms outside the capture
        for f in calls[:3]:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):  # the warm-up's stream: its split-K tickets exist and are zero
        for f in calls:
            f()
    per_call = replay_time_us(g, replays, before_replay) / len(calls)
    del g
    return per_call


def replay_time_us(graph: torch.cuda.CUDAGraph, replays: int = 10,
                   before_replay: Callable[[], object] | None = None) -> float:
    """Median time of one replay of a captured graph (microseconds), timed with events (a graph cannot be
    replayed inside another graph's capture, so a captured step is timed here, not through graph_time_us)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        if before_replay is not None:
            before_replay()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3)
    return statistics.median(times)


def eager_time_us(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> float:
    """Median time of one eager call (microseconds, CUDA events), after `warmup` untimed calls: for work that is not
    captured in graphs (prefill-sized calls that allocate, e.g. engine.kernels.moe_grouped; the vision tower)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes read + written per second: 2 GiB copied by torch's copy kernel,
    timed with events outside a graph (a captured copy becomes a copy-engine node, ~2.8 TB/s here)."""
    src = torch.randint(0, 255, (1 << 29,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        dst.copy_(src)
    t1.record()
    t1.synchronize()
    return 20 * 2 * src.numel() * 4 / (t0.elapsed_time(t1) * 1e-3)


def copies_for(bytes_each: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(128, math.ceil(4 * l2 / bytes_each)))


def sweep(configs, label: str, time_us: Callable[[tuple], float]) -> tuple[dict, tuple]:
    """Time every launch config (a failing one is reported, not fatal); returns all times and the best."""
    res = {}
    for c in configs:
        try:
            res[c] = time_us(c)
        except Exception as e:  # noqa: BLE001 - reported
            print(f"  {label} {c}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return res, (min(res.items(), key=lambda kv: kv[1]) if res else (None, float("nan")))


def calls_of(make: Callable[[int], Callable[[], object]], copies: int) -> list[Callable[[], object]]:
    return [make(i % copies) for i in range(max(copies, 32))]


def gemv_bench_main(bench: Callable[..., None], description: str, shapes_help: str,
                    m_values: tuple[int, ...]) -> None:
    """The command line of a GEMV benchmark module: [--sweep] [--shapes a,b] [--m 1,8] ->
    bench(copy_bandwidth(), sweep, shape names or None, m values)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes")
    parser.add_argument("--shapes", help=f"comma-separated matrices: {shapes_help}")
    parser.add_argument("--m", help="comma-separated M values (default " + ",".join(map(str, m_values)) + ")")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    names = tuple(args.shapes.split(",")) if args.shapes else None
    ms = tuple(int(v) for v in args.m.split(",")) if args.m else m_values
    bench(copy_bandwidth(), args.sweep, names, ms)
