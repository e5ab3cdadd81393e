"""Kernel benchmarks on one CUDA GPU, with the baselines measured in the same run.

    python benchmarks/kernels.py [--only NAME[,NAME...]|none] [--sweep]

NAME: fp8_linear, gumbel, sparse_attn, indexer (here) or a module of benchmarks/kernel_benches/ (moe, topk,
mhc, store, engram, sparse_prefill, fp8_gemv, bf16_gemv, sparse_decode, indexer_cuda, fp8_prefill, indexer_rows;
moe_tokens and moe_grouped: the routed experts at prefill-chunk sizes, in kernel_benches/moe.py).

Timing (all kernels and baselines alike): one CUDA graph holds many back-to-back calls, each reading
its own copy of the inputs (enough copies to exceed 4x the L2, so weights stream from HBM as in a
decode step); per-call time = median graph replay time / calls. Graphs remove host launch overhead
(a served decode step is graph-captured too) but keep each kernel's own start-up and tail.
Rates: bytes moved = the minimum traffic (each input read once, the output written once), reported
as TB/s and as % of the device-to-device copy bandwidth measured at the start of the run.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.sampler import SampleRow, sample  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.kernels.fp8_linear import (Fp8LinearConfig, fp8_linear, fp8_linear_ref, layer_shapes,  # noqa: E402
                                      pick_config)
from engine.kernels.gumbel import gumbel_argmax, gumbel_noise  # noqa: E402
from engine.kernels.indexer import index_scores  # noqa: E402
from engine.kernels.cache_records import fp4_record_bytes, swa_record_bytes, unpack_index_k  # noqa: E402
from engine.kernels.sparse_attention import gather_rows_ref, sparse_attn_paged  # noqa: E402
from engine.presets import full_config  # noqa: E402
from benchmarks.gpu_timing import calls_of, copies_for, copy_bandwidth, graph_time_us, sweep  # noqa: E402
from engine.quant import act_quant, dequant_fp8_weight, quant_fp8_weight  # noqa: E402

M_VALUES = (1, 2, 4, 8, 16, 64, 512)


# --- fp8_linear -------------------------------------------------------------------------------------------------

def fp8_shapes() -> dict[str, tuple[int, int]]:
    """One decoder layer's FP8 linears on the released config."""
    return layer_shapes(full_config())


def _weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    qw, sw = quant_fp8_weight(torch.randn(n, k, device="cuda") * 0.02)
    return [(qw.clone(), sw.clone()) for _ in range(copies)]


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device="cuda").bfloat16()


