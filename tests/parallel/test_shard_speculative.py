"""Speculative decoding over two shards (issue 21) against one shard with the same K (the oracle): every rank loads
its slices of the DSpark stages, drafts over its own pools and verifies the same tokens (the runner checks it each
step: engine.parallel.ranks_differing), so a greedy and a seeded sampled request get the one-shard tokens and the
same draft and accept counts. The random-weight tiny model rejects nearly every greedy draft; at temperature 1.5 some
drafts are accepted."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from multiprocessing.connection import Connection

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.engine_config import EngineConfigError
from engine.core.sampling_params import SamplingParams
from engine.parallel import GroupAddress, ProcessGroups, Rendezvous, ShardSpec, ranks_differing
from tests.core.conftest import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
NUM_NEW = 6
REQUESTS = {  # id: (prompt, params); 21 + 6 tokens within the window of 16 and past it
    "greedy": (random_prompt(21, 1), SamplingParams(max_tokens=NUM_NEW)),
    "sampled": (random_prompt(13, 2), SamplingParams(max_tokens=NUM_NEW, temperature=1.5, seed=7)),
}


def generate(engine: LLMEngine) -> dict[str, tuple[list[int], tuple[int, int, int]]]:
    """Both requests in one batch -> {id: (output ids, (verify steps, drafts verified, drafts accepted))}."""
    for rid, (prompt, params) in REQUESTS.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in REQUESTS}
    stats = {}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                s = o.stats
                stats[o.request_id] = (s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens)
    return {rid: (out[rid], stats[rid]) for rid in REQUESTS}


@pytest.fixture(scope="module")
def one_and_two_shards(tiny_checkpoint):
    config = EngineConfig(speculative_tokens=K, max_num_batched_tokens=48, cache_memory_bytes=32 << 20)
    results = []
    for num_shards in (1, 2):
        engine = LLMEngine.from_checkpoint(tiny_checkpoint, config, "cpu", num_shards=num_shards)
        try:
            results.append(generate(engine))
        finally:
            engine.close()
    return results


def test_two_shards_draft_verify_and_accept_as_one_shard(one_and_two_shards):
    one, two = one_and_two_shards
    print(f"one shard: {one}")
    for rid in REQUESTS:
        assert two[rid] == one[rid], f"{rid}: two shards {two[rid]} vs one shard {one[rid]}"
        tokens, (steps, drafted, _) = one[rid]
        assert len(tokens) == NUM_NEW and steps > 0 and drafted > 0, f"{rid}: {one[rid]}"


def test_a_k_past_the_dspark_block_is_refused_before_any_rank_starts(tiny_checkpoint):
    with pytest.raises(EngineConfigError, match="DSpark block of 3 tokens"):
        LLMEngine.sharded(tiny_checkpoint, EngineConfig(speculative_tokens=4, runner="kernels"), "cpu", 2)


SEEN = [b"[([5, 6], [5, 7])]", b"[([5, 6], [5, 8])]"]  # rank 1's tokens: rank 0's, then other ones
TIMEOUT = timedelta(seconds=120)


def rank_1_compares(address: GroupAddress, conn: Connection) -> None:
    shard = ShardSpec(1, 2)
    groups = ProcessGroups.join(shard, address, torch.device("cpu"), TIMEOUT)
    conn.send([ranks_differing(data, shard) for data in SEEN])
    groups.close()


def test_ranks_differing_names_the_rank_whose_tokens_differ_on_every_rank():
    assert ranks_differing(b"anything", ShardSpec()) == []
    rendezvous = Rendezvous(2, TIMEOUT)
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=rank_1_compares, args=(rendezvous.address, theirs), daemon=True)
    proc.start()
    try:
        groups = ProcessGroups.join(ShardSpec(0, 2), rendezvous.address, torch.device("cpu"), TIMEOUT, rendezvous)
        try:
            here = [ranks_differing(SEEN[0], ShardSpec(0, 2)) for _ in SEEN]
        finally:
            groups.close()
        assert ours.poll(TIMEOUT.total_seconds()), "rank 1 did not report"
        assert here == ours.recv() == [[], [1]]
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
