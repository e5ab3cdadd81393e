"""The CUDA indexer scan (cuda/indexer_scan.cu, engine/kernels/indexer_cuda.py).

CPU (need nvcc only, or nothing): the source builds with the project's flags and the launcher rejects parameters
outside its contract before any CUDA call; the Python shared-memory model equals the launcher's; the picked
launch shapes are valid and fit an SM; and `_emulate_scan`, a torch emulation of the kernel's whole data path
(query staging in the permuted order with the row's bf16-exact scale folded into the head weights, the 4-byte
record words each lane copies, the E2M1 -> f16 bit placement of e2m1_pair, the mma.sync m16n8k16 fragment
tables of the PTX ISA, the C-fragment scaling by the entries' scale words, the fp32 block accumulation, the
bf16 roundings, the per-lane head order and the xor butterfly, the output index), is BITWISE equal to the golden
index_scores_ref and to the Triton index_scores (interpreter) at the real head shape, and differs from it under
each of several one-index mutations. Two storage details are checked against it separately: the staged query
layout hands each MMA the emulation's A registers, and the kernel's reduce-scatter stores every score once with
the butterfly's sums.

GPU (@gpu, skipped without CUDA sm_90 + nvcc): index_scores_cuda at the real shape (H = 32, D = 128) for T in
{4096, 65536, 1M} and M in {1, 2, 6, 8} with random visible counts (incl. 0), paged pools and int32/int64 slots
is bitwise equal (torch.equal: -0 == +0, -inf == -inf) to index_scores_ref and to the Triton index_scores; odd
shapes (T not a multiple of the step, T < 8, H = 16 / 48, zero blocks); every launch shape agrees; results are
deterministic and CUDA-graph capturable.
"""

import ctypes

import numpy as np
import pytest
import torch

from engine.kernels import cuda_build
from engine.kernels.indexer import index_scores, index_scores_ref
from engine.kernels.indexer_cuda import (MAX_ROWS, RECORD_BYTES, ScanParams, declare, grid_size, index_scores_cuda,
                                         pick_params, scan_applies, shape_supported, smem_bytes, valid_params)
from engine.presets import full_config
from engine.quant import fp4_byte_table
from tests.kernels.numeric import assert_index_scores_close, e2m1_pair, index_problem

