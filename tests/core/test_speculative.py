"""The speculative rule (engine/core/speculative.py) on small vocabularies: the greedy and teacher-forced cases, the
distribution it emits against the target's (chi-square), its keyed draws, and the verify-length policy.

Chi-square tests: counts of N draws over V cells against the expected N * p, cells with p = 0 required empty; the
statistic is compared with the chi-square quantile at significance 0.001 (Wilson-Hilferty). The draws are keyed by
seeds 0..N-1, so each test is deterministic: it either always passes or always fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.plan import DraftPolicy, VerifySpec
from engine.core.sampler import SampleRow, sample
from engine.core.sampling_params import SamplingParams
from engine.core.speculative import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, accept_drafts, draw_draft,
                                     keyed_gumbel, keyed_uniform, keys, sampling_distributions, survival, verify,
                                     verify_lengths)
from engine.kernels.gumbel import gumbel_noise_ref

V = 6
NUM_DRAWS = 12_000  # per distribution: at least 10,000 draws
Z_999 = 3.0902  # standard normal quantile at 1 - 0.001


def chi2_critical(dof: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.0902: significance 0.001)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_against(counts: torch.Tensor, p: torch.Tensor, what: str) -> None:
    """counts [V] of draws, p [V] the distribution they should follow: zero-probability cells must be empty, and
    the chi-square statistic of the others must stay below the 0.001 quantile."""
    n = counts.sum().item()
    assert n >= 1000, f"{what}: only {n} draws"
    zero = p <= 0
    assert counts[zero].sum() == 0, f"{what}: {counts[zero].tolist()} draws of zero-probability tokens"
    expected = n * p[~zero]
    stat = float(((counts[~zero] - expected) ** 2 / expected).sum())
    dof = int((~zero).sum()) - 1
    assert stat < chi2_critical(dof), (f"{what}: chi2 {stat:.1f} >= {chi2_critical(dof):.1f} (dof {dof}, {n} draws); "
                                       f"counts {counts.tolist()}, expected {[round(e, 1) for e in expected.tolist()]}")


def one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab, dtype=torch.float64)
    out[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return out


@pytest.mark.parametrize("target, draft, accepted, token", [
    ([4, 1, 2, 5], [4, 1, 2], 3, 5),  # every draft matches: all accepted, then the target's token after them
    ([4, 1, 2, 5], [4, 3, 2], 1, 1),  # first mismatch at draft 1: the target's token there
    ([4, 1, 2, 5], [0, 1, 2], 0, 4),  # the first draft is wrong: the step emits only the target's first token
    ([3], [], 0, 3),  # no drafts: the plain draw
])
def test_greedy_rule_accepts_the_longest_matching_prefix(target, draft, accepted, token):
    k = len(draft)
    g = keyed_gumbel(*keys(7, 0, k + 1), STREAM_SAMPLE, V)
    u = keyed_uniform(*keys(7, 0, k), STREAM_ACCEPT)
    m, t = accept_drafts(one_hot(target), one_hot(draft), torch.tensor(draft, dtype=torch.long), u, g)
    assert (m, t) == (accepted, token)


def test_verify_greedy_forced_stops_and_logprobs():
    torch.manual_seed(0)
    rows = torch.randn(4, V)
    target = rows.argmax(-1).tolist()
    greedy = SamplingParams(logprobs=2)
    d = [target[0], (target[1] + 1) % V, target[2]]
    (out,) = verify([rows], [VerifySpec(0, greedy, 1, 5)], [d], [one_hot(d)])
    assert out.token_ids == [target[0], target[1]] and (out.num_drafted, out.num_accepted) == (3, 1)
    lp = torch.log_softmax(rows.double(), -1)
    for j, (t, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got.token_id == t and got.logprob == pytest.approx(lp[j, t].item(), abs=1e-12)
        assert [i for i, _ in got.top] == lp[j].argsort(descending=True, stable=True)[:2].tolist()
    # teacher forcing: the forced ids are the target's tokens, whatever the logits say
    forced = (d[0], d[1], 0, 1)
    (out,) = verify([rows], [VerifySpec(0, SamplingParams(), 1, 5, force_ids=forced)], [d], [one_hot(d)])
    assert out.token_ids == [d[0], d[1], 0] and out.num_accepted == 2
    # a stop id among the accepted drafts ends the emitted tokens there
    (out,) = verify([rows], [VerifySpec(0, SamplingParams(), 1, 5, stop_ids=(target[0],))],
                    [target[:3]], [one_hot(target[:3])])
    assert out.token_ids == [target[0]] and out.num_accepted == 1
    # unusable logits in a row the verify reads fail the request
    bad = rows.clone()
    bad[0, 2] = float("nan")
    (out,) = verify([bad], [VerifySpec(0, SamplingParams(), 1, 5)], [d], [one_hot(d)])
    assert out.error is not None and out.token_ids == []
    # greedy drafts may come without their q (None: one-hot at each, as the draft step returns them), also when the
    # target samples: the same verdicts as with the one-hot rows
    for params in (greedy, SamplingParams(temperature=0.9)):
        for draft in (d, target[:3], [target[0]], []):
            specs = [VerifySpec(0, params, 4, 5)]
            rows_k = rows[:len(draft) + 1]
            assert verify([rows_k], specs, [draft], [None]) == verify([rows_k], specs, [draft], [one_hot(draft)])


def spec_draws(rows: torch.Tensor, draft_logits: torch.Tensor, params: SamplingParams, num: int) -> list[list[int]]:
    """num speculative steps (seeds 0..num-1) of len(draft_logits) drafts drawn from the draft logits' distributions
    (each position's draft drawn independently of the previous token), verified against rows [k+1, V]."""
    k = draft_logits.size(0)
    seeds = torch.arange(num, dtype=torch.int64)
    drafts, qs = [], []
    for i in range(k):
        d, q = draw_draft(draft_logits[i:i + 1].expand(num, -1), [params] * num, seeds, torch.full((num,), i))
        drafts.append(d)
        qs.append(q)
    d, q = torch.stack(drafts, 1), torch.stack(qs, 1)  # [num, k], [num, k, V]
    out = verify([rows] * num, [VerifySpec(0, params, s, 0) for s in range(num)], d.tolist(), list(q))
    return [o.token_ids for o in out]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)],
                         ids=["T1", "T0.8-topk4"])
