"""Where one decoder layer's time goes: the kernels of a layer forward through the runner's kernel path
(benchmarks/layer_decode.py's real-shape layer and step), with their GPU times from torch.profiler.

    python benchmarks/layer_profile.py [--layers 20,21] [--tokens 1] [--context 8192] [--top 45] [--timeline]

Per layer: the CUDA-graph time (as layer_decode.py measures it), the kernels per call and their summed GPU time
(eager: the kernels are the graph's, the gaps between them are not), then the top kernels by time per call.
Eager times of kernels launched with programmatic dependent launch include their wait for the previous kernel.
--timeline: one replay of the layer's CUDA graph under the profiler instead, kernel by kernel in launch order:
start (from the first kernel's), duration, and the gap after the previous kernel's end (negative: overlap).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import graph_time_us  # noqa: E402
from benchmarks.layer_decode import build_layer, make_step  # noqa: E402
from engine.core.kernel_layers import KernelRunner  # noqa: E402
from engine.presets import full_config  # noqa: E402

CALLS = 5


def kernel_times(fn) -> dict[str, tuple[float, float]]:
    """kernel name -> (launches per call, GPU us per call) over CALLS eager calls."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, tuple[float, float]] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        n, t = agg.get(e.name, (0.0, 0.0))
        agg[e.name] = (n + 1 / CALLS, t + e.time_range.elapsed_us() / CALLS)
    return agg


def graph_timeline(fn) -> list[tuple[str, float, float]]:
    """(kernel, start us, end us) of one replay of fn captured in a CUDA graph, in start order."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):  # the warm-up's stream: its split-K tickets exist and are zero
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type.name == "CUDA")
    assert kernels, "the profiler recorded no kernels of the graph replay"
    t0 = kernels[0][0]
    return [(name, start - t0, end - t0) for start, end, name in kernels]


def print_timeline(rows: list[tuple[str, float, float]]) -> None:
    print("| start us | us | gap us | kernel |")
    print("|---|---|---|---|")
    prev_end = None
    for name, start, end in rows:
        gap = "" if prev_end is None else f"{start - prev_end:.1f}"
        print(f"| {start:.1f} | {end - start:.1f} | {gap} | {name[:90]} |")
        prev_end = end if prev_end is None else max(prev_end, end)
    busy = sum(end - start for _, start, end in rows)
    print(f"\nspan {rows[-1][2]:.1f} us, {len(rows)} kernels, {busy:.1f} us of kernel time (overlaps counted twice)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="20,21")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--timeline", action="store_true", help="kernel timeline of one CUDA-graph replay")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    cfg = full_config()
    layers = [int(x) for x in args.layers.split(",")]
    sources = {cfg.layer_role(i).index_source for i in layers} - {None}
    blocks = {i: build_layer(cfg, i) for i in sorted(set(layers) | sources)}
    kv, plan = make_step(cfg, args.context, args.tokens)
    runner = KernelRunner(SimpleNamespace(cfg=cfg, engram_tables=None), kv)
    step = runner.prepare(plan)
    h = torch.randn(args.tokens, cfg.hc_mult, cfg.dim, device="cuda").bfloat16()
    pre = torch.softmax(torch.randn(args.tokens, cfg.hc_mult, device="cuda"), -1)
    with torch.inference_mode():
        for i in sorted(blocks):  # index sources publish the top-k their Reuse layers read
            runner.layer_forward(blocks[i], h, pre, step, step.phase(i, cfg.ced_cut))
        for i in layers:
            def fn(i=i):
                return runner.layer_forward(blocks[i], h, pre, step, step.phase(i, cfg.ced_cut))
            for _ in range(3):
                fn()
            graph = graph_time_us([fn], 20)
            role = cfg.layer_role(i)
            if args.timeline:
                print(f"\n### layer {i} ({role.mode} r{role.ratio}), T = {args.tokens}, context {args.context:,}: "
                      f"graph {graph:.1f} us; one replay's kernels\n")
                print_timeline(graph_timeline(fn))
                continue
            agg = kernel_times(fn)
            print(f"\n### layer {i} ({role.mode} r{role.ratio}), T = {args.tokens}, context {args.context:,}: graph "
                  f"{graph:.1f} us; {sum(n for n, _ in agg.values()):.0f} kernels a call, "
                  f"{sum(t for _, t in agg.values()):.1f} us of kernel time\n")
            print("| us | launches | kernel |")
            print("|---|---|---|")
            for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"| {t:.1f} | {n:.0f} | {name[:100]} |")


if __name__ == "__main__":
    main()
