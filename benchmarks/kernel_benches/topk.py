"""Indexer top-k (index_topk, k = index_topk) and candidate-block selection (candidate_block_mask /
candidate_blocks, full config) vs torch in the same run.

Bytes = the bf16 scores read once (2·M·T, the floor); the kernels make 4 passes (plus a block-max pass
for the candidates), re-reading the scores from L2 when they fit. Torch baselines: the golden path
(torch.sort(stable=True), sort of the ids, gather, where: index_topk_ref / candidate_blocks_ref) and
plain torch.topk on the bf16 scores (not tie-exact; for candidates: amax over blocks + torch.topk).
index_topk "keys" is the int64-key + torch.topk variant of the same exact selection.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_timing import calls_of, copies_for, graph_time_us, sweep
from engine.kernels.topk import (BIG_CHUNK, BIG_SCORES, BIG_WARPS, BLOCK_ROW_MAX_T, CHUNK, ROW_MAX_T,
                                 candidate_block_mask, candidate_blocks, candidate_blocks_ref, index_topk, index_topk_ref)
from engine.presets import full_config

SHAPES_T = (1 << 14, 1 << 17, 1 << 20)
SHAPES_M = (1, 6)
# (chunk, num_warps, row_max_t): row_max_t 0 = multi-program radix select, 2^30 = one program per row
CONFIGS = [(c, w, r) for c in (512, 1024, 2048) for w in (4, 8) for r in (0, 1 << 30)]  # swept on random data
DEVICE = "cuda"


def _scores(m: int, t: int, data: str) -> torch.Tensor:
    if data == "random":
        return torch.randn(m, t, device=DEVICE).bfloat16()
    vals = torch.tensor([-1.0, 0.5, 2.0], device=DEVICE).bfloat16()  # "few": crowded threshold bins
    return vals[torch.randint(0, 3, (m, t), device=DEVICE)]


def _torch_topk(s: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(s, min(k, s.size(-1)), dim=-1).indices


def _torch_blocks(s: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    blocks = s.unflatten(-1, (-1, block)).amax(-1)
    return torch.topk(blocks, min(topk_blocks, blocks.size(-1)), dim=-1).indices


def _row(name: str, t: int, m: int, data: str, us: float, nbytes: int, copy_bw: float, base: dict[str, float],
         variant: float, best: tuple) -> None:
    cols = " | ".join(f"{v:.1f}" for v in base.values())
    print(f"| {name} | {t:,} | {m} | {data} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.3f} | "
          f"{100 * nbytes / (us * 1e-6) / copy_bw:.1f}% | {cols} | {min(base.values()) / us:.1f}x | {variant:.1f} | "
          f"{best[0]}: {best[1]:.1f} |", flush=True)


def bench(copy_bw: float) -> None:
    cfg = full_config()
    k, kb, blk = cfg.index_topk, cfg.candidate_topk_blocks, cfg.candidate_block_size
    print(f"\n## topk: exact indexer top-{k} and candidate blocks ({kb} blocks of {blk}); CUDA graph replay")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write); defaults: chunk {CHUNK}, "
          f"8 warps (index_topk from {BIG_SCORES:,} scores: chunk {BIG_CHUNK}, {BIG_WARPS} warps), one program per "
          f"row up to {ROW_MAX_T:,} entries ({BLOCK_ROW_MAX_T:,} blocks for the candidates)\n")
    head = ("| op | T | M | data | ours us | bytes (scores once) | TB/s | % copy BW | torch golden (stable sort) us |"
            " torch.topk (not exact) us | speedup vs best torch | our variant us (index_topk: method='keys'; "
            "candidates: bool [M, T] output) | best (chunk, warps, row_max_t): us |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for t in SHAPES_T:
        for m in SHAPES_M:
            for data in ("random", "few"):
                nbytes = 2 * m * t
                copies = copies_for(nbytes)
                ss = [_scores(m, t, data) for _ in range(copies)]
                vis = torch.full((m,), t, dtype=torch.int32, device=DEVICE)
                few = min(copies, 8)

                def time_of(f, n=copies, replays=10):
                    return graph_time_us(calls_of(lambda i: lambda: f(ss[i]), n), replays=replays)

                us = time_of(lambda s: index_topk(s, k))
                base = {"golden": time_of(lambda s: index_topk_ref(s, k), few, 3),
                        "topk": time_of(lambda s: _torch_topk(s, k), few, 3)}
                variant = time_of(lambda s: index_topk(s, k, method="keys"), few, 3)
                _, best = sweep(CONFIGS if data == "random" else [], f"index_topk T={t} M={m}", lambda c: time_of(
                    lambda s: index_topk(s, k, chunk=c[0], num_warps=c[1], row_max_t=c[2])))
                _row("index_topk", t, m, data, us, nbytes, copy_bw, base, variant, best)

                us = time_of(lambda s: candidate_block_mask(s, vis, kb, blk))
                base = {"golden": time_of(lambda s: candidate_blocks_ref(s, vis, kb, blk), few, 3),
                        "topk": time_of(lambda s: _torch_blocks(s, kb, blk), few, 3)}
                variant = time_of(lambda s: candidate_blocks(s, vis, kb, blk), few, 3)
                _, best = sweep(CONFIGS if data == "random" else [], f"candidate_block_mask T={t} M={m}", lambda c: time_of(
                    lambda s: candidate_block_mask(s, vis, kb, blk, chunk=c[0], num_warps=c[1], row_max_t=c[2])))
                _row("candidate_block_mask", t, m, data, us, nbytes, copy_bw, base, variant, best)
                del ss


# A prefill chunk's top-k: M queries of one request against T entries (1M and 128K contexts at ratio 2, as
# kernel_ops.score_rows splits a 16K chunk's scores into 512 MiB passes)
PREFILL_SHAPES = ((512, 1 << 19), (2048, 1 << 16), (8192, 1 << 14))
# (chunk, num_warps, row_max_t): row_max_t 0 = multi-program radix select, 2^30 = one program per row
PREFILL_CONFIGS = ([(c, w, 0) for c in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]
                   + [(c, w, 1 << 30) for c in (2048, 4096, 8192) for w in (8, 16)])


def _pass_times_us(fn) -> dict[str, float]:
    """Each kernel's GPU time in one call of fn (torch.profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in trace.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("_kernel")[0].lstrip("_")[:40]
            per[name] = per.get(name, 0.0) + e.time_range.end - e.time_range.start
    return per


