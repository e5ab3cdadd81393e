"""Global KV blocks leave one engine as flat bytes and enter another as a local prefix-cache hit.

- read_blocks / write_blocks move every global pool's rows of a block, bit for bit;
- KVCacheManager.begin_import holds the blocks it already has and fresh ones (unpublished: no hit) and stops when
  short; end_import publishes the fresh ones, or frees them after a failed write; a block a step registered
  meanwhile wins; a second import skips the blocks a first one in flight brings;
- engine A exports a conversation's first turn, engine B (same fingerprint) imports it: B's second turn
  computes only the new tokens plus the replayed window and equals engine C, which computed the first
  turn itself but kept no snapshot (so it too resumes by block hit + encoder replay);
- a prefix from another fingerprint (weights) or block format is refused and changes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pickle
import time

import numpy as np
import pytest
import torch

from engine.core.block_checksum import host_block_checksums
from engine.core.cache_manager import CacheLayout, KVCacheManager
from engine.core.engine import EngineConfig, LLMEngine
from engine.core.kv_blocks import (ExportedPrefix, PrefixImportError, block_bytes, block_segments,
                                   layout_fingerprint, read_blocks, read_blocks_checked, write_blocks)
from engine.core.kv_cache import PagedKVCache, global_bytes_per_block
from engine.core.sampling_params import SamplingParams
from engine.presets import full_config
from tests.core.conftest import random_prompt, run_engine
from tests.kv.gated_reader import TIMEOUT_S, FileGatedReader

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_NEW = 4


def small_layout(num_global: int = 8) -> CacheLayout:
    return CacheLayout(global_block_size=64, swa_block_size=16, window_size=16, num_global_blocks=num_global,
                       num_swa_blocks=4, num_pending_slots=2, max_snapshots=0)


def test_block_record_size_is_890_bytes_per_token_on_the_real_config(tiny_cfg):
    assert block_bytes(full_config(), 64) == 890 * 64
    for cfg in (full_config(), tiny_cfg):
        assert block_bytes(cfg, 64) == global_bytes_per_block(cfg, 64)
        segs = block_segments(cfg, 64)
        assert [s.offset for s in segs] == [sum(p.nbytes for p in segs[:i]) for i in range(len(segs))]
    assert layout_fingerprint(tiny_cfg, 64) != layout_fingerprint(tiny_cfg, 32)
    assert layout_fingerprint(tiny_cfg, 64) != layout_fingerprint(full_config(), 64)


def whole_word_cfg(tiny_cfg):
    """tiny_cfg with 68-byte index records, as the real config's: every record whole int32 words."""
    return dataclasses.replace(tiny_cfg, index_head_dim=128)


@pytest.mark.parametrize("records", ["bytes", "words"])
def test_read_then_write_moves_every_pool_bit_for_bit(tiny_cfg, records):
    cfg = tiny_cfg if records == "bytes" else whole_word_cfg(tiny_cfg)
    whole_words = all(seg.record_bytes % 4 == 0 for seg in block_segments(cfg, 64))
    assert whole_words == (records == "words"), "the two configs copy as bytes and as int32 words"
    src, dst = PagedKVCache(cfg, small_layout(), "cpu"), PagedKVCache(cfg, small_layout(), "cpu")
    g = torch.Generator().manual_seed(0)
    for t in (*src.main_kv.values(), *src.index_k.values()):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    data = read_blocks(src, [5, 0, 3])
    assert data.dtype == np.uint8 and data.shape == (3, block_bytes(cfg, 64))
    assert read_blocks(src, []).shape == (0, block_bytes(cfg, 64))
    write_blocks(dst, [1, 7, 2], data)
    for name in ("main_kv", "index_k"):
        for s, t in getattr(src, name).items():
            d = getattr(dst, name)[s]
            for a, b in ((5, 1), (0, 7), (3, 2)):
                assert torch.equal(d[b], t[a]), f"{name}[{s}]: block {a} -> {b} differs"
            for b in (0, 3, 4, 5, 6):
                assert not d[b].any(), f"{name}[{s}]: untouched block {b} was written"
    assert np.array_equal(read_blocks(dst, [1, 7, 2]), data)
    ro = data.copy()
    ro.flags.writeable = False  # what Ray hands a remote actor
    write_blocks(dst, [4, 5, 6], ro)
    with pytest.raises(AssertionError, match="expected uint8"):
        write_blocks(dst, [0], data)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_checked_reads_give_the_records_and_their_checksums(tiny_cfg, device):
    """read_blocks_checked: read_blocks' records and each one's block checksum (on CUDA summed on the device),
    equal to the host's sums of the records it returns."""
    cfg = whole_word_cfg(tiny_cfg)
    kv = PagedKVCache(cfg, small_layout(), device)
    g = torch.Generator().manual_seed(1)
    for t in (*kv.main_kv.values(), *kv.index_k.values()):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    data, sums = read_blocks_checked(kv, [6, 2, 0])
    assert np.array_equal(data, read_blocks(kv, [6, 2, 0]))
    assert sums.dtype == np.int64 and np.array_equal(sums, host_block_checksums(data))
    empty, none = read_blocks_checked(kv, [])
    assert empty.shape == (0, block_bytes(cfg, 64)) and none.shape == (0,)


