"""Async scheduling (engine/core/overlap.py): launching decode step k+1 before reading step k's tokens gives
every request exactly what the synchronous engine gives it — tokens, logprobs, finish reasons, counts — through
stops in the middle of a batch, length limits, errors, arrivals (prefills between decode steps), aborts,
teacher forcing, a second conversation turn from the snapshot, and a cache small enough to preempt.

The executor here launches on the golden runner (fast on the CPU): it substitutes the tokens the plan says are
still "on the device" (StepPlan.from_rows) from its previous draw, and draws a forward launched before its grammar
masks once the engine hands them over (launch_forward, LateDraw), as the decode step does on the GPU
(tests/core/test_decode_step.py and tests/gpu/test_decode_graphs.py run the real one)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from engine.core.engine import EngineConfig, LLMEngine, LocalExecutor
from engine.core.request import FinishReason
from engine.core.sampling_params import SamplingParams
from engine.core.step_rows import sample_step
from tests.core.conftest import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Done:
    output: object

    def result(self):
        return self.output


class LaunchingExecutor(LocalExecutor):
    """launch() for decode plans: runs them now, resolving from_rows from its last draw; launch_forward() runs the
    forward now and draws when the engine hands it the grammar masks (LateDraw), as the decode step does."""

    def __init__(self, model, layout):
        super().__init__(model, layout)
        self.last: list[int] = []
        self.num_launched = self.num_behind = 0  # launches, and those with a token still "on the device"
        self.num_late_draws = 0  # launch_forward's draws, and those with a grammar mask
        self.num_late_masked = 0

    def launch(self, plan):
        resolved = self._resolve(plan)
        return None if resolved is None else Done(self._drew(self.execute(resolved)))

    def launch_forward(self, plan):
        resolved = self._resolve(plan)
        return None if resolved is None else LateDraw(self, resolved, self.runner.forward(resolved))

    def _resolve(self, plan):
        if len(plan.samples) != len(plan.chunks) or any(c.end - c.start != 1 or c.keep_logits for c in plan.chunks):
            return None
        rows = plan.from_rows or [-1] * len(plan.chunks)
        chunks = [replace(c, token_ids=[self.last[r]]) if r >= 0 else c for c, r in zip(plan.chunks, rows)]
        assert all(t >= 0 for c in chunks for t in c.token_ids), "a placeholder without its draw row"
        self.num_launched += 1
        self.num_behind += any(r >= 0 for r in rows)
        return replace(plan, chunks=chunks, from_rows=None)

    def _drew(self, out):
        self.last = [max(t, 0) for t in out.sample.token_ids]
        return out


@dataclass
class LateDraw:
    """A forward's logits, drawn once the masks come (the plan's own masks are ignored, as the decode step does)."""

    executor: LaunchingExecutor
    plan: object
    logits: object

    def draw(self, allowed):
        assert len(allowed) == len(self.plan.samples)
        self.executor.num_late_draws += 1
        self.executor.num_late_masked += any(a is not None for a in allowed)
        samples = [replace(s, allowed=a) for s, a in zip(self.plan.samples, allowed)]
        return Done(self.executor._drew(sample_step(replace(self.plan, samples=samples), self.logits)))


def engine(model, async_scheduling: bool, **kw) -> LLMEngine:
    config = EngineConfig(**({"max_num_batched_tokens": 48, "max_num_seqs": 8, "enable_prefix_caching": False,
                              "async_scheduling": async_scheduling} | kw))
    return LLMEngine(model.cfg, config, lambda layout: LaunchingExecutor(model, layout), eos_token_id=-1)


def drive(e: LLMEngine, script: dict[int, list], max_steps: int = 200) -> dict:
    """Run until idle; script[step] = actions before that step: ("add", id, prompt, params[, force]) or
    ("abort", id). Returns id -> (ids, logprobs, finish reason, num_output_tokens, error)."""
    out, step = {}, 0
    while step <= max(script, default=0) or e.has_unfinished:
        for action in script.get(step, []):
            if action[0] == "add":
                e.add_request(action[1], action[2], action[3], force_ids=action[4] if len(action) > 4 else None)
            else:
                e.abort(action[1])
        for o in e.step():
            ids, lps, *_ = out.get(o.request_id, ([], [], None, 0, None))
            ids += o.new_token_ids
            lps += [None if lp is None else (lp.token_id, round(lp.logprob, 9), [(t, round(v, 9)) for t, v in lp.top]) for lp in o.new_logprobs]
            out[o.request_id] = (ids, lps, o.finish_reason, o.num_output_tokens, o.error)
        step += 1
        assert step < max_steps
    e.scheduler.check_integrity()
    assert not e.requests and e._inflight is None
    return out


def both(model, script, **kw) -> tuple[dict, dict, LLMEngine]:
    sync = drive(engine(model, False, **kw), script)
    a = engine(model, True, **kw)
    return sync, drive(a, script), a


def test_same_outputs_with_stops_arrivals_forcing_and_aborts(tiny_model):
    model = tiny_model.model
    g = SamplingParams(max_tokens=9)
    probe = drive(engine(model, False), {0: [("add", "p", random_prompt(11, seed=1), g)]})["p"][0]
    stop = SamplingParams(max_tokens=9, stop_token_ids=(probe[4],))  # "p" again: stops at its 5th token
    script = {
        0: [("add", "p", random_prompt(11, seed=1), stop),
            ("add", "s", random_prompt(7, seed=2), SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=4,
                                                                  logprobs=2))],
        3: [("add", "late", random_prompt(13, seed=3), SamplingParams(max_tokens=3))],  # a prefill between decodes
        4: [("add", "f", random_prompt(5, seed=5), SamplingParams(max_tokens=6, logprobs=1), [7, 8, 9]),
            ("add", "z", random_prompt(6, seed=6), SamplingParams(max_tokens=50))],
        8: [("abort", "z")],
    }
    sync, overlapped, a = both(model, script)
    # an abort lands between steps: the overlapped engine had delivered one step fewer of "z" by then
    z_sync, z_async = sync.pop("z"), overlapped.pop("z")
    assert z_async[0] == z_sync[0][:len(z_async[0])] and len(z_async[0]) >= len(z_sync[0]) - 1 and z_async[2] is None
    assert overlapped == sync
    assert sync["p"][0] == probe[:5] and sync["p"][2] is FinishReason.STOP  # it did stop mid-batch
    assert sync["f"][0][:3] == [7, 8, 9] and sync["late"][2] is FinishReason.LENGTH
    assert a.executor.num_behind >= 6 and a.stats.num_wasted_positions >= 1  # overlapped, and rolled back


def test_second_turn_from_the_snapshot_is_the_same(tiny_model):
    """A request that stops while the next step is in flight rolls that step back: its snapshot is the
    synchronous one, so the next turn (a prefix hit on it) continues identically."""
    model = tiny_model.model
    first = random_prompt(30, seed=7)
    params = SamplingParams(max_tokens=5)
    results = []
    for async_scheduling in (False, True):
        e = engine(model, async_scheduling, enable_prefix_caching=True)
        one = drive(e, {0: [("add", "t1", first, params), ("add", "o", random_prompt(9, seed=8), params)]})
        turn2 = first + one["t1"][0] + random_prompt(4, seed=9)
        two = drive(e, {0: [("add", "t2", turn2, SamplingParams(max_tokens=4))]})
        assert e.requests == {} and two["t2"][2] is FinishReason.LENGTH
        results.append((one, two, e.cache.hit_rate))
        if async_scheduling:
            assert e.stats.num_wasted_positions >= 1  # t1 ended with a step in flight behind it
    assert results[0] == results[1]
    assert results[1][2] > 0  # the second turn did hit the snapshot


def test_preemption_and_errors_keep_the_synchronous_outputs(tiny_model, monkeypatch):
    """A pool too small for every request's growth (preemption: no overlap then) and a step whose tokens fail."""
    from engine.core.kv_cache import global_bytes_per_block, size_layout

    model = tiny_model.model
    cfg = model.cfg
    probe = size_layout(cfg, 1 << 30, max_num_seqs=8, max_num_batched_tokens=48, max_snapshots=0)
    fixed = (1 << 30) - probe.num_global_blocks * global_bytes_per_block(cfg, 64)
    small = dict(cache_memory_bytes=fixed + 3 * global_bytes_per_block(cfg, 64), max_snapshots=0)
    script = {0: [("add", f"r{i}", random_prompt(50 + i, seed=20 + i), SamplingParams(max_tokens=20)) for i in range(3)]}
    sync, overlapped, a = both(model, script, **small)
    assert overlapped == sync and a.stats.num_preemptions > 0

    calls = {"n": 0}
    real = LaunchingExecutor.launch

    def failing(self, plan):  # the 4th launch's tokens fail to arrive
        done = real(self, plan)
        calls["n"] += 1
        if done is not None and calls["n"] == 4:
            done = FailingDone()
        return done

    class FailingDone:
        def result(self):
            raise RuntimeError("injected device fault")

    monkeypatch.setattr(LaunchingExecutor, "launch", failing)
    e = engine(model, True)
    out = drive(e, {0: [("add", "x", random_prompt(8, seed=30), SamplingParams(max_tokens=12)),
                        ("add", "y", random_prompt(9, seed=31), SamplingParams(max_tokens=12))],
                    10: [("add", "after", random_prompt(5, seed=32), SamplingParams(max_tokens=3))]})
    assert out["x"][2] is out["y"][2] is FinishReason.ERROR and "injected device fault" in out["x"][4]
    assert out["after"][2] is FinishReason.LENGTH and len(out["after"][0]) == 3