def bench_prefill(copy_bw: float) -> None:
    """index_topk at a prefill pass's shapes: the default launch, its passes, and a launch sweep."""
    from benchmarks.gpu_timing import eager_time_us  # noqa: PLC0415

    k = full_config().index_topk
    print(f"\n## topk_prefill: index_topk (top-{k}) of a prefill pass's scores; us, eager; bytes = scores once")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    print("| M | T | default us | TB/s (scores once) | its kernels (us) | best (chunk, warps, row_max_t): us | sweep |")
    print("|---|---|---|---|---|---|---|")
    for m, t in PREFILL_SHAPES:
        s = torch.randn(m, t, device=DEVICE).bfloat16()
        s[:, t - m // 2:] = float("-inf")  # the last entries are not yet visible to the chunk's early queries
        us = eager_time_us(lambda: index_topk(s, k), reps=5)
        parts = _pass_times_us(lambda: index_topk(s, k))
        runs, (best, best_us) = sweep(PREFILL_CONFIGS, f"index_topk M={m} T={t}", lambda c: eager_time_us(
            lambda: index_topk(s, k, chunk=c[0], num_warps=c[1], row_max_t=c[2]), reps=3))
        print(f"| {m:,} | {t:,} | {us:,.0f} | {2 * m * t / us / 1e6:.2f} | "
              + ", ".join(f"{n} {v:,.0f}" for n, v in parts.items())
              + f" | {best}: {best_us:,.0f} | " + ", ".join(f"{c}: {v:,.0f}" for c, v in runs.items()) + " |",
              flush=True)
        del s
