"""CPU checks of the CUDA FP4 expert GEMVs (cuda/moe_fp4.cu, engine/kernels/moe_fp4.py); their GPU tests against
the golden MoE math are in test_moe.py (test_fp4_*, test_plan_and_quant_*).

Here: the source builds and every launcher rejects parameters outside its contract before touching the device;
the Python shared-memory model equals the launcher's; the picked launch shapes are valid; and a torch emulation
of the kernel's data path (the E2M1 -> f16 bit placement of `e2m1_pair`, the bytes ldmatrix hands each thread,
the mma.sync m16n8k16 fragment tables of the PTX ISA, the permuted activation order) computes each 32-block's
exact dot product, so a wrong pairing, permutation or fragment index fails on CPU. dequant_rows inverts the
permuted order.
"""

import ctypes

import pytest
import torch

from engine.kernels import cuda_build
from engine.kernels.moe_fp4 import CHUNK, Fp4Params, declare, dequant_rows, pick_params, smem_bytes
from engine.presets import full_config
from engine.quant import fp4_byte_table
from tests.kernels.numeric import e2m1_pair

needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue
PERM8 = [0, 4, 1, 5, 2, 6, 3, 7]  # element stored at each position of an 8-group (position s holds PERM8[s])


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    """The launcher library, built once for the module's tests (nvcc takes most of their time)."""
    return declare(ctypes.CDLL(str(cuda_build.build("moe_fp4", tmp_path_factory.mktemp("moe_fp4")))))


@needs_nvcc
def test_launchers_reject_parameters_outside_the_contract(lib):
    ok = dict(up=1, tiles=6, n=2304, k=5120, kc=2560, x_rows=1, wn=8, wk=1, s=2, st=2)
    assert lib.dsv41_moe_fp4_smem(ok["kc"], 1, 8, 1, 2) > 0
    bad = [dict(kc=2500), dict(x_rows=0), dict(x_rows=33), dict(wn=8, wk=2), dict(st=1), dict(st=5), dict(s=9),
           dict(s=3),  # (splits - 1) * kc >= K: a rank without columns
           dict(s=1),  # splits * kc < K: columns nobody owns
           dict(wn=3, wk=1),  # up quantises h per 32 outputs: warps_n must be even
           dict(n=2300), dict(k=5000, kc=2560), dict(kc=128 * 1600, s=1, k=128 * 1600)]  # x tile past the opt-in
    for change in bad:
        a = ok | change
        err = lib.dsv41_moe_fp4(a["up"], None, None, None, None, None, None, None, None, a["tiles"], None, None, None,
                                None, None, a["n"], a["k"], 6, 10.0, a["kc"], a["x_rows"], a["wn"], a["wk"], a["s"],
                                a["st"], 1, None)
        assert err == CUDA_INVALID_VALUE, f"{change}: launcher returned {err}"
    for change in (dict(mt=7), dict(e=0), dict(k=48), dict(e=5000)):  # 5000 experts: 60 KB of plan counts
        a = dict(r=6, e=384, bm=8, mt=6, k=5120) | change
        err = lib.dsv41_moe_plan_quant(None, a["r"], a["e"], a["bm"], a["mt"], None, None, None, None, None, 1,
                                       a["k"], None)
        assert err == CUDA_INVALID_VALUE, f"plan {change}: launcher returned {err}"
    assert lib.dsv41_moe_quant_rows(None, None, None, 1, 48, None) == CUDA_INVALID_VALUE
    for change in (dict(splits=0), dict(t=-1), dict(e=0), dict(e=1025), dict(k=0), dict(k=33), dict(e=4, k=5),
                   dict(norm=2)):
        a = dict(splits=20, t=1, e=384, k=6, norm=1) | change
        err = lib.dsv41_moe_route(None, None, None, None, a["splits"], a["t"], a["e"], a["k"], 1.5, a["norm"], None)
        assert err == CUDA_INVALID_VALUE, f"route {change}: launcher returned {err}"
    assert lib.dsv41_moe_route(None, None, None, None, 20, 0, 384, 6, 1.5, 1, None) == 0  # no tokens: no launch


@needs_nvcc
def test_shared_memory_model_matches_the_launcher(lib):
    for k in (5120, 2304, 256, 128):
        for x_rows in (1, 3, 8, 9, 16, 17, 32):  # tiles of one, two and four fragments
            for p in (Fp4Params(8, 1, 2, 2), Fp4Params(2, 2, 1, 6), Fp4Params(4, 2, 3, 3), Fp4Params(1, 1, 1, 8)):
                assert smem_bytes(k, x_rows, p) == lib.dsv41_moe_fp4_smem(p.kc(k), x_rows, p.warps_n, p.warps_k,
                                                                           p.stages), (k, x_rows, p)


