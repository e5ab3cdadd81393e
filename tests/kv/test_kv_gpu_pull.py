"""A KV pull between two replicas whose pools are on a GPU (gpu marker; issue 27), composed as EngineReplica composes
them (LLMEngine + AsyncEngine + KVSharing: host store registered with NIXL, ownership in a real Redis):

- replica A serves turn 1 and publishes its blocks (device pools -> its host store -> Redis records);
- replica B, told to pull from A, reads them (from A's shared memory, or over NIXL) into its importer's pinned staging
  buffer and copies them into its device pools beside its steps, checking every block's checksum on the device: B's
  pools then hold, in the blocks its prefix hit uses, A's bytes bit for bit;
- B's turn 2 equals a replica that computed turn 1 itself and resumes by encoder replay (no snapshot), the CPU tests'
  reference (tests/kv/sharing_fixtures.reference_turns).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serve_app.records import KVHint
from tests.core.conftest import random_prompt
from tests.kv.sharing_fixtures import LocalReplica, identity, loop, redis, reference_turns  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def cuda_model(tiny_checkpoint):
    from engine.load import load_model

    return load_model(tiny_checkpoint, "cuda", progress=False, with_mtp=False).model


@pytest.mark.parametrize("same_node_reads", [True, False], ids=["shared-memory", "nixl"])
def test_pulled_blocks_equal_the_owners_bit_for_bit_on_the_gpu(cuda_model, redis, loop, identity, same_node_reads):
    a = LocalReplica(f"gpu-a-{same_node_reads}", cuda_model, redis.url, identity)
    b = LocalReplica(f"gpu-b-{same_node_reads}", cuda_model, redis.url, identity)
    b.kv.same_node_reads = same_node_reads
    try:
        turn1 = random_prompt(300, seed=41)
        first = loop.run(a.turn("t1", turn1))
        turn2 = turn1 + first.token_ids + random_prompt(40, seed=42)
        B = a.engine.cache.layout.global_block_size
        owned = len(turn1 + first.token_ids) // B  # the full blocks A published
        hint = KVHint(a.engine.cache.salt, target=a.name, pull_from=a.name, num_blocks=owned)
        second = loop.run(b.turn("t2", turn2, hint))

        outcome = second.outcome
        assert outcome.fallback is None and outcome.owner == a.name, outcome
        assert b.kv.agent.num_pulls == (0 if same_node_reads else 1), "the path the switch names"
        if same_node_reads:  # A's store, registered with CUDA in B's process (in the background): later pulls copy
            from serve_app.kv_local import peer_stores  # straight from it (tests/kv/test_kv_import.py: both kinds)

            [mapped] = [m for h, m in peer_stores._maps.items() if h == a.kv.store.shared_handle()]
            assert mapped.wait_locked(30.0)
        assert (outcome.num_local_tokens, outcome.num_pulled_tokens) == (0, owned * B)
        assert second.stats.num_cached_tokens == owned * B
        importer = b.engine.executor.importer
        assert importer.host.is_pinned() and importer.stream is not None and importer.num_retired == 0

        _, ids_a, hashes_a = loop.run(a.aengine.call(a.engine.cache.cached_prefix, turn2))
        _, ids_b, hashes_b = loop.run(b.aengine.call(b.engine.cache.cached_prefix, turn2))
        assert hashes_b[:owned] == hashes_a[:owned]
        got = loop.run(b.aengine.call(b.engine.executor.read_blocks, ids_b[:owned]))
        want = loop.run(a.aengine.call(a.engine.executor.read_blocks, ids_a[:owned]))
        assert got.shape == want.shape and got.nbytes > 0
        differ = np.flatnonzero((got != want).any(axis=1))
        assert differ.size == 0, f"blocks {differ.tolist()} of {owned} differ from the owner's"

        reference = reference_turns(cuda_model, identity, [turn1, turn2])
        assert first.token_ids == reference[0]
        assert second.token_ids == reference[1]
    finally:
        for replica in (a, b):
            loop.run(replica.close())
