"""Golden-model primitives against independent expectations: RoPE/YaRN (spec 3), Sinkhorn and the mHC
collapse/expand (spec 3, 4.2), the MoE router and expert clamps (spec 4.5), the Engram gate (spec 4.3).

Every expectation is computed here: with Python's math on scalars, explicit loops, or hand-picked
numbers whose result is known in closed form.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine.model.mhc import hc_post, hc_pre, hc_split_sinkhorn
from engine.model.rope import RotaryTable, apply_rotary, yarn_inv_freq
from engine.presets import tiny_config

BF16_HALF_ULP = 2.0**-8  # relative rounding error of one bf16 rounding (8 significant bits)


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    i = int(diff.argmax())
    idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), diff.shape))
    return f"worst at {idx}: got {actual.flatten()[i].item()!r}, expected {expected.flatten()[i].item()!r}"


# ---- RoPE -----------------------------------------------------------------------------------------

def _yarn_expected(dim: int, base: float, orig: int, factor: float, beta_fast: int, beta_slow: int):
    """(frequencies as Python floats, low, high) from spec 3's formula."""
    freqs = [base ** (-2 * i / dim) for i in range(dim // 2)]
    if orig <= 0:
        return freqs, None, None

    def corr(r: float) -> float:
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return out, low, high


def test_yarn_inv_freq_matches_formula_for_the_released_config():
    expected, low, high = _yarn_expected(64, 160000.0, 65536, 16.0, 32, 1)
    assert (low, high) == (15, 25)  # spec 3: "For base 160000 this gives low = 15, high = 25"
    got = yarn_inv_freq(64, 160000.0, 65536, 16.0, 32, 1)
    assert got.dtype == torch.float32 and got.shape == (32,)
    for i, (g, e) in enumerate(zip(got.tolist(), expected)):
        assert g == pytest.approx(e, rel=2e-6), f"i={i}: got {g}, expected {e}"
    # the ramp's two ends: below `low` the frequency is untouched, from `high` on it is divided by 16
    plain = [160000.0 ** (-2 * i / 64) for i in range(32)]
    assert got[15].item() == pytest.approx(plain[15], rel=2e-6)
    assert got[20].item() == pytest.approx(plain[20] / 16 * 0.5 + plain[20] * 0.5, rel=2e-6)
    assert got[25].item() == pytest.approx(plain[25] / 16, rel=2e-6)
    assert got[31].item() == pytest.approx(plain[31] / 16, rel=2e-6)


def test_yarn_inv_freq_without_original_seq_len_is_plain():
    for dim, base in ((64, 10000.0), (16, 160000.0)):
        got = yarn_inv_freq(dim, base, 0, 16.0, 32, 1)
        expected = [base ** (-2 * i / dim) for i in range(dim // 2)]
        assert got.tolist() == pytest.approx(expected, rel=2e-6)


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor, rd: int) -> torch.Tensor:
    """Explicit interleaved rotation of the last rd dims: [x0 cos - x1 sin, x0 sin + x1 cos] per pair.
    x [B,S,...,d] float64, angles [S, rd/2] float64."""
    out = x.clone()
    d = x.size(-1)
    for j in range(rd // 2):
        c0, c1 = d - rd + 2 * j, d - rd + 2 * j + 1
        shape = [1, angles.size(0)] + [1] * (x.dim() - 3)
        cos, sin = angles[:, j].cos().view(shape), angles[:, j].sin().view(shape)
        x0, x1 = x[..., c0], x[..., c1]
        out[..., c0] = x0 * cos - x1 * sin
        out[..., c1] = x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("head_shape", [(), (3,)], ids=["no-heads", "3-heads"])
def test_apply_rotary_is_an_explicit_pair_rotation_of_the_last_dims(head_shape):
    rd, d, base = 16, 40, 10000.0
    pos = torch.tensor([0, 1, 7, 300, 4097])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, pos.numel(), *head_shape, d, generator=gen)
    cis = RotaryTable(rd, base).at(pos).unsqueeze(0)  # [1,S,rd/2]
    freqs = torch.tensor([base ** (-2 * i / rd) for i in range(rd // 2)], dtype=torch.float64)
    angles = pos.double().unsqueeze(-1) * freqs  # [S, rd/2]
    expected = _rotate_pairs(x.double(), angles, rd)

    got = apply_rotary(x, cis)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got[..., :-rd], x[..., :-rd]), "head dims (the first d - rd) must be untouched"
    # fp32 angles: position 4097 times an fp32 frequency carries up to ~4097 * 2^-23 rad of rounding
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=4097 * 2.0**-23 * x.abs().max().item() * 2)
    small = pos < 8
    torch.testing.assert_close(got[:, small].double(), expected[:, small], rtol=0, atol=1e-5)

    back = apply_rotary(got, cis, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-5)  # fp32: the inverse undoes it

    xb = x.bfloat16()
    gb = apply_rotary(xb, cis)
    assert gb.dtype == torch.bfloat16
    assert torch.equal(gb[..., :-rd], xb[..., :-rd])
    torch.testing.assert_close(gb.float(), apply_rotary(xb.float(), cis).bfloat16().float(), rtol=0, atol=0)


def test_rotary_table_grows_beyond_its_first_size():
    rd, base, orig, factor = 16, 160000.0, 32, 4.0  # the tiny preset's compressed-layer table
    table = RotaryTable(rd, base, orig, factor, 32, 1)
    first = table.at(torch.arange(5))  # builds a small table
    assert first.shape == (5, rd // 2) and first.dtype == torch.complex64
    freqs, _, _ = _yarn_expected(rd, base, orig, factor, 32, 1)
    pos = torch.tensor([[5, 100], [1000, 4099]])
    far = table.at(pos)
    assert far.shape == (2, 2, rd // 2)
    for p_row, c_row in zip(pos.tolist(), far):
        for p, c in zip(p_row, c_row):
            for j, f in enumerate(freqs):
                a = p * f
                # the table's angle is fp32(p) * fp32(f): |error| <= p * f * 2^-23
                tol = 1e-6 + 2 * a * 2.0**-23
                assert abs(c[j].real.item() - math.cos(a)) <= tol and abs(c[j].imag.item() - math.sin(a)) <= tol, (
                    f"position {p}, pair {j}: got {c[j].item()}, expected angle {a}")
    assert torch.equal(table.at(torch.arange(5)), first), "growing the table changed earlier positions"


# ---- Sinkhorn and the mHC collapse / expand --------------------------------------------------------

def _sinkhorn_loop(m: list[float], scale: list[float], base: list[float], n: int, iters: int, eps: float):
    """Spec 3 hc_split_sinkhorn for one token, in Python floats."""
    def sig(v):
        return 1 / (1 + math.exp(-v))

    pre = [sig(m[i] * scale[0] + base[i]) + eps for i in range(n)]
    post = [2 * sig(m[n + i] * scale[1] + base[n + i]) for i in range(n)]
    logits = [[m[2 * n + r * n + c] * scale[2] + base[2 * n + r * n + c] for c in range(n)] for r in range(n)]
    comb = []
    for row in logits:
        mx = max(row)
        e = [math.exp(v - mx) for v in row]
        comb.append([v / sum(e) + eps for v in e])

    def col_norm(c):
        sums = [sum(c[r][k] for r in range(n)) + eps for k in range(n)]
        return [[c[r][k] / sums[k] for k in range(n)] for r in range(n)]

    def row_norm(c):
        return [[v / (sum(row) + eps) for v in row] for row in c]

    comb = col_norm(comb)
    for _ in range(iters - 1):
        comb = col_norm(row_norm(comb))
    return pre, post, comb


def test_hc_split_sinkhorn_matches_a_loop_version():
    n, iters, eps = 4, 20, 1e-6
    gen = torch.Generator().manual_seed(2)
    mixes = torch.randn(2, 3, (2 + n) * n, generator=gen) * 3
    scale = torch.tensor([0.7, 1.3, 2.0])
    base = torch.randn((2 + n) * n, generator=gen)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, n, iters, eps)
    assert pre.shape == (2, 3, n) and post.shape == (2, 3, n) and comb.shape == (2, 3, n, n)
    for b in range(2):
        for s in range(3):
            e_pre, e_post, e_comb = _sinkhorn_loop(mixes[b, s].tolist(), scale.tolist(), base.tolist(), n, iters, eps)
            assert pre[b, s].tolist() == pytest.approx(e_pre, rel=1e-5, abs=1e-7)
            assert post[b, s].tolist() == pytest.approx(e_post, rel=1e-5, abs=1e-7)
            for r in range(n):
                assert comb[b, s, r].tolist() == pytest.approx(e_comb[r], rel=1e-4, abs=1e-6), f"b={b} s={s} row {r}"


@pytest.mark.parametrize("spread", [1.0, 10.0], ids=["moderate", "saturating"])
def test_hc_split_sinkhorn_properties(spread):
    n, eps = 4, 1e-6
    gen = torch.Generator().manual_seed(3)
    mixes = torch.randn(256, (2 + n) * n, generator=gen) * spread
    scale = torch.tensor([1.0, 1.0, 1.0])
    base = torch.randn((2 + n) * n, generator=gen)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, n, 20, eps)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    # ends on a column normalisation: columns sum to 1 up to eps and fp32 rounding, for any input
    col_err = (comb.sum(-2) - 1).abs().max().item()
    assert col_err < 1e-5, f"max |column sum - 1| = {col_err}"
    assert bool((comb > 0).all())
    if spread == 1.0:
        # rows are only approximately 1 after 20 iterations; near one-hot softmaxes (the saturating
        # case) converge much more slowly (measured ~0.08), so the bound is for moderate mixes only
        row_err = (comb.sum(-1) - 1).abs().max().item()
        assert row_err < 2e-3, f"after 20 iterations rows should be ~1, max |row sum - 1| = {row_err}"
    assert bool((pre > eps).all() and (pre <= 1 + eps).all()), (pre.min().item(), pre.max().item())
    # post = 2 sigmoid(.) lies in (0, 2); fp32 sigmoid saturates to exactly 0 or 1 for large |arg|
    assert bool((post >= 0).all() and (post <= 2).all()), (post.min().item(), post.max().item())
    moderate = post[(mixes[:, n:2 * n] * scale[1] + base[n:2 * n]).abs() < 15]
    assert moderate.numel() > 0 and bool((moderate > 0).all() and (moderate < 2).all())


def test_hc_pre_and_hc_post_are_explicit_sums_with_comb_transposed():
    n, d = 4, 6
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(1, 2, n, d, generator=gen)  # fp32 stream: no rounding in the comparison
    a = torch.rand(1, 2, n, generator=gen)
    y = torch.randn(1, 2, d, generator=gen)
    post = torch.rand(1, 2, n, generator=gen) * 2
    comb = torch.rand(1, 2, n, n, generator=gen)  # deliberately not symmetric
    assert not torch.allclose(comb, comb.transpose(-1, -2))

    got_pre = hc_pre(X, a)
    got_post = hc_post(y, X, post, comb)
    assert got_pre.shape == (1, 2, d) and got_post.shape == (1, 2, n, d)
    for s in range(2):
        for c in range(d):
            e = sum(a[0, s, k].item() * X[0, s, k, c].item() for k in range(n))
            assert got_pre[0, s, c].item() == pytest.approx(e, rel=1e-6, abs=1e-6)
            for k in range(n):
                e = post[0, s, k].item() * y[0, s, c].item() + sum(
                    comb[0, s, j, k].item() * X[0, s, j, c].item() for j in range(n))
                assert got_post[0, s, k, c].item() == pytest.approx(e, rel=1e-6, abs=1e-6), (s, k, c)

    # bf16 stream: the sums are taken in (at least) fp32 and rounded once to bf16
    Xb, yb = X.bfloat16(), y.bfloat16()
    pre_b = hc_pre(Xb, a)
    post_b = hc_post(yb, Xb, post, comb)
    assert pre_b.dtype == post_b.dtype == torch.bfloat16
    torch.testing.assert_close(pre_b, hc_pre(Xb.double(), a.double()).bfloat16(), rtol=BF16_HALF_ULP * 2, atol=0)
    torch.testing.assert_close(post_b, hc_post(yb.double(), Xb.double(), post.double(), comb.double()).bfloat16(),
                               rtol=BF16_HALF_ULP * 2, atol=0)


# ---- MoE router and experts -----------------------------------------------------------------------

def _sqrt_softplus(v: float) -> float:
    return math.sqrt(math.log1p(math.exp(v)))


def test_gate_sqrt_softplus_bias_selects_raw_scores_weigh():
    from engine.model.moe import Gate

    cfg = tiny_config()
    assert (cfg.score_func, cfg.norm_topk_prob, cfg.route_scale, cfg.gate_temp) == ("sqrtsoftplus", True, 1.5, 1.0)
    gate = Gate(cfg, n_experts=4, topk=2)
    logits = [2.0, 1.0, 0.5, -1.0]  # exact in bf16
    bias = [0.0, 0.0, 1.0, 0.0]
    gate.weight.zero_()
    gate.weight[:, 0] = torch.tensor(logits)
    gate.bias.copy_(torch.tensor(bias))
    x = torch.zeros(2, cfg.dim, dtype=torch.bfloat16)
    x[0, 0], x[1, 0] = 1.0, -1.0  # token 1 sees the negated logits
    weights, ids = gate(x)
    assert weights.shape == (2, 2) and ids.shape == (2, 2) and weights.is_floating_point()

    for t, sign in enumerate((1.0, -1.0)):
        s = [_sqrt_softplus(sign * v) for v in logits]
        chosen = sorted(range(4), key=lambda e: s[e] + bias[e], reverse=True)[:2]
        expected = {e: s[e] / (s[chosen[0]] + s[chosen[1]]) * 1.5 for e in chosen}
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(expected), f"token {t}: experts {sorted(got)}, expected {sorted(expected)}"
        for e in expected:
            assert got[e] == pytest.approx(expected[e], rel=1e-6), (t, e)
    # token 0: expert 2 only wins through its bias, and its weight still comes from its raw score
    assert set(ids[0].tolist()) == {0, 2}
    s0, s2 = _sqrt_softplus(2.0), _sqrt_softplus(0.5)
    assert dict(zip(ids[0].tolist(), weights[0].tolist()))[2] == pytest.approx(1.5 * s2 / (s0 + s2), rel=1e-6)


def _silu(v: float) -> float:
    return v / (1 + math.exp(-v))


def test_expert_clamps_up_both_sides_and_gate_only_above():
    from engine.model.moe import Expert

    dim = inter = 4
    expert = Expert(dim, inter, "bf16", limit=10.0)
    g = [12.0, -12.0, 3.0, -3.0]  # gate pre-activations
    u = [15.0, -15.0, 2.0, -11.0]  # up pre-activations
    expert.w1.weight.zero_()
    expert.w3.weight.zero_()
    expert.w1.weight[:, 0] = torch.tensor(g)
    expert.w3.weight[:, 0] = torch.tensor(u)
    expert.w2.weight.copy_(torch.eye(dim))
    x = torch.zeros(1, dim, dtype=torch.bfloat16)
    x[0, 0] = 1.0

    expected = [_silu(min(gi, 10.0)) * max(min(ui, 10.0), -10.0) for gi, ui in zip(g, u)]
    # 12 -> 10 (above), -12 stays -12 (no clamp below), 15 -> 10, -15 -> -10, -11 -> -10
    assert expected[1] == pytest.approx(_silu(-12.0) * -10.0)
    for w in (None, 0.375):
        out = expert(x, None if w is None else torch.tensor([[w]]))
        assert out.dtype == torch.bfloat16 and out.shape == (1, dim)
        scale = 1.0 if w is None else w
        for i in range(dim):
            e = expected[i] * scale
            assert out[0, i].item() == pytest.approx(e, rel=BF16_HALF_ULP * 1.01, abs=1e-30), (i, w, out[0].tolist())


# ---- Engram gate --------------------------------------------------------------------------------

def test_engram_gate_signed_sqrt_per_copy_normalisation():
    from engine.model.engram import Engram

    cfg = replace(tiny_config(), dim=32, dtype="bf16")
    D, hc = cfg.dim, cfg.hc_mult
    engram = Engram(cfg, 0)
    # one table row holding a unit vector; every other column of the lookup reads an all-zero row, so
    # the wkv input is e_0 and key/value are simply column 0 of wkv
    engram.embed.weight.copy_(torch.zeros_like(engram.embed.weight, dtype=torch.float32).to(torch.float8_e4m3fn))
    engram.embed.weight[0, 0] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    engram.embed.scale.copy_(torch.ones(engram.embed.scale.shape).to(torch.float8_e8m0fnu))
    hash_ids = torch.ones(1, 2, cfg.n_hash_cols, dtype=torch.long)
    hash_ids[..., 0] = 0
    key = torch.full((hc, D), 2.0)
    value = torch.tensor([(d - 16) / 8 for d in range(D)])
    engram.wkv.weight.zero_()
    engram.wkv.weight[:, 0] = torch.cat([key.flatten(), value]).bfloat16()
    engram.k_weight.fill_(1.0)
    engram.q_weight.fill_(1 / 8)
    engram.q_weight[3] = 2.0**-20  # copy 3's dot falls below the 1e-6 clamp

    h = torch.empty(1, 2, hc, D)
    h[:, :, 0] = 1.0
    h[:, :, 1] = -1.0
    h[:, :, 2] = 4.0  # copy 0 scaled: the per-copy normalisation must give copy 0's gate
    h[:, :, 3] = torch.tensor([1.0] * 17 + [-1.0] * 15)
    x = h.bfloat16()

    # dot = sum(h * w * key) * rsqrt(mean h^2) * rsqrt(mean key^2) * D^-0.5
    d0 = (D * 1 * (1 / 8) * 2) * 1 * 0.5 / math.sqrt(D)  # = 4 / sqrt(32)
    d3 = (2 * 2.0**-20 * 2) * 1 * 0.5 / math.sqrt(D)
    assert d3 < 1e-6

    def sig(v):
        return 1 / (1 + math.exp(-v))

    gates = [sig(math.sqrt(d0)), sig(-math.sqrt(d0)), sig(math.sqrt(d0)), sig(math.sqrt(1e-6))]
    out = engram(x, hash_ids)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    expected = torch.stack([h[0, 0, k] + gates[k] * value for k in range(hc)])  # [hc, D]
    for s in range(2):
        torch.testing.assert_close(out[0, s].float(), expected.bfloat16().float(), rtol=BF16_HALF_ULP * 2.01, atol=1e-6,
                                   msg=lambda m: f"{m}\n{_worst(out[0, s].float(), expected)}")

    masked = engram(x, hash_ids, torch.tensor([[True, False]]))
    assert torch.equal(masked[0, 1], x[0, 1]), "a masked token must pass through unchanged (gate 0)"
    assert torch.equal(masked[0, 0], out[0, 0])
