"""engine/quant.py against hand-computed bytes and an independent float64/numpy oracle.

Quantisation results are compared bitwise (bit patterns, so -0.0 != 0.0). Matmuls are compared with a
float64 product of the dequantised operands, within 1 bf16 ULP of the exact result plus the fp32
accumulation bound K * 2^-24 * sum|a*w|.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import quant
from engine.quant import (
    act_quant,
    act_quant_qdq,
    dequant_fp4_weight,
    dequant_fp8_weight,
    e2m1_decode,
    e2m1_encode,
    fp4_qdq,
    fp4_quant,
    linear,
    pack_fp4,
    quant_fp4_weight,
    quant_fp8_weight,
    ue8m0_scale,
    unpack_fp4,
)

BF16 = torch.bfloat16
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ---------------------------------------------------------------- helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().cpu().contiguous().view(by_size[t.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = _bits(actual), _bits(expected)
    bad = (a != e).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {len(bad)} of {a.numel()} differ; first at {i}: got {actual.cpu()[i].float().item()!r} "
            f"(bits {a[i].item():#x}), want {expected.cpu()[i].float().item()!r} (bits {e[i].item():#x})"
        )


def bf16(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    out = t.to(BF16)
    assert torch.equal(out.double(), t), f"test bug: {values} not exact in bf16"
    return out


def row(values, width: int = 32) -> list[float]:
    return list(values) + [0.0] * (width - len(values))


def e4m3_bytes(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn)


def e8m0(exponents) -> torch.Tensor:
    return (torch.tensor(exponents, dtype=torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


# Independent oracles in numpy: tables enumerated from the format definitions, nearest value with ties
# to the even code; fp32 products/quotients done in np.float32 (correctly rounded like torch).
def _e4m3_code_value(code: int) -> float:
    e, m = (code >> 3) & 0xF, code & 7
    return m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3_POS = np.array([_e4m3_code_value(c) for c in range(127)])  # codes 0..126, 127 is NaN
E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_to_table(v: np.ndarray, table: np.ndarray, qmax: float) -> np.ndarray:
    mag = np.minimum(np.abs(v), qmax)
    hi = np.clip(np.searchsorted(table, mag), 1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(np.signbit(v), -1.0, 1.0) * table[np.where(pick_hi, hi, lo)]


def pow2_ceil_scale(amax32: np.ndarray, inv: float) -> np.ndarray:
    y = (amax32.astype(np.float32) * np.float32(inv)).astype(np.float64)
    m, e = np.frexp(y)  # y = m * 2^e, m in [0.5, 1)
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def oracle_act_qdq(x: torch.Tensor, block: int = 32) -> np.ndarray:
    xg = x.float().numpy().astype(np.float64).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xg).max(-1), np.float32(1e-4))
    s = pow2_ceil_scale(amax, 1 / 448)[..., None]
    return (round_to_table(xg / s, E4M3_POS, 448.0) * s).reshape(x.shape)


def oracle_fp4_qdq(x: torch.Tensor, block: int, scale_fmt: str) -> np.ndarray:
    xg = x.float().numpy().reshape(*x.shape[:-1], -1, block)  # float32
    amax = np.abs(xg).max(-1)
    if scale_fmt == "ue8m0":
        s = pow2_ceil_scale(np.maximum(amax, np.float32(6 * 2.0**-126)), 1 / 6).astype(np.float32)
    else:
        q = np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6.0)
        s = round_to_table(q.astype(np.float64), E4M3_POS, 448.0).astype(np.float32)
    v = (xg / s[..., None]).astype(np.float64)  # float32 quotient, as torch computes it
    out = round_to_table(np.clip(v, -6, 6), E2M1_POS, 6.0) * s[..., None].astype(np.float64)
    return out.reshape(x.shape)


def random_bf16(shape, block: int = 32, seed: int = 0, exp_range: int = 20) -> torch.Tensor:
    """Normal values with a random power-of-two magnitude per block, some exact ties sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    exps = torch.randint(-exp_range, exp_range + 1, (*shape[:-1], shape[-1] // block, 1), generator=g)
    x = (x.unflatten(-1, (-1, block)) * torch.exp2(exps.float())).flatten(-2)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 17.0, 19.0, 464.0])
    x.view(-1)[:: 7] = ties[torch.randint(0, len(ties), x.view(-1)[::7].shape, generator=g)]
    return x.to(BF16)


