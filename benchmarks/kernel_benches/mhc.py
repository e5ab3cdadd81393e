"""RMSNorm and the mHC kernels (engine/kernels/{norm,mhc}.py) at the released shapes: D = 5120, hc = 4,
mixes from fn fp32 [24, 20480], N = 1, 6, 64, 4096 tokens. hc_post_mixes (hc_post fused with the next
sublayer's mixes) is compared with the two separate kernels: wire it into the model only where faster.

Baseline: the same math in plain torch fp32 ops (not the float64 golden), timed in the same CUDA graph
setup. Bytes = the minimum traffic (each input read once, each output written once); every call reads its
own copy of the inputs, fn included (as a decode step streams each layer's fn from HBM).
"""

from __future__ import annotations

import torch

from benchmarks.gpu_timing import calls_of, copies_for, graph_time_us, sweep
from engine.kernels.mhc import (hc_mixes, hc_post, hc_post_mixes, hc_pre, hc_pre_norm, mixes_launch_shape,
                                post_mixes_launch_shape)
from engine.kernels.mhc_cuda import MAX_ROWS, hc_mixes_cuda, pick_launch
from engine.kernels.norm import rms_norm
from engine.presets import full_config

N_VALUES = (1, 6, 64, 4096)
CUDA_MIXES_SPLITS = (20, 40, 80, 160, 320)
MIXES_LAUNCHES = ((16, 128, 1), (16, 128, 10), (16, 128, 20), (16, 128, 40), (16, 64, 80), (16, 64, 160),
                  (32, 64, 20), (64, 64, 1), (64, 64, 2), (64, 64, 4), (64, 64, 8))  # (block_m, block_k, splits)
POST_MIXES_LAUNCHES = ((16, 16, 1), (16, 16, 20), (16, 16, 40), (16, 16, 80), (16, 8, 160), (32, 16, 20),
                       (64, 8, 1), (64, 8, 2), (64, 8, 4), (64, 8, 8))  # (block_m, block_d, splits)


def _rms_torch(x, w, eps):
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).bfloat16()


def _mixes_torch(x, fn, scale, base, hc, iters, hc_eps, norm_eps):
    flat = x.flatten(1).float()
    m = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def _pre_torch(x, pre):
    return (pre.unsqueeze(-1) * x.float()).sum(1).bfloat16()


def _post_torch(y, res, post, comb):
    return (post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("njk,njd->nkd", comb, res.float())).bfloat16()


