"""bf16-weight GEMV with fp32 output (engine/kernels/bf16_gemv.py, cuda/bf16_gemv.cu) vs today's fp32 path and cuBLAS.

    python benchmarks/kernels.py --only bf16_gemv                                 # the table
    python benchmarks/kernel_benches/bf16_gemv.py [--sweep] [--shapes head] [--m 1,8]   # + launch sweep

Per fp32 linear of V4.1 (the LM head [vocab, dim] and a compressor's wkv / wgate [head_dim, dim]) and M in
(1, 2, 4, 8), all in one run with the CUDA-graph timing of benchmarks/gpu_timing.py (weights copied past 4x
L2, so each call streams from HBM):
- gemv: bf16_gemv with pick_params (with programmatic dependent launch; "no PDL": without);
- fp32 copy: today's runner path, F.linear(x.float(), w_fp32) on a cached fp32 copy of the weight;
- cuBLAS: torch.mm(x, w.T, out_dtype=torch.float32), bf16 inputs, fp32 accumulation and output.
Bytes = the bf16 minimum traffic 2·N·K + 2·M·K + 4·M·N (the fp32 path reads 4·N·K; its TB/s is on its own
bytes). "max err" = max |y - ref| / (2^-22 · Σ|x w|) over the outputs (the test's bound is 1).

--sweep: stage 1 times (warps_n, warps_k, splits) at row_tiles 2, unroll 4; stage 2 times the compiled
(row_tiles, unroll) instances at the stage-1 winner; it prints the best few per (matrix, M) next to
pick_params's choice.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_timing import calls_of, copies_for, gemv_bench_main, graph_time_us, sweep  # noqa: E402
from engine.kernels.bf16_gemv import (INSTANCES, GemvParams, bf16_gemv, bf16_gemv_ref,  # noqa: E402
                                      pick_params, smem_bytes)
from engine.presets import full_config  # noqa: E402

M_VALUES = (1, 2, 4, 8)
WARP_SHAPES = ((8, 1), (4, 2), (2, 4), (1, 8), (4, 1), (2, 2), (1, 4))
SPLITS = (1, 2, 3, 4, 6, 8)


def shapes() -> dict[str, tuple[int, int]]:
    cfg = full_config()
    return {"head": (cfg.vocab_size, cfg.dim), "compressor": (cfg.head_dim, cfg.dim)}


def _weights(n: int, k: int, copies: int) -> list[torch.Tensor]:
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    return [w] + [w.clone() for _ in range(copies - 1)]


def _xs(m: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(m, k, device="cuda").bfloat16() for _ in range(4)]


def _bytes(m: int, n: int, k: int) -> int:
    return 2 * n * k + 2 * m * k + 4 * m * n


def _name(p: GemvParams) -> str:
    return f"rt{p.row_tiles} u{p.unroll} {p.warps_n}x{p.warps_k}w s{p.splits}" + ("" if p.pdl else " no-pdl")


def _time_gemv(xs, wts, p: GemvParams | None) -> float:
    return graph_time_us(calls_of(lambda i: lambda: bf16_gemv(xs[i % 4], wts[i], p), len(wts)))


def _max_err(x: torch.Tensor, w: torch.Tensor) -> float:
    y, ref = bf16_gemv(x, w).double(), bf16_gemv_ref(x, w).double()
    bound = 2.0**-22 * (x.double().abs() @ w.double().abs().T) + 2.0**-100
    return ((y - ref).abs() / bound).max().item()


def bench(copy_bw: float, sweep_params: bool = False, names: tuple[str, ...] | None = None,
          m_values: tuple[int, ...] = M_VALUES) -> None:
    todo = {nm: s for nm, s in shapes().items() if names is None or nm in names}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\n## bf16_gemv: bf16-weight GEMV, fp32 out (LM head, compressor) vs fp32-copy F.linear and cuBLAS "
          "bf16->fp32 (CUDA graph replay)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| matrix (N x K) | M | gemv us | bytes | TB/s | % copy BW | gemv no PDL us | fp32 copy us (TB/s) | "
            "cuBLAS bf16->fp32 us (TB/s) | speedup vs fp32 copy | speedup vs cuBLAS | max err / bound | params |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, (n, k) in todo.items():
        wts = _weights(n, k, copies_for(2 * n * k))
        for m in m_values:
            xs = _xs(m, k)
            p = pick_params(m, n, k, sms).normalised(k)
            us = _time_gemv(xs, wts, p)
            no_pdl = _time_gemv(xs, wts, dataclasses.replace(p, pdl=False))
            cub = graph_time_us(calls_of(
                lambda i: lambda: torch.mm(xs[i % 4], wts[i].t(), out_dtype=torch.float32), len(wts)))
            err = _max_err(xs[0], wts[0])
            nbytes = _bytes(m, n, k)
            f32_copies = copies_for(4 * n * k)
            w32 = [wts[0].float() for _ in range(f32_copies)]
            f32 = graph_time_us(calls_of(lambda i: lambda: F.linear(xs[i % 4].float(), w32[i]), len(w32)))
            del w32
            f32_bytes = 4 * n * k + 4 * m * k + 4 * m * n
            print(f"| {name} ({n}x{k}) | {m} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.2f} | "
                  f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {no_pdl:.1f} | "
                  f"{f32:.1f} ({f32_bytes / f32 / 1e6:.2f}) | {cub:.1f} ({nbytes / cub / 1e6:.2f}) | "
                  f"{f32 / us:.2f}x | {cub / us:.2f}x | {err:.3f} | {_name(p)} |", flush=True)
            torch.cuda.empty_cache()
        del wts
        torch.cuda.empty_cache()
    if sweep_params:
        sweep_gemv(todo, m_values if len(m_values) <= 2 else (1, 8))


def sweep_gemv(todo: dict[str, tuple[int, int]], m_values: tuple[int, ...]) -> None:
    """Launch shapes of bf16_gemv, for tuning pick_params."""
    print("\n## bf16_gemv sweep (us per call; auto = pick_params)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in todo.items():
        wts = _weights(n, k, copies_for(2 * n * k))
        for m in m_values:
            xs = _xs(m, k)
            auto = pick_params(m, n, k, sms).normalised(k)
            stage1 = {GemvParams(2, 4, wn, wk, s).normalised(k) for wn, wk in WARP_SHAPES for s in SPLITS}
            stage1 = sorted((p for p in stage1 if smem_bytes(k, p) <= 200 * 1024), key=_name)
            res, (best, _) = sweep(stage1, f"{name} M={m}", lambda p: _time_gemv(xs, wts, p))
            if best is not None:
                stage2 = [GemvParams(rt, u, best.warps_n, best.warps_k, best.splits) for rt, u in INSTANCES]
                res |= sweep(stage2, f"{name} M={m}", lambda p: _time_gemv(xs, wts, p))[0]
            auto_us = res.get(auto) or _time_gemv(xs, wts, auto)
            nbytes = _bytes(m, n, k)
            top = sorted(res.items(), key=lambda kv: kv[1])[:6]
            print(f"- {name} M={m}: auto ({_name(auto)}) {auto_us:.1f} us ({nbytes / auto_us / 1e6:.2f} TB/s); best "
                  + "; ".join(f"{_name(p)}: {t:.1f}" for p, t in top), flush=True)
        del wts
        torch.cuda.empty_cache()


def main() -> None:
    gemv_bench_main(bench, __doc__.splitlines()[0], "head, compressor (default: both)", M_VALUES)

if __name__ == "__main__":
    main()