def chain(n: int) -> list[bytes]:
    return [hashlib.sha256(b"block %d" % i).digest() for i in range(n)]


def test_an_import_holds_its_blocks_unpublished_then_publishes_them_tail_last_evicted_first():
    cache = KVCacheManager(small_layout(num_global=6), salt=b"s")
    pool = cache.global_pool
    h = chain(8)
    first = cache.begin_import(h[1:2])
    assert first.fresh_blocks == [0] and cache.end_import(first, is_written=True) == 1  # h1 held (cached)
    busy = pool.allocate(2)  # blocks 1, 2 in use by someone else
    pending = cache.begin_import(h[:8])
    # free: 3, 4, 5 (plain) -> h0, h2, h3; h1 kept in block 0; no block left for h4
    assert pending.hashes == h[:4] and pending.blocks == [3, 0, 4, 5] and pending.fresh == [0, 2, 3]
    # in flight: all four held (nothing evicts or reuses them), the fresh ones no prefix hit
    assert [pool.lookup(x) for x in h[:4]] == [None, 0, None, None] and cache.num_leading_held(h) == 0
    assert all(pool.ref_count(b) == 1 for b in (0, 3, 4, 5)) and pool.num_free == 0
    pool.check_integrity()
    assert cache.end_import(pending, is_written=True) == 3
    assert [pool.lookup(x) for x in h[:4]] == [3, 0, 4, 5] and pool.lookup(h[4]) is None
    assert cache.num_leading_held(h) == 4
    assert all(pool.ref_count(b) == 0 for b in (0, 3, 4, 5)) and pool.num_cached == 4
    # eviction order: the chain's tail first
    pool.release(busy)
    assert pool.allocate(4)[2:] == [5, 4]
    again = cache.begin_import(h[:2])
    assert again.blocks == [3, 0] and again.fresh == []
    cache.end_import(again, is_written=True)
    pool.check_integrity()


def test_a_failed_import_frees_its_fresh_blocks_and_publishes_nothing():
    cache = KVCacheManager(small_layout(num_global=6), salt=b"s")
    pool = cache.global_pool
    h = chain(4)
    cache.end_import(cache.begin_import(h[:1]), is_written=True)  # h0 in block 0, cached
    pending = cache.begin_import(h)
    assert pending.blocks == [0, 1, 2, 3] and pending.fresh == [1, 2, 3]
    cache.check_integrity([])
    assert cache.end_import(pending, is_written=False) == 0
    assert cache.num_leading_held(h) == 1 and pool.num_cached == 1 and pool.num_in_use == 0
    assert [pool.hash_of(b) for b in (1, 2, 3)] == [None] * 3
    assert not cache.imports
    cache.check_integrity([])


def test_a_block_a_step_registered_during_the_import_wins_over_the_pulled_copy():
    """A request that computed the same block while the pull was in flight registered its own: the pull's copy
    is freed at the end, and the chain is whole either way."""
    cache = KVCacheManager(small_layout(num_global=6), salt=b"s")
    pool = cache.global_pool
    h = chain(2)
    pending = cache.begin_import(h)
    assert pending.fresh_blocks == [0, 1]
    [own] = pool.allocate(1)  # the request's block for h0, registered once computed
    assert pool.register(own, h[0])
    assert cache.end_import(pending, is_written=True) == 1
    assert pool.lookup(h[0]) == own and pool.lookup(h[1]) == 1 and pool.hash_of(0) is None
    assert pool.ref_count(0) == 0 and pool.num_cached == 1
    pool.check_integrity()


