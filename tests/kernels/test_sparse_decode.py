"""CUDA one-launch sparse decode attention (cuda/sparse_decode.cu, engine/kernels/sparse_decode.py).

Tolerance: that of test_sparse_attention.py (`assert_attn_close`), per output element against the float64
golden `sparse_attn_paged_ref`:

    |o - ref| <= 2 bf16 ULPs of ref + 2^-8 * Σ_r p_r |kv_r| / denom

(fp32 logits and sums; a p within ~1e-7 of a bf16 tie may round the other way: one bf16 ULP of its share).

CPU: the source compiles (nvcc), the launcher rejects parameters outside its contract before any CUDA call,
its shared-memory size equals the Python mirror, the launch-shape picker, the wrapper's contract, the
record-decoding bit tricks of the kernel (emulated in torch against cache_records' unpack), and an emulation
of the ldmatrix / mma.sync fragment tables driven by the kernel's own lane address formulas.
GPU: the real V4.1 shape (H 64, D 512, KW 128, KM 512) at M = 1, 2, 6, 16 with -1 padding, an all -1 query,
duplicate slots, a dominant sink, window-only and main-only queries; odd shapes; every launch shape that
fits; against the golden and the Triton sparse_attn_paged; determinism; CUDA-graph capture.
"""

import ctypes

import pytest
import torch

from engine.kernels import cuda_build
from engine.kernels.cache_records import pack_main_kv, pack_swa, unpack_main_kv, unpack_swa
from engine.kernels.sparse_attention import gather_rows_ref, sparse_attn_paged, sparse_attn_paged_ref
from engine.kernels.sparse_decode import (HEAD_DIM, MAX_SMEM, MAX_SPLITS, DecodeParams, decode_applies,
                                          params_fit, pick_params, smem_bytes, sparse_attn_decode)
from engine.presets import full_config
from tests.kernels.numeric import assert_attn_close, bf16_ulp, sparse_attn_problem

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue


def _real_shape():
    cfg = full_config()
    return cfg.n_heads, cfg.head_dim


# --- CPU -----------------------------------------------------------------------------------------------------------

@needs_nvcc
def test_cuda_source_compiles_and_launcher_checks_its_contract(tmp_path):
    lib = ctypes.CDLL(str(cuda_build.build("sparse_decode", tmp_path)))
    lib.dsv41_sparse_decode.restype = ctypes.c_int
    lib.dsv41_sparse_decode.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_float]
                                        + [ctypes.c_int] * 4 + [ctypes.c_void_p])
    lib.dsv41_sparse_decode_smem.restype = ctypes.c_size_t
    lib.dsv41_sparse_decode_smem.argtypes = [ctypes.c_int] * 2
    for hb in (16, 32):
        for r in range(16, 257, 16):
            assert lib.dsv41_sparse_decode_smem(hb, r) == smem_bytes(hb, r), (hb, r)
    for hb, r in ((8, 16), (64, 16), (16, 0), (16, 8), (16, 24), (32, -16)):
        assert lib.dsv41_sparse_decode_smem(hb, r) == 0, (hb, r)
    ok = dict(M=1, H=64, KW=128, KM=512, scale=0.04, hb=16, R=80, splits=8, pdl=1)

    def call(**kw):
        a = {**ok, **kw}
        ptr = 1 << 20  # 16-byte aligned, never dereferenced: every case below fails before any CUDA call
        return lib.dsv41_sparse_decode(ptr, ptr, ptr, ptr, ptr, ptr, ptr, a["M"], a["H"], a["KW"], a["KM"],
                                       a["scale"], a["hb"], a["R"], a["splits"], a["pdl"], None)

    bad = [dict(M=0), dict(M=65536), dict(H=48, hb=32), dict(H=8, hb=32), dict(H=24), dict(H=0), dict(hb=64),
           dict(R=72), dict(R=0),
           dict(splits=7), dict(splits=9, R=16, KW=128, KM=16), dict(KW=-1), dict(KW=0, KM=0, splits=1),
           dict(pdl=2), dict(R=256, splits=3, hb=32)]  # the last: 256 rows of kv + HB 32 exceed 227 KB
    for case in bad:
        assert call(**case) == CUDA_INVALID_VALUE, case


