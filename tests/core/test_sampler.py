"""engine/core/sampler.py against hand-computed supports, python-math softmax, a sort-based filter oracle
and batch-invariance checks. (The noise itself is tested in tests/kernels/test_gumbel.py.)

Token ids are compared exactly. Empirical distributions use fixed seeds (so the tests are deterministic)
and Pearson's chi-square against the exact softmax, with the 0.1% critical value for V-1 dof.
"""

import math

import pytest
import torch

from engine.core import sampler
from engine.core.sampler import SampleRow, filter_logits, sample
from engine.core.sampling_params import SamplingParams
from engine.kernels.gumbel import gumbel_noise_ref

CHI2_999 = {3: 16.27, 4: 18.47}  # chi-square critical values at p = 0.001 by degrees of freedom


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def _draws(logits_row: torch.Tensor, params: SamplingParams, num: int, step: int = 0) -> list[int]:
    """num tokens from one logits row [1, V] under seeds 0..num-1, sampled as one batch."""
    rows = [SampleRow(params, seed=s, step=step) for s in range(num)]
    return sample(logits_row.expand(num, -1).contiguous(), rows).token_ids


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _chi2(draws: list[int], probs: list[float]) -> float:
    n = len(draws)
    return sum((draws.count(i) - n * p) ** 2 / (n * p) for i, p in enumerate(probs))


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_ties_to_lower_id() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 1.0, 5.0, 5.0], [float("-inf"), -1.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=7)  # filters are ignored when greedy
    out = sample(logits, [SampleRow(params, seed=s, step=s) for s in range(3)])
    assert out.token_ids == [1, 0, 1]
    assert out.logprobs == [None, None, None]


def test_empty_batch() -> None:
    out = sample(torch.zeros(0, 7), [])
    assert out.token_ids == [] and out.logprobs == []


# ---------------------------------------------------------------- seeding and batch invariance


def test_same_seed_step_same_token_anywhere_in_any_batch() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 257
    target = torch.randn(1, vocab, generator=g) * 2
    others = torch.randn(5, vocab, generator=g) * 2
    other_rows = [
        SampleRow(SamplingParams(temperature=0.0), seed=1, step=0),
        SampleRow(SamplingParams(temperature=1.3, top_p=0.7), seed=2, step=5),
        SampleRow(SamplingParams(temperature=0.6, top_k=9), seed=3, step=1),
        SampleRow(SamplingParams(temperature=1.0, min_p=0.2), seed=4, step=2),
        SampleRow(SamplingParams(temperature=0.9), seed=5, step=3),
    ]
    for params in [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)]:
        for seed, step in [(0, 0), (123, 4), (2**63 - 1, 10_000)]:
            row = SampleRow(params, seed=seed, step=step)
            alone = sample(target, [row]).token_ids[0]
            first = sample(torch.cat([target, others]), [row, *other_rows]).token_ids[0]
            last = sample(torch.cat([others[:3], target]), [*other_rows[:3], row]).token_ids[-1]
            assert alone == first == last, f"{params} seed={seed} step={step}: {alone} {first} {last}"


def _noise(seed: int, step: int, vocab: int) -> torch.Tensor:
    return gumbel_noise_ref(torch.tensor([seed]), torch.tensor([step]), vocab)[0]


def test_noise_depends_only_on_seed_step_and_token_id() -> None:
    assert torch.equal(_noise(42, 3, 100), _noise(42, 3, 100))
    assert torch.equal(_noise(42, 3, 100), _noise(42, 3, 1000)[:100])  # a token's noise ignores the vocab size
    assert not torch.equal(_noise(42, 3, 100), _noise(42, 4, 100))
    assert not torch.equal(_noise(42, 3, 100), _noise(43, 3, 100))
    rows = torch.stack([_noise(s, t, 8) for s in range(30) for t in range(30)])
    assert len({tuple(r.tolist()) for r in rows}) == 900


def test_seed_bit_pattern_is_the_key() -> None:
    # seeds are 64-bit keys: 2^64 - 1 and -1 are one key; the sampler accepts any Python int
    logits = torch.zeros(1, 64)
    params = SamplingParams(temperature=1.0)
    a = sample(logits, [SampleRow(params, seed=2**64 - 1, step=2**40)]).token_ids
    expected = int((logits + gumbel_noise_ref(torch.tensor([-1]), torch.tensor([2**40]), 64)).argmax())
    assert a == [expected]