def test_a_second_import_of_an_overlapping_prefix_skips_the_blocks_the_first_brings():
    """At the cache's level two imports may overlap: the second neither reads nor holds the blocks the first
    holds unpublished, and its run is whole once both ended. (AsyncEngine runs one pull at a time, so in
    serving the second finds the first's blocks published instead: tests/kv/test_pull_beside_steps.py.)"""
    cache = KVCacheManager(small_layout(num_global=6), salt=b"s")
    h = chain(4)
    first = cache.begin_import(h[:2])
    second = cache.begin_import(h)
    assert first.blocks == [0, 1] and second.blocks == [None, None, 2, 3] and second.fresh == [2, 3]
    cache.check_integrity([])
    assert cache.end_import(second, is_written=True) == 2 and cache.num_leading_held(h) == 0
    assert cache.end_import(first, is_written=True) == 2 and cache.num_leading_held(h) == 4
    cache.check_integrity([])


def test_an_import_is_a_no_op_without_prefix_caching():
    cache = KVCacheManager(small_layout(), salt=b"s", enable_prefix_caching=False)
    pending = cache.begin_import(chain(2))
    assert pending.hashes == [] and pending.fresh == [] and cache.end_import(pending, is_written=True) == 0
    assert cache.cached_prefix(list(range(200))) == (0, [], [])


def make_engine(model, **kw) -> LLMEngine:
    return LLMEngine.local(model, EngineConfig(max_num_batched_tokens=256, **kw), eos_token_id=-1,
                           weights_identity="tiny")


def turn(engine, rid, prompt, num_new=NUM_NEW):
    return run_engine(engine, {rid: prompt}, SamplingParams(max_tokens=num_new), keep_logits=True)[rid]


def test_imported_prefix_is_a_local_hit_equal_to_a_replica_that_computed_it(tiny_model):
    model, W = tiny_model.model, tiny_model.cfg.window_size
    a, b = make_engine(model), make_engine(model)
    c = make_engine(model, max_snapshots=0)  # computes turn 1 itself, resumes turn 2 by block hit + replay
    assert a.cache.salt == b.cache.salt
    turn1 = random_prompt(150, seed=21)
    out1, _, _ = turn(a, "t1", turn1)
    assert turn(c, "t1", turn1)[0] == out1
    turn2 = turn1 + out1 + random_prompt(20, seed=22)

    exported = a.export_prefix(turn2)
    assert exported.num_blocks == 2  # 153 positions computed: two full 64-token blocks
    assert np.array_equal(exported.data, c.export_prefix(turn2).data)  # the global KV does not depend on snapshots
    assert b.import_prefix(exported) == 128
    assert b.cache.cached_prefix(turn2)[0] == 128
    assert b.import_prefix(exported) == 128  # again: already held, nothing written
    b.scheduler.check_integrity()

    out_b, rows_b, stats_b = turn(b, "t2", turn2)
    out_c, rows_c, stats_c = turn(c, "t2", turn2)
    for stats in (stats_b, stats_c):
        assert (stats.num_cached_tokens, stats.num_replayed_tokens) == (128, W)
        assert stats.num_computed_prompt_tokens == len(turn2) - 128 + W  # the new tokens + the replay tail
    assert out_b == out_c
    assert sorted(rows_b) == sorted(rows_c)
    for pos in rows_b:
        assert torch.equal(rows_b[pos], rows_c[pos]), f"logits at position {pos} differ"
    assert np.array_equal(b.export_prefix(turn2).data[:2], exported.data)
    b.scheduler.check_integrity()


def test_a_prefix_from_another_fingerprint_or_format_is_refused(tiny_model):
    model = tiny_model.model
    a = make_engine(model)
    prompt = random_prompt(70, seed=23)
    turn(a, "t1", prompt, num_new=1)
    exported = a.export_prefix(prompt)
    assert exported.num_blocks == 1
    other = LLMEngine.local(model, EngineConfig(max_num_batched_tokens=256), weights_identity="other-weights")
    with pytest.raises(PrefixImportError, match="fingerprint"):
        other.import_prefix(exported)
    b = make_engine(model)
    short = ExportedPrefix(exported.fingerprint, exported.hashes, exported.data[:, :-4])
    with pytest.raises(PrefixImportError, match="bytes"):
        b.import_prefix(short)
    for engine in (other, b):
        assert engine.cache.global_pool.num_cached == 0 and engine.cache.cached_prefix(prompt)[0] == 0