def _fp8_bytes(m: int, n: int, k: int) -> int:
    return n * k + math.ceil(n / 32) * (k // 32) + 2 * m * k + 2 * m * n


def scaled_mm_probes(n: int = 1280, k: int = 5120, m: int = 64) -> dict[str, str]:
    """Which torch._scaled_mm scalings run on this device (first line of the error otherwise)."""
    x, (qw, sw) = _x(m, k), _weights(n, k, 1)[0]
    qa, sa = act_quant(x)
    swf = sw.float()
    e8 = torch.float8_e8m0fnu
    tries = {
        "1x32 fp32 scales (these numerics)": lambda: torch._scaled_mm(
            qa, qw.t(), scale_a=sa, scale_b=swf.t().contiguous(), out_dtype=torch.bfloat16),
        "1x32 E8M0 (MXFP8)": lambda: torch._scaled_mm(
            qa, qw.t(), scale_a=sa.to(e8), scale_b=swf.repeat_interleave(32, 0).to(e8), out_dtype=torch.bfloat16),
    }
    for a_name, sa128 in (("[M,K/128]", torch.ones(m, k // 128, device="cuda")),
                          ("[M,K/128] M-major", torch.ones(k // 128, m, device="cuda").t())):
        for b_name, sb128 in (("[K/128,N/128]", torch.ones(k // 128, n // 128, device="cuda")),
                              ("[K/128,N/128] N-major", torch.ones(n // 128, k // 128, device="cuda").t()),
                              ("[N/128,K/128]", torch.ones(n // 128, k // 128, device="cuda"))):
            tries[f"1x128 x 128x128 fp32, scales {a_name} {b_name}"] = (
                lambda sa128=sa128, sb128=sb128: torch._scaled_mm(qa, qw.t(), scale_a=sa128, scale_b=sb128,
                                                                   out_dtype=torch.bfloat16))
    out = {}
    for name, f in tries.items():
        try:
            f()
            torch.cuda.synchronize()
            out[name] = "runs"
        except Exception as e:  # noqa: BLE001 - reported, not swallowed
            out[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return out


def _time_fp8(m, n, k, wts, cfg: Fp8LinearConfig | None = None) -> float:
    xs = [_x(m, k) for _ in range(4)]
    return graph_time_us(calls_of(lambda i: lambda: fp8_linear(xs[i % 4], *wts[i], cfg), len(wts)))


def bench_fp8_linear(copy_bw: float) -> None:
    print("\n## fp8_linear: torch._scaled_mm on this device")
    probes = scaled_mm_probes()
    for name, status in probes.items():
        print(f"- {name}: {status}")

    print("\n## fp8_linear: accuracy vs fp8_linear_ref")
    print("| matrix | M | elements within 1 bf16 ULP | max (err - 1 ULP)+ / S (S = Σ|a||w|) |")
    print("|---|---|---|---|")
    for name, (n, k) in fp8_shapes().items():
        qw, sw = _weights(n, k, 1)[0]
        s_w = dequant_fp8_weight(qw, sw).abs().T
        for m in (1, 64, 512):
            x = _x(m, k)
            y, ref = fp8_linear(x, qw, sw).float(), fp8_linear_ref(x, qw, sw).float()
            ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.abs().clamp_min(2.0**-100))[1] - 8)
            q, s = act_quant(x)
            big_s = (q.float() * s.repeat_interleave(32, 1)).abs() @ s_w
            err = (y - ref).abs()
            within = (err <= ulp).float().mean().item()
            print(f"| {name} | {m} | {100 * within:.3f}% | {((err - ulp).clamp_min(0) / big_s).max().item():.2e} |")

    print("\n## fp8_linear: time per call (CUDA graph replay, weights from HBM)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = "| matrix (N x K) | M | fp8_linear us | bytes | TB/s | % copy BW | cuBLAS bf16 us (TB/s) | speedup |"
    head += " _scaled_mm per-tensor us | config |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, (n, k) in fp8_shapes().items():
        wts = _weights(n, k, copies_for(n * k))
        bf = [dequant_fp8_weight(*wts[0]).bfloat16() for _ in range(copies_for(2 * n * k))]
        one = torch.ones((), device="cuda")
        for m in M_VALUES:
            us = _time_fp8(m, n, k, wts)
            nbytes = _fp8_bytes(m, n, k)
            x = _x(m, k)
            cublas = graph_time_us(calls_of(lambda i: lambda: F.linear(x, bf[i]), len(bf)))
            cublas_bytes = 2 * (n * k + m * k + m * n)
            xf8 = x.to(torch.float8_e4m3fn)
            try:
                smm = f"{graph_time_us(calls_of(lambda i: lambda: torch._scaled_mm(xf8, wts[i][0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), len(wts))):.1f}"  # noqa: E501
            except Exception as e:  # noqa: BLE001 - reported in the table
                smm = type(e).__name__
            row = (f"| {name} ({n}x{k}) | {m} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.2f} | "
                   f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {cublas:.1f} ({cublas_bytes / cublas / 1e6:.2f}) | "
                   f"{cublas / us:.2f}x | {smm} |")
            cfg = pick_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
            row += f" {_cfg_name(cfg)} |"
            print(row, flush=True)
        del wts, bf


def _cfg_name(c: Fp8LinearConfig) -> str:
    return (f"{c.block_n}x{c.block_m}x{c.block_k} split {c.split_k} w{c.num_warps} s{c.num_stages}"
            + ("" if c.fuse_quant else " prequant"))


def sweep_fp8_linear() -> None:
    """Launch shapes around the heuristic, for tuning pick_config."""
    print("\n## fp8_linear sweep (us per call; auto = pick_config)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("wq_a", "wq_b", "wkv", "wo_b"):
        n, k = fp8_shapes()[name]
        wts = _weights(n, k, copies_for(n * k))
        for m in (1, 8, 64):
            auto = pick_config(m, n, k, sms)
            results = {"auto": _time_fp8(m, n, k, wts)}
            shapes = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3),
                      (256, 128, 8, 3), (64, 128, 4, 5), (64, 64, 4, 4)]
            for bn, bk, warps, stages in shapes:
                for mult in (0.5, 1, 2):
                    split = max(1, round(auto.split_k * mult * 64 / bn))
                    cfg = Fp8LinearConfig(bn, auto.block_m, bk, split, warps, stages, True)
                    try:
                        results[_cfg_name(cfg)] = _time_fp8(m, n, k, wts, cfg)
                    except Exception as e:  # noqa: BLE001 - reported
                        print(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            pre = Fp8LinearConfig(auto.block_n, auto.block_m, auto.block_k, auto.split_k, auto.num_warps,
                                  auto.num_stages, False)
            results[_cfg_name(pre)] = _time_fp8(m, n, k, wts, pre)
            best = sorted(results.items(), key=lambda kv: kv[1])[:5]
            print(f"- {name} M={m}: auto ({_cfg_name(auto)}) {results['auto']:.1f} us; best "
                  + "; ".join(f"{c}: {t:.1f}" for c, t in best), flush=True)
        del wts
    n, k = fp8_shapes()["wq_b"]
    wts = _weights(n, k, copies_for(n * k))
    for m in (512, 4096):
        res = {}
        for bn, bm, bk, warps, stages in ((128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4),
                                          (256, 128, 64, 8, 3), (128, 256, 64, 8, 3)):
            cfg = Fp8LinearConfig(bn, bm, bk, 1, warps, stages, False)
            try:
                res[_cfg_name(cfg)] = _time_fp8(m, n, k, wts, cfg)
            except Exception as e:  # noqa: BLE001 - reported
                print(f"  wq_b M={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        print(f"- wq_b M={m} (prefill): " + "; ".join(
            f"{c}: {t:.1f} us {2 * m * n * k / t / 1e6:.0f} TFLOP/s" for c, t in sorted(res.items(), key=lambda kv: kv[1])))


# --- gumbel (sampling noise) ---------------------------------------------------------------------------------

GUMBEL_N = (1, 8, 64, 128)


def _old_cpu_generator_argmax(x: torch.Tensor, keys: list[tuple[int, int]]) -> torch.Tensor:
    """The replaced path (sampler.py before 2026-11-30): per row, float64 Gumbel noise from a CPU
    torch.Generator seeded by splitmix64(splitmix64(seed) ^ step), copied to the device, added to the
    float64 logits, argmax."""
    mask = (1 << 64) - 1

    def mix(v: int) -> int:
        v = (v + 0x9E3779B97F4A7C15) & mask
        v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & mask
        v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & mask
        return v ^ (v >> 31)

    rows = []
    for seed, step in keys:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(mix(mix(seed) ^ step))
        u = torch.rand(x.size(1), generator=gen, dtype=torch.float64).clamp_(min=torch.finfo(torch.float64).tiny)
        rows.append(-torch.log(-torch.log(u)))
    return (x.double() + torch.stack(rows).to(x.device)).argmax(dim=-1)


def _wall_ms(f: Callable[[], object], reps: int) -> float:
    f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_gumbel(copy_bw: float) -> None:
    vocab = full_config().vocab_size
    print(f"\n## gumbel: Gumbel-max sampling over V = {vocab:,} (CUDA graph replay, logits from HBM)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| N | gumbel_argmax us | logits bytes | TB/s | % copy BW | Gtoken/s | noise-only kernel us (writes 4NV B) |"
            " old CPU-generator path ms | speedup |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n in GUMBEL_N:
        nbytes = 4 * n * vocab
        copies = copies_for(nbytes)
        xs = [torch.randn(n, vocab, device="cuda") * 3 for _ in range(copies)]
        seeds = torch.arange(n, dtype=torch.int64, device="cuda") * 7919 + 1
        steps = torch.full((n,), 17, dtype=torch.int64, device="cuda")
        us = graph_time_us(calls_of(lambda i: lambda: gumbel_argmax(xs[i], seeds, steps), copies))
        noise_us = graph_time_us(calls_of(lambda i: lambda: gumbel_noise(seeds, steps, vocab), 2))
        keys = list(zip(seeds.tolist(), steps.tolist()))
        old_ms = _wall_ms(lambda: _old_cpu_generator_argmax(xs[0], keys), reps=3 if n >= 64 else 7)
        print(f"| {n} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.2f} | "
              f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {n * vocab / us / 1e3:.1f} | {noise_us:.1f} | "
              f"{old_ms:.1f} | {old_ms * 1e3 / us:,.0f}x |", flush=True)
        del xs

    print("\n## gumbel: launch shapes (us per call; default block_j 512, 4 warps)")
    for n in (1, 128):
        copies = copies_for(4 * n * vocab)
        xs = [torch.randn(n, vocab, device="cuda") * 3 for _ in range(copies)]
        seeds = torch.arange(n, dtype=torch.int64, device="cuda")
        steps = torch.zeros(n, dtype=torch.int64, device="cuda")
        res = {}
        for bj, warps in ((256, 4), (512, 4), (512, 8), (1024, 8)):
            res[f"block_j {bj} w{warps}"] = graph_time_us(calls_of(
                lambda i, bj=bj, warps=warps: lambda: gumbel_argmax(xs[i], seeds, steps, block_j=bj, num_warps=warps),
                copies))
        print(f"- N={n}: " + "; ".join(f"{c}: {t:.1f}" for c, t in res.items()), flush=True)
        del xs

    print("\n## gumbel: whole sample() at N = 128 (wall clock incl. host work and the token copy-back)")
    n = 128
    logits = torch.randn(n, vocab, device="cuda") * 3
    mixes = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature 0.8": SamplingParams(temperature=0.8),
        "top_k 50": SamplingParams(temperature=0.8, top_k=50),
        "top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
        "top_k 50 + top_p 0.95 + min_p 0.05": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    }
    print("| params (all 128 rows) | sample() ms |")
    print("|---|---|")
    for name, params in mixes.items():
        rows = [SampleRow(params, seed=1000 + i, step=5) for i in range(n)]
        print(f"| {name} | {_wall_ms(lambda: sample(logits, rows), reps=10):.2f} |", flush=True)


# --- sparse_attn (decode MQA over the packed pools) ------------------------------------------------------------

SPARSE_M = (1, 6, 32)
SPARSE_SHAPE = dict(h=64, d=512, kw=128, km=512)
SPARSE_CONFIGS = ((16, 32, 32, 4), (16, 32, 64, 4), (16, 32, 64, 8), (16, 16, 32, 4), (32, 32, 64, 8),
                  (64, 32, 64, 8), (16, 64, 128, 8))  # block_h, block_n, rows_per_split, warps


def sparse_torch_fp32(q, swa_pool, swa_idx, main_pool, main_idx, sink, scale):
    """Baseline: unpack the listed records with cache_records, then the golden's math in fp32 torch ops."""
    kv, idx = gather_rows_ref(q, swa_pool, swa_idx, main_pool, main_idx)  # bf16 [M, K, D], [M, 1, K]
    kvf = kv.float()
    logits = torch.einsum("mhd,mkd->mhk", q.float(), kvf) * scale
    logits = logits.masked_fill(idx < 0, float("-inf"))
    mx = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(logits - mx)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1) - mx)
    return (torch.einsum("mhk,mkd->mhd", p.bfloat16().float(), kvf) / denom).bfloat16()


SPARSE_SLOTS = (1 << 18, 1 << 19)  # SWA, main records: 138 MB + 151 MB at D = 512, so gathers come from HBM


def sparse_pools(d: int, swa_slots: int = SPARSE_SLOTS[0], main_slots: int = SPARSE_SLOTS[1]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed SWA (FP8) and main-KV (FP4) record pools on the GPU, with finite moderate values."""
    swa_rec, main_rec = swa_record_bytes(d), fp4_record_bytes(d, 16)
    swa_pool = torch.randint(0, 256, (swa_slots, swa_rec), dtype=torch.uint8, device="cuda")
    swa_pool[:, :d] &= 0x77  # finite E4M3 codes, moderate magnitudes
    swa_pool[:, d:] = torch.randint(120, 131, (swa_slots, d // 32), dtype=torch.uint8, device="cuda")
    main_pool = torch.randint(0, 256, (main_slots, main_rec), dtype=torch.uint8, device="cuda")
    main_pool[:, d // 2:] = torch.randint(0x30, 0x40, (main_slots, d // 16), dtype=torch.uint8, device="cuda")
    return swa_pool, main_pool


def bench_sparse_attn(copy_bw: float) -> None:
    h, d, kw, km = (SPARSE_SHAPE[k] for k in ("h", "d", "kw", "km"))
    swa_slots, main_slots = SPARSE_SLOTS
    swa_pool, main_pool = sparse_pools(d)
    sink = torch.randn(h, device="cuda")
    scale = d ** -0.5
    print(f"\n## sparse_attn: decode MQA over packed pools (H={h}, D={d}, KW={kw} FP8 rows + KM={km} FP4 rows; "
          "CUDA graph replay, fresh random slots per call)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| M | sparse_attn_paged us | bytes | TB/s | % copy BW | torch fp32 (unpack + math) us | speedup |"
            " best config (block_h, block_n, rows/split, warps): us |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m in SPARSE_M:
        copies = 32
        qs = [torch.randn(m, h, d, device="cuda").bfloat16() for _ in range(copies)]
        sw = [torch.randint(0, swa_slots, (m, kw), dtype=torch.int32, device="cuda") for _ in range(copies)]
        mn = [torch.randint(0, main_slots, (m, km), dtype=torch.int32, device="cuda") for _ in range(copies)]
        args = lambda i: (qs[i], swa_pool, sw[i], main_pool, mn[i], sink, scale)  # noqa: E731
        us = graph_time_us(calls_of(lambda i: lambda: sparse_attn_paged(*args(i)), copies))
        nbytes = m * (kw * swa_pool.size(1) + km * main_pool.size(1) + 4 * (kw + km) + 4 * h * d)  # record bytes
        base = graph_time_us(calls_of(lambda i: lambda: sparse_torch_fp32(*args(i)), copies))
        res, best = sweep(SPARSE_CONFIGS, f"M={m}", lambda c: graph_time_us(calls_of(
            lambda i: lambda: sparse_attn_paged(*args(i), block_h=c[0], block_n=c[1], rows_per_split=c[2],
                                                num_warps=c[3]), copies)))
        print(f"| {m} | {us:.1f} | {nbytes / 1e6:.3f} MB | {nbytes / us / 1e6:.3f} | "
              f"{100 * nbytes / (us * 1e-6) / copy_bw:.1f}% | {base:.1f} | {base / us:.1f}x | "
              f"{best[0]}: {best[1]:.1f} |", flush=True)
        print("  configs: " + "; ".join(f"{c}: {t:.1f}" for c, t in res.items()), flush=True)
        del qs, sw, mn


# --- indexer (lightning-indexer scores over packed MXFP4 keys) --------------------------------------------------

INDEXER_T = (1 << 16, 1 << 20)
INDEXER_M = (1, 6)
INDEXER_CONFIGS = ((64, 4, 2), (64, 4, 8), (64, 4, 16), (32, 4, 16), (128, 4, 8), (128, 8, 4), (32, 2, 32),
                   (64, 4, 1000))  # block_t, warps, programs/SM


def indexer_torch(q, w, pool, slots, visible, dtype):
    """Baseline: gather + unpack the records, einsum in `dtype`, the golden's relu * w head sum."""
    k = unpack_index_k(pool[slots.long()], q.size(-1)).to(dtype)  # [T, D]
    score = torch.einsum("mhd,td->mht", q.to(dtype), k).bfloat16()
    score = (score.relu() * w.unsqueeze(-1)).float().sum(1).bfloat16()
    t = torch.arange(k.size(0), device=q.device)
    return score.masked_fill(t >= visible.unsqueeze(-1), float("-inf"))


def index_key_pools(t: int, d: int, copies: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`copies` random MXFP4 index-key pools of t records (random E2M1 codes, UE8M0 scales 2^-7..2^3) on the GPU,
    each with a random permutation of its slots (int32)."""
    pools, slots = [], []
    for _ in range(copies):
        p = torch.randint(0, 256, (t, d // 2 + d // 32), dtype=torch.uint8, device="cuda")
        p[:, d // 2:] = torch.randint(120, 131, (t, d // 32), dtype=torch.uint8, device="cuda")
        pools.append(p)
        slots.append(torch.randperm(t, device="cuda").to(torch.int32))
    return pools, slots


def bench_indexer(copy_bw: float) -> None:
    cfg = full_config()
    h, d = cfg.index_n_heads, cfg.index_head_dim
    rec = d // 2 + d // 32
    print(f"\n## indexer: index_scores over packed MXFP4 keys (H={h}, D={d}, {rec} B records, int32 slots; "
          "CUDA graph replay, keys from HBM)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| T | M | index_scores us | bytes | TB/s | % copy BW | torch fp32 us | torch bf16 us |"
            " speedup vs best torch | best config (block_t, warps, programs/SM): us |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for t in INDEXER_T:
        copies = copies_for(t * (rec + 4))
        pools, slots = index_key_pools(t, d, copies)
        for m in INDEXER_M:
            q = (torch.randn(m, h, d, device="cuda")).bfloat16()
            w = (torch.randn(m, h, device="cuda") * 0.02).bfloat16()
            vis = torch.full((m,), t, dtype=torch.int32, device="cuda")
            args = lambda i: (q, w, pools[i], slots[i], vis)  # noqa: E731
            us = graph_time_us(calls_of(lambda i: lambda: index_scores(*args(i)), copies))
            nbytes = t * (rec + 4) + 2 * m * h * d + 2 * m * h + 2 * m * t
            few = min(copies, 8)
            f32 = graph_time_us(calls_of(lambda i: lambda: indexer_torch(*args(i), torch.float32), few), replays=3)
            b16 = graph_time_us(calls_of(lambda i: lambda: indexer_torch(*args(i), torch.bfloat16), few), replays=3)
            _, best = sweep(INDEXER_CONFIGS, f"T={t} M={m}", lambda c: graph_time_us(calls_of(
                lambda i: lambda: index_scores(*args(i), block_t=c[0], num_warps=c[1], programs_per_sm=c[2]),
                copies)))
            print(f"| {t:,} | {m} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.2f} | "
                  f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {f32:.1f} | {b16:.1f} | {min(f32, b16) / us:.1f}x | "
                  f"{best[0]}: {best[1]:.1f} ({100 * nbytes / (best[1] * 1e-6) / copy_bw:.0f}%) |", flush=True)
        del pools, slots


def _module_bench(name: str) -> Callable[[float], None]:
    """A benchmark in benchmarks/kernel_benches/<name>.py, imported when it runs."""
    return lambda bw: importlib.import_module(f"benchmarks.kernel_benches.{name}").bench(bw)


BENCHES = {"fp8_linear": bench_fp8_linear, "gumbel": bench_gumbel, "sparse_attn": bench_sparse_attn,
           "indexer": bench_indexer,
           "moe_tokens": lambda bw: importlib.import_module("benchmarks.kernel_benches.moe").bench_tokens(bw),
           "moe_grouped": lambda bw: importlib.import_module("benchmarks.kernel_benches.moe").bench_grouped(bw),
           "topk_prefill": lambda bw: importlib.import_module("benchmarks.kernel_benches.topk").bench_prefill(bw),
           **{name: _module_bench(name) for name in ("moe", "topk", "mhc", "store", "engram", "sparse_prefill", "fp8_gemv",
                                                    "bf16_gemv", "sparse_decode", "fp4_grouped",
                                                    "indexer_cuda", "fp8_prefill", "indexer_rows")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated benchmarks to run (none: only the sweeps); "
                        f"default all of {', '.join(BENCHES)}")
    parser.add_argument("--sweep", action="store_true", help="also sweep fp8_linear launch shapes")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "benchmarks/kernels.py needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"torch {torch.__version__}")
    bw = copy_bandwidth()
    if args.sweep:
        sweep_fp8_linear()
    only = list(BENCHES) if args.only is None else [n for n in args.only.split(",") if n != "none"]
    unknown = set(only) - set(BENCHES)
    assert not unknown, f"unknown benchmarks {sorted(unknown)}; known: {', '.join(BENCHES)}"
    for name in only:
        BENCHES[name](bw)


if __name__ == "__main__":
    main()