def ulp_bf16(r: torch.Tensor) -> torch.Tensor:
    exp = torch.floor(torch.log2(r.abs().clamp_min(2.0**-126)))
    return torch.exp2(exp - 7)


def assert_matmul_close(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """y (bf16) vs exact a @ w^T in float64: within 1 bf16 ULP + fp32 accumulation bound."""
    a64, w64 = a.double().cpu(), w.double().cpu()
    a64 = a64.reshape(-1, a64.size(-1))
    ref = a64 @ w64.T
    bound = ulp_bf16(ref) + a64.size(1) * 2.0**-24 * (a64.abs() @ w64.abs().T)
    err = (y.double().cpu().reshape(ref.shape) - ref).abs()
    worst = (err / bound).argmax()
    i, j = divmod(worst.item(), ref.size(1))
    assert (err <= bound).all(), (
        f"{what}: worst [{i},{j}] got {y.reshape(ref.shape)[i, j].item()} want {ref[i, j].item()} "
        f"err {err[i, j].item():.3e} > bound {bound[i, j].item():.3e} "
        f"({(err[i, j] / ulp_bf16(ref[i, j])).item():.2f} bf16 ULP)"
    )


# ---------------------------------------------------------------- UE8M0 scale


def test_ue8m0_scale_powers_of_two_and_just_above():
    amax = torch.tensor([448.0, 448.0001, 224.0, 224.0001, 896.0, 1e-4, 448 * 2.0**-22])
    want = torch.tensor([1.0, 2.0, 0.5, 1.0, 2.0, 2.0**-22, 2.0**-22])
    assert_bitwise(ue8m0_scale(amax, 1 / 448), want, "ue8m0 1/448")
    amax = torch.tensor([6.0, 6.0001, 3.0, 12.0, 6 * 2.0**-126])
    want = torch.tensor([1.0, 2.0, 0.5, 2.0, 2.0**-126])
    assert_bitwise(ue8m0_scale(amax, 1 / 6), want, "ue8m0 1/6")
    assert ue8m0_scale(torch.ones(3, 0, 4), 1 / 448).shape == (3, 0, 4)


# ---------------------------------------------------------------- FP8 activations


def test_act_quant_hand_cases():
    rows = [
        # s = 1: ties 17->16, 19->20, 1.0625->1, 1.1875->1.25; subnormals 3*2^-10 -> 2^-8, 2^-10 -> 0,
        # 5*2^-10 -> 2^-8 (ties to even code); -0.0 keeps its sign
        row([448, 17, 19, 1.0625, 1.1875, -17, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10, 0, -0.0]),
        row([464, 232]),  # s = 2: 232 (tie 224|240) -> 224; 116 (tie 112|120) -> 112
        row([]),  # all zero: amax clamped to 1e-4 -> s = 2^ceil(log2(1e-4/448)) = 2^-22
        row([2.0**-20]),  # below the clamp too: s = 2^-22 (2^-28 without it), q = 4
        row([450, -225]),  # just above 448: s = 2; 225 -> 224, -112.5 -> -112
    ]
    x = bf16(rows)
    q, s = act_quant(x)
    assert_bitwise(s, torch.tensor([[1.0], [2.0], [2.0**-22], [2.0**-22], [2.0]]), "scales")
    want = torch.zeros(5, 32, dtype=torch.uint8)
    want[0, :11] = torch.tensor([0x7E, 0x58, 0x5A, 0x38, 0x3A, 0xD8, 0x02, 0x00, 0x02, 0x00, 0x80])
    want[1, :2] = torch.tensor([0x76, 0x6E])
    want[3, 0] = 0x48
    want[4, :2] = torch.tensor([0x76, 0xEE])
    assert_bitwise(q, want.view(torch.float8_e4m3fn), "e4m3 codes")
    qdq = act_quant_qdq(x)
    want_qdq = bf16(
        [
            row([448, 16, 20, 1, 1.25, -16, 2.0**-8, 0, 2.0**-8, 0, -0.0]),
            row([448, 224]),
            row([]),
            row([2.0**-20]),
            row([448, -224]),
        ]
    )
    assert_bitwise(qdq, want_qdq, "act_quant_qdq")


def test_e4m3_cast_saturates():
    v = torch.tensor([448.0, 464.0, 480.0, 1e4, float("inf"), -1e4, -float("inf")])
    assert_bitwise(quant._to_e4m3(v), e4m3_bytes([0x7E] * 5 + [0xFE] * 2), "saturating e4m3")


def test_act_quant_matches_oracle_and_shapes():
    x = random_bf16((3, 5, 256), seed=1)
    q, s = act_quant(x)
    assert q.shape == (3, 5, 256) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (3, 5, 8) and s.dtype == torch.float32
    assert_bitwise(act_quant_qdq(x).double(), torch.from_numpy(oracle_act_qdq(x)), "act qdq vs oracle")
    # block 128 too, and the qdq equals q * s
    q128, s128 = act_quant(x, 128)
    assert s128.shape == (3, 5, 2)
    deq = (q128.float().unflatten(-1, (-1, 128)) * s128[..., None]).flatten(-2).to(BF16)
    assert_bitwise(act_quant_qdq(x, 128), deq, "qdq == q*s (block 128)")
    empty_q, empty_s = act_quant(torch.zeros(0, 64, dtype=BF16))
    assert empty_q.shape == (0, 64) and empty_s.shape == (0, 2)


def test_act_quant_qdq_idempotent():
    x = random_bf16((4, 7, 128), seed=2)
    once = act_quant_qdq(x)
    assert_bitwise(act_quant_qdq(once), once, "act qdq twice")


def test_act_quant_contract():
    with pytest.raises(AssertionError, match="bf16"):
        act_quant(torch.zeros(2, 32))
    with pytest.raises(AssertionError, match="multiple"):
        act_quant(torch.zeros(2, 48, dtype=BF16))


# ---------------------------------------------------------------- E2M1 / FP4


def test_e2m1_encode_every_tie_and_sign():
    v = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    want = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7], dtype=torch.uint8)
    assert_bitwise(e2m1_encode(v), want, "ties")
    assert_bitwise(e2m1_encode(-v), want | 8, "negative ties")
    up = torch.nextafter(torch.tensor([0.25, 1.25, 2.5, 5.0]), torch.tensor(7.0))
    down = torch.nextafter(torch.tensor([0.75, 1.75, 3.5]), torch.tensor(0.0))
    assert_bitwise(e2m1_encode(up), torch.tensor([1, 3, 5, 7], dtype=torch.uint8), "just above even ties")
    assert_bitwise(e2m1_encode(down), torch.tensor([1, 3, 5], dtype=torch.uint8), "just below odd ties")
    assert_bitwise(e2m1_encode(torch.tensor([-0.0, -0.1, 0.1])), torch.tensor([8, 8, 0], dtype=torch.uint8), "zeros")


