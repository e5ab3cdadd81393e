"""The kernel runner split over two local processes (`engine.run --num-shards 2 --runner kernels`, Triton
interpreter, gloo) against one shard: the same greedy tokens, the same logits of the eager kernel path, and the
same tokens and logprobs through the decode step (decode_step=True, run eagerly on the CPU).

Tolerance. Two shards compute what one computes up to fp32 summation order before each of the row-parallel
roundings (wo_b: the ranks' fp32 partials summed; the MoE: the routed outputs and the shared expert's partials
summed in another association, engine/core/kernel_ops.py), and the column-parallel GEMMs (wq_b, the shared
expert's W1|W3) get other K splits. A rounding moves only where a value lies within a few fp32 ULPs of a bf16
rounding boundary; the inputs here are fixed, so whether one moves is a property of this prompt and these
weights, not chance: measured here, none did (every logit bitwise equal). The head's fp32 product is a CPU BLAS
GEMM over half the vocabulary rows, whose rounding may depend on the matrix shape (test_decode_step measured up
to 1.1e-5 between row counts), so logits and logprobs are compared within LOGIT_TOL = 1e-4
(logits here are |x| <= ~5, so ~2^-15 relative). A wrong slice, a missing all-reduce or a rank's partial counted
twice moves logits by ~0.1 .. 1 and fails; so does a moved bf16 rounding upstream in general (the tiny model
amplifies one: logits rows up to 0.19 relative apart after one, tests/core/test_runner_kernels.py), though one whose
effect on the logits stays below 1e-4 would pass (harmless to the tokens). The decode step's logprobs are
log_softmax of its logits in float64, compared with that of one shard's logits.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import random_prompt
from tests.parallel.test_shard_group import step_until_done

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

LOGIT_TOL = 1e-4
CONFIG = EngineConfig(runner="kernels", max_num_seqs=2, max_num_batched_tokens=32, enable_prefix_caching=False,
                      max_model_len=512)
PROMPT, NUM_NEW = random_prompt(4, 21), 3
SAMPLED = SamplingParams(max_tokens=NUM_NEW, temperature=1.5, min_p=0.01, seed=7)


def generate(engine: LLMEngine, rid: str, params: SamplingParams, keep_logits: bool = False):
    engine.add_request(rid, PROMPT, params, keep_logits=keep_logits)
    out = step_until_done(engine, 600)
    tokens = [t for o in out for t in o.new_token_ids]
    logprobs = [lp for o in out for lp in o.new_logprobs]
    rows = {}
    for o in out:
        if o.logits is not None:
            first, block = o.logits
            rows.update({first + i: block[i] for i in range(block.size(0))})
    return tokens, logprobs, rows


@pytest.fixture(scope="module")
def one_shard(tiny_checkpoint):
    """One shard's greedy tokens and every position's logits (the eager kernel path: logits kept), and its seeded
    sample (SAMPLED: its decode steps draw on the whole vocabulary)."""
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, CONFIG)
    tokens, _, rows = generate(engine, "ref", SamplingParams(max_tokens=NUM_NEW), keep_logits=True)
    assert sorted(rows) == list(range(len(PROMPT) + NUM_NEW - 1))
    return tokens, rows, generate(engine, "sampled", SAMPLED)[0]


@pytest.fixture(scope="module")
def two_shards(tiny_checkpoint):
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, CONFIG, num_shards=2)
    try:
        yield engine
    finally:
        engine.close()


def test_eager_kernel_path_two_shards_give_one_shards_tokens_and_logits(one_shard, two_shards):
    """Prefill and decode steps with logits kept (the eager kernel path): every position's logits."""
    tokens, rows, _ = one_shard
    tok2, _, rows2 = generate(two_shards, "eager", SamplingParams(max_tokens=NUM_NEW), keep_logits=True)
    assert tok2 == tokens
    assert sorted(rows2) == sorted(rows)
    bitwise = 0
    for pos in sorted(rows):
        diff = (rows2[pos] - rows[pos]).abs()
        assert diff.max() <= LOGIT_TOL, f"position {pos}: max |logit diff| {diff.max():.3g} at id {int(diff.argmax())}"
        bitwise += int(diff.max() == 0)
    print(f"logit rows bitwise equal: {bitwise}/{len(rows)}")


def test_decode_step_two_shards_draw_one_shards_tokens_and_logprobs(one_shard, two_shards):
    """Decode steps through the decode step on device buffers on every rank (rank 0's counted): the same greedy
    tokens, and logprobs (log_softmax of the logits in float64, top 2) of one shard's logits within LOGIT_TOL."""
    tokens, rows, _ = one_shard
    taken = []
    step = two_shards.executor.runner.decode
    execute = step.execute
    step.execute = lambda plan: (taken.append(len(plan.chunks)), execute(plan))[1]
    try:
        tok2, lps2, _ = generate(two_shards, "decode", SamplingParams(max_tokens=NUM_NEW, logprobs=2))
    finally:
        step.execute = execute
    assert taken == [1] * (NUM_NEW - 1), f"rank 0's decode step took {taken}"
    assert tok2 == tokens
    for i, lp in enumerate(lps2):
        ref = rows[len(PROMPT) - 1 + i].double().log_softmax(-1)
        top = ref.topk(2)
        assert lp.token_id == tokens[i] and [t for t, _ in lp.top] == top.indices.tolist(), (i, lp)
        got = torch.tensor([lp.logprob] + [v for _, v in lp.top], dtype=torch.float64)
        want = torch.cat([ref[tokens[i]].view(1), top.values])
        assert (got - want).abs().max() <= LOGIT_TOL, f"token {i}: logprobs {got.tolist()} != {want.tolist()}"


def test_decode_step_two_shards_sample_without_gathering_the_logits(one_shard, two_shards):
    """Without logprobs the decode step's plain draws gather each rank's maxima, not the logits
    (engine/core/sharded_draw.py): one shard's seeded sample (temperature, min_p). (Greedy draws take the same
    path's first gather: tests/core/test_sharded_draw.py.)"""
    tokens, _, sampled = one_shard
    draws = []
    step = two_shards.executor.runner.decode
    draw = step.draw

    def recording_draw(v, variant, lp, masked=False):
        draws.append((variant, lp, masked))
        return draw(v, variant, lp, masked)

    step.draw = recording_draw
    try:
        assert generate(two_shards, "sampled", SAMPLED)[0] == sampled
    finally:
        step.draw = draw
    assert draws == [("plain", 0, False)] * (NUM_NEW - 1)
    assert sampled != tokens  # the seeded draw is not the greedy one (else the plain draw went untested)