gpu = pytest.mark.gpu
needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")
needs_kernels = pytest.mark.skipif(not cuda_build.cuda_kernels_available(), reason="needs CUDA sm_90 and nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue
PERM8 = [0, 4, 1, 5, 2, 6, 3, 7]  # element stored at each position of an 8-group


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    """The launcher library, built once for the module's tests (nvcc takes most of their time)."""
    return declare(ctypes.CDLL(str(cuda_build.build("indexer_scan", tmp_path_factory.mktemp("indexer_scan")))))


# ------------------------------------------------------------------------------------------------ CPU: launcher

@needs_nvcc
def test_launcher_rejects_parameters_outside_the_contract(lib):
    ok = dict(q=0, pool=0, slots=0, s64=0, out=0, m=2, h=32, t=1000, wp=8, gr=2, st=4, grid=10, pdl=1)

    def call(a):
        return lib.dsv41_indexer_scan(a["q"] or None, None, a["pool"] or None, a["slots"] or None, a["s64"], None,
                                      a["out"] or None, a["m"], a["h"], a["t"], a["wp"], a["gr"], a["st"], a["grid"],
                                      a["pdl"], None)

    assert call(ok | dict(t=0)) == 0, "T = 0 is a valid empty call (nothing launched)"
    bad = [dict(m=0), dict(m=9), dict(h=8), dict(h=24), dict(h=48, m=6),  # M·H = 288 > 256 rows
           dict(wp=0), dict(wp=9), dict(gr=3), dict(gr=8), dict(st=1), dict(st=5), dict(st=8), dict(grid=0),
           dict(t=-1), dict(t=(1 << 30) + 1), dict(s64=2), dict(pdl=2),
           dict(q=8), dict(pool=2), dict(slots=2), dict(slots=4, s64=1), dict(out=1)]  # misaligned pointers
    for change in bad:
        assert call(ok | change) == CUDA_INVALID_VALUE, f"{change}: launcher accepted it"
        if "t" not in change:  # the contract is checked before the empty-call shortcut
            assert call(ok | change | dict(t=0)) == CUDA_INVALID_VALUE, f"{change} at T = 0: launcher accepted it"


@needs_nvcc
def test_shared_memory_model_matches_the_launcher(lib):
    for m, h in ((1, 32), (2, 32), (6, 32), (8, 32), (1, 16), (5, 48), (3, 64)):
        for p in (ScanParams(8, 2, 4), ScanParams(8, 4, 3), ScanParams(1, 1, 2), ScanParams(4, 4, 6),
                  ScanParams(8, 4, 6)):
            want = smem_bytes(m, h, p) if smem_bytes(m, h, p) <= 200 * 1024 else None
            got = lib.dsv41_indexer_scan_smem(m, h, p.warps, p.groups, p.stages)
            assert got == smem_bytes(m, h, p), (m, h, p)
            assert valid_params(m, h, p) == (want is not None), (m, h, p)
    for args in ((0, 32, 8, 2, 4), (9, 32, 8, 2, 4), (1, 24, 8, 2, 4), (8, 48, 8, 2, 4), (1, 32, 9, 2, 4),
                 (1, 32, 8, 3, 4), (1, 32, 8, 2, 5)):
        assert lib.dsv41_indexer_scan_smem(*args) == 0, args


def test_picked_shapes_are_valid_and_fit_an_sm():
    h = full_config().index_n_heads
    for hh in (h, 16, 64):
        for m in range(1, 9):
            if m * hh > MAX_ROWS:
                continue
            for t in (1, 7, 4096, 65536, 1 << 20):
                p = pick_params(m, hh, t)
                assert valid_params(m, hh, p), (m, hh, t, p)
                assert p.ctas_per_sm * (smem_bytes(m, hh, p) + 1024) <= 227 * 1024, (m, hh, p)
                g = grid_size(t, p, 132)
                assert 1 <= g <= p.ctas_per_sm * 132
                assert g * p.warps * p.entries_per_step() >= min(t, 132 * p.ctas_per_sm * p.warps * 8), "idle grid"


def test_shape_rules():
    assert shape_supported(8, 32, 128, 1 << 20) and shape_supported(1, 16, 128, 0)
    assert not shape_supported(9, 32, 128, 10) and not shape_supported(1, 32, 64, 10)
    assert not shape_supported(1, 24, 128, 10) and not shape_supported(6, 48, 128, 10)
    q, w, pool, slots, vis = index_problem(1, 32, 128, 5, entries=8)
    assert not scan_applies(q, w, pool, slots, vis), "CPU tensors never go to the CUDA scan"


# ------------------------------------------------------------------------------------------------ CPU: emulation

_F16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).double()  # bits -> value