def test_e2m1_decode_table():
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    want = torch.tensor(mags + [-m for m in mags])
    assert_bitwise(e2m1_decode(torch.arange(16, dtype=torch.uint8)), want, "decode")
    assert torch.signbit(e2m1_decode(torch.tensor([8], dtype=torch.uint8))).item()


def test_pack_order_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert_bitwise(pack_fp4(codes), torch.tensor([[0x21, 0x8F]], dtype=torch.uint8), "pack")
    assert_bitwise(unpack_fp4(torch.tensor([[0x21, 0x8F]], dtype=torch.uint8)), codes, "unpack")
    as_fp4 = torch.tensor([0x21], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert_bitwise(unpack_fp4(as_fp4), torch.tensor([1, 2], dtype=torch.uint8), "unpack float4_e2m1fn_x2")


def test_mxfp4_hand_cases():
    x = bf16(
        [
            row([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5, -0.0, -0.125]),  # s = 1
            row([12, 10, 7, -5]),  # s = 2: 6, 5->4, 3.5->4, -2.5->-2
            row([6.0625, 0.75]),  # just above 6: s = 2; 3.03 -> 3, 0.375 -> 0.5
            row([]),  # zero: amax clamped to 6*2^-126 -> s = 2^-126 (E8M0 byte 1)
            row([2.0**-127, 3 * 2.0**-128, -(2.0**-126)]),  # s = 2^-126: 0.5, 0.75->1, -1
        ]
    )
    packed, s = fp4_quant(x, 32, "ue8m0")
    assert_bitwise(s, e8m0([[0], [1], [1], [-126], [-126]]), "MXFP4 scales")
    want = torch.zeros(5, 16, dtype=torch.uint8)
    want[0, :6] = torch.tensor([0x67, 0x46, 0x24, 0x02, 0x8E, 0x08])
    want[1, :2] = torch.tensor([0x67, 0xC6])
    want[2, :1] = torch.tensor([0x15])
    want[4, :2] = torch.tensor([0x21, 0x0A])
    assert_bitwise(packed, want, "MXFP4 packed codes")
    want_qdq = bf16(
        [
            row([6, 4, 4, 2, 2, 1, 1, 0, -4, -0.0, -0.0]),
            row([12, 8, 8, -4]),
            row([6, 1]),
            row([]),
            row([2.0**-127, 2.0**-126, -(2.0**-126)]),
        ]
    )
    assert_bitwise(fp4_qdq(x, 32, "ue8m0"), want_qdq, "MXFP4 qdq")


def test_nvfp4_e4m3_scale_hand_cases():
    x = bf16(
        [
            row([6, 5, -2.5], 16),  # amax/6 = 1 -> s = 1 (0x38)
            row([], 16),  # zero: amax clamped to 6*2^-9 -> s = 2^-9 (0x01)
            row([7], 16),  # 7/6 = 1.1667 -> 1.125 (0x39); 7/1.125 = 6.22 clamps to 6
            row([6.375], 16),  # 1.0625 ties 1|1.125 -> 1 (0x38)
            row([7.125, 1.875], 16),  # 1.1875 ties 1.125|1.25 -> 1.25 (0x3A); 5.7 -> 6, 1.5
            row([4096, 2240], 16),  # 682.7 saturates to 448 (0x7E); 9.14 -> 6, 5 (tie) -> 4
            row([2.0**-8], 16),  # below the clamp: s = 2^-9 (would be e4m3(6.5e-4) = 0), v = 2
        ]
    )
    packed, s = fp4_quant(x, 16, "e4m3")
    assert_bitwise(s, e4m3_bytes([[0x38], [0x01], [0x39], [0x38], [0x3A], [0x7E], [0x01]]), "NVFP4 scales")
    want = torch.zeros(7, 8, dtype=torch.uint8)
    want[0, :2] = torch.tensor([0x67, 0x0C])
    want[2, 0] = 0x07
    want[3, 0] = 0x07
    want[4, 0] = 0x37
    want[5, 0] = 0x67
    want[6, 0] = 0x04
    assert_bitwise(packed, want, "NVFP4 packed codes")
    want_qdq = bf16(
        [
            row([6, 4, -2], 16),
            row([], 16),
            row([6.75], 16),
            row([6], 16),
            row([7.5, 1.875], 16),
            row([2688, 1792], 16),
            row([2.0**-8], 16),
        ]
    )
    assert_bitwise(fp4_qdq(x, 16, "e4m3"), want_qdq, "NVFP4 qdq")


@pytest.mark.parametrize("block,scale_fmt", [(32, "ue8m0"), (16, "e4m3")])
def test_fp4_matches_oracle_and_qdq_idempotent(block, scale_fmt):
    x = random_bf16((2, 3, 128), block=block, seed=3)
    packed, s = fp4_quant(x, block, scale_fmt)
    assert packed.shape == (2, 3, 64) and packed.dtype == torch.uint8 and s.shape == (2, 3, 128 // block)
    qdq = fp4_qdq(x, block, scale_fmt)
    assert_bitwise(qdq.double(), torch.from_numpy(oracle_fp4_qdq(x, block, scale_fmt)), "fp4 qdq vs oracle")
    deq = (e2m1_decode(unpack_fp4(packed)).unflatten(-1, (-1, block)) * s.float()[..., None]).flatten(-2)
    assert_bitwise(deq.to(BF16), qdq, "qdq == decode(packed) * s")
    assert_bitwise(fp4_qdq(qdq, block, scale_fmt), qdq, "fp4 qdq twice")


def test_fp4_contract():
    with pytest.raises(ValueError, match="scale_fmt"):
        fp4_quant(torch.zeros(1, 32, dtype=BF16), 32, "e5m2")
    with pytest.raises(AssertionError, match="bf16"):
        fp4_qdq(torch.zeros(1, 32), 32, "ue8m0")


# ---------------------------------------------------------------- weights


def test_dequant_fp8_weight_partial_blocks():
    out_features, in_features = 33, 40  # scale blocks [2, 2], the last ones partial
    raw = torch.full((out_features, in_features), 0x38, dtype=torch.uint8)  # 1.0
    raw[0, 0], raw[32, 39], raw[31, 33] = 0x7E, 0xC0, 0x01  # 448, -2, 2^-9
    scale_exp = [[0, 1], [-1, 3]]
    got = dequant_fp8_weight(raw.view(torch.float8_e4m3fn), e8m0(scale_exp))
    want = torch.ones(out_features, in_features)
    want[0, 0], want[32, 39], want[31, 33] = 448, -2, 2.0**-9
    for r in range(out_features):
        for c in range(in_features):
            want[r, c] *= 2.0 ** scale_exp[r // 32][c // 32]
    assert_bitwise(got, want, "dequant fp8 (E8M0 scale)")
    fp32_scale = torch.exp2(torch.tensor(scale_exp, dtype=torch.float32))
    assert_bitwise(dequant_fp8_weight(raw.view(torch.float8_e4m3fn), fp32_scale), want, "dequant fp8 (fp32 scale)")
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        dequant_fp8_weight(raw.view(torch.float8_e4m3fn), e8m0([[0, 0]]))


def test_dequant_fp4_weight_hand_bytes_all_dtypes():
    raw = torch.zeros(2, 16, dtype=torch.uint8)
    raw[0, :3] = torch.tensor([0x21, 0x8F, 0x7A])  # 0.5, 1 | -6, -0 | -1, 6
    raw[1, 0] = 0x43  # 1.5, 2
    scale = e8m0([[1], [-1]])
    want = torch.zeros(2, 32)
    want[0, :6] = torch.tensor([1.0, 2.0, -12.0, -0.0, -2.0, 12.0])
    want[1, :2] = torch.tensor([0.75, 1.0])
    for view in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
        assert_bitwise(dequant_fp4_weight(raw.view(view), scale), want, f"dequant fp4 ({view})")
    with pytest.raises(ValueError, match="scale"):
        dequant_fp4_weight(raw, e8m0([[1, 1], [1, 1]]))


def test_quant_fp8_weight_round_trip():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(70, 100, generator=g)
    exps = torch.randint(-30, 31, (3, 4), generator=g).float()
    w *= torch.exp2(exps).repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :100]
    q, s = quant_fp8_weight(w)
    assert q.shape == (70, 100) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (3, 4) and s.dtype == torch.float8_e8m0fnu
    deq = dequant_fp8_weight(q, s)
    s_elem = s.float().repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :100]
    # e4m3 keeps 3 mantissa bits: RNE error <= 2^-4 |w| for normals, <= half the subnormal step
    # 2^-9 * s below; hence also <= 2^-4 of the block's amax (plus 2^-10 * s <= amax / 2^17).
    bound = 2.0**-4 * w.abs() + 2.0**-10 * s_elem
    err = (deq - w).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.3f} of the bound"
    # dequantised values are a fixed point (codes may not be: amax 224.5*s rounds to 224*s, and the
    # requantised block then picks s/2)
    assert_bitwise(dequant_fp8_weight(*quant_fp8_weight(deq)), deq, "requantise fp8 weight")
    assert_bitwise(dequant_fp8_weight(*quant_fp8_weight(deq.to(BF16))), deq, "requantise from bf16")


