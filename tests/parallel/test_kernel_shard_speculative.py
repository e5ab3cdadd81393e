"""Speculative decoding on the kernel runner over two shards (issue 21; Triton interpreter, gloo), tiny checkpoint
with its DSpark stages (block 3), K = 3, chunked prefill and the prefix cache on.

The oracles are independent runs: the kernel runner without speculative decoding (K = 0) at one shard, whose
greedy tokens every speculative run must give (speculation never changes greedy output), and the kernel runner at one
shard with the same K, whose draft and accept counts, and seeded sample, two shards must give too (every rank
drafts with its slices of the DSpark stages over its own pools and verifies the same tokens; the runner checks that
each step, engine.parallel.ranks_differing). The random-weight DSpark stages propose drafts the target nearly always
rejects, so a second two-shard run drafts with tests/core/oracle_drafter.py (K = 0's continuation, wrong at chosen
positions, pickled to both ranks): its accept counts are known in advance (an accept of none, of some and of all
drafts, accepted ends inside a ratio-2 group and at its end).

Paths covered on both ranks: greedy drafts on the draft step's buffers and greedy verify chunks on the verify step's
(rank 0's are recorded; both run eagerly on the CPU), and the eager speculative step (a step with a prefill chunk
or the sampled request: KernelRunner.forward with its tap hiddens, keyed draft and verify draws). Two shards compute
what one computes up to fp32 summation order (tests/parallel/test_kernel_shard_group.py, where every logit was
bitwise equal); a token that differs is a bug unless one shard's logits are within ~1e-4 of a tie there.

Checked that it fails: rank 1's draft hidden rows scaled by 1 + 2^-6 (an error on rank 1 alone) left the tokens,
the counts, the draft ids and rank 0's confidences as they were, and failed on the draft logits (0.0145 apart).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import load_config
from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import random_prompt, run_engine
from tests.core.oracle_drafter import OracleDrafter
from tests.core.test_engine_speculative import expected_verifies

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow, pytest.mark.timeout(3600)]

K = 3
NUM_NEW = 6
# blocks of 32 positions, so that "c" (a's first block + 5) starts from a prefix-cache hit once "a" has computed it;
# window 16: "a" and "c" decode past it; chunks of 7 within 24 positions a step
CONFIG = EngineConfig(runner="kernels", max_num_seqs=4, max_num_batched_tokens=24, max_chunk_tokens=7,
                      enable_prefix_caching=True, global_block_size=32, max_model_len=512,
                      cache_memory_bytes=32 << 20)
SPECULATIVE = replace(CONFIG, speculative_tokens=K)
A = random_prompt(36, seed=81)
GREEDY = {"a": A, "b": random_prompt(10, seed=82), "c": A[:32] + random_prompt(5, seed=83)}
ARRIVALS = {"b": 1, "c": 7}
SAMPLED = SamplingParams(max_tokens=4, temperature=1.5, seed=7)  # request "s", after them, with the DSpark drafter
S_PROMPT = random_prompt(13, seed=84)
CONFIDENCE_TOL = 1e-4  # fp32 logits of acceptance, |x| of a few units
LOGIT_TOL = 1e-4  # the fp32 head products over half the vocabulary (tests/parallel/test_kernel_shard_group.py)
WRONG = frozenset({38, 12})  # the oracle's wrong drafts: a accepts 1 then 2, b 1 then 2, c 0 then 3


def generate(engine: LLMEngine, sampled: bool) -> dict:
    """GREEDY (and "s" when sampled) -> {id: (output ids, (verify steps, drafts verified, drafts accepted), cached
    tokens)}, the drafts of every step rank 0 verified on the verify step's buffers (key "verify step": per step, per
    chunk, (draft ids, confidences)) and the Markov-corrected draft logits rank 0's DSpark stages gave, all ranks'
    vocabulary slices gathered (key "draft logits": per draft call, fp32 [B, n, V])."""
    runner, taken, logits = engine.executor.runner, [], []
    if runner.verify is not None:
        execute, propose = runner.verify.execute, runner.dspark.propose

        def recording_execute(plan, drafts):
            taken.append([(d.token_ids, d.confidence) for d in drafts])
            return execute(plan, drafts)

        def recording_propose(*args):
            out = propose(*args)
            logits.append(out.logits.clone())
            return out

        runner.verify.execute, runner.dspark.propose = recording_execute, recording_propose
    results = run_engine(engine, GREEDY, SamplingParams(max_tokens=NUM_NEW), ARRIVALS)
    if sampled:  # "s" alone: its steps take the eager speculative path (sampled drafts and rejection sampling)
        results |= run_engine(engine, {"s": S_PROMPT}, SAMPLED)
    engine.scheduler.check_integrity()
    out = {rid: (tokens, (s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens), s.num_cached_tokens)
           for rid, (tokens, _, s) in results.items()}
    return out | {"verify step": taken, "draft logits": logits}


def sharded(ckpt, config: EngineConfig, drafter=None) -> dict:
    engine = LLMEngine.sharded(ckpt, config, "cpu", 2, drafter=drafter)
    try:
        assert engine.executor.runner.kernels and engine.executor.runner.decode is None
        return generate(engine, sampled=drafter is None)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def one_shard(tiny_checkpoint):
    """One shard on the kernel runner: K = 0 (the greedy oracle) and K = 3 with the DSpark stages."""
    plain = LLMEngine.from_checkpoint(tiny_checkpoint, CONFIG)
    speculative = LLMEngine.from_checkpoint(tiny_checkpoint, SPECULATIVE)
    return generate(plain, sampled=False), generate(speculative, sampled=True)


def test_two_shards_draft_and_verify_as_one_shard_and_keep_the_greedy_tokens(tiny_checkpoint, one_shard):
    """Also the DSpark drafts themselves (the random stages' drafts are all rejected, so the counts alone would not
    see a wrong draft): the draft ids of every verify-step step equal one shard's, the confidences within
    CONFIDENCE_TOL, and every draft call's logits within LOGIT_TOL (they hold rank 1's vocabulary slice, computed
    from rank 1's own stages and context: an error on rank 1 alone shows there; rank 0's confidences and, mostly,
    the draft ids would not see it)."""
    plain, one = one_shard
    two = sharded(tiny_checkpoint, SPECULATIVE)
    shown = ("verify step", "draft logits")
    print("\n".join(f"{name}: { {k: v for k, v in out.items() if k not in shown} }"
                    for name, out in (("K = 0", plain), ("one shard", one), ("two shards", two))))
    drafts1, drafts2 = one["verify step"], two["verify step"]
    assert len(drafts2) == len(drafts1) > 0, (drafts1, drafts2)
    worst = 0.0
    for step, (d1, d2) in enumerate(zip(drafts1, drafts2)):
        assert [ids for ids, _ in d2] == [ids for ids, _ in d1], f"verify step {step}: drafts {d2} vs one shard {d1}"
        worst = max([worst] + [abs(a - b) for (_, c1), (_, c2) in zip(d1, d2) for a, b in zip(c1, c2)])
    print(f"draft confidences: max |two shards - one shard| {worst:.3g}")
    assert worst <= CONFIDENCE_TOL
    logits1, logits2 = one["draft logits"], two["draft logits"]
    assert [t.shape for t in logits2] == [t.shape for t in logits1] and logits1, "other draft calls"
    diff = max(float((a - b).abs().max()) for a, b in zip(logits1, logits2))
    print(f"draft logits: max |two shards - one shard| {diff:.3g}, "
          f"{sum(torch.equal(a, b) for a, b in zip(logits1, logits2))}/{len(logits1)} calls bitwise equal")
    assert diff <= LOGIT_TOL
    for rid in GREEDY:
        assert len(plain[rid][0]) == NUM_NEW and plain[rid][1] == (0, 0, 0), rid
        assert one[rid][0] == plain[rid][0], f"{rid}: one shard at K = {K} {one[rid][0]} vs K = 0 {plain[rid][0]}"
        assert two[rid] == one[rid], f"{rid}: two shards {two[rid]} vs one shard {one[rid]}"
        assert one[rid][1][1] > 0, f"{rid}: no drafts verified: {one[rid]}"
    assert plain["c"][2] == one["c"][2] == 32, "the prefix cache took no part"
    assert two["s"] == one["s"] and len(one["s"][0]) == SAMPLED.max_tokens and one["s"][1][1] > 0, (one["s"], two["s"])


def test_two_shards_accept_the_oracles_drafts_as_known_and_keep_the_greedy_tokens(tiny_checkpoint, one_shard):
    plain, _ = one_shard
    sequences = [GREEDY[rid] + plain[rid][0] for rid in GREEDY]
    vocab = load_config(tiny_checkpoint).vocab_size
    two = sharded(tiny_checkpoint, SPECULATIVE, OracleDrafter(sequences, vocab, WRONG))
    print(f"two shards, oracle drafts: { {k: v for k, v in two.items() if k != 'draft logits'} }")
    for rid, prompt in GREEDY.items():
        steps, accepted = expected_verifies(len(prompt), NUM_NEW, K, WRONG)
        tokens, (got_steps, _, got_accepted), _ = two[rid]
        assert tokens == plain[rid][0], f"{rid}: {tokens} vs K = 0 {plain[rid][0]}"
        assert (got_steps, got_accepted) == (steps, accepted), f"{rid}: {two[rid]}, expected {(steps, accepted)}"
    assert len(two["verify step"]) > 0