def test_different_steps_give_different_draws() -> None:
    vocab = 1000
    logits = torch.zeros(1, vocab)
    params = SamplingParams(temperature=1.0)
    steps = 300
    tokens = [sample(logits, [SampleRow(params, seed=9, step=t)]).token_ids[0] for t in range(steps)]
    # uniform over 1000: 300 draws have ~258 distinct values on average (sd ~ 6)
    assert len(set(tokens)) > 220, len(set(tokens))


# ---------------------------------------------------------------- filters


def test_top_k_one_equals_greedy_any_temperature() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 50, generator=g)
    logits[3, [4, 9]] = 10.0  # a tie at the max: top_k=1 keeps the lower id, like argmax
    greedy = logits.argmax(dim=-1).tolist()
    for temperature in (0.3, 1.0, 2.0):
        rows = [SampleRow(SamplingParams(temperature=temperature, top_k=1), seed=s, step=s) for s in range(8)]
        assert sample(logits, rows).token_ids == greedy


def test_top_k_support_is_k_largest() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 12, generator=g)
    expected = set(logits[0].topk(3).indices.tolist())
    assert set(_draws(logits, SamplingParams(temperature=1.5, top_k=3), 1500)) == expected


def test_top_k_ties_at_kth_value_go_to_lower_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2), 400)) == {1, 2}


@pytest.mark.parametrize(
    "top_p, support",
    [(0.4, {0}), (0.79, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_support_hand_computed(top_p: float, support: set[int]) -> None:
    # probs 0.5, 0.3, 0.15, 0.05: the smallest prefix with mass >= top_p
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=top_p), 1500)) == support


def test_top_p_applies_to_top_k_survivors_renormalised() -> None:
    # top_k=2 leaves {0.5, 0.3} -> renormalised {0.625, 0.375}; top_p=0.6 is met by token 0 alone.
    # (On the un-renormalised probs, 0.5 < 0.6 would also keep token 1.)
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), 500)) == {0}


@pytest.mark.parametrize("min_p, support", [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.35, {0, 1}), (0.9, {0})])
def test_min_p_support_hand_computed(min_p: float, support: set[int]) -> None:
    # probs 0.5, 0.3, 0.15, 0.05: keep p >= min_p * 0.5
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    assert set(_draws(logits, SamplingParams(temperature=1.0, min_p=min_p), 1500)) == support