def test_quant_fp8_weight_hand_block():
    w = torch.zeros(32, 64)
    w[0, 0], w[5, 7], w[0, 32] = 448.0, -17.0, 2.0**-20  # block 0: s = 1; block 1: clamp -> 2^-22
    q, s = quant_fp8_weight(w)
    assert_bitwise(s, e8m0([[0, -22]]), "weight scales")
    assert _bits(q)[0, 0] == 0x7E and _bits(q)[5, 7] == 0xD8 and _bits(q)[0, 32] == 0x48


def test_quant_fp4_weight_round_trip():
    g = torch.Generator().manual_seed(5)
    block_exp = torch.randint(-20, 21, (48, 3), generator=g).float()
    w = torch.randn(48, 96, generator=g) * torch.exp2(block_exp).repeat_interleave(32, 1)
    packed, s = quant_fp4_weight(w)
    assert packed.shape == (48, 48) and packed.dtype == torch.uint8
    assert s.shape == (48, 3) and s.dtype == torch.float8_e8m0fnu
    deq = dequant_fp4_weight(packed, s)
    s_elem = s.float().repeat_interleave(32, 1)
    # E2M1 spacing is <= |v|/2 for |v| >= 1 and 0.5 below: error <= 0.25 * max(|w|, s)
    err = (deq - w).abs()
    assert (err <= 0.25 * torch.maximum(w.abs(), s_elem)).all()
    assert_bitwise(dequant_fp4_weight(*quant_fp4_weight(deq)), deq, "requantise fp4 weight")
    hand = torch.tensor([row([6, 5, 0.75, -0.25])])
    packed_h, s_h = quant_fp4_weight(hand)
    assert_bitwise(packed_h[:, :2], torch.tensor([[0x67, 0x82]], dtype=torch.uint8), "hand fp4 weight")
    assert_bitwise(s_h, e8m0([[0]]), "hand fp4 weight scale")


