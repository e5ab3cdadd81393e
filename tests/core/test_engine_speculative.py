"""Speculative decoding in the engine (issue 22) on the tiny checkpoint (DSpark block 3). K = 0 is the oracle:
greedy tokens and every kept logits row with drafts are those without, bit for bit (the verify rows are the target's
own rows; rejected drafts leave nothing behind). An oracle drafter (tests/core/oracle_drafter.py) proposes the
target's continuation, wrong at chosen positions, so the accept counts are known in advance; the DSpark stages
themselves draft in the free-running tests (random weights: nearly every draft is rejected)."""

from __future__ import annotations

import pytest
import torch

from engine.core.drafter import DraftRequest, DSparkDrafter
from engine.core.engine import EngineConfig, LLMEngine
from engine.core.engine_config import EngineConfigError
from engine.core.sampling_params import SamplingParams
from engine.kernels import paged
from tests.core.conftest import random_prompt, run_engine
from tests.core.oracle_drafter import OracleDrafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_NEW = 8


def engine_for(model, K: int, drafter=None, eos: int = -1, **kw) -> LLMEngine:
    """An engine whose every step ends with the scheduler's self-check (blocks of rejected drafts given back)."""
    config = EngineConfig(**(dict(max_num_batched_tokens=48, speculative_tokens=K) | kw))
    engine = LLMEngine.local(model, config, eos_token_id=eos, drafter=drafter)
    step = engine.step

    def step_and_check():
        outputs = step()
        engine.scheduler.check_integrity()
        return outputs

    engine.step = step_and_check
    return engine


def expected_verifies(prompt_len: int, max_tokens: int, K: int, wrong: frozenset[int]) -> tuple[int, int]:
    """(verify steps, accepted drafts) of one request whose drafts are right except at `wrong` positions: the
    prefill draws output 0, then each step verifies min(K, outputs left - 1) drafts after the anchor."""
    num_out, steps, accepted = 1, 0, 0
    while num_out < max_tokens:
        k = min(K, max_tokens - num_out - 1)
        if k == 0:
            num_out += 1
            continue
        anchor = prompt_len + num_out - 1
        m = next((i for i in range(k) if anchor + 1 + i in wrong), k)
        num_out, steps, accepted = num_out + m + 1, steps + 1, accepted + m
    return steps, accepted


# ---- free-running greedy with the DSpark drafter --------------------------------------------------------------

@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """Two 70-token prompts sharing their first 64-token block (the second arrives once the first block is
    registered: a prefix-cache hit with encoder replay) and a short one; prefill chunks of 16."""
    a = random_prompt(70, seed=1)
    return {"a": a, "b": a[:64] + random_prompt(6, seed=2), "c": random_prompt(11, seed=3)}, {"b": 6}


def test_free_running_greedy_is_identical_for_every_K(tiny_model_mtp, shared_prefix_prompts):
    model = tiny_model_mtp.model
    prompts, arrivals = shared_prefix_prompts
    params = SamplingParams(max_tokens=NUM_NEW)
    outputs = {}
    for K in range(model.cfg.dspark_block_size + 1):
        engine = engine_for(model, K, max_chunk_tokens=16)
        results = run_engine(engine, prompts, params, arrivals)
        outputs[K] = {rid: toks for rid, (toks, _, _) in results.items()}
        assert results["b"][2].num_cached_tokens == 64, "b should hit a's first block"
        engine.scheduler.check_integrity()
        assert not engine.scheduler.running
        assert (engine.stats.num_draft_tokens > 0) == (K > 0)
        assert engine.stats.num_verify_steps == sum(r[2].num_verify_steps for r in results.values())
        assert outputs[K] == outputs[0], f"K = {K}: {outputs[K]} vs K = 0: {outputs[0]}"
        assert all(len(t) == NUM_NEW for t in outputs[K].values())


# ---- the oracle drafter: all accepted, partial accepts ----------------------------------------------------------

ORACLE_PROMPTS = {"p": random_prompt(21, seed=11), "q": random_prompt(9, seed=12)}
ORACLE_NEW = 12


@pytest.fixture(scope="module")
def plain_run(tiny_model_mtp):
    """K = 0 with every logits row kept: the oracle of the drafted runs."""
    engine = engine_for(tiny_model_mtp.model, 0)
    return run_engine(engine, ORACLE_PROMPTS, SamplingParams(max_tokens=ORACLE_NEW), keep_logits=True)