def _filter_oracle(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """The filters by their definition, one row at a time with a full stable sort in float64."""
    out = x.double().clone()
    for m, p in enumerate(ps):
        row = out[m]
        vals, order = row.sort(descending=True, stable=True)  # (value desc, id asc)
        vocab = row.numel()
        k = p.top_k if 0 < p.top_k < vocab else vocab
        vals[k:] = float("-inf")
        if p.top_p < 1.0:
            probs = vals.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            vals[mass_before >= p.top_p] = float("-inf")
        row = torch.empty_like(row).scatter_(0, order, vals)
        if p.min_p > 0.0:
            row[row - row.max() < math.log(p.min_p)] = float("-inf")
        out[m] = row
    return out


def test_filters_match_sort_oracle_with_many_ties() -> None:
    # integer-valued logits: many ties at every cut; k both below (top-k select) and above the vocab
    g = torch.Generator().manual_seed(5)
    vocab = 40
    x = torch.randint(-3, 4, (48, vocab), generator=g).float() * 0.5
    ps = [SamplingParams(temperature=1.0, top_k=[0, 1, 3, 7, 20, 45][i % 6], top_p=[1.0, 0.9, 0.5, 0.2][i % 4],
                         min_p=[0.0, 0.0, 0.3, 0.05, 1.0][i % 5]) for i in range(48)]
    got = filter_logits(x, ps)
    ref = _filter_oracle(x, ps)
    for m in range(48):
        kept, kept_ref = torch.isfinite(got[m]).nonzero().flatten(), torch.isfinite(ref[m]).nonzero().flatten()
        assert kept.tolist() == kept_ref.tolist(), f"row {m} {ps[m]}: kept {kept.tolist()} vs {kept_ref.tolist()}"
        assert torch.equal(got[m][kept], x[m][kept]), f"row {m}: kept values changed"


def test_filters_sort_path_matches_select_path(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-4, 5, (16, 300), generator=g).float()
    ps = [SamplingParams(temperature=1.0, top_k=5 + 9 * i, top_p=1.0 - 0.05 * i) for i in range(16)]
    select = filter_logits(x, ps)
    monkeypatch.setattr(sampler, "_TOPK_SELECT_MAX", 0)
    assert torch.equal(filter_logits(x, ps), select)


def test_min_p_threshold_is_exact_in_fp32() -> None:
    # d < log(min_p) decided in fp32 exactly as in float64, for d on both sides of the threshold
    ps = [SamplingParams(temperature=1.0, min_p=m) for m in (0.1, 0.25, 0.5, 0.7, 1.0)]
    thr = sampler._min_p_thresholds(ps)
    for p, t in zip(ps, thr.tolist()):
        exact = math.log(p.min_p)
        d = torch.tensor(exact, dtype=torch.float32)
        for cand in (torch.nextafter(d, torch.tensor(-math.inf)), d, torch.nextafter(d, torch.tensor(math.inf))):
            assert bool(cand < t) == (cand.item() < exact), (p.min_p, cand.item(), t)


# ---------------------------------------------------------------- distribution


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    raw = [1.0, 0.2, -0.5, 0.7, -2.0]
    expected = _softmax([x / temperature for x in raw])
    draws = _draws(torch.tensor([raw]), SamplingParams(temperature=temperature), 12_000)
    chi2 = _chi2(draws, expected)
    freqs = [round(draws.count(i) / len(draws), 4) for i in range(len(raw))]
    assert chi2 < CHI2_999[4], f"T={temperature}: chi2 {chi2:.2f}, freqs {freqs} vs {expected}"


def test_lower_temperature_is_sharper() -> None:
    raw = torch.tensor([[1.0, 0.2, -0.5, 0.7, -2.0]])
    top_freq = []
    for temperature in (0.25, 0.5, 1.0, 2.0):
        draws = _draws(raw, SamplingParams(temperature=temperature), 3000)
        top_freq.append(draws.count(0) / len(draws))
    assert top_freq == sorted(top_freq, reverse=True), top_freq
    assert top_freq[0] > 0.6 and top_freq[-1] < 0.45, top_freq  # exact: 0.766, 0.537, 0.383, 0.286


def test_filtered_distribution_is_renormalised_softmax() -> None:
    # top_k=3 on 5 tokens: the survivors keep their softmax ratios
    raw = [1.0, 0.2, -0.5, 0.7, -2.0]
    kept = _softmax([raw[0], raw[1], raw[3]])
    draws = _draws(torch.tensor([raw]), SamplingParams(temperature=1.0, top_k=3), 8000)
    assert set(draws) == {0, 1, 3}
    expected = [kept[0], kept[1], 0.0, kept[2], 0.0]
    chi2 = sum((draws.count(i) - len(draws) * p) ** 2 / (len(draws) * p) for i, p in enumerate(expected) if p > 0)
    assert chi2 < 13.82, f"chi2 {chi2:.2f} (2 dof, p=0.001)"


# ---------------------------------------------------------------- logprobs


def test_logprobs_match_raw_log_softmax_and_top_list() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g) * 3
    logits[2, [5, 17, 22]] = 9.0  # a three-way tie at the top: ids ascending in the top list
    rows = [
        SampleRow(SamplingParams(temperature=0.0, logprobs=5), seed=0, step=0),
        SampleRow(SamplingParams(temperature=0.5, top_k=4, logprobs=3), seed=1, step=2),
        SampleRow(SamplingParams(temperature=1.0, logprobs=0), seed=2, step=0),
        SampleRow(SamplingParams(temperature=1.0), seed=3, step=0),
    ]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[3] is None
    for i in range(3):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        row = logits[i].double().tolist()
        lse = max(row) + math.log(sum(math.exp(x - max(row)) for x in row))
        assert lp.logprob == ref[i, lp.token_id].item()
        assert abs(lp.logprob - (row[lp.token_id] - lse)) < 1e-12  # raw logits, not temperature-scaled
        k = rows[i].params.logprobs
        expected_ids = sorted(range(30), key=lambda t: (-row[t], t))[:k]
        assert [t for t, _ in lp.top] == expected_ids, (i, lp.top)
        assert all(isinstance(v, float) and v == ref[i, t].item() for t, v in lp.top)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert [t for t, _ in out.logprobs[2].top] == [] and out.logprobs[0].top[0][0] == out.token_ids[0]