def test_weight_contract():
    with pytest.raises(ValueError):
        quant_fp8_weight(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError):
        quant_fp4_weight(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequant_fp8_weight(torch.zeros(4, 32, dtype=torch.uint8), e8m0([[0]]))


# ---------------------------------------------------------------- linear


def test_linear_fp8_vs_float64():
    x = (torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(6)) * 3).to(BF16)
    q, s = quant_fp8_weight(torch.randn(40, 96, generator=torch.Generator().manual_seed(7)))
    y = linear(x, q, s)
    assert y.shape == (2, 3, 40) and y.dtype == BF16
    assert_matmul_close(y, act_quant_qdq(x), dequant_fp8_weight(q, s), "fp8 linear")
    assert_bitwise(linear(x, q, s.float()), y, "fp32 scale gives the same result")


def test_linear_fp4_vs_float64_all_weight_dtypes():
    x = (torch.randn(5, 64, generator=torch.Generator().manual_seed(8)) * 0.1).to(BF16)
    packed, s = quant_fp4_weight(torch.randn(48, 64, generator=torch.Generator().manual_seed(9)))
    y = linear(x, packed, s)
    assert y.shape == (5, 48) and y.dtype == BF16
    assert_matmul_close(y, act_quant_qdq(x), dequant_fp4_weight(packed, s), "fp4 linear")
    for view in (torch.int8, torch.float4_e2m1fn_x2):
        assert_bitwise(linear(x, packed.view(view), s), y, f"fp4 linear ({view})")


