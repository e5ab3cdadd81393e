"""The engine against the golden model: every request of a mixed, staggered, chunked batch produces
what the golden model produces for it alone.

Tolerance: the engine runs the golden layers over a flat stream, so every per-position value is the
same float64-then-rounded computation; we expect bitwise-equal logits and assert |diff| <= 1e-5
(a float64 summation-order difference could in principle flip one bf16 rounding).
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import golden_greedy, random_prompt, run_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_TOL = 1e-5
NUM_NEW = 5
# window 16 in the tiny preset: lengths below, at and above it; odd lengths leave a ratio-2 remainder
LENGTHS = [1, 2, 15, 16, 17, 33, 40, 51]
ARRIVALS = [0, 0, 1, 2, 2, 3, 5, 6]


def engine_for(model, **kw) -> LLMEngine:
    cfg = dict(max_num_batched_tokens=48, enable_prefix_caching=False) | kw
    return LLMEngine.local(model, EngineConfig(**cfg), eos_token_id=-1)  # no EOS: every request runs NUM_NEW tokens


def assert_matches_golden(model, prompt, result, replay: bool) -> None:
    tokens, rows, stats = result
    gold = golden_greedy(model, prompt, NUM_NEW, replay)
    assert tokens == gold.tokens, f"prompt of {len(prompt)}: engine {tokens} vs golden {gold.tokens}"
    positions = sorted(rows)
    expected = list(range(gold.first_pos, len(prompt) + NUM_NEW - 1))
    assert positions == expected, f"prompt of {len(prompt)}: logits rows at {positions[:3]}.., expected {expected[:3]}.."
    got = torch.stack([rows[p] for p in positions])
    diff = (got - gold.logits).abs().max().item()
    assert diff <= LOGIT_TOL, f"prompt of {len(prompt)}: max |logit diff| {diff}"
    assert stats is not None and stats.num_iterations >= NUM_NEW


@pytest.mark.parametrize("replay", [False, True], ids=["replay-off", "replay-on"])
def test_mixed_staggered_batch_matches_golden_alone(tiny_model, replay):
    engine = engine_for(tiny_model.model, bounded_replay=replay)
    prompts = {f"r{i}": random_prompt(n, seed=i) for i, n in enumerate(LENGTHS)}
    arrivals = {f"r{i}": a for i, a in enumerate(ARRIVALS)}
    results = run_engine(engine, prompts, SamplingParams(max_tokens=NUM_NEW), arrivals, keep_logits=True)
    assert engine.stats.num_steps < sum(LENGTHS)  # batched, not one request at a time
    for rid, prompt in prompts.items():
        assert_matches_golden(tiny_model.model, prompt, results[rid], replay)
    engine.scheduler.check_integrity()
    assert not engine.scheduler.running


def test_prefill_capped_beside_decodes_matches_golden_alone(tiny_model):
    """max_prefill_beside_decode = 5: the staggered batch's prompts prefill 5 positions a step while others decode
    (chunk boundaries wherever the cap falls), and every request still gets what the golden model gives it alone."""
    engine = engine_for(tiny_model.model, max_prefill_beside_decode=5)
    prompts = {f"r{i}": random_prompt(n, seed=i) for i, n in enumerate(LENGTHS)}
    arrivals = {f"r{i}": a for i, a in enumerate(ARRIVALS)}
    results = run_engine(engine, prompts, SamplingParams(max_tokens=NUM_NEW), arrivals, keep_logits=True)
    for rid, prompt in prompts.items():
        assert_matches_golden(tiny_model.model, prompt, results[rid], True)
    assert not engine.scheduler.running


@pytest.mark.parametrize("replay", [False, True], ids=["replay-off", "replay-on"])
@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_equals_unchunked(tiny_model, chunk, replay):
    """Odd chunk sizes put chunk boundaries inside ratio-2 groups and across the replay start."""
    prompts = {f"c{n}": random_prompt(n, seed=100 + n) for n in (33, 40)}
    whole = run_engine(engine_for(tiny_model.model, bounded_replay=replay, max_num_batched_tokens=128),
                       prompts, SamplingParams(max_tokens=NUM_NEW), keep_logits=True)
    chunked_engine = engine_for(tiny_model.model, bounded_replay=replay, max_chunk_tokens=chunk)
    chunked = run_engine(chunked_engine, prompts, SamplingParams(max_tokens=NUM_NEW), keep_logits=True)
    for rid, prompt in prompts.items():
        (t1, r1, _), (t2, r2, s2) = whole[rid], chunked[rid]
        assert t1 == t2
        assert sorted(r1) == sorted(r2)
        for p in r1:
            assert torch.equal(r1[p], r2[p]), f"{rid} position {p}"
        assert s2.num_iterations >= -(-len(prompt) // chunk) + NUM_NEW - 1


def test_preemption_recomputes_and_matches_golden(tiny_model):
    """A cache too small for all requests at once: some are preempted, recomputed, and still exact
    (bounded replay off: a recompute with replay on re-approximates the decoder's window)."""
    model = tiny_model.model
    from engine.core.kv_cache import size_layout

    cfg = tiny_model.cfg
    probe = size_layout(cfg, 1 << 30, max_num_seqs=4, max_num_batched_tokens=48, max_snapshots=0)
    fixed = (1 << 30) - probe.num_global_blocks * _global_block_bytes(cfg)
    engine = engine_for(model, bounded_replay=False, max_num_seqs=4, max_snapshots=0, cache_memory_bytes=fixed + 3 * _global_block_bytes(cfg))
    assert engine.cache.layout.num_global_blocks == 3
    prompts = {f"p{i}": random_prompt(n, seed=200 + i) for i, n in enumerate([60, 61, 62])}
    results = run_engine(engine, prompts, SamplingParams(max_tokens=NUM_NEW), keep_logits=True)
    assert engine.stats.num_preemptions > 0
    for rid, prompt in prompts.items():
        tokens, _, _ = results[rid]
        assert tokens == golden_greedy(model, prompt, NUM_NEW, replay=False).tokens
    engine.scheduler.check_integrity()


def _global_block_bytes(cfg) -> int:
    from engine.core.kv_cache import global_bytes_per_block

    return global_bytes_per_block(cfg, 64)
