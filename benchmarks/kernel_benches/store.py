"""RoPE, the fused quantise-and-store kernels and the ratio-2 compressor on the released shapes
(head_dim 512, rope dim 64, index dim 128), N = 1, 6, 4096 rows, each next to the torch path timed in the
same run: the golden's ops in fp32 torch (RMSNorm, complex RoPE, softmax pooling) + engine.kernels.paged
packing (cache_records), as the runner does today.

Bytes = minimum traffic: inputs read once (rows, slots, positions, the table rows used), records / outputs
written once. Per-call time from CUDA-graph replays, inputs and pools in enough copies to exceed 4x L2.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_timing import calls_of, copies_for, graph_time_us
from engine.kernels import paged
from engine.kernels.cache_records import fp4_record_bytes, swa_record_bytes
from engine.kernels.cache_store import store_index_k_fused, store_main_kv, store_swa_fused
from engine.kernels.compressor import Ratio2Chunk, compress_ratio2, plan_ratio2, store_index_keys
from engine.kernels.rope import apply_rope, rope_table
from engine.model.rope import RotaryTable
from engine.presets import full_config

N_VALUES = (1, 6, 4096)
TABLE_LEN = 1 << 17
DEVICE = "cuda"  # a CPU dry run (TRITON_INTERPRET=1) patches this and the timing helpers


# --- the torch path (golden-style fp32 ops + paged packing) ----------------------------------------------------

def _norm_t(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).bfloat16()


def _rope_t(x: torch.Tensor, cis: torch.Tensor, rd: int) -> torch.Tensor:
    """x bf16 [N, ..., D], cis complex64 [N, rd/2] (broadcast over the middle dims) -> bf16, last rd rotated."""
    while cis.dim() < x.dim():
        cis = cis.unsqueeze(-2)
    tail = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    return torch.cat([x[..., :-rd], torch.view_as_real(tail * cis).flatten(-2).bfloat16()], dim=-1)


def _compress_t(kv, score, pkv, psc, src0, src1, w, eps, cis, rd, pool, slots):
    pend = (src0 < 0)[:, None]
    i0, ps = src0.clamp_min(0), (-src0 - 1).clamp_min(0)
    k0 = torch.where(pend, pkv[ps, 0], kv[i0])
    s0 = torch.where(pend, psc[ps, 0], score[i0])
    wts = torch.stack([s0, score[src1]]).softmax(0)
    pooled = (torch.stack([k0, kv[src1]]) * wts).sum(0).bfloat16()
    latent = _norm_t(pooled, w, eps)
    paged.store_main_kv(pool, slots, _rope_t(latent, cis, rd))
    return latent


# --- helpers --------------------------------------------------------------------------------------------------

def _row(name: str, n: int, us: float, nbytes: int, torch_us: float, copy_bw: float) -> str:
    return (f"| {name} | {n} | {us:.2f} | {nbytes / 1e6:.3f} MB | {nbytes / us / 1e6:.2f} | "
            f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {torch_us:.2f} | {torch_us / us:.2f}x |")


def _pools(n: int, rec: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(max(n, 1), rec, dtype=torch.uint8, device=DEVICE),
             torch.randperm(n, device=DEVICE)) for _ in range(copies)]


def bench(copy_bw: float) -> None:
    cfg = full_config()
    d, di, rd, eps = cfg.head_dim, cfg.index_head_dim, cfg.rope_head_dim, cfg.norm_eps
    rot = RotaryTable(rd, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast,
                      cfg.beta_slow)
    table = rope_table(rot, DEVICE, TABLE_LEN)
    cis_all = torch.view_as_complex(table.cs)  # complex64 [L, rd/2], the same values
    w_kv = (1 + 0.1 * torch.randn(d, device=DEVICE)).bfloat16()
    w_k = (1 + 0.1 * torch.randn(di, device=DEVICE)).bfloat16()
    wk = (torch.randn(di, d, device=DEVICE) * d ** -0.5).bfloat16()
    swa_rec, main_rec, idx_rec = swa_record_bytes(d), fp4_record_bytes(d, 16), fp4_record_bytes(di, 32)
    print("\n## store: RoPE, fused quantise-and-store, ratio-2 compressor (full shapes)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = "| op | N | kernel us | bytes | TB/s | % copy BW | torch path us | speedup |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n in N_VALUES:
        pos = torch.randint(0, TABLE_LEN, (n,), device=DEVICE)
        cis = cis_all[pos]
        tab_bytes = n * rd * 4 + 8 * n  # table rows + positions

        # window KV: RMSNorm -> RoPE -> FP8 record
        nbytes = 2 * n * d + n * swa_rec + 8 * n + tab_bytes
        copies = copies_for(nbytes)
        xs = [torch.randn(n, d, device=DEVICE).bfloat16() for _ in range(copies)]
        pools = _pools(n, swa_rec, copies)
        us = graph_time_us(calls_of(lambda i: lambda: store_swa_fused(xs[i], w_kv, eps, pos, table, *pools[i]), copies))
        t_us = graph_time_us(calls_of(lambda i: lambda: paged.store_swa(
            pools[i][0], pools[i][1], _rope_t(_norm_t(xs[i], w_kv, eps), cis, rd)), copies))
        print(_row("store_swa_fused (norm+rope+FP8)", n, us, nbytes, t_us, copy_bw), flush=True)

        # main KV from a pre-RoPE latent: RoPE -> NVFP4 record
        nbytes = 2 * n * d + n * main_rec + 8 * n + tab_bytes
        pools = _pools(n, main_rec, copies)
        us = graph_time_us(calls_of(lambda i: lambda: store_main_kv(*pools[i], xs[i], pos, table), copies))
        t_us = graph_time_us(calls_of(lambda i: lambda: paged.store_main_kv(
            pools[i][0], pools[i][1], _rope_t(xs[i], cis, rd)), copies))
        print(_row("store_main_kv (rope+NVFP4)", n, us, nbytes, t_us, copy_bw), flush=True)

        # index keys after wk: k_norm -> RoPE -> MXFP4 record
        nbytes = 2 * n * di + n * idx_rec + 8 * n + tab_bytes
        ks = [torch.randn(n, di, device=DEVICE).bfloat16() for _ in range(copies)]
        pools = _pools(n, idx_rec, copies)
        us = graph_time_us(calls_of(lambda i: lambda: store_index_k_fused(ks[i], w_k, eps, pos, table, *pools[i]),
                                    copies))
        t_us = graph_time_us(calls_of(lambda i: lambda: paged.store_index_k(
            pools[i][0], pools[i][1], _rope_t(_norm_t(ks[i], w_k, eps), cis, rd)), copies))
        print(_row("store_index_k_fused (norm+rope+MXFP4)", n, us, nbytes, t_us, copy_bw), flush=True)
        del xs, ks, pools

        # queries: RoPE in place on q [N, 64, 512] (only the rotated tail moves)
        h = cfg.n_heads
        nbytes = 2 * 2 * n * h * rd + tab_bytes
        qcopies = copies_for(2 * n * h * d)
        qs = [torch.randn(n, h, d, device=DEVICE).bfloat16() for _ in range(qcopies)]
        us = graph_time_us(calls_of(lambda i: lambda: apply_rope(qs[i], pos, table, inplace=True), qcopies))

        def rope_torch(q):
            q[..., -rd:] = _rope_t(q[..., -rd:], cis, rd)
        t_us = graph_time_us(calls_of(lambda i: lambda: rope_torch(qs[i]), qcopies))
        print(_row(f"apply_rope in place (q, H={h})", n, us, nbytes, t_us, copy_bw), flush=True)
        del qs

        # ratio-2 compressor: N=4096 one prefill chunk from position 0; N=1, 6 decode steps of as many
        # requests, each completing its pending group (odd positions)
        if n >= 2 * 64:
            chunks = [Ratio2Chunk(0, n, 0, 0)]
        else:
            chunks = [Ratio2Chunk(r, 1, 2 * (100 + 37 * r) + 1, r) for r in range(n)]
        plan = plan_ratio2(chunks, DEVICE)
        g = plan.num_groups
        items = plan.items
        gcis = cis_all[plan.positions]
        pkv = torch.randn(n, 2, d, device=DEVICE)
        psc = torch.randn(n, 2, d, device=DEVICE)
        pend_reads = int((items[:, 0] < 0).sum())
        nbytes = (2 * 4 * d * (2 * g - pend_reads) + 2 * 4 * d * pend_reads + 2 * g * d + g * main_rec
                  + 8 * g + items.numel() * 8 + g * rd * 4)
        copies = copies_for(nbytes)
        kvs = [(torch.randn(n, d, device=DEVICE), torch.randn(n, d, device=DEVICE)) for _ in range(copies)]
        pools = _pools(g, main_rec, copies)
        us = graph_time_us(calls_of(lambda i: lambda: compress_ratio2(
            *kvs[i], pkv, psc, plan, w_kv, eps, pools[i][0], pools[i][1], table), copies))
        t_us = graph_time_us(calls_of(lambda i: lambda: _compress_t(
            *kvs[i], pkv, psc, items[:, 0], items[:, 1], w_kv, eps, gcis, rd, *pools[i]), copies))
        print(_row(f"compress_ratio2 + main KV ({g} groups)", n, us, nbytes, t_us, copy_bw), flush=True)

        # index keys from the latents: torch wk GEMM + fused k_norm/RoPE/MXFP4 vs the same GEMM + torch path
        lat = torch.randn(g, d, device=DEVICE).bfloat16()
        nbytes = 2 * g * d + 2 * di * d + g * idx_rec + 8 * g + g * rd * 4
        pools = _pools(g, idx_rec, copies)
        us = graph_time_us(calls_of(lambda i: lambda: store_index_keys(
            lat, wk, w_k, eps, plan.positions, table, *pools[i]), copies))
        t_us = graph_time_us(calls_of(lambda i: lambda: paged.store_index_k(
            pools[i][0], pools[i][1], _rope_t(_norm_t(lat @ wk.t(), w_k, eps), gcis, rd)), copies))
        print(_row(f"store_index_keys (wk GEMM + fused, {g} groups)", n, us, nbytes, t_us, copy_bw), flush=True)
        del kvs, pools
