"""CUDA indexer scan (engine/kernels/indexer_cuda.py, cuda/indexer_scan.cu) vs the Triton index_scores and torch.

    python benchmarks/kernels.py --only indexer_cuda                                   # the table (once registered)
    python benchmarks/kernel_benches/indexer_cuda.py [--sweep] [--t 65536,1048576] [--m 1,6,8] [--slots random]

Shapes: the real indexer heads (H = index_n_heads, D = index_head_dim: 68 B records), T in (64K, 1M) entries
gathered by int32 slots, M in (1, 6, 8) decode queries (MXFP4-QDQ q, as the model feeds it), every entry visible.
Slots: "random" = a random permutation of the pool (bench_indexer's layout: a 68 B record at a random 4-byte
offset always spans three 32 B sectors, so HBM moves ~96 B per record and the byte floor below can reach at most
~72% of the copy bandwidth), "in order" = 0..T-1 (a request's pages in order: adjacent records share sectors).
Timing: benchmarks/gpu_timing.py (one CUDA graph of back-to-back calls, each on its own copy of the pool and
slots, copies past 4x L2: the records stream from HBM).
- CUDA: index_scores_cuda with pick_params (PDL on); "no PDL": the same shape without it;
- Triton: engine.kernels.indexer.index_scores at its defaults;
- torch: gather + unpack the records, bf16 einsum (cuBLAS), the golden's relu · w head sum (benchmarks/kernels.py
  indexer_torch in bf16).
Bytes = the floor T·(68 + 4) + 2·M·H·D + 2·M·H + 2·M·T; TB/s and % copy BW on those bytes. "tensor floor" =
the time of the M·H·D·2 flops per entry at the dense f16 mma.sync rate assumed here (MMA_TFLOPS; the kernel
is tensor-bound where it exceeds the memory floor). "!= golden" counts the scores (of M·T, one copy) that differ
from index_scores_ref (float64) for the CUDA and the Triton kernel: these random keys and weights make some
fp32 sums inexact (both kernels' exactness condition; the GPU tests' problems keep it), where the two kernels
round in different orders.

--sweep: every valid (warps, groups, stages, ctas_per_sm) per (T, M); prints the best few next to the pick.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_timing import calls_of, copies_for, copy_bandwidth, graph_time_us, sweep  # noqa: E402
from benchmarks.kernels import index_key_pools, indexer_torch  # noqa: E402
from engine.kernels.indexer import index_scores, index_scores_ref  # noqa: E402
from engine.kernels.indexer_cuda import (ScanParams, index_scores_cuda, pick_params, smem_bytes,  # noqa: E402
                                         valid_params)
from engine.presets import full_config  # noqa: E402
from engine.quant import fp4_qdq  # noqa: E402

T_VALUES = (1 << 16, 1 << 20)
M_VALUES = (1, 6, 8)
MMA_TFLOPS = 660.0  # dense f16 mma.sync on an H200 (~2/3 of the wgmma peak): the "tensor floor" column only
SWEEP = [ScanParams(w, g, s, c) for w, g, s, c in itertools.product((4, 8), (1, 2, 4), (2, 3, 4, 6), (1, 2, 3, 4))]


def _queries(m: int, h: int, d: int):
    q = fp4_qdq((torch.randn(m, h, d, device="cuda") * 2).bfloat16(), 32, "ue8m0")
    w = (torch.randn(m, h, device="cuda") * (d ** -0.5 * h ** -0.5)).bfloat16()
    return q, w


def bench(copy_bw: float, t_values=T_VALUES, m_values=M_VALUES, do_sweep: bool = False,
          layouts=("random", "in order")) -> None:
    cfg = full_config()
    h, d = cfg.index_n_heads, cfg.index_head_dim
    rec = d // 2 + d // 32
    print(f"\n## indexer_cuda: CUDA indexer scan over packed MXFP4 keys (H={h}, D={d}, {rec} B records, int32 "
          "slots; CUDA graph replay, keys from HBM)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| T | slots | M | CUDA us | no PDL us | bytes | TB/s | % copy BW | tensor floor us | Triton us "
            "| torch bf16 us | vs Triton | vs torch | != golden: CUDA / Triton | params |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    sweeps = []
    for t, layout in itertools.product(t_values, layouts):
        copies = copies_for(t * (rec + 4))
        pools, slots = index_key_pools(t, d, copies)
        if layout == "in order":
            slots = [torch.arange(t, dtype=torch.int32, device="cuda") for _ in slots]
        for m in m_values:
            q, w = _queries(m, h, d)
            vis = torch.full((m,), t, dtype=torch.int32, device="cuda")
            args = lambda i: (q, w, pools[i], slots[i], vis)  # noqa: E731
            p = pick_params(m, h, t)
            nopdl = ScanParams(p.warps, p.groups, p.stages, p.ctas_per_sm, False)
            us = graph_time_us(calls_of(lambda i: lambda: index_scores_cuda(*args(i), params=p), copies))
            us_np = graph_time_us(calls_of(lambda i: lambda: index_scores_cuda(*args(i), params=nopdl), copies))
            tri = graph_time_us(calls_of(lambda i: lambda: index_scores(*args(i)), copies))
            few = min(copies, 8)
            tor = graph_time_us(calls_of(lambda i: lambda: indexer_torch(*args(i), torch.bfloat16), few), replays=3)
            gold = index_scores_ref(*args(0))
            off_cuda = int((index_scores_cuda(*args(0), params=p) != gold).sum())
            off_tri = int((index_scores(*args(0)) != gold).sum())
            nbytes = t * (rec + 4) + 2 * m * h * d + 2 * m * h + 2 * m * t
            floor = 2 * m * h * d * t / (MMA_TFLOPS * 1e12) * 1e6
            print(f"| {t:,} | {layout} | {m} | {us:.1f} | {us_np:.1f} | {nbytes / 1e6:.2f} MB | "
                  f"{nbytes / us / 1e6:.2f} | "
                  f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {floor:.1f} | {tri:.1f} | {tor:.1f} | "
                  f"{tri / us:.1f}x | {tor / us:.1f}x | {off_cuda} / {off_tri} | "
                  f"w{p.warps} g{p.groups} s{p.stages} c{p.ctas_per_sm} |", flush=True)
            if do_sweep:
                configs = [c for c in SWEEP if valid_params(m, h, c)
                           and c.ctas_per_sm * (smem_bytes(m, h, c) + 1024) <= 227 * 1024]
                res, best = sweep(configs, f"T={t} M={m}", lambda c: graph_time_us(calls_of(
                    lambda i: lambda: index_scores_cuda(*args(i), params=c), copies)))
                sweeps.append((t, layout, m, p, us, nbytes, sorted(res.items(), key=lambda kv: kv[1])[:6]))
        pools.clear()  # free this T's copies before the next
        slots.clear()
    if do_sweep:
        print("\n### indexer_cuda --sweep: best launch shapes (warps, groups, stages, ctas/SM): us (% copy BW)\n")
        print("| T | slots | M | pick: us | best 6 |")
        print("|---|---|---|---|---|")
        for t, layout, m, p, us, nbytes, top in sweeps:
            pct = lambda x: 100 * nbytes / (x * 1e-6) / copy_bw  # noqa: E731
            cells = ", ".join(f"({c.warps},{c.groups},{c.stages},{c.ctas_per_sm}): {x:.1f} ({pct(x):.0f}%)"
                              for c, x in top)
            print(f"| {t:,} | {layout} | {m} | ({p.warps},{p.groups},{p.stages},{p.ctas_per_sm}): {us:.1f} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes")
    parser.add_argument("--t", default=",".join(map(str, T_VALUES)), help="comma-separated entry counts")
    parser.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma-separated query counts")
    parser.add_argument("--slots", default="random,in order", help="comma-separated slot layouts")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"torch {torch.__version__}")
    bench(copy_bandwidth(), tuple(int(x) for x in args.t.split(",")), tuple(int(x) for x in args.m.split(",")),
          args.sweep, tuple(args.slots.split(",")))


if __name__ == "__main__":
    main()