def test_picked_shapes_are_launchable():
    cfg = full_config()
    d, inter = cfg.dim, cfg.moe_inter_dim
    for up, n, k in ((True, inter, d), (False, d, inter), (True, 128, 256), (False, 256, 128)):
        for tiles in (1, 6, 54, 432):
            for x_rows in (1, 8, 16, 32):
                p = pick_params(up, n, k, tiles, x_rows)
                kc, chunks = p.kc(k), k // CHUNK
                assert kc % CHUNK == 0 and (p.splits - 1) * kc < k <= p.splits * kc, (p, k)
                assert p.warps_n * p.warps_k <= 8 and (not up or p.warps_n % 2 == 0) and 1 <= p.splits <= chunks
                assert smem_bytes(k, x_rows, p) <= 100 * 1024, "two CTAs per SM"


def _f16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).item()


def test_nibble_bit_placement_is_the_e2m1_value_times_2_pow_minus_14():
    table = fp4_byte_table(torch.device("cpu")).view(256, 2)  # byte -> (low nibble value, high nibble value)
    for w in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C, 0x89ABCDEF):
        values = [table[(w >> (8 * b)) & 0xFF, i].item() for b in range(4) for i in range(2)]  # elements 0..7
        for j in range(4):
            lo, hi = e2m1_pair(w, j)
            assert _f16(lo) == values[j] * 2.0**-14 and _f16(hi) == values[j + 4] * 2.0**-14, (hex(w), j)


def _mma_16816(a_regs, b_regs) -> torch.Tensor:
    """C [16, 8] of mma.sync m16n8k16 from per-thread registers, via the PTX fragment tables: thread (g, t) holds
    A (row g, k 2t..2t+1), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..) and B (k 2t.., col g),
    (k 2t+8.., col g); each register is a pair (low = first k)."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for (r0, k0), (lo, hi) in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)), a_regs[lane]):
            A[r0, k0], A[r0, k0 + 1] = lo, hi
        for k0, (lo, hi) in zip((2 * t, 2 * t + 8), b_regs[lane]):
            B[k0, g], B[k0 + 1, g] = lo, hi
    return A @ B


def test_fragments_compute_each_32_block_dot_product():
    """One 32-block of 16 weight rows x 8 tokens through the kernel's data path equals the plain product."""
    g_ = torch.Generator().manual_seed(0)
    wbytes = torch.randint(0, 256, (16, 16), generator=g_, dtype=torch.int32)  # rows x 16 bytes (32 elements)
    table = fp4_byte_table(torch.device("cpu")).view(256, 2).double()
    w = table[wbytes.long()].reshape(16, 32)  # natural order: element 2i low nibble, 2i + 1 high nibble of byte i
    x = torch.randint(-448, 449, (8, 32), generator=g_).double()  # stand-ins for E4M3 codes (exact in f16/f64)
    x_perm = x.view(8, 4, 8)[:, :, PERM8].reshape(8, 32)  # as quant_rows stores them
    a_regs, b_regs = {}, {}
    for lane in range(32):
        g, t = lane // 4, lane % 4
        words = []
        for row in (g, g + 8):  # ldmatrix: bytes 4t..4t+3 of the row's 16 bytes
            words.append(sum(int(wbytes[row, 4 * t + i]) << (8 * i) for i in range(4)))
        pairs = {(row, j): tuple(_f16(h) * 2.0**14 for h in e2m1_pair(wd, j)) for row, wd in enumerate(words)
                 for j in range(4)}
        q = x_perm[g, 8 * t: 8 * t + 8].tolist()  # the thread's 16-byte shared-memory load
        a_regs[lane] = ([pairs[(0, 0)], pairs[(1, 0)], pairs[(0, 1)], pairs[(1, 1)]],   # MMA 1
                        [pairs[(0, 2)], pairs[(1, 2)], pairs[(0, 3)], pairs[(1, 3)]])   # MMA 2
        b_regs[lane] = ([(q[0], q[1]), (q[2], q[3])], [(q[4], q[5]), (q[6], q[7])])
    c = (_mma_16816({ln: a_regs[ln][0] for ln in a_regs}, {ln: b_regs[ln][0] for ln in b_regs})
         + _mma_16816({ln: a_regs[ln][1] for ln in a_regs}, {ln: b_regs[ln][1] for ln in b_regs}))
    assert torch.equal(c, w @ x.T), "the fragments do not compute the block's product"


def test_dequant_rows_inverts_the_permuted_order():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-448, 449, (3, 64), generator=g).to(torch.float16)
    scales = torch.ldexp(torch.ones(3, 2), torch.randint(-8, 8, (3, 2), generator=g))
    stored = codes.view(3, 8, 8)[:, :, PERM8].reshape(3, 64)
    assert torch.equal(dequant_rows(stored, scales), codes.float() * scales.repeat_interleave(32, dim=1))