# ---------------------------------------------------------------- contract


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_wrong_dtype_raises(dtype: torch.dtype) -> None:
    with pytest.raises(AssertionError, match="fp32"):
        sample(torch.zeros(1, 8, dtype=dtype), [SampleRow(SamplingParams(), seed=0, step=0)])


def test_wrong_shape_raises() -> None:
    row = SampleRow(SamplingParams(), seed=0, step=0)
    with pytest.raises(AssertionError, match=r"\[N, V\]"):
        sample(torch.zeros(8), [row])
    with pytest.raises(AssertionError, match="SampleRows"):
        sample(torch.zeros(2, 8), [row])


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows, vocab", [(64, 4099), (24, 129_280)])
def test_cuda_matches_cpu(num_rows: int, vocab: int) -> None:
    # CUDA: the Triton Gumbel-max kernel, top-k select or sort on the GPU; CPU: the torch reference
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(num_rows, vocab, generator=g) * 2
    logits[1, :100] = 7.0  # a 100-way tie at the top: the top-k / top-p cuts pick by id
    rows = [
        SampleRow(SamplingParams(temperature=0.2 + 0.03 * i, top_k=i % 7 * 10, top_p=1.0 - i % 3 * 0.2,
                                 min_p=i % 4 * 0.02, logprobs=i % 3), seed=1000 + i, step=i)
        for i in range(num_rows)
    ]
    cpu, gpu = sample(logits, rows), sample(logits.cuda(), rows)
    assert cpu.token_ids == gpu.token_ids
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert a is not None and b is not None and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert abs(a.logprob - b.logprob) < 1e-9


# ---------------------------------------------------------------- numerically unsafe inputs


@pytest.mark.parametrize("filters", [dict(top_p=0.5), dict(top_k=3), dict(min_p=0.2), dict(top_p=0.9, top_k=5)])
def test_temperature_below_the_floor_is_greedy(filters) -> None:
    """The replica-killing request of issue 20 (temperature 1e-308 with top_p < 1 overflowed the scaled
    logits and raised inside the sampler): below MIN_TEMPERATURE the token is the argmax, not an error."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g) * 4
    for temperature in (1e-308, 5e-324, SamplingParams.MIN_TEMPERATURE / 2):
        params = SamplingParams(temperature=temperature, seed=1, **filters).validate()
        assert params.is_greedy
        out = sample(logits, [SampleRow(params, seed=s, step=0) for s in range(5)])
        assert out.token_ids == logits.argmax(dim=-1).tolist() and out.errors == [None] * 5


def test_temperature_at_the_floor_samples_without_overflow() -> None:
    """At MIN_TEMPERATURE itself the row is sampled: logits 1 apart become 1e5 apart, so every draw is the
    argmax (the others' mass is e^-1e5), and nothing overflows on the way."""
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0], [7.0, 1.0, 6.0, 6.5]])
    params = SamplingParams(temperature=SamplingParams.MIN_TEMPERATURE, top_p=0.5, seed=2).validate()
    assert not params.is_greedy
    out = sample(logits, [SampleRow(params, seed=s, step=s) for s in range(2)])
    assert out.token_ids == [1, 0] and out.errors == [None, None]


