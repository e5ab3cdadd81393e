"""A KV pull runs beside the steps (AsyncEngine.import_blocks): its blocks are held on the engine's thread,
unpublished, the executor reads and writes them on the pull thread while the engine keeps stepping the other
requests, and they are published between two steps once written.

- while the pull's read is held (a reader that waits on an event), another request runs to its end with the
  tokens it gets without the pull, the pulled prefix is no hit and the pools check out; then the pull ends, its
  blocks equal the owner's bit for bit, and a request with that prefix takes them as a hit;
- a read that fails mid-pull (after a first chunk reached the pools) publishes nothing, leaves the pools
  consistent, and the prompt recomputes;
- two pulls at once for overlapping prefixes: the second waits for the first, then reads only the blocks the
  first did not bring (all of them if the first failed);
- a request that cannot be admitted only because a pull holds blocks waits for it, not EngineStuckError;
- a pull whose caller is cancelled runs to its end (publishes, releases its blocks).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.kv_cache import size_layout
from engine.core.kv_blocks import block_bytes
from engine.core.kv_import import BlockImporter
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import random_prompt
from tests.kv.gated_reader import TIMEOUT_S, GatedReader
from tests.kv.test_kv_blocks import make_engine, turn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def exported_turn(model, seed: int):
    """Engine a's first turn of 200 prompt tokens: its tokens and their 3 full blocks, exported."""
    a = make_engine(model)
    prompt = random_prompt(200, seed=seed)
    out, _, _ = turn(a, "a1", prompt)
    exported = a.export_prefix(prompt + out)
    assert exported.num_blocks == 3
    return a, prompt + out, exported


async def tokens_of(aengine: AsyncEngine, rid: str, prompt: list[int]) -> tuple[list[int], object]:
    """The request's tokens and its last stats, or TimeoutError when it gets none within TIMEOUT_S."""
    async def run():
        tokens, stats = [], None
        async for out in aengine.generate(rid, prompt, GREEDY):
            tokens += out.new_token_ids
            stats = out.stats
        return tokens, stats
    return await asyncio.wait_for(run(), TIMEOUT_S)


def test_the_engine_steps_on_while_a_pull_is_in_flight(tiny_model):
    model, W = tiny_model.model, tiny_model.cfg.window_size
    a, tokens, exported = exported_turn(model, seed=61)
    other = random_prompt(40, seed=62)
    want_other = a.generate([other], GREEDY)[0]
    b = make_engine(model)
    reader = GatedReader(exported.data)
    turn2 = tokens + random_prompt(10, seed=63)

    async def main():
        aengine = AsyncEngine(b)
        try:
            pull = asyncio.ensure_future(aengine.import_blocks(exported.fingerprint, exported.hashes, reader))
            assert await asyncio.to_thread(reader.started.wait, TIMEOUT_S), "the pull's read never started"
            steps = b.stats.num_steps
            got_other, _ = await tokens_of(aengine, "other", other)
            assert not pull.done() and not reader.go.is_set()  # every token came while the read was held
            assert b.stats.num_steps - steps >= len(got_other)
            held = await aengine.call(lambda: (b.cache.cached_prefix(tokens)[0], b.cache.global_pool.num_cached,
                                               [list(p.fresh_blocks) for p in b.cache.imports]))
            await aengine.call(b.scheduler.check_integrity)
            reader.go.set()
            assert await pull == 192
            assert not b.cache.imports and b.stats.num_imported_tokens == 192
            _, stats = await tokens_of(aengine, "pulled", turn2)
            return got_other, held, stats
        finally:
            reader.go.set()
            await aengine.shutdown()

    got_other, (hit_tokens, num_cached, in_flight), stats = asyncio.run(main())
    assert got_other == want_other
    assert hit_tokens == 0 and num_cached == 0, "a block of the pull in flight was a prefix hit"
    assert len(in_flight) == 1 and len(in_flight[0]) == 3
    assert (stats.num_cached_tokens, stats.num_replayed_tokens) == (192, W)
    assert stats.num_computed_prompt_tokens == len(turn2) - 192 + W
    assert np.array_equal(b.export_prefix(tokens).data, exported.data)
    b.scheduler.check_integrity()


def test_a_pull_that_fails_mid_flight_publishes_nothing_and_the_prompt_recomputes(tiny_model):
    model = tiny_model.model
    _, tokens, exported = exported_turn(model, seed=64)
    b = make_engine(model)
    b.executor.importer = BlockImporter(b.executor.kv, chunk_blocks=1)  # block 0 reaches the pools, block 1 fails
    reader = GatedReader(exported.data, fail_at=1)

    async def main():
        aengine = AsyncEngine(b)
        try:
            pull = asyncio.ensure_future(aengine.import_blocks(exported.fingerprint, exported.hashes, reader))
            assert await asyncio.to_thread(reader.started.wait, TIMEOUT_S)
            got, _ = await tokens_of(aengine, "other", random_prompt(40, seed=65))
            assert len(got) == GREEDY.max_tokens and not pull.done()
            reader.go.set()
            with pytest.raises(ConnectionError, match="block 1"):
                await pull
            await aengine.call(b.scheduler.check_integrity)
            return await tokens_of(aengine, "again", tokens + random_prompt(10, seed=66))
        finally:
            reader.go.set()
            await aengine.shutdown()

    _, stats = asyncio.run(main())
    assert stats.num_cached_tokens == 0 and b.stats.num_imported_tokens == 0
    assert not b.cache.imports and b.executor.importer.num_retired == 1
    b.scheduler.check_integrity()