def test_smem_and_params_cpu():
    h, d = _real_shape()
    assert d == HEAD_DIM
    assert smem_bytes(16, 80) == 80 * 1040 + 16 * 1040 + 4 * 16 * 80 * 4 + 16 * 88 * 2 + 80 * 4 + 16 * 16
    n_rows = 128 + 512
    for m in range(1, 17):
        p = pick_params(m, h, n_rows)
        r = p.rows_per_split(n_rows)
        assert params_fit(p, h, n_rows) and p == p.normalised(n_rows), (m, p)
        assert r % 16 == 0 and (p.splits - 1) * r < n_rows <= p.splits * r, (m, p, r)
        assert smem_bytes(p.heads_per_cta, r) <= MAX_SMEM
        assert (p.splits, r) == ((MAX_SPLITS, 80) if m <= 8 else (6, 112)), (m, p)  # the H200 sweep's picks
        assert p.heads_per_cta == (16 if m * 4 * 8 <= 132 else 32), (m, p)  # one wave of 16-head CTAs
    # odd shapes still get a launch shape; H = 48 cannot take 32 heads per CTA
    for hh, rows in ((16, 20), (48, 640), (64, 1), (64, 1280), (32, 17)):
        p = pick_params(8, hh, rows)
        assert params_fit(p, hh, rows) and hh % p.heads_per_cta == 0, (hh, rows, p)
    for hh in (1, 4, 8):  # a rank's heads at N = 64 / 16 / 8: one partial 16-head block, never 32
        p = pick_params(6, hh, n_rows)
        assert p.heads_per_cta == 16 and params_fit(p, hh, n_rows), (hh, p)
        assert not params_fit(DecodeParams(32, 8), hh, n_rows)
    assert not params_fit(DecodeParams(16, 8), 24, n_rows)  # above 16: whole blocks only
    assert not params_fit(DecodeParams(16, 1), h, n_rows)  # 640 rows in one CTA: too much shared memory
    assert DecodeParams(16, 8).normalised(20) == DecodeParams(16, 2)  # 16-row splits: 2 own rows
    assert DecodeParams(32, 3).rows_per_split(640) == 224
    with pytest.raises(ValueError):
        pick_params(1, 64, 8 * 200)  # 200 rows per CTA do not fit


def test_wrapper_contract_cpu():
    args = sparse_attn_problem(2, 16, 512, 8, 16, swa_slots=32, main_slots=32)
    assert not decode_applies(*args[:5])  # CPU tensors
    with pytest.raises(AssertionError):
        sparse_attn_decode(*args, 0.04)  # not on a CUDA device
    q, *rest = args
    with pytest.raises(AssertionError):
        sparse_attn_decode(q[:, :, :256].contiguous(), *rest, 0.04)  # records of 528 B != D = 256