def _mma(a_regs, b_regs) -> torch.Tensor:
    """mma.sync m16n8k16 from per-lane registers via the PTX fragment tables -> C [16, 8] (float64, exact).
    a_regs[lane] = 4 pairs: (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..);
    b_regs[lane] = 2 pairs: (k 2t.., col g), (k 2t+8.., col g); a pair's low half is the lower k."""
    A = torch.full((16, 16), float("nan"), dtype=torch.float64)
    B = torch.full((16, 8), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (lo, hi) in enumerate(a_regs[lane]):
            r, k = g + 8 * (i & 1), 2 * t + 8 * (i >> 1)
            A[r, k], A[r, k + 1] = lo, hi
        for i, (lo, hi) in enumerate(b_regs[lane]):
            B[2 * t + 8 * i, g], B[2 * t + 8 * i + 1, g] = lo, hi
    assert not A.isnan().any() and not B.isnan().any(), "a fragment element was never written"
    return A @ B


def _f32(x: float) -> float:
    """x rounded to fp32 (round to nearest even)."""
    return float(np.float32(x))


def _f32_bits(u: int) -> float:
    return float(np.array([u], dtype=np.uint32).view(np.float32)[0])


def _bf16(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).bfloat16().float().item()


def _emulate_scan(q, w, key_pool, slots, visible, groups=2, mutation=None) -> torch.Tensor:
    """The kernel's arithmetic, lane by lane, on CPU (fp32 and bf16 roundings as the kernel does them). One warp
    walks the units of 8·groups entries (the persistent grid only deals units out; the math per unit is this).
    mutation: one index of the data path changed, to show that the emulation (and so each formula) matters."""
    M, H, D = q.shape
    R, T = M * H, slots.numel()
    pool = key_pool.reshape(-1, RECORD_BYTES)
    # Staging (stage_query_block): per row sa = 2^max(floor(log2 amax) - 15, -126) (1 for a zero row), q / sa in
    # f16 stored in the permuted order; the head weight times sq = sa·2^14 in bf16
    x = q.reshape(R, D).float()
    amax_bits = x.abs().amax(dim=-1).view(torch.int32)
    sb = torch.where(amax_bits == 0, 127, ((amax_bits >> 23) - 15).clamp_min(1))
    xs = (x * ((254 - sb) << 23).view(torch.float32)[:, None]).to(torch.float16).double()
    perm = list(range(8)) if mutation == "natural_q_order" else PERM8
    stored = xs.view(R, D // 8, 8)[:, :, perm].reshape(R, D)
    sq = ((sb + 14) << 23).view(torch.float32)
    w_staged = (w.reshape(R).float() * sq).bfloat16()
    assert torch.equal(w_staged.float(), w.reshape(R).float() * sq), "w · sq not exact in bf16"
    wf = w_staged.double()
    out = torch.empty(M, T, dtype=torch.bfloat16)
    unit = 8 * groups
    for e0 in range(0, T, unit):
        # Ring contents: lane (g, t) copies word 4b + t of entry g of each group; lanes t = 0 the scale word
        words, scale_word = {}, {}
        for grp in range(groups):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                e = min(e0 + grp * 8 + g, T - 1)
                rec = pool[int(slots[e])].tolist()
                for b in range(4):
                    off = 16 * b + 4 * t
                    words[grp, b, lane] = sum(rec[off + i] << (8 * i) for i in range(4))
                if t == 0:
                    scale_word[grp, g] = sum(rec[64 + i] << (8 * i) for i in range(4))
        for m in range(M):
            hs = {(lane, grp, c): 0.0 for lane in range(32) for grp in range(groups) for c in range(2)}
            for r0 in range(m * H, (m + 1) * H, 16):
                acc = {(lane, grp, i): 0.0 for lane in range(32) for grp in range(groups) for i in range(4)}
                for b in range(4):
                    for grp in range(groups):
                        mmas = [({}, {}), ({}, {})]
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            rb = r0 + g if mutation == "a_row_g8" else r0 + g + 8
                            qa = stored[r0 + g, 32 * b + 8 * t: 32 * b + 8 * t + 8].tolist()  # 16-byte load
                            qb = stored[rb, 32 * b + 8 * t: 32 * b + 8 * t + 8].tolist()
                            word = lambda k, v: (v[2 * k], v[2 * k + 1])  # noqa: E731  f16x2 word k of the load
                            wd = words[grp, b, lane]
                            pairs = [tuple(_F16[h].item() for h in e2m1_pair(wd, j)) for j in range(4)]
                            if mutation == "b_pair_order":
                                pairs = [pairs[1], pairs[0], pairs[2], pairs[3]]
                            # mma(cc, qa.x, qb.x, qa.y, qb.y, pair0, pair1)
                            # mma(cc, qa.z, qb.z, qa.w, qb.w, pair2, pair3)
                            mmas[0][0][lane] = [word(0, qa), word(0, qb), word(1, qa), word(1, qb)]
                            mmas[0][1][lane] = [pairs[0], pairs[1]]
                            mmas[1][0][lane] = [word(2, qa), word(2, qb), word(3, qa), word(3, qb)]
                            mmas[1][1][lane] = [pairs[2], pairs[3]]
                        C = _mma(*mmas[0]) + _mma(*mmas[1])  # exact: the fp32 accumulator cc of the block
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            cc = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
                            assert all(_f32(v) == v for v in cc), "block sum not exact in fp32"
                            ent = [2 * t, 2 * t + 1] if mutation != "scale_word_g" else [g, g]
                            byte = (b + 1) % 4 if mutation == "sk_block" else b
                            sk = [_f32_bits(((scale_word[grp, ent[c]] >> (8 * byte)) & 0xFF) << 23) for c in range(2)]
                            for i in range(4):  # c[i]: row g + 8 (i >> 1), entry 2t + (i & 1)
                                acc[lane, grp, i] = _f32(acc[lane, grp, i] + cc[i] * sk[i & 1])  # fmaf: exact product
                for lane in range(32):
                    g = lane // 4
                    w0 = wf[r0 + g].item()
                    w1 = w0 if mutation == "w_row_g" else wf[r0 + g + 8].item()
                    for grp in range(groups):
                        for c in range(2):  # bf16x2 (row g, row g + 8): cvt.rn, max with 0, mul.bf16x2 (exact, rounded)
                            p0 = _bf16(max(_bf16(acc[lane, grp, c]), 0.0) * w0)
                            p1 = _bf16(max(_bf16(acc[lane, grp, 2 + c]), 0.0) * w1)
                            hs[lane, grp, c] = _f32(_f32(hs[lane, grp, c] + p0) + p1)
            for grp in range(groups):
                for c in range(2):
                    v = [hs[lane, grp, c] for lane in range(32)]
                    for o in (4, 8, 16):  # __shfl_xor_sync butterfly over g
                        v = [_f32(v[lane] + v[lane ^ o]) for lane in range(32)]
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        e = e0 + grp * 8 + 2 * t + c
                        if g == grp and e < T:
                            out[m, e] = v[lane] if e < int(visible[m]) else float("-inf")
    return out


def test_emulated_kernel_is_bitwise_the_golden_and_triton():
    h, d = full_config().index_n_heads, full_config().index_head_dim
    cases = [(1, 19, 2, 0), (3, 21, 1, 1), (2, 37, 4, 2)]  # (M, T, groups, seed): partial last units, visible 0
    for m, t, groups, seed in cases:
        q, w, pool, slots, vis = index_problem(m, h, d, t, entries=t + 11, seed=seed)
        vis[-1] = t - 5 if m == 1 else 0  # some -inf columns in every case
        if seed == 2:
            pool, slots = pool[: 48].view(3, 16, -1), torch.randperm(48)[:t].long()  # paged pool, int64 slots
            q[0, 1, 32:64] = 0  # an all-zero query block
        emu = _emulate_scan(q, w, pool, slots, vis, groups)
        ref = index_scores_ref(q, w, pool, slots, vis)
        tri = index_scores(q, w, pool, slots, vis)
        assert torch.isinf(ref).any() and torch.isfinite(ref).any()
        assert torch.equal(emu, ref), f"M={m} T={t}: {(emu != ref).sum().item()} differ from the golden"
        assert torch.equal(emu, tri), f"M={m} T={t}: {(emu != tri).sum().item()} differ from Triton"


@pytest.mark.parametrize("mutation", ["natural_q_order", "a_row_g8", "b_pair_order", "scale_word_g", "sk_block",
                                      "w_row_g"])
def test_emulation_fails_under_a_mutated_index(mutation):
    h, d = full_config().index_n_heads, full_config().index_head_dim
    q, w, pool, slots, vis = index_problem(1, h, d, 9, entries=20, seed=3)
    emu = _emulate_scan(q, w, pool, slots, vis, 1, mutation)
    assert not torch.equal(emu, index_scores_ref(q, w, pool, slots, vis)), f"{mutation} went unnoticed"


def test_e2m1_pair_places_the_value_times_2_pow_minus_14():
    table = fp4_byte_table(torch.device("cpu")).view(256, 2)
    for wd in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C, 0x89ABCDEF):
        values = [table[(wd >> (8 * b)) & 0xFF, i].item() for b in range(4) for i in range(2)]
        for j in range(4):
            lo, hi = e2m1_pair(wd, j)
            assert _F16[lo] == values[j] * 2.0**-14 and _F16[hi] == values[j + 4] * 2.0**-14, (hex(wd), j)


def _q_frag_word(row: int, b: int, t: int, j: int) -> int:
    """q_frag_word of cuda/indexer_scan.cu."""
    rr = row & 15
    return (((((row >> 4) * 4 + b) * 2 + (j >> 1)) * 32 + (rr & 7) * 4 + t) * 4 + (j & 1) * 2 + (rr >> 3))


def test_query_fragment_layout_feeds_each_mma_its_a_registers():
    """The staged layout is a bijection onto the rows' 64 words each, and the 16-byte load of lane (g, t) for MMA i
    of block b holds the emulation's A registers (word 2i of rows g, g + 8, then word 2i + 1 of rows g, g + 8)."""
    rows = 32
    where = {}
    for row in range(rows):
        for b in range(4):
            for t in range(4):
                for j in range(4):
                    where[_q_frag_word(row, b, t, j)] = (row, b, t, j)
    assert sorted(where) == list(range(rows * 64))
    for tile in range(rows // 16):
        for b in range(4):
            for i in range(2):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    base = ((tile * 4 + b) * 2 + i) * 32 * 4 + lane * 4  # uint4 index (tile·8 + 2b + i)·32 + lane
                    got = [where[base + r] for r in range(4)]
                    r0 = 16 * tile
                    assert got == [(r0 + g, b, t, 2 * i), (r0 + g + 8, b, t, 2 * i), (r0 + g, b, t, 2 * i + 1),
                                   (r0 + g + 8, b, t, 2 * i + 1)]


def _reduce_scatter(vals: list[list[float]]) -> list[tuple[int, float, bool]]:
    """reduce_scatter_g of cuda/indexer_scan.cu over 32 lanes: vals[lane] = V fp32 values -> per lane (index of
    the value it ends with, that value, whether it stores it)."""
    v = [list(x) for x in vals]
    idx, own, n = [0] * 32, [True] * 32, len(vals[0])
    for lvl in range(3):
        o = 4 << lvl
        upper = [(lane // 4 >> lvl) & 1 for lane in range(32)]
        if n > 1:
            h = n // 2
            send = [[v[ln][i] if upper[ln] else v[ln][h + i] for i in range(h)] for ln in range(32)]
            keep = [[v[ln][h + i] if upper[ln] else v[ln][i] for i in range(h)] for ln in range(32)]
            v = [[_f32(keep[ln][i] + send[ln ^ o][i]) for i in range(h)] for ln in range(32)]
            idx = [idx[ln] + (h if upper[ln] else 0) for ln in range(32)]
            n = h
        else:
            v = [[_f32(v[ln][0] + v[ln ^ o][0])] for ln in range(32)]
            own = [own[ln] and not upper[ln] for ln in range(32)]
    return [(idx[ln], v[ln][0], own[ln]) for ln in range(32)]


@pytest.mark.parametrize("nb", [1, 2, 4])
def test_reduce_scatter_is_the_butterfly_with_one_owner_per_score(nb):
    """Every (t, value) is stored by exactly one lane, bitwise the xor butterfly's sum (the emulation's order)."""
    rng = np.random.default_rng(nb)
    vals = [[_f32(float(x)) for x in rng.standard_normal(2 * nb) * 2.0 ** rng.integers(-20, 20, 2 * nb)]
            for _ in range(32)]
    want = {}
    for i in range(2 * nb):
        v = [vals[ln][i] for ln in range(32)]
        for o in (4, 8, 16):
            v = [_f32(v[ln] + v[ln ^ o]) for ln in range(32)]
        for ln in range(32):
            want[ln % 4, i] = v[ln]
    stored = {}
    for lane, (i, val, own) in enumerate(_reduce_scatter(vals)):
        if own:
            assert (lane % 4, i) not in stored, f"two lanes store t={lane % 4} value {i}"
            stored[lane % 4, i] = val
    assert stored == want


# ------------------------------------------------------------------------------------------------ GPU

def _gpu_problem(m, t, seed, slot_dtype=torch.int32, page=64, h=None, d=None):
    cfg = full_config()
    h, d = h or cfg.index_n_heads, d or cfg.index_head_dim
    entries = (t + 1000 + page - 1) // page * page
    q, w, pool, slots, vis = index_problem(m, h, d, t, entries=entries, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    vis = torch.randint(0, t + 1, (m,), generator=g)
    vis[0] = t
    if m > 1:
        vis[-1] = 0
    return (q.cuda(), w.cuda(), pool.view(-1, page, RECORD_BYTES).cuda(), slots.to(slot_dtype).cuda(), vis.cuda())


def _assert_bitwise(args, **kw):
    out = index_scores_cuda(*args, **kw)
    ref = index_scores_ref(*args)
    tri = index_scores(*args)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ from the golden"
    assert torch.equal(out, tri), f"{(out != tri).sum().item()} of {out.numel()} differ from the Triton kernel"
    return out


@gpu
@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 6, 8])
@pytest.mark.parametrize("t", [4096, 65536, 1 << 20])
def test_real_shape_bitwise(m, t):
    args = _gpu_problem(m, t, seed=m + t % 97, slot_dtype=torch.int64 if m % 2 == 0 else torch.int32)
    _assert_bitwise(args)


@gpu
@needs_kernels
@pytest.mark.parametrize("m,t,h", [(1, 1, 32), (2, 7, 32), (3, 13, 32), (8, 100, 32), (5, 4096 + 13, 32),
                                   (7, 1003, 16), (5, 517, 48), (4, 8, 64)])
def test_odd_shapes_bitwise(m, t, h):
    args = _gpu_problem(m, t, seed=t, page=16, h=h)
    q, w, pool, slots, vis = args
    q[0, 0, :32] = 0  # an all-zero query block
    q[-1, -1] = 0  # an all-zero query row (sa = 1)
    w[0, 1] = 0
    pool.view(-1, RECORD_BYTES)[slots[: min(3, t)].long(), :64] = 0  # entries with zero codes
    _assert_bitwise((q, w, pool, slots, vis))


@gpu
@needs_kernels
def test_every_launch_shape_agrees():
    args = _gpu_problem(3, 4096 + 29, seed=5)
    want = index_scores_ref(*args)
    for groups in (1, 2, 4):
        for stages in (2, 3, 4, 6):
            for warps, ctas in ((8, 1), (4, 2), (1, 3), (8, 2)):
                for pdl in (False, True):
                    p = ScanParams(warps, groups, stages, ctas, pdl)
                    assert torch.equal(index_scores_cuda(*args, params=p), want), p


@gpu
@needs_kernels
def test_deterministic_and_graph_capturable():
    args = _gpu_problem(6, 65536 + 5, seed=9)
    first = index_scores_cuda(*args)
    for _ in range(3):
        assert torch.equal(index_scores_cuda(*args).view(torch.int16), first.view(torch.int16))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        index_scores_cuda(*args)  # build + smem opt-in outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = index_scores_cuda(*args)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.int16), first.view(torch.int16))


@gpu
@needs_kernels
def test_plain_bf16_queries_match_triton_within_the_indexer_tolerance():
    """q not MXFP4 (randn bf16, as benchmarks/kernels.py's bench_indexer uses): the staging is still exact
    (|q| >= amax·2^-32); only fp32 sums may round. Against the golden within test_indexer's bound."""
    q, w, pool, slots, vis = _gpu_problem(4, 65536, seed=11)
    q = torch.randn(q.shape, device="cuda").bfloat16()
    assert_index_scores_close(index_scores_cuda(q, w, pool, slots, vis), q, w, pool, slots, vis)
