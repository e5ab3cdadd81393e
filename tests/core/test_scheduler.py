"""Scheduler and cache manager without a model: exact chunks, block ids, window-block release,
preemption, snapshots and integrity. Layout: 4-token global blocks, 2-token window blocks, window 4."""

from __future__ import annotations

import sys

import pytest

from engine.core.cache_manager import CacheLayout, KVCacheManager
from engine.core.request import FinishReason, Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig

W = 4


def make(num_global=8, num_swa=12, slots=3, snapshots=1, budget=6, seqs=3, chunk=None, replay=True, caching=True):
    layout = CacheLayout(4, 2, W, num_global, num_swa, slots, snapshots)
    cache = KVCacheManager(layout, b"salt", enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(W, seqs, budget, chunk, replay), cache)


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), seed=0, eos_token_id=None, max_total_len=1000)


def step(s: Scheduler, tokens: dict[str, int] | None = None):
    """schedule + advance + append a token to every request that sampled; returns [(id, start, end)]."""
    out = s.schedule()
    s.advance(out)
    for c in out.chunks:
        if c.sample:
            c.request.output_ids.append((tokens or {}).get(c.request.request_id, 7))
    s.check_integrity()
    return [(c.request.request_id, c.start, c.end) for c in out.chunks], out


def test_scheduler_module_imports_no_torch():
    import subprocess

    code = ("import sys; import engine.core.scheduler, engine.core.cache_manager, engine.core.block_pool, "
            "engine.core.request; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_chunks_and_exact_block_ids():
    s = make(budget=6)
    a, b = req("a", list(range(10))), req("b", list(range(100, 103)))
    s.add(a)
    s.add(b)
    chunks, _ = step(s)
    assert chunks == [("a", 0, 6)]  # the budget stops at a's first chunk; b waits
    assert a.global_blocks == [0, 1] and a.swa_blocks == {0: 0, 1: 1, 2: 2}
    chunks, _ = step(s)
    assert chunks == [("a", 6, 10), ("b", 0, 2)]
    # a's positions <= 2 are out of every later window (6 - 4 + 1 = 3): window block 0 went back first
    assert a.global_blocks == [0, 1, 2] and a.swa_blocks == {1: 1, 2: 2, 3: 3, 4: 4}
    assert b.global_blocks == [3] and b.swa_blocks == {0: 5}
    chunks, _ = step(s)
    assert chunks == [("a", 10, 11), ("b", 2, 3)]
    # positions <= 6 are out of every later window: window blocks 1, 2 went back; a released block
    # joins the back of the free queue, so the never-used ids 6, 7 come first
    assert a.swa_blocks == {3: 3, 4: 4, 5: 6}
    assert b.swa_blocks == {0: 5, 1: 7}


def test_decoder_replay_planned_at_admission():
    s = make(budget=20, num_global=8)
    long, short = req("long", list(range(11))), req("short", list(range(4)))
    s.add(long)
    s.add(short)
    step(s)
    assert (long.decoder_from, long.decoder_floor) == (11 - W, 11 - W)
    assert (short.decoder_from, short.decoder_floor) == (0, 0)  # 4 tokens: not more than the window
    off = make(budget=20, replay=False)
    r = req("r", list(range(11)))
    off.add(r)
    step(off)
    assert r.decoder_from == 0


def test_preemption_frees_the_newest_request_and_recomputes_it():
    s = make(num_global=3, budget=12, seqs=3, snapshots=0)
    a, b = req("a", list(range(7))), req("b", list(range(50, 54)))
    s.add(a)
    s.add(b)
    step(s)
    assert a.global_blocks == [0, 1] and b.global_blocks == [2]
    chunks, _ = step(s)  # a: position 7, b: position 4 -> b needs a second block: none left
    assert chunks == [("a", 7, 8)]
    assert b.num_computed == 0 and b.global_blocks == [] and s.waiting[0] is b
    assert b.stats.num_preemptions == 1 and len(b.output_ids) == 1
    s.finish(a, FinishReason.STOP)
    assert s.cache.global_pool.num_in_use == 0
    chunks, _ = step(s)
    assert chunks == [("b", 0, 5)]  # recomputes prompt + its output (block 0 was registered by a: no hit)
    assert b.global_blocks == [2, 1]  # free FIFO: block 2 (b's, released first), then 1 (a's tail, unregistered)


def test_finished_request_becomes_a_snapshot_and_the_next_turn_adopts_it():
    s = make(num_global=8, budget=16)
    a = req("a", list(range(9)), max_tokens=2)
    s.add(a)
    step(s)
    step(s)
    s.finish(a, FinishReason.LENGTH)
    assert a.global_blocks == [] and len(s.cache.snapshots) == 1
    snap = next(iter(s.cache.snapshots.values()))
    assert snap.token_ids == list(range(9)) + [7] and snap.global_blocks == [0, 1, 2]
    assert s.cache.global_pool.ref_count(0) == 1  # held by the snapshot
    turn2 = req("b", list(range(9)) + [7, 7, 42, 43])
    s.add(turn2)
    chunks, _ = step(s)
    assert chunks == [("b", 10, 13)]
    assert turn2.global_blocks == [0, 1, 2, 3] and turn2.stats.num_cached_tokens == 10
    assert not s.cache.snapshots
    third = req("c", list(range(8)) + [99, 98])  # shares the first two full blocks, not the snapshot
    s.add(third)
    chunks, _ = step(s)
    assert ("c", 8 - W, 10) in chunks  # encoder replay of the last window before the 8-token hit
    assert third.global_blocks[:2] == [0, 1] and third.stats.num_replayed_tokens == W
    assert s.cache.global_pool.ref_count(0) == 2


def test_snapshots_are_dropped_oldest_first_when_blocks_run_short():
    s = make(num_global=4, budget=16, snapshots=2)
    for rid, base in (("a", 0), ("b", 100)):
        r = req(rid, list(range(base, base + 5)), max_tokens=1)
        s.add(r)
        step(s)
        s.finish(r, FinishReason.LENGTH)
    assert len(s.cache.snapshots) == 2 and s.cache.global_pool.num_in_use == 4
    c = req("c", list(range(200, 203)))
    s.add(c)
    step(s)
    assert len(s.cache.snapshots) == 1  # a's went to make room
    assert next(iter(s.cache.snapshots.values())).token_ids == list(range(100, 105))


def test_abort_releases_everything():
    s = make()
    a = req("a", list(range(10)))
    s.add(a)
    step(s)
    assert s.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert s.cache.global_pool.num_in_use == 0 and s.cache.swa_pool.num_in_use == 0
    assert not s.cache.snapshots
    s.check_integrity()
    assert s.abort("a") is None


def test_integrity_check_catches_a_leak():
    s = make()
    a = req("a", list(range(5)))
    s.add(a)
    step(s)
    a.global_blocks.pop()  # the request forgets a block it holds
    with pytest.raises(AssertionError, match="global block 1"):
        s.check_integrity()


def test_ids_between_equals_slicing_all_ids():
    r = req("r", [10, 11, 12, 13])
    r.output_ids = [20, 21, 22]
    ids = r.all_ids
    for a in range(len(ids) + 1):
        for b in range(a, len(ids) + 1):
            assert r.ids_between(a, b) == ids[a:b], (a, b)


def test_a_request_alone_short_of_blocks_waits_for_a_pull_in_flight_instead_of_ending():
    """Blocks a KV pull holds come back when it ends (KVCacheManager.begin_import .. end_import): a request that
    cannot grow only because of them waits (no chunk, no LENGTH finish, no admission behind it); without a pull in
    flight the same shortage ends it, as before."""
    s = make(num_global=3, budget=12, snapshots=0)
    a = req("a", list(range(8)))
    s.add(a)
    step(s)
    assert a.global_blocks == [0, 1]
    pending = s.cache.begin_import([bytes([i]) * 32 for i in range(1)])  # holds the last free block
    assert pending.fresh_blocks == [2]
    s.add(req("b", list(range(50, 52))))
    for _ in range(2):
        chunks, out = step(s)  # a's position 8 needs a third block
        assert chunks == [] and out.cannot_grow == [] and not a.is_finished and len(s.waiting) == 1
    s.cache.end_import(pending, is_written=False)
    chunks, _ = step(s)
    assert chunks[0] == ("a", 8, 9) and a.global_blocks == [0, 1, 2]

    alone = make(num_global=2, budget=12, snapshots=0)
    r = req("r", list(range(8)))
    alone.add(r)
    step(alone)
    _, out = step(alone)
    assert out.cannot_grow == [r] and r.finish_reason is FinishReason.LENGTH


def test_decodes_admitted_after_a_long_prefill_keep_their_token():
    """A request still prefilling ahead of decoding ones in admission order (placed there by hand; in the engine a
    per-request chunk cap lets decodes be admitted behind a prompt): its chunk leaves the decodes after it their
    positions. By hand: budget 6, decodes d1 and d2 after the prefilling p take 1 each, so p takes 4."""
    s = make(budget=6, num_global=16, num_swa=24)
    d1, d2 = req("d1", [1, 2]), req("d2", [3, 4])
    s.add(d1)
    s.add(d2)
    step(s)  # both prefill and draw their first token
    p = req("p", list(range(20, 40)))
    s.running.insert(0, p)  # ahead of them in admission order
    p.status = d1.status
    s.cache.admit(p, s.cache.find_prefix(p))
    chunks, _ = step(s)
    assert chunks == [("p", 0, 4), ("d1", 2, 3), ("d2", 2, 3)]


@pytest.mark.parametrize("cap", [None, 3])
def test_prefill_beside_decodes_is_capped(cap):
    """max_prefill_beside_decode: while a request decodes, every prefill chunk of the step together takes at most
    cap positions (by hand: budget 8, one decode; a 20-token prompt gets 3 a step with the cap, 7 without); with no
    decode in the step the prompt takes the whole budget."""
    layout = CacheLayout(4, 2, W, 16, 24, 3, 1)
    s = Scheduler(SchedulerConfig(W, 3, 8, max_prefill_beside_decode=cap), KVCacheManager(layout, b"salt", True))
    d = req("d", [1, 2], max_tokens=3)
    s.add(d)
    assert step(s)[0] == [("d", 0, 2)]
    p = req("p", list(range(20, 40)))
    s.add(p)
    first = 3 if cap else 7
    assert step(s)[0] == [("d", 2, 3), ("p", 0, first)]
    assert step(s)[0] == [("d", 3, 4), ("p", first, 2 * first)]
    s.finish(d, FinishReason.LENGTH)  # what the engine does at its third token
    assert step(s)[0] == [("p", 2 * first, min(20, 2 * first + 8))]  # alone: the whole budget


def test_prefill_beside_decode_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_beside_decode"):
        SchedulerConfig(W, max_prefill_beside_decode=0)
