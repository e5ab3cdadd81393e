"""Two replicas on one GPU through Ray Serve (gpu marker; issue 27, item 3): each replica's shard actor asks Ray for
half the GPU (--gpu-fraction 0.5), KV sharing on, real Redis, NIXL. Turn 1 runs on the owner; turn 2, retargeted at
the other replica, is pulled there over NIXL into that shard actor's pinned staging buffer and copied into its device
pools, and its tokens equal a replica's that computed turn 1 itself without keeping a snapshot (the oracle of
tests/kv/test_kv_serving.py), computed here on the same GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.core.conftest import random_prompt
from tests.kv.sharing_fixtures import (generate, identity, kv_sharing_app, read_log, redis,  # noqa: F401 (fixtures)
                                       reference_turns, replica_statuses, wait_owned)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_app(redis, tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("kv_gpu_logs") / "requests.jsonl"
    with kv_sharing_app(redis.url, tiny_checkpoint, log, device="cuda", gpu_fraction=0.5, replica_num_cpus=0.5,
                        cache_memory_bytes=64 << 20, max_num_batched_tokens=256, host_kv_bytes=8 << 20) as handles:
        yield handles


def test_two_replicas_on_one_gpu_turn_2_on_the_other_pulls(gpu_app, tiny_checkpoint, identity):
    from engine.load import load_model

    engine = gpu_app["engine"]
    before = replica_statuses(engine)
    assert len(before) == 2, "two replicas up, each on half of the one GPU"
    turn1 = random_prompt(300, seed=61)
    out1 = [t for c in generate(engine, "g1", turn1) for t in c.token_ids]
    turn2 = turn1 + out1 + random_prompt(30, seed=62)
    owned = len(turn1 + out1) // 64
    hint = wait_owned(gpu_app, turn2, owned)
    [other] = [rid for rid in before if rid != hint.target]
    chunks = generate(engine, "g2", turn2, dataclasses.replace(hint, target=other))
    after = replica_statuses(engine)

    [line] = [r for r in read_log(gpu_app["log"]) if r["request_id"] == "g2"]
    assert line["kv"]["owner"] == hint.target and line["kv"]["fallback"] is None, line["kv"]
    assert chunks[0].num_cached_tokens == owned * 64 and chunks[-1].metrics.num_pulled_tokens == owned * 64
    imported = {rid: after[rid]["engine"]["num_imported_tokens"] - before[rid]["engine"]["num_imported_tokens"]
                for rid in after}
    assert imported == {other: owned * 64, hint.target: 0}

    model = load_model(tiny_checkpoint, "cuda", progress=False, with_mtp=False).model
    want = reference_turns(model, identity, [turn1, turn2])
    assert out1 == want[0]
    assert [t for c in chunks for t in c.token_ids] == want[1]
