"""CUDA one-launch sparse decode attention (engine/kernels/sparse_decode.py, cuda/sparse_decode.cu) vs the Triton
sparse_attn_paged and a torch baseline, at the real V4.1 shape (H 64, D 512, KW 128 FP8 rows + KM 512 FP4 rows).

    python benchmarks/kernels.py --only sparse_decode                 # the table
    python benchmarks/kernel_benches/sparse_decode.py [--sweep] [--m 1,6,16]

Pools as bench_sparse_attn's (benchmarks/kernels.py): 2^18 SWA + 2^19 main records (~290 MB), fresh random
slots per call, so the gathers come from HBM; CUDA-graph timing (benchmarks/gpu_timing.py), 32 calls per graph,
each with its own q and slot lists. Bytes = the floor M·(KW·528 + KM·288 + 4·(KW+KM) + 4·H·D) (records, slots,
q and o). "tol" = the kernel's output within the tolerance of tests/kernels/test_sparse_attention.py of the
float64 golden on the first call's inputs; "= triton" = share of outputs bitwise equal to sparse_attn_paged.

--sweep: every (heads_per_cta, splits) that fits in shared memory, with and without PDL, per M.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_timing import calls_of, copy_bandwidth, graph_time_us, sweep  # noqa: E402
from benchmarks.kernels import SPARSE_SLOTS, sparse_pools, sparse_torch_fp32  # noqa: E402
from engine.kernels.sparse_attention import sparse_attn_paged, sparse_attn_paged_ref  # noqa: E402
from engine.kernels.sparse_decode import (DecodeParams, params_fit, pick_params,  # noqa: E402
                                          sparse_attn_decode)

M_VALUES = (1, 6, 16)
H, D, KW, KM = 64, 512, 128, 512
SWA_SLOTS, MAIN_SLOTS = SPARSE_SLOTS
COPIES = 32


def _inputs(m: int):
    qs = [torch.randn(m, H, D, device="cuda").bfloat16() for _ in range(COPIES)]
    sw = [torch.randint(0, SWA_SLOTS, (m, KW), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
    mn = [torch.randint(0, MAIN_SLOTS, (m, KM), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
    return qs, sw, mn


def _name(p: DecodeParams) -> str:
    return f"hb{p.heads_per_cta} s{p.splits}" + ("" if p.pdl else " no-pdl")


def _within_tol(o, args, scale) -> bool:
    import pytest

    from tests.kernels.numeric import assert_attn_close  # the test's tolerance
    try:
        assert_attn_close(o, sparse_attn_paged_ref(*args, scale), args, scale, "bench")
    except (AssertionError, pytest.fail.Exception):
        return False
    return True


def bench(copy_bw: float, sweep_params: bool = False, m_values: tuple[int, ...] = M_VALUES) -> None:
    swa_pool, main_pool = sparse_pools(D, SWA_SLOTS, MAIN_SLOTS)
    sink = torch.randn(H, device="cuda")
    scale = D ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\n## sparse_decode: one-launch CUDA sparse MQA decode over packed pools (H={H}, D={D}, KW={KW} FP8 rows "
          f"+ KM={KM} FP4 rows; CUDA graph replay, fresh random slots per call) vs Triton sparse_attn_paged")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| M | cuda us | bytes | TB/s | % copy BW | cuda no PDL us | triton us | torch fp32 us | "
            "speedup vs triton | speedup vs torch | tol | = triton | params |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m in m_values:
        qs, sw, mn = _inputs(m)
        args = lambda i: (qs[i], swa_pool, sw[i], main_pool, mn[i], sink, scale)  # noqa: E731
        p = pick_params(m, H, KW + KM, sms)
        no_pdl = DecodeParams(p.heads_per_cta, p.splits, False)
        us = graph_time_us(calls_of(lambda i: lambda: sparse_attn_decode(*args(i), p), COPIES))
        us_np = graph_time_us(calls_of(lambda i: lambda: sparse_attn_decode(*args(i), no_pdl), COPIES))
        tri = graph_time_us(calls_of(lambda i: lambda: sparse_attn_paged(*args(i)), COPIES))
        base = graph_time_us(calls_of(lambda i: lambda: sparse_torch_fp32(*args(i)), COPIES))
        nbytes = m * (KW * (D + D // 32) + KM * (D // 2 + D // 16) + 4 * (KW + KM) + 4 * H * D)
        o = sparse_attn_decode(*args(0))
        same = (o.view(torch.int16) == sparse_attn_paged(*args(0)).view(torch.int16)).double().mean().item()
        ok = _within_tol(o, args(0)[:6], scale)
        print(f"| {m} | {us:.1f} | {nbytes / 1e6:.3f} MB | {nbytes / us / 1e6:.3f} | "
              f"{100 * nbytes / (us * 1e-6) / copy_bw:.1f}% | {us_np:.1f} | {tri:.1f} | {base:.1f} | "
              f"{tri / us:.2f}x | {base / us:.2f}x | {'ok' if ok else 'FAIL'} | {100 * same:.1f}% | {_name(p)} |",
              flush=True)
    if sweep_params:
        sweep_decode(swa_pool, main_pool, sink, scale, m_values)


def sweep_decode(swa_pool, main_pool, sink, scale, m_values) -> None:
    """Launch shapes of sparse_attn_decode, for tuning pick_params."""
    print("\n## sparse_decode sweep (us per call; auto = pick_params)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in m_values:
        qs, sw, mn = _inputs(m)
        args = lambda i: (qs[i], swa_pool, sw[i], main_pool, mn[i], sink, scale)  # noqa: E731
        auto = pick_params(m, H, KW + KM, sms)
        configs = sorted({DecodeParams(hb, s, pdl).normalised(KW + KM) for hb in (16, 32) for s in range(2, 9)
                          for pdl in (True, False)}, key=_name)
        configs = [c for c in configs if params_fit(c, H, KW + KM)]
        res, _ = sweep(configs, f"M={m}", lambda c: graph_time_us(
            calls_of(lambda i: lambda: sparse_attn_decode(*args(i), c), COPIES)))
        auto_us = res.get(auto) or graph_time_us(calls_of(lambda i: lambda: sparse_attn_decode(*args(i), auto),
                                                          COPIES))
        top = sorted(res.items(), key=lambda kv: kv[1])
        print(f"- M={m}: auto ({_name(auto)}) {auto_us:.1f} us; all: "
              + "; ".join(f"{_name(c)}: {t:.1f}" for c, t in top), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes")
    parser.add_argument("--m", help="comma-separated M values (default 1,6,16)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    m_values = tuple(int(v) for v in args.m.split(",")) if args.m else M_VALUES
    bench(copy_bandwidth(), args.sweep, m_values)


if __name__ == "__main__":
    main()
