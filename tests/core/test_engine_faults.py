"""Faults stay with the requests they concern (issue 20): a step that raises ends only the requests it
scheduled, unusable logits end only their own request, and the engine keeps serving the others with the
tokens they get in a fault-free run; the cache's accounting holds afterwards."""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine, LocalExecutor
from engine.core.request import FinishReason
from engine.core.sampling_params import SamplingParams
from engine.core.step_rows import sample_step
from tests.core.conftest import random_prompt, run_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=5)


class FaultyExecutor(LocalExecutor):
    """LocalExecutor whose step number `fail_at` raises (before running), or whose step `nan_at` returns a
    NaN in the sampled row `nan_row`."""

    def __init__(self, model, layout, fail_at: int = -1, nan_at: int = -1, nan_row: int = 0):
        super().__init__(model, layout)
        self.fail_at, self.nan_at, self.nan_row, self.num_steps = fail_at, nan_at, nan_row, 0

    def execute(self, plan):
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise RuntimeError("injected fault")
        logits = self.runner.forward(plan)
        if self.num_steps == self.nan_at:
            with torch.inference_mode():
                logits.sample[self.nan_row, 11] = float("nan")
        return sample_step(plan, logits)


def engine_with(model, **faults) -> LLMEngine:
    config = EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=64)
    return LLMEngine(model.cfg, config, lambda layout: FaultyExecutor(model, layout, **faults), eos_token_id=-1)


def finished(engine: LLMEngine, steps: int = 40) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    done, tokens = {}, {}
    for _ in range(steps):
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = (tokens[o.request_id], o.finish_reason, o.error)
        if not engine.has_unfinished:
            break
    return done


def _assert_idle_and_consistent(engine: LLMEngine) -> None:
    assert not engine.has_unfinished and not engine.requests
    engine.scheduler.check_integrity()
    cache = engine.cache
    held = len({b for s in cache.snapshots.values() for b in s.global_blocks})
    assert cache.global_pool.num_in_use == held
    assert cache.swa_pool.num_in_use == sum(len(s.swa_blocks) for s in cache.snapshots.values())


@pytest.mark.parametrize("fail_at", [1, 3])  # the prefill step (the n = 2 pair has not forked yet), a decode step
def test_a_step_that_raises_fails_only_its_requests(tiny_model, fail_at):
    model = tiny_model.model
    prompts = {"a": random_prompt(12, seed=1), "b": random_prompt(20, seed=2)}
    clean = run_engine(engine_with(model), {"late": random_prompt(9, seed=3)}, GREEDY)
    engine = engine_with(model, fail_at=fail_at)
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    engine.add_request("pair", random_prompt(7, seed=4), SamplingParams(max_tokens=3, n=2))
    for _ in range(fail_at - 1):
        assert all(not o.finished for o in engine.step())
    failed = finished(engine, steps=1)  # this step raises
    assert set(failed) == {"a", "b", "pair", "pair/1"}  # every choice of the group ends, forked or not
    assert all(toks == [] and r is FinishReason.ERROR and "injected fault" in err for toks, r, err in failed.values())
    _assert_idle_and_consistent(engine)
    # the engine keeps serving: a later request gets what it gets from a fault-free engine
    engine.add_request("late", random_prompt(9, seed=3), GREEDY)
    after = finished(engine)
    assert after["late"] == (clean["late"][0], FinishReason.LENGTH, None)
    assert engine.stats.num_failed_steps == 1
    _assert_idle_and_consistent(engine)


def test_unusable_logits_end_only_their_request(tiny_model):
    model = tiny_model.model
    prompts = {"a": random_prompt(12, seed=5), "b": random_prompt(16, seed=6)}
    clean = run_engine(engine_with(model), prompts, GREEDY)
    engine = engine_with(model, nan_at=3, nan_row=0)  # step 3: "a"'s row (first scheduled) gets a NaN
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    done = finished(engine)
    assert done["a"][1] is FinishReason.ERROR and "NaN" in done["a"][2]
    assert done["a"][0] == clean["a"][0][:2]  # the tokens it had before the bad step
    assert done["b"] == (clean["b"][0], FinishReason.LENGTH, None)
    _assert_idle_and_consistent(engine)