def test_the_shard_actor_reads_writes_and_pulls_blocks(tiny_checkpoint, tiny_cfg, monkeypatch, tmp_path):
    """Through Ray: block reads and writes, and a pull. A pull runs in the actor's "pull" group: while its read
    is held, step-group calls (a block read, the barrier) still answer. For a pull the replica hands the actor a
    reader of a few hundred bytes (the owner's agent metadata, store handle and block addresses); the actor reads
    the blocks from the owner's host store (here: this process), with its own NIXL agent or from the store's shared
    memory, into its staging buffer, so the block bytes never pass through Ray. A corrupted block raises
    BlockChecksumMismatch out of the actor, as the replica's fallback expects. (One test: starting the actor is
    most of its time.)"""
    ray = pytest.importorskip("ray")
    from serve_app.shard_worker import CONCURRENCY_GROUPS, ShardExecutor, ShardWorker

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as tests/serve does: Ray 2.60 turns token auth on
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        actor = ray.remote(num_cpus=1, concurrency_groups=CONCURRENCY_GROUPS)(ShardWorker).remote(
            str(tiny_checkpoint), "cpu", small_layout())
        executor = ShardExecutor([actor])
        data = np.random.default_rng(0).integers(0, 256, (2, block_bytes(tiny_cfg, 64)), dtype=np.uint8)
        executor.write_blocks([2, 0], data)
        back = executor.read_blocks([0, 2, 1])
        assert np.array_equal(back[:2], data[::-1]) and not back[2].any()
        pull_beside_a_step_call(ray, actor, executor, data, tmp_path)
        if importlib.util.find_spec("nixl_cu13") is not None:
            pull_into_the_actor(executor, tiny_cfg)
        executor.shutdown()
    finally:
        if started:
            ray.shutdown()


def pull_beside_a_step_call(ray, actor, executor, data: np.ndarray, tmp_path) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    pulling = actor.import_blocks.remote([5, 6], FileGatedReader(data, str(started), str(go)))
    deadline = time.monotonic() + TIMEOUT_S
    while not started.exists():
        assert time.monotonic() < deadline, "the pull's read never started"
        time.sleep(0.05)
    # the step group answers while the pull's read is held (before the "pull" group it waited for the pull);
    # well within the gate's own timeout, so that a step call queued behind the pull fails here
    assert np.array_equal(ray.get(actor.read_blocks.remote([2]), timeout=TIMEOUT_S / 4), data[:1])
    ray.get(actor.barrier.remote(), timeout=TIMEOUT_S / 4)
    assert not ray.wait([pulling], timeout=0)[0]
    go.touch()
    ray.get(pulling, timeout=TIMEOUT_S)
    assert np.array_equal(executor.read_blocks([5, 6]), data)


def pull_into_the_actor(executor, tiny_cfg) -> None:
    from serve_app.kv_store import HostKVStore
    from engine.core.kv_import import BlockChecksumMismatch
    from serve_app.kv_transfer import PeerBlockReader, TransferAgent

    nbytes = block_bytes(tiny_cfg, 64)
    store = HostKVStore(b"salt", nbytes, 8 * nbytes)
    data = np.random.default_rng(4).integers(0, 256, (5, nbytes), dtype=np.uint8)
    hashes = [bytes([i]) * 32 for i in range(5)]
    store.put(ExportedPrefix(b"salt", hashes, data))
    owner = TransferAgent(f"owner-{os.getpid()}-{id(store)}", store)
    try:
        executor.prepare_pulls()  # the actor's staging buffer and NIXL agent, before the first pull
        for shared in (None, store.shared_handle()):  # over NIXL; from this process's shared memory (same node)
            reader = PeerBlockReader(owner.metadata, store.get_descriptors(hashes), 5.0, shared, agent=owner)
            assert len(pickle.dumps(reader)) < 2048 < data.nbytes  # what crosses Ray: no block bytes, no agent
            executor.import_blocks([7, 1, 4], reader.select([0, 3, 4]))
            assert np.array_equal(executor.read_blocks([7, 1, 4]), data[[0, 3, 4]])
            store.buffer[1, 5] ^= 1  # the importer checks what landed
            with pytest.raises(BlockChecksumMismatch, match="checksum mismatch"):
                executor.import_blocks([2, 3], reader.select([0, 1]))
            store.buffer[1, 5] ^= 1
    finally:
        owner.close()