def test_unusable_rows_fail_alone() -> None:
    """A NaN, a +inf or an all -inf row gets token -1 and an error; the other rows get exactly the tokens
    (and logprobs) they get without the bad rows in the batch."""
    g = torch.Generator().manual_seed(5)
    good = torch.randn(3, 30, generator=g)
    nan_row = good[0].clone()
    nan_row[7] = float("nan")
    inf_row = good[1].clone()
    inf_row[2] = float("inf")
    dead_row = torch.full((30,), float("-inf"))
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=4, logprobs=2), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=5, seed=5, logprobs=0)]
    rows = [SampleRow(p, seed=10 + i, step=i) for i, p in enumerate(params)]
    alone = sample(good, rows)
    mixed_logits = torch.stack([nan_row, good[0], inf_row, good[1], dead_row, good[2]])
    bad_row = SampleRow(SamplingParams(temperature=0.7, top_p=0.5, seed=1, logprobs=1), seed=1, step=0)
    mixed = sample(mixed_logits, [bad_row, rows[0], bad_row, rows[1], bad_row, rows[2]])
    assert mixed.token_ids[1::2] == alone.token_ids
    assert mixed.logprobs[1::2] == alone.logprobs
    assert mixed.token_ids[0::2] == [-1, -1, -1] and mixed.logprobs[0::2] == [None, None, None]
    assert all("NaN" in e for e in mixed.errors[0::2]) and mixed.errors[1::2] == [None] * 3


# ---------------------------------------------------------------- the device form (the decode step's graph)


def sample_tensors(specs, vocab_size):
    """SampleTensors of (params, seed, step, force id) rows, the values the decode step stages (sample_row_values)."""
    from engine.core.sampler import SampleTensors, sample_row_values

    cols = list(zip(*(sample_row_values(p, seed, step, force, vocab_size) for p, seed, step, force in specs)))
    return SampleTensors(torch.tensor(cols[0], dtype=torch.bool), torch.tensor(cols[1], dtype=torch.float64).float(),
                         torch.tensor(cols[2]), torch.tensor(cols[3], dtype=torch.float64),
                         torch.tensor(cols[4], dtype=torch.float64).float(), torch.tensor(cols[5]),
                         torch.tensor(cols[6]), torch.tensor(cols[7]))


def test_sample_device_draws_what_sample_draws() -> None:
    """sample_device (no host decisions: every filter of its variant runs on every row) gives sample()'s
    tokens, logprobs and failures row for row, for the variant the params need and for the most general one;
    forced rows take their token and report its logprob as sample_specs does."""
    from engine.core.plan import SampleSpec
    from engine.core.sampler import draw_output, sample_device, sample_specs, sample_variant

    g = torch.Generator().manual_seed(8)
    V = 50
    logits = torch.randn(9, V, generator=g) * 3
    logits[4, 7] = float("nan")
    logits[5, :] = float("-inf")
    logits[6, :40] = float("-inf")
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1, logprobs=3),
              SamplingParams(temperature=1.3, top_k=4, seed=2), SamplingParams(temperature=0.9, top_p=0.6, min_p=0.05),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, min_p=0.3, logprobs=0), SamplingParams(logprobs=2),
              SamplingParams(temperature=1.1, top_k=60, top_p=0.95, logprobs=5)]
    forces = [None, None, None, 11, None, None, None, 3, None]
    specs = [SampleSpec(i, p, 100 + i, 7 * i, f) for i, (p, f) in enumerate(zip(params, forces))]
    want = sample_specs(logits, specs)
    plain = [1, 5, 6]
    for rows, variant in ((list(range(9)), "filtered"), (plain, "plain"), (plain, "filtered"), ([0, 7], "greedy"),
                          ([0, 7], "plain")):
        if variant == "plain" and rows == plain:
            assert sample_variant([params[i] for i in rows]) == "plain"
        t = sample_tensors([(params[i], 100 + i, 7 * i, forces[i]) for i in rows], V)
        d = sample_device(logits[rows], t, variant, num_logprobs=SamplingParams.MAX_LOGPROBS)
        got = draw_output(d.token_ids.tolist(), d.logprob.tolist(), d.top_logprobs.tolist(), d.top_ids.tolist(),
                          [params[i].logprobs for i in rows])
        assert got.token_ids == [want.token_ids[i] for i in rows], (variant, rows)
        assert got.errors == [want.errors[i] for i in rows]
        for i, lp in zip(rows, got.logprobs):
            if want.logprobs[i] is None:
                assert lp is None
            else:
                assert lp.token_id == want.logprobs[i].token_id and lp.top == want.logprobs[i].top
                assert lp.logprob == pytest.approx(want.logprobs[i].logprob, abs=1e-12)
    assert sample_variant(params) == "filtered" and want.token_ids[3] == 11 and want.token_ids[4] == -1