def _e4m3_bits_to_fp32(b: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (int) -> fp32 (independent of the kernel's cvt: exponent/mantissa arithmetic)."""
    e, man = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, man * 2.0**-9, (1 + man / 8) * torch.pow(2.0, (e - 7).double()))
    return torch.where((b & 0x80) != 0, -mag, mag).float()


def test_record_decoding_bit_tricks_cpu():
    """The kernel's per-lane decoding (lane c: elements [16c, 16c + 16)) emulated in torch, vs unpack_*."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-6, 2, 512)).bfloat16()
    x[0] = 0
    x[1, :40] = 0
    # SWA: 16 codes at 16c, the UE8M0 byte at 512 + c / 2; s = 2^(e-127) (e = 0: the subnormal 2^-127)
    rec = pack_swa(x)
    rec[2, 512] = 0  # a zero scale byte: 2^-127
    ref = unpack_swa(rec, 512)
    codes = rec[:, :512].long().view(-1, 32, 16)
    e = rec[:, 512:].long()[:, torch.arange(32) // 2]  # [rows, lane]
    tiny = torch.tensor([0x00400000], dtype=torch.int32).view(torch.float32)
    s = torch.where(e == 0, tiny, (e.int() << 23).view(torch.float32))
    got = (_e4m3_bits_to_fp32(codes) * s.unsqueeze(-1)).bfloat16().view(-1, 512)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    # main: 8 bytes at 8c (byte j: elements 2j low nibble, 2j + 1 high), the E4M3 byte at 256 + c;
    # e2m1 = bits ((c & 8) << 28 | (c & 7) << 22) as fp32, times 2^126
    rec = pack_main_kv(x)
    ref = unpack_main_kv(rec, 512)
    b = rec[:, :256].int().view(-1, 32, 8)
    nib = torch.stack([b & 15, b >> 4], dim=-1).view(-1, 32, 16)
    v = (((nib & 8) << 28) | ((nib & 7) << 22)).view(torch.float32) * 2.0**126
    s = _e4m3_bits_to_fp32(rec[:, 256:].int())  # [rows, lane]
    got = (v * s.unsqueeze(-1)).bfloat16().view(-1, 512)
    assert torch.equal(got.float(), ref.float())  # -0 vs 0 is allowed: the same value


def _kernel_model(q, swa_pool, swa_idx, main_pool, main_idx, sink, scale, p: DecodeParams):
    """The kernel's decomposition in fp32 torch (per cluster rank: rows [sR, sR + R) of the window-then-main
    list, zero rows for -1 and past the end; 4 D-quarter logit sums; local (max, Σp) seeded with -1e30;
    rank-order merge; p = bf16(exp(l - global max)); per-rank P·V partials summed in rank order)."""
    M, H, D = q.shape
    kw, km = swa_idx.size(1), main_idx.size(1)
    n = kw + km
    p = p.normalised(n)
    R = p.rows_per_split(n)
    kv_all, _ = gather_rows_ref(q, swa_pool, swa_idx, main_pool, main_idx)  # bf16 [M, n, D]
    slots = torch.cat([swa_idx, main_idx], 1)
    pad = p.splits * R - n
    kv_all = torch.cat([kv_all.float(), kv_all.new_zeros(M, pad, D).float()], 1)
    slots = torch.cat([slots, slots.new_full((M, pad), -1)], 1)
    kv_all = torch.where((slots >= 0).unsqueeze(-1), kv_all, 0.0)
    out = torch.empty_like(q)
    for m in range(M):
        qf = q[m].float()
        logits, stats = [], []
        for s in range(p.splits):
            kv = kv_all[m, s * R:(s + 1) * R]
            quarters = [qf[:, i * D // 4:(i + 1) * D // 4] @ kv[:, i * D // 4:(i + 1) * D // 4].T for i in range(4)]
            lg = (((quarters[0] + quarters[1]) + quarters[2]) + quarters[3]) * scale
            lg = lg.masked_fill(slots[m, s * R:(s + 1) * R] < 0, float("-inf"))
            mx = lg.amax(1).clamp_min(-1e30)
            stats.append((mx, torch.exp(lg - mx[:, None]).sum(1)))
            logits.append(lg)
        gm = torch.full((H,), -1e30)
        for mx, _ in stats:
            gm = torch.maximum(gm, mx)
        gs = torch.zeros(H)
        for mx, sm in stats:
            gs = gs + sm * torch.exp(mx - gm)
        den = gs + torch.exp(sink - gm)
        acc = torch.zeros(H, D)
        for s in range(p.splits):
            pb = torch.exp(logits[s] - gm[:, None]).bfloat16().float()
            acc = acc + pb @ kv_all[m, s * R:(s + 1) * R]
        out[m] = (acc / den[:, None]).bfloat16()
    return out


@pytest.mark.parametrize("m,h,kw,km", [(3, 16, 21, 45), (3, 32, 128, 40), (2, 16, 0, 37), (3, 16, 70, 4)])
@pytest.mark.parametrize("params", [DecodeParams(16, 1), DecodeParams(16, 3), DecodeParams(32, 8)])
def test_split_decomposition_matches_golden_cpu(m, h, kw, km, params):
    """The kernel's split / merge arithmetic (not its code) within the GPU tolerance of the golden, with
    splits whose rows are all -1 or past the end and an all -1 query."""
    args = sparse_attn_problem(m, h, HEAD_DIM, kw, km, swa_slots=256, main_slots=256, seed=kw + km)
    ref = sparse_attn_paged_ref(*args, 0.05)
    o = _kernel_model(*args, 0.05, params)
    assert_attn_close(o, ref, args, 0.05, f"model {params} M={m} H={h} KW={kw} KM={km}")
    assert torch.equal(o[1], torch.zeros_like(o[1]))


# --- fragment-table emulation (PTX ISA: ldmatrix m8n8 .b16, mma.m16n8k16 .bf16 row.col) -------------------------

def _ldsm_x4(mem: torch.Tensor, addr, trans: bool = False) -> list[list[tuple]]:
    """mem [rows, cols] (the shared array), addr(lane) -> (row, col) of the 8 contiguous elements that lane
    points at (matrix lane // 8, row lane % 8). Returns regs[lane][j] = (low, high) element of matrix j."""
    mats = []
    for j in range(4):
        rows = [addr(8 * j + i) for i in range(8)]
        mats.append([[mem[r, c + k] for k in range(8)] for r, c in rows])
    regs = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        if trans:
            regs.append([(mats[j][2 * t][g], mats[j][2 * t + 1][g]) for j in range(4)])
        else:
            regs.append([(mats[j][g][2 * t], mats[j][g][2 * t + 1]) for j in range(4)])
    return regs


def _mma(a_regs, b0_regs, b1_regs) -> torch.Tensor:
    """a_regs[lane] = 4 pairs, b*_regs[lane] = pair -> C [16, 8] (float64) from the PTX fragment tables."""
    a = torch.full((16, 16), float("nan"), dtype=torch.float64)
    b = torch.full((16, 8), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for (rr, kk), pair in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)), a_regs[lane]):
            a[rr, kk], a[rr, kk + 1] = float(pair[0]), float(pair[1])
        b[2 * t, g], b[2 * t + 1, g] = float(b0_regs[lane][0]), float(b0_regs[lane][1])
        b[2 * t + 8, g], b[2 * t + 9, g] = float(b1_regs[lane][0]), float(b1_regs[lane][1])
    assert not a.isnan().any() and not b.isnan().any(), "a fragment element was never written"
    return a @ b