@pytest.mark.parametrize("K, wrong", [
    (3, frozenset()),  # every draft accepted
    (3, frozenset({23, 24, 26, 13, 16})),  # rejections at the first and later drafts, odd and even positions
    (2, frozenset({25, 12, 27})),
], ids=["K3-all", "K3-partial", "K2-partial"])
def test_oracle_drafts_accept_as_expected_and_logits_equal_K0(tiny_model_mtp, plain_run, K, wrong):
    model = tiny_model_mtp.model
    sequences = [ORACLE_PROMPTS[r] + plain_run[r][0] for r in ORACLE_PROMPTS]
    drafter = OracleDrafter(sequences, model.cfg.vocab_size, wrong)
    engine = engine_for(model, K, drafter)
    results = run_engine(engine, ORACLE_PROMPTS, SamplingParams(max_tokens=ORACLE_NEW), keep_logits=True)
    engine.scheduler.check_integrity()
    for rid, prompt in ORACLE_PROMPTS.items():
        (want, want_rows, _), (got, got_rows, stats) = plain_run[rid], results[rid]
        assert got == want, f"{rid}: {got} vs {want}"
        assert sorted(got_rows) == sorted(want_rows), f"{rid}: logits rows at {sorted(got_rows)}"
        changed = [p for p in want_rows if not torch.equal(got_rows[p], want_rows[p])]
        assert not changed, f"{rid}: logits differ at positions {changed}"
        steps, accepted = expected_verifies(len(prompt), ORACLE_NEW, K, wrong)
        assert (stats.num_verify_steps, stats.num_accepted_tokens) == (steps, accepted), rid
        assert stats.average_accept_length == pytest.approx(1 + accepted / steps)
    assert engine.stats.num_accepted_tokens == sum(r[2].num_accepted_tokens for r in results.values())


def test_teacher_forced_logits_with_drafts_equal_K0(tiny_model_mtp):
    """Forced ids are the target's tokens: drafts equal to them are accepted, the others rejected."""
    model = tiny_model_mtp.model
    prompt, forced = random_prompt(19, seed=21), random_prompt(10, seed=22)
    params = SamplingParams(max_tokens=len(forced) + 1, ignore_eos=True)

    def run(K: int, drafter=None):
        engine = engine_for(model, K, drafter)
        engine.add_request("f", prompt, params, force_ids=forced, keep_logits=True)
        tokens, rows = [], {}
        while engine.has_unfinished:
            for o in engine.step():
                tokens += o.new_token_ids
                if o.logits is not None:
                    first, block = o.logits
                    rows.update({first + i: block[i] for i in range(block.size(0))})
        engine.scheduler.check_integrity()
        return tokens, rows, engine.stats

    want_tokens, want_rows, _ = run(0)
    drafter = OracleDrafter([prompt + forced], model.cfg.vocab_size, frozenset({22, 26}))
    for K, d in ((3, drafter), (2, None)):  # the oracle (partial accepts) and the DSpark stages
        tokens, rows, stats = run(K, d)
        assert tokens[:len(forced)] == want_tokens[:len(forced)] == forced
        assert sorted(rows) == sorted(want_rows) and all(torch.equal(rows[p], want_rows[p]) for p in rows), K
        assert stats.num_verify_steps > 0
    assert stats.num_draft_tokens > 0


# ---- sampling -------------------------------------------------------------------------------------------------

def test_seeded_sampling_with_drafts_is_reproducible_and_batch_independent(tiny_model_mtp):
    model = tiny_model_mtp.model
    prompt = random_prompt(13, seed=31)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, seed=7, n=2)
    alone = run_engine(engine_for(model, 2), {"s": prompt}, params)
    again = run_engine(engine_for(model, 2), {"s": prompt}, params)
    crowded = run_engine(engine_for(model, 2), {"s": prompt, "other": random_prompt(5, seed=32)}, params)
    for rid in ("s", "s/1"):
        assert alone[rid][0] == again[rid][0] == crowded[rid][0] and len(alone[rid][0]) == NUM_NEW
        assert alone[rid][2].num_verify_steps > 0
    assert alone["s"][0] != alone["s/1"][0]


# ---- DSpark context and drafts against the golden model ---------------------------------------------------------

