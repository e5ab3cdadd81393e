"""RoPE, the fused quantise-and-store kernels and the ratio-2 compressor vs the golden model.

Oracles: engine.model.rope.apply_rotary, engine.model.layers.RMSNorm, engine.model.attention.Compressor
(all float64 math rounded to bf16) and engine.kernels.paged.store_* (cache_records packing).

Tolerances:
- bf16 values the kernels compute in fp32 (RoPE, RMSNorm, the pooled latent): within 1 bf16 ULP of the
  golden, and >= 99% bitwise (the fp32 result lands within ~2^-24 relative of a bf16 tie rarely).
- plain stores (already-final bf16 in): records bitwise paged.store_* on the whole pool (untouched
  slots keep their bytes; slot -1 rows write nothing).
- fused stores: the records are bitwise paged.store_* of the kernel's own pre-quantisation bf16 values
  (`norm_rope`, same code); a record differs from the golden's only in rows whose bf16 values differ
  (by <= 1 ULP, detected here), and at least 99% of the records are bitwise the golden's when N >= 256.
  Norm + RoPE: the golden rounds the normed row to bf16 before rotating, so the rotated dims also get the
  rotated rounding slack 2^-7 (|a| + |b|) of their pair (`rotated_rounding_slack`; seen once on the H200 in
  4096 x 128 index keys: 0.000977 off, 2 ULP of a cancelling output).
- compressor pending state: bitwise (copies).
"""

import pytest
import torch

from engine.config import ModelConfig
from engine.kernels import paged
from engine.kernels.cache_records import fp4_record_bytes, swa_record_bytes
from engine.kernels.cache_store import (norm_rope, rope_mxfp4_qdq, store_index_k, store_index_k_fused,
                                        store_main_kv, store_swa, store_swa_fused)
from engine.kernels.compressor import Ratio2Chunk, compress_ratio2, plan_ratio2, store_index_keys
from engine.kernels.rope import apply_rope, rope_table
from engine.model.attention import Compressor
from engine.model.cache import SourceCache
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryTable, apply_rotary
from engine.presets import full_config, tiny_config
from engine.quant import fp4_qdq
from tests.kernels.numeric import bf16_ulp

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- helpers --------------------------------------------------------------------------------------------------

def _rotary(cfg: ModelConfig, compressed: bool = True) -> RotaryTable:
    if compressed:
        return RotaryTable(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                           cfg.beta_fast, cfg.beta_slow)
    return RotaryTable(cfg.rope_head_dim, cfg.rope_theta)