def _c_scatter(c: torch.Tensor, out: torch.Tensor, row0: int, col0: int) -> None:
    """Store C [16, 8] the way the kernel's lanes do: lane (g, t) holds C[g][2t, 2t+1], C[g+8][2t, 2t+1]."""
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[row0 + g, col0 + 2 * t: col0 + 2 * t + 2] += c[g, 2 * t: 2 * t + 2]
        out[row0 + g + 8, col0 + 2 * t: col0 + 2 * t + 2] += c[g + 8, 2 * t: 2 * t + 2]


def test_mma_fragment_addressing_emulated_cpu():
    """QK (S = q kv^T) and PV (O = P kv) of one CTA computed through the emulated ldmatrix / mma with the
    kernel's lane address formulas (copied verbatim), against plain matmuls. HB = 32 (2 m-tiles), R = 32 rows,
    a D slice of 32 columns (the formulas do not depend on D beyond the offsets)."""
    g_ = torch.Generator().manual_seed(0)
    HB, R, D = 32, 32, 32
    q_s = torch.randint(-8, 8, (HB, D), generator=g_).double()
    kv_s = torch.randint(-8, 8, (R, D), generator=g_).double()
    p_s = torch.randint(-8, 8, (HB, R), generator=g_).double()
    # QK: unit (row tile rt, D offset k0); kernel: b <- kv_s + (r0 + (lane & 7) + 8 (lane >> 4)) * stride + k0
    # + 8 ((lane >> 3) & 1); a <- q_s + (16 mt + (lane & 7) + 8 ((lane >> 3) & 1)) * stride + k0 + 8 (lane >> 4)
    s = torch.zeros(HB, R, dtype=torch.float64)
    for rt in range(R // 16):
        r0 = rt * 16
        for k0 in range(0, D, 16):
            b = _ldsm_x4(kv_s, lambda lane: (r0 + (lane & 7) + 8 * (lane >> 4), k0 + 8 * ((lane >> 3) & 1)))
            for mt in range(HB // 16):
                a = _ldsm_x4(q_s, lambda lane: (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1), k0 + 8 * (lane >> 4)))
                a4 = [regs for regs in a]
                _c_scatter(_mma(a4, [x[0] for x in b], [x[1] for x in b]), s, 16 * mt, r0)
                _c_scatter(_mma(a4, [x[2] for x in b], [x[3] for x in b]), s, 16 * mt, r0 + 8)
    assert torch.equal(s, q_s @ kv_s.T)
    # PV: warp columns d0w; a <- p_s + (16 mt + (lane & 7) + 8 ((lane >> 3) & 1)) * pstride + r0 + 8 (lane >> 4);
    # b (trans) <- kv_s + (r0 + (lane & 7) + 8 ((lane >> 3) & 1)) * stride + d0w + 16 np + 8 (lane >> 4)
    o = torch.zeros(HB, D, dtype=torch.float64)
    for d0w in range(0, D, 16):  # (one n-pair per "warp" here)
        for rt in range(R // 16):
            r0 = rt * 16
            a = [_ldsm_x4(p_s, lambda lane: (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1), r0 + 8 * (lane >> 4)))
                 for mt in range(HB // 16)]
            b = _ldsm_x4(kv_s, lambda lane: (r0 + (lane & 7) + 8 * ((lane >> 3) & 1), d0w + 8 * (lane >> 4)),
                         trans=True)
            for mt in range(HB // 16):
                _c_scatter(_mma(a[mt], [x[0] for x in b], [x[1] for x in b]), o, 16 * mt, d0w)
                _c_scatter(_mma(a[mt], [x[2] for x in b], [x[3] for x in b]), o, 16 * mt, d0w + 8)
    assert torch.equal(o, p_s @ kv_s)


def test_shared_row_strides_are_bank_conflict_free_cpu():
    """Every 8-lane ldmatrix phase reads 8 rows of 16 B: with row strides of 16 x odd bytes they fall in 8
    different 16-byte bank groups (of 128 B)."""
    for stride_bytes in [1040] + [(r + 8) * 2 for r in range(16, 257, 16)]:
        assert stride_bytes % 16 == 0 and (stride_bytes // 16) % 2 == 1
        assert len({(i * stride_bytes) % 128 for i in range(8)}) == 8


# --- GPU -----------------------------------------------------------------------------------------------------------

def _real_problem(m, seed, window_only=(), main_only=()):
    h, d = _real_shape()
    args = sparse_attn_problem(m, h, d, 128, 512, swa_slots=4096, main_slots=8192, device="cuda", seed=seed)
    for i in window_only:
        args[4][i] = -1
    for i in main_only:
        args[2][i] = -1
    return args


def _assert_close_to_triton(o, tri, ref, args, scale, what):
    """|o - tri| <= 4 bf16 ULPs of ref + 2^-7 A: the sum of both kernels' golden tolerances (triangle
    inequality), so it holds whenever both pass against the golden; A as in assert_attn_close."""
    q, swa_pool, swa_idx, main_pool, main_idx, sink = args
    kv, idx = gather_rows_ref(q, swa_pool, swa_idx, main_pool, main_idx)
    logits = (torch.einsum("mhd,mkd->mhk", q.double(), kv.double()) * scale).masked_fill(idx < 0, float("-inf"))
    mx = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(logits - mx)
    a = torch.einsum("mhk,mkd->mhd", p, kv.double().abs()) / (p.sum(-1, keepdim=True)
                                                               + torch.exp(sink.double().view(1, -1, 1) - mx))
    rf = ref.double()
    ulp = bf16_ulp(rf, 2.0**-100)
    err = (o.double() - tri.double()).abs()
    bad = ~(err <= 4 * ulp + 2.0**-7 * a)
    assert not bad.any(), f"{what}: {int(bad.sum())} outputs differ from Triton by more than both tolerances"


def _check(args, scale, what, params=None, triton=True):
    o = sparse_attn_decode(*args, scale, params)
    torch.cuda.synchronize()
    ref = sparse_attn_paged_ref(*args, scale)
    assert_attn_close(o, ref, args, scale, what)
    if triton:
        _assert_close_to_triton(o, sparse_attn_paged(*args, scale), ref, args, scale, what + " vs Triton")
    return o


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 6, 16])
def test_matches_golden_real_shape_gpu(m):
    d = HEAD_DIM
    wo, mo = ((3,), (4,)) if m > 4 else ((), ())
    args = _real_problem(m, seed=10 + m, window_only=wo, main_only=mo)
    assert decode_applies(*args[:5])
    o = _check(args, d ** -0.5, f"M={m} H=64 D=512 KW=128 KM=512")
    if m > 1:
        assert torch.equal(o[1], torch.zeros_like(o[1])), "an all -1 query must give 0"
    assert not o.isnan().any()


@gpu
@needs_cuda
@pytest.mark.parametrize("hb", [16, 32])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_launch_shapes_gpu(hb, splits):
    args = _real_problem(6, seed=7, window_only=(3,), main_only=(4,))
    p = DecodeParams(hb, splits, pdl=splits % 2 == 0)
    if not params_fit(p, 64, 640):
        pytest.skip(f"{p} does not fit in shared memory")
    _check(args, 0.05, f"params {p}", p, triton=False)


@gpu
@needs_cuda
@pytest.mark.parametrize("m,h,kw,km", [(1, 16, 7, 13), (3, 48, 5, 37), (2, 64, 33, 0), (2, 32, 0, 19),
                                       (7, 64, 128, 512), (1, 64, 1, 1), (8, 64, 9, 4), (5, 32, 200, 300)])
def test_odd_shapes_gpu(m, h, kw, km):
    """Lists that end mid-tile, splits with no valid row, one-CTA clusters, H = 16 / 48 (16-head CTAs only)."""
    args = sparse_attn_problem(m, h, HEAD_DIM, kw, km, swa_slots=64, main_slots=96, device="cuda", seed=m + kw)
    n = kw + km
    for p in (None, DecodeParams(16, 1), DecodeParams(32, 2, False), DecodeParams(16, 8), DecodeParams(32, 5)):
        if p is not None and not (params_fit(p, h, n) and h % p.heads_per_cta == 0):
            continue
        _check(args, 0.03, f"M={m} H={h} KW={kw} KM={km} params {p}", p, triton=p is None)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("h", [8, 4, 1])
def test_a_ranks_heads_gpu(m, h):
    """H < 16 (a rank's heads under tensor parallelism: 8 at N = 8): one partial 16-head block, the missing heads
    computed on zero queries and never stored; the real record counts (128 window + 512 compressed rows)."""
    args = sparse_attn_problem(m, h, HEAD_DIM, 128, 512, swa_slots=256, main_slots=1024, device="cuda", seed=h + m)
    assert decode_applies(*args[:5])
    out = _check(args, HEAD_DIM ** -0.5, f"M={m} H={h} KW=128 KM=512")
    assert out.shape == (m, h, HEAD_DIM)
    whole = torch.cat([args[0], torch.zeros(m, 16 - h, HEAD_DIM, dtype=args[0].dtype, device="cuda")], dim=1)
    padded = sparse_attn_decode(whole, *args[1:5], torch.cat([args[5], torch.zeros(16 - h, device="cuda")]),
                                HEAD_DIM ** -0.5)
    assert torch.equal(out, padded[:, :h]), "a partial block must equal the first heads of a padded whole block"


@gpu
@needs_cuda
def test_zero_q_and_all_invalid_gpu():
    args = _real_problem(4, seed=3)
    args[0].zero_()  # equal logits: p = 1 everywhere, bf16-exact
    _check(args, 0.04, "q = 0")
    args = _real_problem(2, seed=4)
    args[2].fill_(-1)
    args[4].fill_(-1)
    o = sparse_attn_decode(*args, 0.04)
    assert torch.equal(o, torch.zeros_like(o))


@gpu
@needs_cuda
def test_deterministic_and_graph_capturable_gpu():
    args = _real_problem(6, seed=5)
    o1 = sparse_attn_decode(*args, 0.04)
    o2 = sparse_attn_decode(*args, 0.04)
    assert torch.equal(o1, o2)
    out = torch.empty_like(o1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sparse_attn_decode(*args, 0.04)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(sparse_attn_decode(*args, 0.04))
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o1)
    for p in (DecodeParams(16, 8, True), DecodeParams(16, 8, False), DecodeParams(32, 6, True)):
        assert torch.equal(sparse_attn_decode(*args, 0.04, p), sparse_attn_decode(*args, 0.04, p)), p
    with pytest.raises(AssertionError, match="no kernel instance"):  # 32 heads x 160 rows: past shared memory
        sparse_attn_decode(*args, 0.04, DecodeParams(32, 4, True))


@gpu
@needs_cuda
def test_large_pool_offsets_gpu():
    """Slots whose record offset passes 2^31 bytes (size_t offsets in the kernel)."""
    h, d = _real_shape()
    swa_slots, main_slots = (1 << 31) // 528 + 64, (1 << 31) // 288 + 64
    try:
        swa_pool = torch.zeros(swa_slots, 528, dtype=torch.uint8, device="cuda")
        main_pool = torch.zeros(main_slots, 288, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    args = sparse_attn_problem(2, h, d, 16, 32, swa_slots=64, main_slots=64, device="cuda", seed=9)
    swa_pool[-64:] = args[1].view(-1, 528)
    main_pool[-64:] = args[3].view(-1, 288)
    sw = torch.where(args[2] >= 0, args[2] + swa_slots - 64, -1).int()
    mn = torch.where(args[4] >= 0, args[4] + main_slots - 64, -1).int()
    big = (args[0], swa_pool, sw, main_pool, mn, args[5])
    o = sparse_attn_decode(*big, 0.04)
    ref = sparse_attn_paged_ref(*args, 0.04)
    assert_attn_close(o, ref, args, 0.04, "pool offsets > 2^31")