def test_dspark_context_and_drafts_equal_the_golden_models(tiny_model_mtp):
    """After a run with partial accepts (bounded replay off), the finished request's snapshot holds every DSpark
    stage's context KV of its last window + 1 positions, equal to the golden model observing the whole sequence;
    the DSpark drafter's greedy proposal from it is the golden dspark_draft's."""
    model, cfg = tiny_model_mtp.model, tiny_model_mtp.model.cfg
    prompt = random_prompt(21, seed=41)
    plain = run_engine(engine_for(model, 0, bounded_replay=False), {"g": prompt}, SamplingParams(max_tokens=9))
    sequence = prompt + plain["g"][0]
    engine = engine_for(model, 3, OracleDrafter([sequence], cfg.vocab_size, frozenset({24, 27})), bounded_replay=False)
    run_engine(engine, {"g": prompt}, SamplingParams(max_tokens=9))
    (snap,) = engine.cache.snapshots.values()
    L = len(snap.token_ids)
    assert snap.token_ids == sequence[:L] and L == len(sequence) - 1
    kv, W, S = engine.executor.kv, cfg.window_size, engine.cache.layout.swa_block_size

    cache = model.new_cache(1, L + 1)
    out = model(torch.tensor([sequence[:L]]), 0, cache)
    model.dspark_observe(out.main_hidden, out.first_pos, cache)
    for s, pool in enumerate(kv.dspark_swa):
        got = paged.gather_swa(pool, paged.swa_slots(snap.swa_blocks, L - W - 1, L, S), cfg.head_dim)
        want = cache.swa[cfg.n_layers + s][0, L - W - 1:L]
        assert torch.equal(got, want), f"stage {s}: context differs at positions {L - W - 1}..{L - 1}"

    golden = model.dspark_draft(torch.tensor([sequence[L]]), cache, temperature=0.0)
    request = DraftRequest(sequence[L], L, sequence[L - 3:L], cfg.dspark_block_size, snap.swa_blocks,
                           SamplingParams(), 0, 0)
    (draft,) = DSparkDrafter(model, kv).propose([request])
    assert draft.token_ids == golden.tokens[0, 1:].tolist()
    assert draft.confidence == golden.confidence[0].tolist()
    assert torch.equal(draft.q.argmax(-1), golden.logits[0].argmax(-1)) and bool((draft.q.max(-1).values == 1).all())


# ---- a stop among accepted drafts, and the next turn from its snapshot ------------------------------------------

def test_stop_inside_accepted_drafts_and_the_next_turn_resume_exactly(tiny_model_mtp):
    model = tiny_model_mtp.model
    prompt = random_prompt(23, seed=51)
    free = run_engine(engine_for(model, 0), {"t": prompt}, SamplingParams(max_tokens=10))["t"][0]
    eos = free[4]  # the request stops at its 5th token, which the oracle proposes in the middle of a draft block
    assert eos not in free[:4]
    follow = random_prompt(5, seed=52)

    def turns(K: int, drafter=None):
        engine = engine_for(model, K, drafter, eos=eos)
        first = run_engine(engine, {"t1": prompt}, SamplingParams(max_tokens=10))["t1"]
        second = run_engine(engine, {"t2": prompt + first[0] + follow}, SamplingParams(max_tokens=4), keep_logits=True)
        engine.scheduler.check_integrity()
        return first, second["t2"]

    (want1, _, _), (want2, want_rows, want_stats) = turns(0)
    assert want1 == free[:5] and want_stats.num_cached_tokens == len(prompt) + 4  # resumed from the snapshot
    sequences = [prompt + free, prompt + want1 + follow + want2]
    (got1, _, s1), (got2, got_rows, s2) = turns(3, OracleDrafter(sequences, model.cfg.vocab_size))
    assert got1 == want1 and s1.num_accepted_tokens > 0
    assert got2 == want2 and s2.num_cached_tokens == want_stats.num_cached_tokens
    assert sorted(got_rows) == sorted(want_rows) and all(torch.equal(got_rows[p], want_rows[p]) for p in got_rows)


# ---- refusals -------------------------------------------------------------------------------------------------

def test_refusals_name_the_block_and_the_missing_stages(tiny_model_mtp, tiny_model):
    model = tiny_model_mtp.model
    with pytest.raises(EngineConfigError, match="DSpark block of 3 tokens"):
        engine_for(model, 4)
    # the kernel runner speculates too (tests/core/test_kernel_speculative.py)
    assert engine_for(model, 2, runner="kernels").executor.runner.dspark is not None
    with pytest.raises(EngineConfigError, match="DSpark stages"):
        engine_for(tiny_model.model, 2)
