"""Sparse MQA prefill attention over the packed pools (engine/kernels/sparse_prefill.py) on one GPU.

    python benchmarks/kernels.py --only sparse_prefill

Shape from full_config(): H = 64 heads x D = 512, KW = 128 window rows (FP8 SWA records, 528 B) + KM = 512
top-k rows (FP4 main-KV records, 288 B) per query. Two slot patterns:
- request: one request's prefill chunk: query i's window is the 128 consecutive slots ending at its own
  position in a 16,384-slot window pool; its top-k are 512 random slots of a 65,536-entry compressed KV
  (a 128K-token context at ratio 2). Both pools (27 MB) fit in L2, as one request's caches do.
- scattered: uniform random slots into 138 MB + 151 MB pools (the decode benchmark's pattern): the
  records come from HBM.
Timing: benchmarks.gpu_timing.graph_time_us (calls captured back to back in one CUDA graph, each with its
own q and slot lists). Bytes = the floor: records once per query + int32 slots + q + o. FLOPs =
4·M·H·(KW+KM)·D (one QK and one PV; the kernel does QK twice to round P with the final max), as a
share of the measured ~790 TFLOP/s dense bf16 peak. Baselines in the same run: the decode split kernel
`sparse_attn_paged` (defaults) and torch (gather + cache_records unpack, then matmuls; chunks of 512 queries)
with bf16 MMAs (fp32 softmax) and with fp32 MMAs.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_timing import graph_time_us, sweep
from engine.kernels.sparse_attention import gather_rows_ref, sparse_attn_paged
from engine.kernels.sparse_prefill import DECODE_MAX_M, sparse_attn_prefill
from engine.presets import full_config

PREFILL_M = (512, 2048, 8192)
CROSSOVER_M = (8, 16, 32, 64, 128, 256)
PEAK_BF16 = 790e12  # dense bf16 matmul measured on the H200 (shared/spec/environment.md)
# block_h, block_n, num_warps, num_stages, prefetch; the first is sparse_attn_prefill's default
CONFIGS = ((64, 32, 8, 1, True), (64, 32, 8, 1, False), (64, 16, 8, 1, True), (64, 16, 8, 1, False),
           (64, 64, 8, 1, True), (64, 32, 8, 2, True), (64, 32, 8, 3, False), (64, 32, 16, 1, True),
           (64, 64, 16, 2, False), (32, 32, 8, 1, True), (32, 32, 4, 2, False), (16, 32, 4, 1, True))
TORCH_CHUNK = 512


def _shape() -> tuple[int, int, int, int]:
    cfg = full_config()
    return cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.index_topk


def _pools(swa_slots: int, main_slots: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random records with finite codes and moderate scales (as the decode benchmark)."""
    swa = torch.randint(0, 256, (swa_slots, d + d // 32), dtype=torch.uint8, device="cuda")
    swa[:, :d] &= 0x77
    swa[:, d:] = torch.randint(120, 131, (swa_slots, d // 32), dtype=torch.uint8, device="cuda")
    main = torch.randint(0, 256, (main_slots, d // 2 + d // 16), dtype=torch.uint8, device="cuda")
    main[:, d // 2:] = torch.randint(0x30, 0x40, (main_slots, d // 16), dtype=torch.uint8, device="cuda")
    return swa, main


def _slots(pattern: str, m: int, kw: int, km: int, swa_slots: int, main_slots: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if pattern == "request":
        pos = 50_000 + seed * m + torch.arange(m, device="cuda")  # the chunk's absolute positions
        sw = (pos[:, None] - kw + 1 + torch.arange(kw, device="cuda")) % swa_slots
    else:
        sw = torch.randint(0, swa_slots, (m, kw), generator=g, device="cuda")
    mn = torch.randint(0, main_slots, (m, km), generator=g, device="cuda")
    return sw.to(torch.int32).contiguous(), mn.to(torch.int32).contiguous()


def _torch_attn(q, swa_pool, swa_idx, main_pool, main_idx, sink, scale, mm_dtype):
    """Baseline: per chunk of queries, gather + unpack the rows, then the golden's math in torch."""
    out = torch.empty_like(q)
    for c in range(0, q.size(0), TORCH_CHUNK):
        sl = slice(c, c + TORCH_CHUNK)
        kv, idx = gather_rows_ref(q[sl], swa_pool, swa_idx[sl], main_pool, main_idx[sl])  # [C, K, D], [C, 1, K]
        kv = kv.to(mm_dtype)
        logits = torch.matmul(q[sl].to(mm_dtype), kv.transpose(1, 2)).float() * scale  # [C, H, K]
        logits = logits.masked_fill(idx < 0, float("-inf"))
        mx = logits.amax(-1, keepdim=True).clamp_min(-1e30)
        p = torch.exp(logits - mx)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1) - mx)
        out[sl] = (torch.matmul(p.bfloat16().to(mm_dtype), kv).float() / denom).bfloat16()
    return out


def _timer(m: int, args_of, copies: int):
    """us per call of f(*args_of(i)) for call sites i; fewer calls and replays at large M (each call is
    milliseconds and moves more than 4x the L2 on its own)."""
    n_calls, replays = (32, 10) if m <= 512 else (8, 5) if m <= 2048 else (4, 3)

    def time_us(f, n: int | None = None) -> float:
        return graph_time_us([lambda i=i: f(*args_of(i % copies)) for i in range(n or n_calls)], replays=replays)
    return time_us


def _row(pattern, m, h, d, kw, km, copy_bw, swa_pool, main_pool, sink, do_sweep: bool) -> None:
    copies = 2 if m > 512 else 8
    qs = [torch.randn(m, h, d, device="cuda").bfloat16() for _ in range(copies)]
    idx = [_slots(pattern, m, kw, km, swa_pool.size(0), main_pool.size(0), seed=i) for i in range(copies)]
    scale = d ** -0.5
    args_of = lambda i: (qs[i], swa_pool, idx[i][0], main_pool, idx[i][1], sink, scale)  # noqa: E731
    time_us = _timer(m, args_of, copies)
    us = time_us(sparse_attn_prefill)
    nbytes = m * (kw * (d + d // 32) + km * (d // 2 + d // 16) + 4 * (kw + km) + 4 * h * d)
    flops = 4 * m * h * (kw + km) * d
    dec = time_us(sparse_attn_paged, n=2 if m > 2048 else None)  # 10.7 GB of split partials per call at 8192
    t_bf16 = time_us(lambda *a: _torch_attn(*a, torch.bfloat16))
    t_f32 = time_us(lambda *a: _torch_attn(*a, torch.float32))
    best = "-"
    if do_sweep:
        res, (cfg, t) = sweep(CONFIGS, f"{pattern} M={m}", lambda c: time_us(
            lambda *a: sparse_attn_prefill(*a, block_h=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3],
                                           prefetch=c[4])))
        best = f"{cfg}: {t:.1f}"
        print("  configs (block_h, block_n, warps, stages, prefetch): "
              + "; ".join(f"{c}: {v:.1f}" for c, v in res.items()))
    print(f"| {pattern} | {m} | {us:.1f} | {nbytes / 1e6:.1f} MB | {nbytes / us / 1e6:.2f} | "
          f"{100 * nbytes / (us * 1e-6) / copy_bw:.1f}% | {flops / us / 1e6:.1f} | "
          f"{100 * flops / (us * 1e-6) / PEAK_BF16:.1f}% | "
          f"{dec:.1f} | {t_bf16:.1f} | {t_f32:.1f} | {min(dec, t_bf16, t_f32) / us:.2f}x | {best} |", flush=True)
    del qs, idx


def bench(copy_bw: float) -> None:
    h, d, kw, km = _shape()
    sink = torch.randn(h, device="cuda")
    print(f"\n## sparse_prefill: prefill MQA over packed pools (H={h}, D={d}, KW={kw} FP8 rows + KM={km} FP4 rows; "
          "CUDA graph replay)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write); "
          f"bf16 peak taken as {PEAK_BF16 / 1e12:.0f} TFLOP/s\n")
    head = ("| slots | M | sparse_attn_prefill us | bytes | TB/s | % copy BW | TFLOP/s | % bf16 peak | "
            "decode kernel us | torch bf16-MMA us | torch fp32 us | speedup vs best baseline | "
            "best config (block_h, block_n, warps, stages, prefetch): us |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    req_swa, req_main = _pools(1 << 14, 1 << 16, d)
    for m in PREFILL_M:
        _row("request", m, h, d, kw, km, copy_bw, req_swa, req_main, sink, do_sweep=True)
    big_swa, big_main = _pools(1 << 18, 1 << 19, d)
    _row("scattered", 2048, h, d, kw, km, copy_bw, big_swa, big_main, sink, do_sweep=False)

    print(f"\n## sparse_prefill: decode kernel vs prefill kernel at small M (scattered slots; defaults; "
          f"sparse_attn dispatches to the decode kernel for M <= {DECODE_MAX_M})\n")
    print("| M | decode sparse_attn_paged us | prefill sparse_attn_prefill us | faster |")
    print("|---|---|---|---|")
    for m in CROSSOVER_M:
        copies = 32
        qs = [torch.randn(m, h, d, device="cuda").bfloat16() for _ in range(copies)]
        idx = [_slots("scattered", m, kw, km, big_swa.size(0), big_main.size(0), seed=i) for i in range(copies)]
        args_of = lambda i: (qs[i], big_swa, idx[i][0], big_main, idx[i][1], sink, d ** -0.5)  # noqa: E731
        time_us = _timer(m, args_of, copies)
        t_dec, t_pre = time_us(sparse_attn_paged), time_us(sparse_attn_prefill)
        print(f"| {m} | {t_dec:.1f} | {t_pre:.1f} | {'prefill' if t_pre < t_dec else 'decode'} |", flush=True)
        del qs, idx
