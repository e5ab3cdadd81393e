"""Engine-level sampling: seeds reproducible whatever shares the batch, logprobs from the logits,
n > 1 from one prompt computation, stop ids, length caps, and request validation."""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine, RequestError
from engine.core.request import FinishReason
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import random_prompt, run_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
# The engine's rule (engine.core.engine._sibling_seed), stated here as the contract: choice i of a seeded
# n > 1 request draws with seed (seed + i * SIBLING_SEED_STEP) mod 2^63.
SIBLING_SEED_STEP = 0x9E3779B97F4A7C15


def fresh(model, **kw) -> LLMEngine:
    return LLMEngine.local(model, EngineConfig(enable_prefix_caching=False, **kw), eos_token_id=-1)


def test_seeded_sampling_is_independent_of_batch_composition(tiny_model):
    model = tiny_model.model
    target = random_prompt(23, seed=11)
    alone = run_engine(fresh(model), {"x": target}, SAMPLED)["x"][0]
    others = {f"o{i}": random_prompt(5 + 9 * i, seed=20 + i) for i in range(4)}
    crowded = run_engine(fresh(model, max_num_batched_tokens=16), {**others, "x": target}, SAMPLED,
                         arrivals={"x": 2})["x"][0]
    assert alone == crowded
    other_seed = run_engine(fresh(model), {"x": target}, SamplingParams(**{**_kw(SAMPLED), "seed": 99}))["x"][0]
    assert other_seed != alone  # the seed matters (6 tokens from a 129k vocabulary)


def _kw(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_logprobs_are_log_softmax_of_the_logits(tiny_model):
    engine = fresh(tiny_model.model)
    params = SamplingParams(**{**_kw(SAMPLED), "logprobs": 3})
    engine.add_request("x", random_prompt(12, seed=3), params, keep_logits=True)
    seen = 0
    while engine.has_unfinished:
        for o in engine.step():
            first, rows = o.logits
            expected = torch.log_softmax(rows[-1].double(), dim=-1)
            lp = o.new_logprobs[0]
            assert lp.token_id == o.new_token_ids[0]
            assert lp.logprob == pytest.approx(expected[lp.token_id].item(), abs=1e-9)
            top = expected.topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-9)
            seen += 1
    assert seen == 6


def test_n_choices_share_one_prompt_computation(tiny_model):
    model = tiny_model.model
    prompt = random_prompt(37, seed=4)
    params = SamplingParams(**{**_kw(SAMPLED), "n": 3})
    engine = fresh(model)
    results = run_engine(engine, {"g": prompt}, params)
    choices = [results["g"][0], results["g/1"][0], results["g/2"][0]]
    assert engine.stats.num_computed_tokens == len(prompt) + 3 * (SAMPLED.max_tokens - 1)
    for i, tokens in enumerate(choices):
        seed = (SAMPLED.seed + i * SIBLING_SEED_STEP) % 2**63
        alone = run_engine(fresh(model), {"c": prompt}, SamplingParams(**{**_kw(SAMPLED), "seed": seed}))["c"][0]
        assert tokens == alone, f"choice {i}"
    assert len({tuple(c) for c in choices}) == 3
    engine.scheduler.check_integrity()


def test_stop_ids_max_tokens_and_context_cap(tiny_model):
    model = tiny_model.model
    prompt = random_prompt(9, seed=5)
    greedy = run_engine(fresh(model), {"x": prompt}, SamplingParams(max_tokens=5))["x"][0]
    engine = fresh(model)
    engine.add_request("s", prompt, SamplingParams(max_tokens=5, stop_token_ids=(greedy[2],)))
    outs = [o for _ in range(20) for o in engine.step()]
    assert [t for o in outs for t in o.new_token_ids] == greedy[:3]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
    eos_engine = LLMEngine.local(model, EngineConfig(), eos_token_id=greedy[1])
    assert eos_engine.generate([prompt], SamplingParams(max_tokens=5))[0] == greedy[:2]
    assert eos_engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0] == greedy
    capped = fresh(model, max_model_len=12)
    assert len(capped.generate([prompt], SamplingParams(max_tokens=50))[0]) == 3  # 9 + 3 = the window


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2, 200000], SamplingParams(), "token id 200000 is outside the vocabulary"),
    ([1] * 20, SamplingParams(), "context window is 20"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature must be"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p must be"),
    ([1, 2], SamplingParams(logprobs=50), "logprobs must be"),
])
def test_bad_requests_are_refused_and_queue_nothing(tiny_model, prompt, params, match):
    engine = fresh(tiny_model.model, max_model_len=20)
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished


def test_teacher_forcing_and_abort(tiny_model):
    engine = fresh(tiny_model.model)
    forced = [5, 6, 7, 8]
    engine.add_request("f", random_prompt(10, seed=6), SamplingParams(max_tokens=4), force_ids=forced)
    engine.add_request("z", random_prompt(30, seed=7), SamplingParams(max_tokens=50))
    got = []
    for _ in range(6):
        got += [t for o in engine.step() if o.request_id == "f" for t in o.new_token_ids]
    assert got == forced
    assert engine.abort("z") and not engine.abort("z")
    assert not engine.has_unfinished
    engine.scheduler.check_integrity()


def test_requests_larger_than_the_cache_end_instead_of_looping(tiny_model):
    from engine.core.kv_cache import global_bytes_per_block, size_layout

    cfg = tiny_model.cfg
    probe = size_layout(cfg, 1 << 30, max_num_seqs=2, max_num_batched_tokens=64, max_snapshots=0)
    fixed = (1 << 30) - probe.num_global_blocks * global_bytes_per_block(cfg, 64)
    engine = fresh(tiny_model.model, max_num_seqs=2, max_num_batched_tokens=64, max_snapshots=0,
                   cache_memory_bytes=fixed + global_bytes_per_block(cfg, 64))
    assert engine.cache.layout.num_global_blocks == 1
    with pytest.raises(RequestError, match="KV cache holds 64"):
        engine.add_request("big", random_prompt(64, seed=8), SamplingParams())
    engine.add_request("grows", random_prompt(60, seed=9), SamplingParams(max_tokens=20))
    outs = [o for _ in range(30) for o in engine.step()]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs) == 5  # the prompt, then positions 60..63; 64 needs a block
    assert not engine.has_unfinished
    engine.scheduler.check_integrity()