def test_speculative_tokens_follow_the_plain_samplers_distribution(params):
    """Chi-square at significance 0.001, >= 10,000 draws: the first emitted token follows the target's first row,
    the second (when the first draft was accepted) its second row, and the plain sampler's draws follow the same."""
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(3, V, generator=g) * 1.5).float()  # the target's anchor row and two draft rows
    draft_logits = (torch.randn(2, V, generator=g) * 1.5).float()  # a drafter that disagrees with the target
    p = sampling_distributions(rows, [params] * 3)
    emitted = spec_draws(rows, draft_logits, params, NUM_DRAWS)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V)
    chi2_against(first, p[0], "speculative first token")
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=V)
    chi2_against(second, p[1], "speculative second token")
    accepted = sum(len(e) > 1 for e in emitted) / NUM_DRAWS
    q0 = sampling_distributions(draft_logits[:1], [params])[0]
    assert accepted == pytest.approx(torch.minimum(p[0], q0).sum().item(), abs=0.02)  # sum_x min(p, q)
    plain = sample(rows[:1].expand(NUM_DRAWS, -1).contiguous(), [SampleRow(params, s, 0) for s in range(NUM_DRAWS)])
    chi2_against(torch.bincount(torch.tensor(plain.token_ids), minlength=V), p[0], "plain sampler")


def test_a_drafter_equal_to_the_target_is_always_accepted():
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(3, V, generator=g)
    params = SamplingParams(temperature=1.0)
    emitted = spec_draws(rows, rows[:2].clone(), params, 500)
    assert all(len(e) == 3 for e in emitted)  # p(d) >= q(d) everywhere: two drafts and the token after them


def test_draws_are_keyed_by_seed_output_index_and_stream():
    seeds, steps = keys(5, 10, 3)
    assert steps.tolist() == [10, 11, 12]
    noise = keyed_gumbel(seeds, steps, STREAM_SAMPLE, V)
    assert torch.equal(noise, gumbel_noise_ref(seeds, steps, V))  # stream 0 is the sampler's own noise
    draft = keyed_gumbel(seeds, steps, STREAM_DRAFT, V)
    assert not torch.equal(noise, draft)
    u = keyed_uniform(seeds, steps, STREAM_ACCEPT)
    assert torch.equal(u, keyed_uniform(*keys(5, 10, 3), STREAM_ACCEPT)) and bool(((u > 0) & (u < 1)).all())
    assert len(set(u.tolist())) == 3
    rows = torch.randn(3, V)
    params = SamplingParams(temperature=1.0)
    d = [1, 2]
    q = sampling_distributions(rows[:2] * 0.5, [params] * 2)
    same = [verify([rows], [VerifySpec(0, params, 9, 4)], [d], [q])[0].token_ids for _ in range(2)]
    assert same[0] == same[1]


def test_survival_and_verify_lengths():
    assert survival([0.0, 0.0]) == [0.5, 0.25]
    assert survival([math.inf, -math.inf, 5.0]) == [1.0, 0.0, 0.0]
    assert survival([-800.0])[0] == 0.0 and survival([800.0])[0] == 1.0  # no overflow
    conf = [[2.0, 2.0, 2.0], [-1.0, 3.0], [math.inf, math.inf]]  # survivals: .88 .78 .69 | .27 .26 | 1 1
    assert verify_lengths(conf, DraftPolicy()) == [3, 2, 2]
    assert verify_lengths(conf, DraftPolicy(min_survival=0.5)) == [3, 0, 2]
    assert verify_lengths(conf, DraftPolicy(max_draft_tokens=4)) == [2, 0, 2]  # the 4 best slots: 1, 1, .88, .78
    assert verify_lengths(conf, DraftPolicy(max_draft_tokens=0)) == [0, 0, 0]
    assert verify_lengths([[1.0, 1.0], [1.0, 1.0]], DraftPolicy(max_draft_tokens=3)) == [2, 1]  # ties: lower request


def test_draft_draws_of_a_mixed_batch_are_gumbel_max_over_every_row():
    """draw_draft draws noise only for sampled rows; every row's token is still Gumbel-max of log q + its keyed noise
    (the rule with noise on every row, computed here)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=0.0)]
    seeds = torch.tensor([11, 12, 13, 14, 15])
    steps = torch.tensor([0, 7, 2, 9, 4])
    for trial in range(20):
        tokens, q = draw_draft(logits, params, seeds + trial, steps)
        full = (q.log() + keyed_gumbel(seeds + trial, steps, STREAM_DRAFT, V).double()).argmax(dim=-1)
        assert torch.equal(tokens, full)
        assert torch.equal(q, sampling_distributions(logits, params))
    greedy = [SamplingParams(temperature=0.0)] * 5
    assert torch.equal(draw_draft(logits, greedy, seeds, steps)[0], logits.argmax(dim=-1))