def _rows(n: int, d: int, g: torch.Generator, device) -> torch.Tensor:
    """bf16 [n, d] with per-channel magnitudes over 5 decades, exact zeros, -0.0 and a few E2M1/E4M3 ties."""
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 2, d)[torch.randperm(d, generator=g)]
    if n > 2:
        x[1, : d // 4] = 0.0
        x[1, d // 4: d // 2] = -0.0
        if n > 3:
            x[3] = 0.0  # an all-zero row: every amax floor
        x[2, :16] = torch.tensor([6.0, 1.5, 0.75, -0.25, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.0, 4.0, 3.0, 2.0, 1.0, 0.5])
    return x.bfloat16().to(device)


def _positions(n: int, cfg: ModelConfig, g: torch.Generator, device) -> torch.Tensor:
    """Positions around and far past original_seq_len, plus 0."""
    hi = 4 * cfg.original_seq_len
    p = torch.randint(0, hi, (n,), generator=g)
    fixed = torch.tensor([0, cfg.original_seq_len - 1, cfg.original_seq_len, cfg.original_seq_len + 1, hi - 1])
    p[: min(n, 5)] = fixed[: min(n, 5)]
    return p.to(device)


def _slots(n: int, total: int, g: torch.Generator, device) -> torch.Tensor:
    s = torch.randperm(total, generator=g)[:n]
    s[::5] = -1  # skipped rows
    return s.to(device)


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, what: str, min_exact: float = 0.99,
                      extra: torch.Tensor | None = None) -> None:
    """<= 1 bf16 ULP (+ extra, an error bound stated by the caller) everywhere, >= min_exact of the elements
    bitwise equal (signed zeros included)."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape, (
        f"{what}: {out.dtype} {tuple(out.shape)} vs {ref.dtype} {tuple(ref.shape)}")
    err = (out.double() - ref.double()).abs()
    bad = ~(err <= bf16_ulp(ref) + (0 if extra is None else extra))
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements over 1 ULP; worst err {err.max().item():.3g} at "
                           f"{torch.unravel_index(err.argmax(), err.shape)}")
    exact = (out.view(torch.int16) == ref.view(torch.int16)).double().mean().item() if out.numel() else 1.0
    assert exact >= min_exact, f"{what}: only {100 * exact:.2f}% bitwise"


def _pool(total: int, rec: int, g: torch.Generator, device) -> torch.Tensor:
    """A pool of random bytes, [blocks, 4, rec]: untouched slots must keep theirs."""
    return torch.randint(0, 256, (total // 4, 4, rec), generator=g, dtype=torch.uint8).to(device)


def rotated_rounding_slack(normed: torch.Tensor, rd: int) -> torch.Tensor:
    """Extra error allowed after RoPE for a fused norm + RoPE: the golden rounds the normed row to bf16 before
    rotating, so a 1-ULP difference there (<= 2^-7 |v|) moves each rotated output by up to
    ulp(a)|cos| + ulp(b)|sin| <= 2^-7 (|a| + |b|) of its pair (a, b), which is many output ULPs where the
    rotation cancels. normed bf16 [N, D] (the golden's pre-RoPE values) -> fp64 [N, D] (0 outside the last rd)."""
    extra = torch.zeros(normed.shape, dtype=torch.float64, device=normed.device)
    pairs = normed[:, -rd:].double().abs().unflatten(-1, (-1, 2)).sum(-1, keepdim=True)  # |a| + |b| per pair
    extra[:, -rd:] = (2.0**-7 * pairs).expand(-1, -1, 2).flatten(-2)
    return extra


def assert_records(pool: torch.Tensor, init: torch.Tensor, slots: torch.Tensor, v_kernel: torch.Tensor,
                   v_golden: torch.Tensor, store_ref, what: str, slack: torch.Tensor | None = None) -> None:
    """pool (kernel-written) = store_ref(init, v_kernel) bitwise; records differ from store_ref(init, v_golden)
    only in rows where v_kernel != v_golden (<= 1 ULP); >= 99% of the records are the golden's when N >= 256."""
    keep = slots >= 0
    mine = init.clone()
    store_ref(mine, slots[keep], v_kernel[keep])
    assert torch.equal(pool, mine), (f"{what}: records differ from paged.store_* of the kernel's own bf16 values in "
                                     f"{int((pool != mine).any(-1).sum())} slots")
    gold = init.clone()
    store_ref(gold, slots[keep], v_golden[keep])
    flat_k, flat_g = pool.view(-1, pool.size(-1)), gold.view(-1, gold.size(-1))
    rec_differs = (flat_k[slots[keep]] != flat_g[slots[keep]]).any(-1)
    val_differs = (v_kernel[keep].view(torch.int16) != v_golden[keep].view(torch.int16)).any(-1)
    assert not (rec_differs & ~val_differs).any(), f"{what}: a record differs although its bf16 values are equal"
    assert_bf16_close(v_kernel, v_golden, f"{what} (pre-quantisation values)", extra=slack)
    if keep.sum() >= 256:
        frac = 1.0 - rec_differs.double().mean().item()
        assert frac >= 0.99, f"{what}: only {100 * frac:.2f}% of the records bitwise the golden's"
    assert torch.equal(flat_k[~torch.isin(torch.arange(flat_k.size(0), device=pool.device), slots[keep])],
                       init.view(-1, init.size(-1))[~torch.isin(torch.arange(flat_k.size(0), device=pool.device),
                                                               slots[keep])]), f"{what}: an untouched slot changed"


def _norm(w: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(w.numel(), eps).to(w.device)
    norm.weight.copy_(w)
    return norm


def _weight(d: int, g: torch.Generator, device) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(d, generator=g)).bfloat16().to(device)


# --- RoPE -----------------------------------------------------------------------------------------------------

def check_rope(cfg: ModelConfig, n: int, h: int, device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d = cfg.head_dim
    for compressed in (True, False):
        rot = _rotary(cfg, compressed)
        pos = _positions(n, cfg, g, device)
        table = rope_table(rot, device, 4 * cfg.original_seq_len)
        x = _rows(n * h, d, g, device).view(n, h, d)
        for inverse in (False, True):
            ref = apply_rotary(x[None], rot.at(pos)[None], inverse)[0]
            what = f"rope N={n} H={h} D={d} compressed={compressed} inverse={inverse}"
            assert_bf16_close(apply_rope(x, pos, table, inverse), ref, what)
            y = x.clone()
            assert apply_rope(y, pos, table, inverse, inplace=True) is y
            assert_bf16_close(y, ref, what + " in place")
            ref2 = apply_rotary(x[:, 0][None], rot.at(pos)[None], inverse)[0]
            assert_bf16_close(apply_rope(x[:, 0].contiguous(), pos, table, inverse), ref2, what + " [N, D]")
        # heavy cancellation: o = bf16(e c / s), so the real part e c - o s is ~2^-9 of its terms or less
        cis = rot.at(pos)
        c, sn = cis.real[:, None, :], cis.imag[:, None, :]
        tail = x[..., d - cfg.rope_head_dim:].unflatten(-1, (-1, 2)).clone()
        ok = sn.abs() > 1e-3
        tail[..., 1] = torch.where(ok, tail[..., 0].float() * c / sn.where(ok, 1.0), tail[..., 1].float()).bfloat16()
        xc = torch.cat([x[..., :d - cfg.rope_head_dim], tail.flatten(-2)], dim=-1).contiguous()
        ref = apply_rotary(xc[None], cis[None])[0]
        assert_bf16_close(apply_rope(xc, pos, table), ref, f"rope cancellation N={n} compressed={compressed}",
                          min_exact=0.95)


def check_rope_qdq(cfg: ModelConfig, n: int, h: int, device, seed: int) -> None:
    """rope_mxfp4_qdq is bitwise (signed zeros included) fp4_qdq(apply_rope(x), 32, "ue8m0"): the two-launch
    path it replaces in the indexer."""
    g = torch.Generator().manual_seed(seed)
    d = cfg.index_head_dim
    table = rope_table(_rotary(cfg), device, 4 * cfg.original_seq_len)
    x = _rows(n * h, d, g, device).view(n, h, d)
    pos = _positions(n, cfg, g, device)
    got = rope_mxfp4_qdq(x, pos, table)
    want = fp4_qdq(apply_rope(x, pos, table), 32, "ue8m0")
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    diff = got.view(torch.int16) != want.view(torch.int16)
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} differ, first at {diff.nonzero()[0].tolist()}"
    assert torch.equal(fp4_qdq(got, 32, "ue8m0").view(torch.int16), got.view(torch.int16)), "not a fixed point"


def test_rope_qdq_cpu():
    check_rope_qdq(tiny_config(), n=5, h=3, device="cpu", seed=4)
    check_rope_qdq(full_config(), n=2, h=4, device="cpu", seed=5)


def test_rope_cpu():
    check_rope(tiny_config(), n=37, h=3, device="cpu", seed=1)
    check_rope(tiny_config(), n=1, h=1, device="cpu", seed=2)


def test_rope_empty_and_contract_cpu():
    cfg = tiny_config()
    table = rope_table(_rotary(cfg), "cpu", 64)
    x = torch.zeros(0, 2, cfg.head_dim, dtype=torch.bfloat16)
    assert apply_rope(x, torch.zeros(0, dtype=torch.long), table).shape == x.shape
    with pytest.raises(AssertionError, match="outside the table"):
        apply_rope(torch.zeros(1, cfg.head_dim, dtype=torch.bfloat16), torch.tensor([64]), table)


# --- plain stores ---------------------------------------------------------------------------------------------

_STORES = {  # name: (kernel, paged reference, record bytes of D)
    "swa": (store_swa, paged.store_swa, swa_record_bytes),
    "main_kv": (store_main_kv, paged.store_main_kv, lambda d: fp4_record_bytes(d, 16)),
    "index_k": (store_index_k, paged.store_index_k, lambda d: fp4_record_bytes(d, 32)),
}


def check_plain_store(kind: str, n: int, d: int, device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kernel, ref, rec = _STORES[kind]
    total = 4 * (n // 2 + 4)
    x, slots = _rows(n, d, g, device), _slots(n, total, g, device)
    init = _pool(total, rec(d), g, device)
    pool, want = init.clone(), init.clone()
    kernel(pool, slots, x)
    keep = slots >= 0
    ref(want, slots[keep], x[keep])
    diff = (pool != want).any(-1).flatten()
    assert not diff.any(), (f"{kind} N={n} D={d}: {int(diff.sum())} records differ, "
                            f"first at slot {int(diff.nonzero()[0])}")


@pytest.mark.parametrize("kind", list(_STORES))
@pytest.mark.parametrize("n,d", [(7, 64), (13, 128), (3, 512), (1, 64)])
def test_plain_store_bitwise_cpu(kind, n, d):
    check_plain_store(kind, n, d, "cpu", seed=n * 1000 + d)


def test_store_contract_cpu():
    pool = torch.zeros(2, 4, swa_record_bytes(64), dtype=torch.uint8)
    store_swa(pool, torch.zeros(0, dtype=torch.long), torch.zeros(0, 64, dtype=torch.bfloat16))  # empty: no launch
    assert not pool.any()
    with pytest.raises(AssertionError, match="slots outside"):
        store_swa(pool, torch.tensor([8]), torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="uint8"):
        store_main_kv(pool, torch.tensor([0]), torch.zeros(1, 64, dtype=torch.bfloat16))


# --- fused stores ---------------------------------------------------------------------------------------------

def check_fused_stores(cfg: ModelConfig, n: int, device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rot = _rotary(cfg)
    table = rope_table(rot, device, 4 * cfg.original_seq_len)
    d, di, eps = cfg.head_dim, cfg.index_head_dim, cfg.norm_eps
    pos = _positions(n, cfg, g, device)
    cis = rot.at(pos)[None]
    total = 4 * (n // 2 + 4)
    slots = _slots(n, total, g, device)

    # window KV: RMSNorm(kv_norm) -> RoPE -> FP8 (Attention.window_kv_unquantized, then paged.store_swa)
    kv, w = _rows(n, d, g, device), _weight(d, g, device)
    normed = _norm(w, eps)(kv)
    golden = apply_rotary(normed[None], cis)[0]
    init = _pool(total, swa_record_bytes(d), g, device)
    pool = init.clone()
    store_swa_fused(kv, w, eps, pos, table, pool, slots)
    assert_records(pool, init, slots, norm_rope(kv, w, eps, pos, table), golden, paged.store_swa,
                   f"store_swa_fused N={n} D={d}", rotated_rounding_slack(normed, table.rd))

    # main KV from a pre-RoPE latent: RoPE at group positions -> NVFP4 (Attention.rotate_latent)
    latent = _rows(n, d, g, device)
    golden = apply_rotary(latent[None], cis)[0]
    init = _pool(total, fp4_record_bytes(d, 16), g, device)
    pool = init.clone()
    store_main_kv(pool, slots, latent, pos, table)
    assert_records(pool, init, slots, norm_rope(latent, None, 0.0, pos, table), golden, paged.store_main_kv,
                   f"store_main_kv + RoPE N={n} D={d}")

    # index keys after wk: k_norm -> RoPE -> MXFP4 (Indexer.index_keys)
    keys, kw = _rows(n, di, g, device), _weight(di, g, device)
    normed = _norm(kw, eps)(keys)
    golden = apply_rotary(normed[None], cis)[0]
    init = _pool(total, fp4_record_bytes(di, 32), g, device)
    pool = init.clone()
    store_index_k_fused(keys, kw, eps, pos, table, pool, slots)
    assert_records(pool, init, slots, norm_rope(keys, kw, eps, pos, table), golden, paged.store_index_k,
                   f"store_index_k_fused N={n} Di={di}", rotated_rounding_slack(normed, table.rd))


def test_fused_stores_cpu():
    check_fused_stores(tiny_config(), n=5, device="cpu", seed=5)
    check_fused_stores(tiny_config(), n=301, device="cpu", seed=6)


# --- ratio-2 compressor ---------------------------------------------------------------------------------------

def _compressor(cfg: ModelConfig, g: torch.Generator, device) -> Compressor:
    comp = Compressor(cfg, 2)
    comp.wkv.weight.copy_((torch.randn(cfg.head_dim, cfg.dim, generator=g) * cfg.dim ** -0.5).bfloat16())
    comp.wgate.weight.copy_((torch.randn(cfg.head_dim, cfg.dim, generator=g) * 2 * cfg.dim ** -0.5).bfloat16())
    comp.norm.weight.copy_(_weight(cfg.head_dim, g, "cpu"))
    return comp.to(device)


def _pooling_bound(kv, score, pkv, psc, plan, w, eps) -> torch.Tensor:
    """Error allowance of a latent beyond 1 ULP: the kernel's fp32 softmax weights (exp to ~2^-21 relative on
    the GPU, ex2.approx) and products leave |pooled error| <= 2^-20 A, A = |kv0| w0 + |kv1| w1, before the
    bf16 rounding of pooled (1 ULP of it); RMSNorm scales both by |w| r. The A term only matters where the
    two tokens' contributions cancel."""
    it = plan.items[plan.items[:, 1] >= 0].cpu()
    src0, src1 = it[:, 0], it[:, 1]
    pend = (src0 < 0)[:, None]
    kv0 = torch.where(pend, pkv.cpu()[(-src0 - 1).clamp_min(0), 0], kv.cpu()[src0.clamp_min(0)]).double()
    sc0 = torch.where(pend, psc.cpu()[(-src0 - 1).clamp_min(0), 0], score.cpu()[src0.clamp_min(0)]).double()
    kv1, sc1 = kv.cpu()[src1].double(), score.cpu()[src1].double()
    wts = torch.stack([sc0, sc1]).softmax(0)
    pooled = (kv0 * wts[0] + kv1 * wts[1]).bfloat16().double()
    a = kv0.abs() * wts[0] + kv1.abs() * wts[1]
    r = torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps)
    out = torch.zeros(plan.num_groups, kv.size(1), dtype=torch.float64)
    out[it[:, 2]] = w.double().cpu().abs() * r * (bf16_ulp(pooled) + 2.0**-20 * a)
    return out.to(kv.device)


def check_compressor(cfg: ModelConfig, steps: list[list[tuple[int, int, int]]], device, seed: int,
                     min_exact: float = 0.99) -> None:
    """steps: per step, chunks (pending slot, start position, tokens). The golden Compressor runs chunk by
    chunk on its own copy of the pending state; the kernel runs each step's chunks in one launch and also
    stores the main KV (RoPE at 2g, NVFP4) and the index keys (wk, k_norm, RoPE, MXFP4)."""
    g = torch.Generator().manual_seed(seed)
    comp = _compressor(cfg, g, device)
    rot = _rotary(cfg)
    table = rope_table(rot, device, 1 << 14)
    wk, kw = (torch.randn(cfg.index_head_dim, cfg.head_dim, generator=g) * cfg.head_dim ** -0.5).bfloat16().to(
        device), _weight(cfg.index_head_dim, g, device)
    slots_n = 1 + max(s for step in steps for s, _, _ in step)
    pkv = torch.randn(slots_n, 2, cfg.head_dim, generator=g).to(device)
    psc = torch.randn(slots_n, 2, cfg.head_dim, generator=g).to(device)
    pkv_g, psc_g = pkv.clone(), psc.clone()
    for si, step in enumerate(steps):
        xs = [(torch.randn(n, cfg.dim, generator=g)).bfloat16().to(device) for _, _, n in step]
        x = torch.cat(xs)
        kv, score = comp.wkv(x), comp.wgate(x)  # fp32 [N, hd], the caller's linears
        chunks, row = [], 0
        for slot, start, n in step:
            chunks.append(Ratio2Chunk(row, n, start, slot))
            row += n
        plan = plan_ratio2(chunks, device)
        G = plan.num_groups
        total = 4 * (G // 4 + 2)
        mslots = torch.randperm(total, generator=g)[:G].to(device)
        if G > 2:
            mslots[1] = -1
        init_m = _pool(total, fp4_record_bytes(cfg.head_dim, 16), g, device)
        pool_m = init_m.clone()
        pkv_before, psc_before = pkv.clone(), psc.clone()
        latent = compress_ratio2(kv, score, pkv, psc, plan, comp.norm.weight, cfg.norm_eps, pool_m, mslots, table)

        golden = []
        for (slot, start, n), xc in zip(step, xs):
            out = comp(xc[None], start, SourceCache(None, None, pkv_g[slot:slot + 1], psc_g[slot:slot + 1]))
            first, count = start // 2, (start + n) // 2 - start // 2
            assert (out is None) == (count == 0)
            golden.append(out[0] if out is not None else latent.new_empty(0, cfg.head_dim))
        golden = torch.cat(golden)
        what = f"compressor step {si} chunks {step}"
        assert [c for _, c in plan.groups] == [(s + n) // 2 - s // 2 for _, s, n in step]
        assert torch.equal(pkv, pkv_g) and torch.equal(psc, psc_g), f"{what}: pending state differs"
        assert_bf16_close(latent, golden, what + " latent", min_exact,
                          extra=_pooling_bound(kv, score, pkv_before, psc_before, plan, comp.norm.weight, cfg.norm_eps))
        gpos = plan.positions
        assert torch.equal(gpos.cpu(), torch.cat([2 * torch.arange(f, f + c) for f, c in plan.groups]).long())
        # main KV: the golden rotate_latent of the kernel's latent (its own error is bounded above), paged packing
        rot_g = apply_rotary(latent[None], rot.at(gpos)[None])[0]
        rot_k = norm_rope(latent, None, 0.0, gpos, table) if G else latent
        if G:
            assert_records(pool_m, init_m, mslots, rot_k, rot_g, paged.store_main_kv, what + " main KV")
            # index keys from the kernel's latent (the matmul is torch's; its k within 1 ULP of the golden)
            init_i = _pool(total, fp4_record_bytes(cfg.index_head_dim, 32), g, device)
            pool_i = init_i.clone()
            store_index_keys(latent, wk, kw, cfg.norm_eps, gpos, table, pool_i, mslots)
            k = torch.matmul(latent, wk.t())
            # torch's GEMM (fp32 accumulation), not ours: 1 ULP + K 2^-24 sum|a||w|
            bound = cfg.head_dim * 2.0**-24 * (latent.double().abs() @ wk.double().abs().t())
            assert_bf16_close(k, (latent.double() @ wk.double().t()).bfloat16(), what + " wk", 0.9, bound)
            golden_k = apply_rotary(_norm(kw, cfg.norm_eps)(k)[None], rot.at(gpos)[None])[0]
            assert_records(pool_i, init_i, mslots, norm_rope(k, kw, cfg.norm_eps, gpos, table), golden_k,
                           paged.store_index_k, what + " index K")


def test_compressor_cpu():
    cfg = tiny_config()
    # (slot, start, n): even start odd n (leaves pending), odd start even n (reads and leaves), odd start n=1
    # (completes only), even start n=1 (pending only), even/even, odd/odd; then a second step continuing them
    step1 = [(0, 0, 5), (3, 7, 4), (1, 9, 1), (2, 4, 1), (5, 10, 6), (4, 3, 3)]
    step2 = [(0, 5, 1), (3, 11, 2), (2, 5, 7), (4, 6, 1)]
    check_compressor(cfg, [step1, step2], "cpu", seed=7)


def test_empty_cpu():
    cfg = tiny_config()
    d = cfg.head_dim
    table = rope_table(_rotary(cfg), "cpu", 64)
    none = torch.zeros(0, dtype=torch.long)
    pool = torch.zeros(4, fp4_record_bytes(d, 16), dtype=torch.uint8)
    store_main_kv(pool, none, torch.zeros(0, d, dtype=torch.bfloat16), none, table)
    assert not pool.any()
    assert norm_rope(torch.zeros(0, d, dtype=torch.bfloat16), torch.ones(d, dtype=torch.bfloat16), 1e-6).shape == (0, d)
    pend = torch.zeros(2, 2, d)
    plan = plan_ratio2([], "cpu")
    out = compress_ratio2(torch.zeros(0, d), torch.zeros(0, d), pend, pend.clone(), plan,
                          torch.ones(d, dtype=torch.bfloat16), 1e-6, pool, none, table)
    assert out.shape == (0, d) and out.dtype == torch.bfloat16 and not pool.any()


def test_compressor_plan_cpu():
    plan = plan_ratio2([Ratio2Chunk(0, 1, 4, 0)], "cpu")  # pending only: one item, no group
    assert plan.num_groups == 0 and plan.items.tolist() == [[-1, -1, -1, 0, 0, 0]]
    plan = plan_ratio2([Ratio2Chunk(2, 4, 3, 1)], "cpu")  # reads slot 1, groups 1..3, leaves row 5
    assert plan.items.tolist() == [[-2, 2, 0, 2, 5, 1], [3, 4, 1, 4, -1, -1]]
    with pytest.raises(AssertionError, match="share a pending slot"):
        plan_ratio2([Ratio2Chunk(0, 1, 0, 0), Ratio2Chunk(1, 1, 0, 0)], "cpu")


# --- GPU, full shapes -----------------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 6, 4096])
def test_rope_gpu(n):
    check_rope(full_config(), n=n, h=64 if n < 4096 else 4, device="cuda", seed=n)


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 6, 512])
def test_rope_qdq_gpu(n):
    check_rope_qdq(full_config(), n=n, h=full_config().index_n_heads, device="cuda", seed=n)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", list(_STORES))
@pytest.mark.parametrize("n", [1, 6, 4096])
def test_plain_store_gpu(kind, n):
    cfg = full_config()
    check_plain_store(kind, n, cfg.index_head_dim if kind == "index_k" else cfg.head_dim, "cuda", seed=n)


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 6, 4096])
def test_fused_stores_gpu(n):
    check_fused_stores(full_config(), n=n, device="cuda", seed=n)


@gpu
@needs_cuda
def test_compressor_gpu():
    cfg = full_config()
    steps = [[(0, 0, 4095), (1, 0, 1), (2, 5, 6)],  # prefill chunk + two decode-ish chunks
             [(0, 4095, 1), (1, 1, 1), (2, 11, 1)],  # decode steps completing the pending groups
             [(0, 4096, 1), (2, 12, 1)]]  # decode steps leaving a pending token
    check_compressor(cfg, steps, "cuda", seed=11)