def test_linear_is_unaffected_by_matmul_precision_mode():
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(16)).to(BF16)
    q, s = quant_fp8_weight(torch.randn(33, 64, generator=torch.Generator().manual_seed(17)))
    want = linear(x, q, s)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        got = linear(x, q, s)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(prev)
    assert_bitwise(got, want, "linear under 'medium' matmul precision")


def test_linear_unquantised():
    x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(10)).to(BF16)
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(11))
    # the exact product rounded once: float64 accumulation of these 32 terms is exact to ~1e-16
    exact = F.linear(x.double(), w.to(BF16).double())
    assert_bitwise(linear(x, w.to(BF16)), exact.float().to(BF16), "bf16 linear")
    y = linear(x, w)
    assert y.dtype == torch.float32
    assert_bitwise(y, F.linear(x.double(), w.double()).float(), "fp32 linear")


def test_linear_rows_do_not_depend_on_batch_size():
    x = (torch.randn(37, 96, generator=torch.Generator().manual_seed(20)) * 0.3).to(BF16)
    q8, s8 = quant_fp8_weight(torch.randn(72, 96, generator=torch.Generator().manual_seed(21)))
    q4, s4 = quant_fp4_weight(torch.randn(72, 96, generator=torch.Generator().manual_seed(22)))
    wb = torch.randn(72, 96, generator=torch.Generator().manual_seed(23)).to(BF16)
    for w, s in ((q8, s8), (q4, s4), (wb, None)):
        batch = linear(x, w, s)
        for r in (0, 17, 36):
            assert_bitwise(linear(x[r:r + 1], w, s), batch[r:r + 1], f"row {r} alone vs in a batch of 37")


