"""Sparse MQA decode attention over the packed pools vs the golden sparse_attn on unpacked records.

Tolerance, per output element, against `sparse_attn_paged_ref` (float64 math, bf16 output):

    |o - ref| <= 2 bf16 ULPs of ref + 2^-8 * A,   A[m, h, d] = Σ_r p_r |kv_r[d]| / denom

The kernel rounds p = exp(l - mx) to bf16 with the same final max as the golden (two passes), so the
only differences are fp32 logits (a p within ~1e-6 of a bf16 tie may round the other way: at most
one bf16 ULP, 2^-8 relative, of that p's share of A), fp32 sums (split order) and the final bf16
rounding (the ULPs). Measured on CPU: bitwise equal with one split per list; within 1 ULP with several.
"""

import pytest
import torch

from engine.kernels.cache_records import pack_main_kv, pack_swa
from engine.kernels.sparse_attention import gather_rows_ref, sparse_attn_paged, sparse_attn_paged_ref

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _problem(m, h, d, kw, km, swa_slots, main_slots, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(m, h, d, generator=g) * 2).bfloat16()
    swa_pool = pack_swa((torch.randn(swa_slots, d, generator=g) * torch.logspace(-1, 0.5, d)).bfloat16())
    main_pool = pack_main_kv((torch.randn(main_slots, d, generator=g)).bfloat16())
    swa_idx = torch.randint(0, swa_slots, (m, kw), generator=g, dtype=torch.int32)
    main_idx = torch.randint(0, main_slots, (m, km), generator=g, dtype=torch.int32)
    swa_idx[:, : kw // 3] = -1  # a window that starts late
    main_idx[:, km - km // 4:] = -1  # top-k padding
    if m > 1:
        swa_idx[1] = -1  # an all -1 row: output 0
        main_idx[1] = -1
    if m > 2:
        main_idx[2, :3] = main_idx[2, 3]  # duplicate rows count once per listing, as in the golden
        swa_idx[2, -2:] = swa_idx[2, -3]
    sink = torch.randn(h, generator=g) * 2
    sink[0] = 30.0  # a sink that dominates the denominator
    return [t.to(device) for t in (q, swa_pool.view(-1, 4, swa_pool.size(-1)), swa_idx,
                                   main_pool.view(-1, 4, main_pool.size(-1)), main_idx, sink)]


def assert_attn_close(o, ref, args, scale, what):
    q, swa_pool, swa_idx, main_pool, main_idx, sink = args
    assert o.shape == ref.shape and o.dtype == torch.bfloat16, f"{what}: got {o.dtype} {tuple(o.shape)}"
    kv, idx = gather_rows_ref(q, swa_pool, swa_idx, main_pool, main_idx)
    logits = torch.einsum("mhd,mkd->mhk", q.double(), kv.double()) * scale
    logits = logits.masked_fill(idx < 0, float("-inf"))
    mx = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(logits - mx)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.double().view(1, -1, 1) - mx)
    a = torch.einsum("mhk,mkd->mhd", p, kv.double().abs()) / denom
    of, rf = o.double(), ref.double()
    _, e = torch.frexp(rf.abs().clamp_min(2.0**-100))
    ulp = torch.ldexp(torch.ones_like(rf), e - 8)
    allowed = 2 * ulp + 2.0**-8 * a
    err = (of - rf).abs()
    bad = ~(err <= allowed)  # NaN fails
    if bad.any():
        w = int(torch.where(bad, err / allowed, torch.inf).nan_to_num(posinf=1e30).flatten().argmax())
        mi, hi, di = torch.unravel_index(torch.tensor(w), rf.shape)
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance; worst [m={mi}, h={hi}, d={di}]: "
                    f"o={of[mi, hi, di].item():.6g} ref={rf[mi, hi, di].item():.6g} err={err[mi, hi, di].item():.3g} "
                    f"allowed={allowed[mi, hi, di].item():.3g}")


@pytest.mark.parametrize("m,h,d,kw,km", [(1, 2, 64, 7, 13), (3, 4, 128, 5, 37), (3, 2, 64, 33, 19)])
def test_matches_golden_cpu(m, h, d, kw, km):
    args = _problem(m, h, d, kw, km, swa_slots=64, main_slots=96, seed=m * 100 + d + kw)
    scale = d ** -0.5
    o = sparse_attn_paged(*args, scale, block_n=16, rows_per_split=16 * (1 + m % 2))
    ref = sparse_attn_paged_ref(*args, scale)
    assert_attn_close(o, ref, args, scale, f"M={m} H={h} D={d} KW={kw} KM={km}")
    if m > 1:
        assert torch.equal(o[1], torch.zeros_like(o[1])), "an all -1 row must give 0"


def test_launch_shapes_cpu():
    """Head blocks wider than H, splits that end mid-tile, one split for everything."""
    args = _problem(3, 4, 64, 21, 45, swa_slots=64, main_slots=96, seed=5)
    ref = sparse_attn_paged_ref(*args, 0.125)
    for bh, bn, rps in ((32, 16, 48), (16, 32, 64), (64, 16, 16)):
        o = sparse_attn_paged(*args, 0.125, block_h=bh, block_n=bn, rows_per_split=rps)
        assert_attn_close(o, ref, args, 0.125, f"block_h={bh} block_n={bn} rows_per_split={rps}")


def test_empty_main_list_cpu():
    args = _problem(2, 2, 64, 9, 0, swa_slots=32, main_slots=32)
    o = sparse_attn_paged(*args, 0.125, block_n=16, rows_per_split=16)
    assert_attn_close(o, sparse_attn_paged_ref(*args, 0.125), args, 0.125, "KM=0")


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 6])
def test_matches_golden_real_shape_gpu(m):
    d = 512
    args = _problem(m, 64, d, 128, 512, swa_slots=4096, main_slots=8192, device="cuda", seed=m)
    o = sparse_attn_paged(*args, d ** -0.5)
    ref = sparse_attn_paged_ref(*args, d ** -0.5)
    assert_attn_close(o, ref, args, d ** -0.5, f"GPU M={m} H=64 D=512 KW=128 KM=512")
    if m > 1:
        assert torch.equal(o[1], torch.zeros_like(o[1]))
