"""AsyncEngine: concurrent streams equal the offline engine, n > 1, disconnects free the cache, step
errors reach every consumer, and the driver sleeps when idle. Each test runs its own event loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.core.async_engine import AsyncEngine, EngineStuckError
from engine.core.engine import EngineConfig, LLMEngine, RequestError, RequestOutput
from engine.core.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[11, 12, 13, 14, 15], list(range(200, 220)), list(range(500, 533))]  # shorter than, 1.25x, 2x the window
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
TIMEOUT_S = 60  # a lost stream must fail the test, not hang it


def run(main):
    return asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> LLMEngine:
    """One engine for the module; every test leaves it empty (see assert_idle_and_clean)."""
    config = EngineConfig(max_num_batched_tokens=64, enable_prefix_caching=False, cache_memory_bytes=16 << 20)
    return LLMEngine.from_checkpoint(tiny_checkpoint, config)


def assert_idle_and_clean(engine: LLMEngine) -> None:
    """Nothing running or waiting, and the pools hold exactly what snapshots hold."""
    engine.scheduler.check_integrity()
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    snapshots = engine.cache.snapshots.values()
    assert engine.cache.global_pool.num_in_use == len({b for s in snapshots for b in s.global_blocks})
    assert engine.cache.swa_pool.num_in_use == sum(len(s.swa_blocks) for s in snapshots)


async def collect(stream) -> dict[str, list[RequestOutput]]:
    """Every output of a generate() stream, by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    async for out in stream:
        outs.setdefault(out.request_id, []).append(out)
    return outs