@pytest.mark.parametrize("first_fails", [False, True])
def test_a_second_pull_of_an_overlapping_prefix_waits_for_the_first(tiny_model, first_fails):
    model = tiny_model.model
    _, tokens, exported = exported_turn(model, seed=67)
    b = make_engine(model)
    b.executor.importer = BlockImporter(b.executor.kv, chunk_blocks=1)
    first = GatedReader(exported.data[:2], fail_at=1 if first_fails else None)
    second = GatedReader(exported.data)
    second.go.set()

    async def main():
        aengine = AsyncEngine(b)
        try:
            pull1 = asyncio.ensure_future(aengine.import_blocks(exported.fingerprint, exported.hashes[:2], first))
            assert await asyncio.to_thread(first.started.wait, TIMEOUT_S)
            pull2 = asyncio.ensure_future(aengine.import_blocks(exported.fingerprint, exported.hashes, second))
            await tokens_of(aengine, "other", random_prompt(20, seed=68))  # steps go on; pull 2 waits meanwhile
            assert not pull2.done() and second.selected == []
            first.go.set()
            results = await asyncio.gather(pull1, pull2, return_exceptions=True)
            await aengine.call(b.scheduler.check_integrity)
            return results
        finally:
            first.go.set()
            await aengine.shutdown()

    got1, got2 = asyncio.run(main())
    if first_fails:
        assert isinstance(got1, ConnectionError) and second.selected == [[0, 1, 2]]
    else:
        assert got1 == 128 and second.selected == [[2]]  # the first's two blocks were held here by then
    assert got2 == 192 and b.stats.num_imported_tokens == 192
    assert np.array_equal(b.export_prefix(tokens).data, exported.data)


def test_a_request_that_fits_only_without_the_pulls_blocks_waits_for_them(tiny_model):
    """A pool of 4 global blocks: the pull holds 3, a 130-token prompt needs 3. Before blocks could be held across
    steps this could not happen; the driver must not call that request stuck."""
    model = tiny_model.model
    _, tokens, exported = exported_turn(model, seed=69)
    gb = block_bytes(model.cfg, 64)
    probe = size_layout(model.cfg, 1 << 30, max_num_seqs=16, max_num_batched_tokens=256, max_snapshots=0)
    b = make_engine(model, cache_memory_bytes=(1 << 30) - (probe.num_global_blocks - 4) * gb, max_snapshots=0)
    assert b.cache.layout.num_global_blocks == 4
    reader = GatedReader(exported.data)

    async def main():
        aengine = AsyncEngine(b)
        try:
            pull = asyncio.ensure_future(aengine.import_blocks(exported.fingerprint, exported.hashes, reader))
            assert await asyncio.to_thread(reader.started.wait, TIMEOUT_S)
            waiting = asyncio.ensure_future(tokens_of(aengine, "waits", random_prompt(130, seed=70)))
            for _ in range(50):  # the driver's empty steps: it must wait for the pull, not fail the request
                await asyncio.sleep(0.02)
            assert not waiting.done() and len(b.scheduler.waiting) == 1
            reader.go.set()
            assert await pull == 192
            return await waiting
        finally:
            reader.go.set()
            await aengine.shutdown()

    got, stats = asyncio.run(main())
    assert len(got) == GREEDY.max_tokens and stats.num_cached_tokens == 0


def test_a_pull_whose_caller_is_cancelled_still_ends_and_publishes(tiny_model):
    """A client that disconnects during the pull cancels its prefetch; the pull itself runs on (its blocks must
    not stay held, nor be freed under the write): a later pull of the same prefix waits for it and reads nothing."""
    model = tiny_model.model
    _, tokens, exported = exported_turn(model, seed=71)
    b = make_engine(model)
    reader, again = GatedReader(exported.data), GatedReader(exported.data)

    async def main():
        aengine = AsyncEngine(b)
        try:
            pull = asyncio.ensure_future(aengine.import_blocks(exported.fingerprint, exported.hashes, reader))
            assert await asyncio.to_thread(reader.started.wait, TIMEOUT_S)
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            reader.go.set()
            got = await aengine.import_blocks(exported.fingerprint, exported.hashes, again)
            await aengine.call(b.scheduler.check_integrity)
            return got
        finally:
            reader.go.set()
            await aengine.shutdown()

    assert asyncio.run(main()) == 192
    assert again.selected == [] and not b.cache.imports and b.stats.num_imported_tokens == 192
    assert np.array_equal(b.export_prefix(tokens).data, exported.data)
