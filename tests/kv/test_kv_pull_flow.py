"""The pieces composed as a replica will (phase 2 puts them behind Serve): replica A finishes a turn,
exports its blocks into its host store and publishes them; replica B looks the next turn's prompt up in
the ownership index, pulls the blocks it lacks from A's store over NIXL, imports them, and answers
the turn from a local prefix hit, as a replica that computed the first turn itself would."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.core.kv_blocks import ExportedPrefix, block_bytes
from engine.core.prefix_hash import block_hashes
from serve_app.kv_store import HostKVStore
from serve_app.kv_transfer import TransferAgent
from serve_app.ownership import OwnershipIndex
from tests.core.conftest import random_prompt
from tests.kv.test_kv_blocks import make_engine, turn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Replica:
    """What phase 2's replica holds next to its engine."""

    def __init__(self, name: str, model, redis_url: str):
        self.engine = make_engine(model)
        salt, B = self.engine.cache.salt, self.engine.cache.layout.global_block_size
        self.index = OwnershipIndex(redis_url, replica_id=name, region="local", fingerprint=salt, lease_s=30)
        self.store = HostKVStore(salt, block_bytes(model.cfg, B), 64 * block_bytes(model.cfg, B),
                                 on_evict=self.index.withdraw)
        self.agent = TransferAgent(f"{name}-{os.getpid()}", self.store, staging_bytes=1 << 20)
        self.index.announce(self.agent.name, self.agent.metadata)

    def share(self, token_ids: list[int]) -> int:
        """After a request: its full blocks into the host store, and their ownership published."""
        prefix = self.engine.export_prefix(token_ids)
        stored = self.store.put(prefix)
        self.index.publish(self.store.get_descriptors(stored))
        return len(stored)

    def prefetch(self, token_ids: list[int]) -> int:
        """Before admitting a prompt: pull the blocks a peer has beyond the local prefix; tokens imported."""
        B = self.engine.cache.layout.global_block_size
        local = self.engine.cache.cached_prefix(token_ids)[0] // B
        hashes = block_hashes(token_ids, B, self.engine.cache.salt)
        n, owner, blocks = self.index.longest_owned_prefix(hashes)
        if n <= local:
            return 0
        data = self.agent.pull(owner.agent_metadata, [b.ref() for b in blocks[local:n]])
        prefix = ExportedPrefix(self.engine.cache.salt, hashes[local:n], data.copy())
        return self.engine.import_prefix(prefix)


def test_pull_a_conversation_prefix_from_another_replica(tiny_model, redis_server):
    model, W = tiny_model.model, tiny_model.cfg.window_size
    a, b = Replica("a", model, redis_server.url), Replica("b", model, redis_server.url)
    c = make_engine(model, max_snapshots=0)  # the reference: computed turn 1 itself, no snapshot
    turn1 = random_prompt(150, seed=31)
    out1, _, _ = turn(a.engine, "t1", turn1)
    turn(c, "t1", turn1)
    assert a.share(turn1 + out1) == 2
    turn2 = turn1 + out1 + random_prompt(20, seed=32)
    assert b.prefetch(turn2) == 128
    assert b.prefetch(turn2) == 0  # now local
    out_b, _, stats_b = turn(b.engine, "t2", turn2)
    out_c, _, stats_c = turn(c, "t2", turn2)
    assert (stats_b.num_cached_tokens, stats_b.num_replayed_tokens) == (128, W)
    assert stats_b.num_computed_prompt_tokens == len(turn2) - 128 + W
    assert out_b == out_c
    assert np.array_equal(b.engine.export_prefix(turn2).data, a.engine.export_prefix(turn2).data)
    a.index.withdraw_all()
    assert b.index.longest_owned_prefix(block_hashes(turn2, 64, b.engine.cache.salt)).num_blocks == 0
    for r in (a, b):
        r.agent.close()


def test_a_failed_write_of_import_prefix_leaves_no_block_to_hit(tiny_model, monkeypatch):
    """import_prefix registers its blocks before the write; a write that raises (a dead shard actor) must not
    leave them registered, half written, for the next request's prefix lookup."""
    a, b = make_engine(tiny_model.model), make_engine(tiny_model.model)
    prompt = random_prompt(150, seed=52)
    out, _, _ = turn(a, "a1", prompt)
    exported = a.export_prefix(prompt + out)

    def broken(block_ids, data):
        raise RuntimeError("the shard actor died")

    monkeypatch.setattr(b.executor, "write_blocks", broken)
    with pytest.raises(RuntimeError, match="died"):
        b.import_prefix(ExportedPrefix(exported.fingerprint, exported.hashes, exported.data))
    assert b.cache.global_pool.num_cached == 0 and b.cache.cached_prefix(prompt + out)[0] == 0
    b.cache.global_pool.check_integrity()