def test_concurrent_streams_equal_offline_generate(engine):
    expected = engine.generate(PROMPTS, GREEDY)
    steps_before = engine.stats.num_steps

    async def main():
        aengine = AsyncEngine(engine)
        try:
            return await asyncio.gather(*(collect(aengine.generate(f"r{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)))
        finally:
            await aengine.shutdown()

    results = run(main)
    for i, (outs, want) in enumerate(zip(results, expected)):
        stream = outs[f"r{i}"]
        assert [t for o in stream for t in o.new_token_ids] == want, f"prompt {i}"
        assert all(len(o.new_token_ids) == 1 for o in stream), "one token per output: streamed, not batched up"
        assert [o.finished for o in stream] == [False] * (len(want) - 1) + [True]
        assert stream[-1].finish_reason.value == "length" and stream[-1].group_id == f"r{i}"
    # the three ran in one batch: fewer steps than the 3 x 4 of running them one by one
    assert engine.stats.num_steps - steps_before == GREEDY.max_tokens
    assert_idle_and_clean(engine)


def test_n2_streams_both_choices(engine):
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=7, n=2, ignore_eos=True)
    # the same request through the synchronous API
    engine.add_request("sync", PROMPTS[1], params)
    sync: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished:
        for o in engine.step():
            sync[o.choice_index] += o.new_token_ids

    async def main():
        aengine = AsyncEngine(engine)
        try:
            return await collect(aengine.generate("pair", PROMPTS[1], params))
        finally:
            await aengine.shutdown()

    outs = run(main)
    assert sorted(outs) == ["pair", "pair/1"]
    for rid, choice in (("pair", 0), ("pair/1", 1)):
        stream = outs[rid]
        assert {o.group_id for o in stream} == {"pair"} and {o.choice_index for o in stream} == {choice}
        assert [t for o in stream for t in o.new_token_ids] == sync[choice]
        assert stream[-1].finished and len(sync[choice]) == 3
    assert sync[0] != sync[1]  # two seeds, two samples
    assert_idle_and_clean(engine)


def test_disconnect_aborts_and_frees_blocks(engine):
    """A cancelled consumer (client gone) and one that breaks out both abort; a neighbour is unaffected."""
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = engine.generate([PROMPTS[0]], GREEDY)[0]

    async def main():
        aengine = AsyncEngine(engine)
        got_two = asyncio.Event()
        seen: list[int] = []

        async def doomed():
            async for out in aengine.generate("doomed", PROMPTS[2], long):
                seen.extend(out.new_token_ids)
                if len(seen) == 2:
                    got_two.set()

        task = asyncio.create_task(doomed())
        neighbour = asyncio.create_task(collect(aengine.generate("neighbour", PROMPTS[0], GREEDY)))
        await got_two.wait()
        assert any(r.request_id == "doomed" for r in engine.scheduler.running)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "doomed" not in engine.requests  # the abort ran before the cancellation completed
        async with contextlib.aclosing(aengine.generate("breaker", PROMPTS[1], long)) as stream:
            async for _ in stream:
                break
        assert "breaker" not in engine.requests
        neighbour_outs = await neighbour
        await aengine.shutdown()
        return seen, neighbour_outs

    seen, neighbour_outs = run(main)
    assert 2 <= len(seen) < long.max_tokens
    assert [t for o in neighbour_outs["neighbour"] for t in o.new_token_ids] == expected
    assert_idle_and_clean(engine)


def test_step_error_reaches_every_consumer(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    async def main():
        aengine = AsyncEngine(engine)
        monkeypatch.setattr(engine, "step", broken_step)
        streams = [collect(aengine.generate(f"e{i}", p, GREEDY)) for i, p in enumerate(PROMPTS[:2])]
        results = await asyncio.gather(*streams, return_exceptions=True)
        monkeypatch.undo()
        # the consumers aborted their requests; the engine serves the next one normally
        after = await collect(aengine.generate("after", PROMPTS[0], GREEDY))
        await aengine.shutdown()
        return results, after

    results, after = run(main)
    assert all(isinstance(r, RuntimeError) and str(r) == "device lost" for r in results), results
    assert [t for o in after["after"] for t in o.new_token_ids] == engine.generate([PROMPTS[0]], GREEDY)[0]
    assert_idle_and_clean(engine)


def test_scheduler_that_places_nothing_fails_the_streams(engine, monkeypatch):
    """Two steps in a row that compute nothing mean no waiting request fits: fail, don't spin."""
    async def main():
        aengine = AsyncEngine(engine)
        monkeypatch.setattr(engine, "step", lambda: [])
        with pytest.raises(EngineStuckError):
            await collect(aengine.generate("stuck", PROMPTS[0], GREEDY))
        monkeypatch.undo()
        await aengine.shutdown()

    run(main)
    assert_idle_and_clean(engine)


def test_request_error_before_anything_is_yielded_and_idle_driver_sleeps(engine, monkeypatch):
    calls = []
    step = engine.step

    def counting_step():
        calls.append(1)
        return step()

    monkeypatch.setattr(engine, "step", counting_step)

    async def main():
        aengine = AsyncEngine(engine)
        with pytest.raises(RequestError, match="empty"):
            await anext(aengine.generate("bad", [], GREEDY))
        with pytest.raises(RequestError, match="max_tokens"):
            await anext(aengine.generate("bad", [1, 2], SamplingParams(max_tokens=0)))
        first = asyncio.create_task(collect(aengine.generate("ok", PROMPTS[0], SamplingParams(max_tokens=2,
                                                                                             ignore_eos=True))))
        await asyncio.sleep(0)  # "ok" is registered
        with pytest.raises(RequestError, match="already in use"):
            await anext(aengine.generate("ok", PROMPTS[1], GREEDY))
        assert len((await first)["ok"]) == 2  # the refused duplicate left the first stream alone
        num_calls = len(calls)
        await asyncio.sleep(0.2)  # a busy driver would call step() many times here
        idle_calls = len(calls) - num_calls
        await aengine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await anext(aengine.generate("late", PROMPTS[0], GREEDY))
        return num_calls, idle_calls

    num_calls, idle_calls = run(main)
    assert num_calls == 2 and idle_calls == 0
    assert_idle_and_clean(engine)


def test_coalesce_merges_consecutive_outputs_of_one_choice():
    from engine.core.async_engine import coalesce
    from engine.core.engine import RequestOutput
    from engine.core.request import FinishReason

    def out(rid, tokens, finished=False):
        return RequestOutput(rid, "g", 0, tokens, [None] * len(tokens), 5, 0, finished,
                             FinishReason.LENGTH if finished else None)

    marker = object()
    merged = coalesce([out("g", [1]), out("g", [2]), out("g/1", [7]), out("g", [3], finished=True), marker])
    assert [(o.request_id, o.new_token_ids) for o in merged[:3]] == [("g", [1, 2]), ("g/1", [7]), ("g", [3])]
    assert merged[2].finished and merged[3] is marker
    assert len(merged[0].new_logprobs) == 2
    # nothing merges across a finished output
    assert len(coalesce([out("g", [1], finished=True), out("g", [2])])) == 2
