"""FP8 linears at prefill M (issue 23): the engine's path against the Triton kernel's prefill shape and cuBLAS bf16.

    python benchmarks/kernels.py --only fp8_prefill

Per FP8 linear of one released layer (engine.kernels.fp8_linear.layer_shapes) and M in (64, 128, 512, 4096), with
the CUDA-graph timing of benchmarks/gpu_timing.py (weights copied past 4x L2 where they fit, so calls stream them
from HBM):
- auto: fp8_linear as the engine calls it (from DEQUANT_MIN_M rows: act QDQ + the weight dequantised to bf16 +
  one cuBLAS GEMM, `dequant_linear`; below: the Triton kernel);
- triton: the Triton kernel at pick_config's shape;
- cuBLAS bf16: F.linear on an already-dequantised bf16 weight (the issue's baseline: the same math without the
  FP8 storage), and its TFLOP/s;
- speedup = cuBLAS bf16 / auto (target: >= 1.0x at M = 64, >= 1.5x at M >= 512).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import calls_of, copies_for, graph_time_us
from engine.kernels.fp8_linear import DEQUANT_MIN_M, fp8_linear, layer_shapes, pick_config
from engine.presets import full_config
from engine.quant import dequant_fp8_weight, quant_fp8_weight

M_VALUES = (64, 128, 512, 4096)


def bench(copy_bw: float) -> None:
    del copy_bw  # compute-bound shapes: no bandwidth column
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\n## fp8_linear at prefill M (auto = dequantised weight + cuBLAS from M = {DEQUANT_MIN_M})")
    print("| matrix (N x K) | M | auto us | triton us | cuBLAS bf16 us (TFLOP/s) | cuBLAS / auto | cuBLAS / triton |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in layer_shapes(full_config()).items():
        copies = min(copies_for(2 * n * k), 16)  # the bf16 copies are the larger set
        qw, sw = quant_fp8_weight(torch.randn(n, k, device="cuda") * 0.02)
        wts = [(qw.clone(), sw.clone()) for _ in range(copies)]
        bf = [dequant_fp8_weight(qw, sw).bfloat16() for _ in range(copies)]
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda").bfloat16()
            cfg = pick_config(m, n, k, sms)
            auto = graph_time_us(calls_of(lambda i: lambda: fp8_linear(x, *wts[i]), copies))
            triton_us = graph_time_us(calls_of(lambda i: lambda: fp8_linear(x, *wts[i], cfg), copies))
            cublas = graph_time_us(calls_of(lambda i: lambda: F.linear(x, bf[i]), copies))
            tflops = 2 * m * n * k / cublas / 1e6
            print(f"| {name} ({n}x{k}) | {m} | {auto:.1f} | {triton_us:.1f} | {cublas:.1f} ({tflops:.0f}) | "
                  f"{cublas / auto:.2f}x | {cublas / triton_us:.2f}x |", flush=True)
        del wts, bf