def _row(name: str, n: int, us: float, nbytes: int, base_us: float, copy_bw: float, note: str = "") -> None:
    print(f"| {name} | {n} | {us:.1f} | {nbytes / 1e6:.3f} MB | {nbytes / us / 1e6:.2f} | "
          f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {base_us:.1f} | {base_us / us:.1f}x | {note} |", flush=True)


def bench(copy_bw: float) -> None:
    cfg = full_config()
    d, hc, iters, hc_eps, eps = cfg.dim, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
    mix, k = (2 + hc) * hc, hc * cfg.dim
    print(f"\n## mHC + RMSNorm (D={d}, hc={hc}, fn fp32 [{mix}, {k}], {iters} Sinkhorn iterations; "
          "CUDA graph replay, inputs from HBM)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = "| kernel | N | us | bytes | TB/s | % copy BW | torch fp32 us | speedup | note |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    w = (1 + 0.1 * torch.randn(d, device="cuda")).bfloat16()
    scale = torch.randn(3, device="cuda") * 0.5
    base = torch.randn(mix, device="cuda") * 0.5
    for n in N_VALUES:
        stream_bytes = 2 * n * hc * d
        copies = copies_for(stream_bytes + 4 * mix * k)
        xs = [torch.randn(n, hc, d, device="cuda").bfloat16() for _ in range(copies)]
        fns = [torch.randn(mix, k, device="cuda") / k**0.5 for _ in range(copies)]
        pres = [torch.rand(n, hc, device="cuda") for _ in range(copies)]
        posts = [2 * torch.rand(n, hc, device="cuda") for _ in range(copies)]
        combs = [torch.rand(n, hc, hc, device="cuda").softmax(-1) for _ in range(copies)]
        ys = [torch.randn(n, d, device="cuda").bfloat16() for _ in range(copies)]

        def timed(f):
            return graph_time_us(calls_of(lambda i: lambda: f(i), copies))

        margs = lambda i: (xs[i], fns[i], scale, base, hc, iters, hc_eps, eps)  # noqa: E731
        us = timed(lambda i: hc_mixes(*margs(i)))
        res, best = sweep(MIXES_LAUNCHES, f"hc_mixes N={n}",
                          lambda c: timed(lambda i: hc_mixes(*margs(i), launch=c)))
        cuda = n <= MAX_ROWS
        auto = f"CUDA {pick_launch(k, n)} splits" if cuda else f"Triton {mixes_launch_shape(n, k)}"
        _row("hc_mixes", n, us, stream_bytes + 4 * mix * k + 4 * n * mix, timed(lambda i: _mixes_torch(*margs(i))),
             copy_bw, f"auto: {auto}; best Triton {best[0]}: {best[1]:.1f} us")
        print("  hc_mixes Triton launches (block_m, block_k, splits): "
              + "; ".join(f"{c}: {t:.1f}" for c, t in res.items()), flush=True)
        if cuda:
            res, best = sweep(CUDA_MIXES_SPLITS, f"hc_mixes_cuda N={n}",
                              lambda c: timed(lambda i: hc_mixes_cuda(*margs(i), splits=c)))
            print("  hc_mixes CUDA splits: " + "; ".join(f"{c}: {t:.1f}" for c, t in res.items()), flush=True)

        _row("rms_norm", n, timed(lambda i: rms_norm(ys[i], w, eps)), 4 * n * d + 2 * d,
             timed(lambda i: _rms_torch(ys[i], w, eps)), copy_bw)
        pre_bytes = stream_bytes + 4 * n * hc + 2 * n * d
        _row("hc_pre", n, timed(lambda i: hc_pre(xs[i], pres[i])), pre_bytes,
             timed(lambda i: _pre_torch(xs[i], pres[i])), copy_bw)
        _row("hc_pre_norm", n, timed(lambda i: hc_pre_norm(xs[i], pres[i], w, eps)), pre_bytes + 2 * d,
             timed(lambda i: _rms_torch(_pre_torch(xs[i], pres[i]), w, eps)), copy_bw, "collapse + RMSNorm")
        _row("hc_post", n, timed(lambda i: hc_post(ys[i], xs[i], posts[i], combs[i])),
             2 * n * d + 2 * stream_bytes + 4 * n * (hc + hc * hc),
             timed(lambda i: _post_torch(ys[i], xs[i], posts[i], combs[i])), copy_bw)

        pargs = lambda i: (ys[i], xs[i], posts[i], combs[i])  # noqa: E731
        fused = timed(lambda i: hc_post_mixes(*pargs(i), fns[i], scale, base, iters, hc_eps, eps))
        separate = timed(lambda i: hc_mixes(hc_post(*pargs(i)), *margs(i)[1:]))
        res, best = sweep(POST_MIXES_LAUNCHES, f"hc_post_mixes N={n}", lambda c: timed(
            lambda i: hc_post_mixes(*pargs(i), fns[i], scale, base, iters, hc_eps, eps, launch=c)))
        fused_bytes = 2 * n * d + 2 * stream_bytes + 4 * n * (hc + hc * hc) + 4 * mix * k + 4 * n * mix
        _row("hc_post_mixes", n, fused, fused_bytes,
             timed(lambda i: _mixes_torch(_post_torch(*pargs(i)), *margs(i)[1:])), copy_bw,
             f"hc_post then hc_mixes: {separate:.1f} us ({separate / fused:.2f}x); auto "
             f"{post_mixes_launch_shape(n, d, hc)}; best {best[0]}: {best[1]:.1f} us")
        print("  hc_post_mixes launches (block_m, block_d, splits): "
              + "; ".join(f"{c}: {t:.1f}" for c, t in res.items()), flush=True)
        del xs, fns, pres, posts, combs, ys