def test_linear_errors_name_shapes():
    x = torch.zeros(2, 64, dtype=BF16)
    fp8 = torch.zeros(40, 64, dtype=torch.float8_e4m3fn)
    fp4 = torch.zeros(40, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(2, 2\).*\(40, 2\)"):
        linear(x, fp8, e8m0([[0, 0]] * 40))  # an FP4-shaped scale on an FP8 weight
    with pytest.raises(ValueError, match=r"\(40, 32\).*\(2, 2\)"):
        linear(x, fp4, e8m0([[0, 0]] * 2))  # an FP8-shaped scale on a packed FP4 weight
    with pytest.raises(ValueError, match="needs a scale"):
        linear(x, fp8)
    with pytest.raises(ValueError, match="takes no scale"):
        linear(x, torch.zeros(40, 64, dtype=BF16), e8m0([[0]]))
    with pytest.raises(ValueError, match=r"\(2, 96\)"):
        linear(torch.zeros(2, 96, dtype=BF16), fp8, e8m0([[0, 0]] * 2))
    with pytest.raises(ValueError, match="bf16"):
        linear(x.float(), fp8, e8m0([[0, 0]] * 2))


# ---------------------------------------------------------------- CUDA (same bits as CPU)


@pytest.mark.gpu
@requires_cuda
def test_cuda_matches_cpu():
    dev = torch.device("cuda")
    x = random_bf16((3, 4, 256), seed=12)
    for fn in (lambda t: act_quant(t), lambda t: (act_quant_qdq(t),)):
        for got, want in zip(fn(x.to(dev)), fn(x)):
            assert_bitwise(got.cpu(), want, "act_quant on CUDA")
    for block, fmt in ((32, "ue8m0"), (16, "e4m3")):
        for got, want in zip(fp4_quant(x.to(dev), block, fmt), fp4_quant(x, block, fmt)):
            assert_bitwise(got.cpu(), want, f"fp4_quant {fmt} on CUDA")
        assert_bitwise(fp4_qdq(x.to(dev), block, fmt).cpu(), fp4_qdq(x, block, fmt), f"fp4_qdq {fmt} on CUDA")
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(13))
    q, s = quant_fp8_weight(w)
    for got, want in zip(quant_fp8_weight(w.to(dev)), (q, s)):
        assert_bitwise(got.cpu(), want, "quant_fp8_weight on CUDA")
    assert_bitwise(dequant_fp8_weight(q.to(dev), s.to(dev)).cpu(), dequant_fp8_weight(q, s), "dequant fp8 CUDA")
    p, ps = quant_fp4_weight(w)
    for got, want in zip(quant_fp4_weight(w.to(dev)), (p, ps)):
        assert_bitwise(got.cpu(), want, "quant_fp4_weight on CUDA")
    assert_bitwise(dequant_fp4_weight(p.to(dev), ps.to(dev)).cpu(), dequant_fp4_weight(p, ps), "dequant fp4 CUDA")


@pytest.mark.gpu
@requires_cuda
def test_cuda_linear_ignores_tf32():
    dev = torch.device("cuda")
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(14)).to(BF16)
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(15))
    q, s = quant_fp8_weight(w)
    p, ps = quant_fp4_weight(w)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        y8 = linear(x.to(dev), q.to(dev), s.to(dev))
        y4 = linear(x.to(dev), p.to(dev), ps.to(dev))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(prev)
    a = act_quant_qdq(x)
    assert_matmul_close(y8, a, dequant_fp8_weight(q, s), "fp8 linear on CUDA")
    assert_matmul_close(y4, a, dequant_fp4_weight(p, ps), "fp4 linear on CUDA")


def test_oracle_tables_sane():
    # the oracle's own hand anchors, so the oracle is not trusted blindly
    assert E4M3_POS[0x7E] == 448 and E4M3_POS[0x38] == 1 and E4M3_POS[1] == 2.0**-9
    assert round_to_table(np.array([17.0, 19.0, -464.0]), E4M3_POS, 448.0).tolist() == [16, 20, -448]
    assert pow2_ceil_scale(np.array([448.0, 450.0], dtype=np.float32), 1 / 448).tolist() == [1, 2]
    assert math.isclose(float(np.float32(1 / 448)) * 448, 1.0, rel_tol=1e-7)
