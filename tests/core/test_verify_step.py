"""The verify step on device buffers (engine/core/verify_step.py), run eagerly on the CPU (Triton interpreter),
against the kernel runner's eager speculative path (runner._speculative_step) with the same drafts
(tests/core/oracle_drafter.py: the target's continuation, wrong at chosen positions): the same tokens, accept counts and logprobs, and, once the
requests have ended, the same cache contents (window KV, main KV, index keys, the pending group and the DSpark context
of every position the snapshots keep). Logprobs: assert_same_draws' bound (the head's fp32 GEMM rounds a row
differently at other row counts on the CPU); caches bit for bit (measured: the kernel path's bf16 rows do not depend
on how many rows share a step on the CPU). Its CUDA graphs: the GPU test at the end.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import random_prompt
from tests.core.oracle_drafter import OracleDrafter
from tests.core.test_decode_step import assert_same_draws
from tests.core.test_kernel_speculative import snapshot_contents

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(3600)]

PROMPTS = {"a": random_prompt(8, seed=81), "b": random_prompt(11, seed=82)}
NUM_NEW = 7
# Wrong drafts at positions 10 and 13 (a's outputs 2 and 5; b's output 2 at 13) and 17 (b's output 6): K = 2 and 3
# reject a's second draft (mid-chunk); K = 1's drafts land on 9, 11, 13, so it rejects at 13 (without 13 it accepted
# all of a's; the counts of each run are printed)
WRONG = frozenset({10, 13, 17})
STOP_AT = 3  # b stops at its output 3


def engine_for(model, K: int, on_device: bool, drafter=None, **kw) -> LLMEngine:
    config = EngineConfig(**(dict(max_num_batched_tokens=48, speculative_tokens=K, runner="kernels", max_num_seqs=4,
                                  decode_step=on_device, max_model_len=512) | kw))
    engine = LLMEngine.local(model, config, eos_token_id=-1, drafter=drafter)
    assert (engine.executor.runner.verify is not None) == on_device
    return engine


def run(engine: LLMEngine, params: dict[str, SamplingParams]) -> dict:
    """{id: (tokens, logprobs, (verify steps, drafts, accepted))}, the scheduler checked after every step."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params[rid])
    out = {rid: ([], []) for rid in PROMPTS}
    stats = {}
    while engine.has_unfinished:
        for o in engine.step():
            ids, lps = out[o.request_id]
            ids += o.new_token_ids
            lps += [None if lp is None else (lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs]
            if o.finished:
                s = o.stats
                stats[o.request_id] = (s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens)
        engine.scheduler.check_integrity()
    return {rid: (*out[rid], stats[rid]) for rid in PROMPTS}


def snapshots(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """Every finished request's cache contents by name (test_kernel_speculative.snapshot_contents)."""
    return {f"{key} {name}": t for key, snap in engine.cache.snapshots.items()
            for name, t in snapshot_contents(engine, snap).items()}


@pytest.fixture(scope="module")
def targets(tiny_model_mtp):
    """The target's greedy continuations (speculating, no draft verified) and the params of the runs: a with
    logprobs, b stopping at its output STOP_AT."""
    engine = engine_for(tiny_model_mtp.model, 1, False, max_draft_tokens=0)
    plain = run(engine, {rid: SamplingParams(max_tokens=NUM_NEW) for rid in PROMPTS})
    stop = plain["b"][0][STOP_AT]
    assert stop not in plain["b"][0][:STOP_AT], "pick another prompt: b's stop token comes earlier"
    params = {"a": SamplingParams(max_tokens=NUM_NEW, logprobs=2),
              "b": SamplingParams(max_tokens=NUM_NEW, stop_token_ids=(stop,))}
    return [PROMPTS[rid] + plain[rid][0] for rid in PROMPTS], params


@pytest.mark.parametrize("K", [1, 3])  # K = 2 rejects where K = 3 does (mid-chunk) and cost as much again
def test_verify_step_equals_the_eager_speculative_path(tiny_model_mtp, targets, K):
    model = tiny_model_mtp.model
    sequences, params = targets
    results, caches = [], []
    for on_device in (False, True):
        drafter = OracleDrafter(sequences, model.cfg.vocab_size, WRONG)
        engine = engine_for(model, K, on_device, drafter)
        if on_device:
            verify, taken = engine.executor.runner.verify, []
            execute = verify.execute
            verify.execute = lambda plan, drafts: (taken.append(len(plan.chunks)), execute(plan, drafts))[1]
        results.append(run(engine, params))
        caches.append(snapshots(engine))
    eager, device = results
    print(f"K = {K}: " + ", ".join(f"{rid} {device[rid][2]}" for rid in PROMPTS))
    assert taken and max(taken) == 2, taken
    assert_same_draws({rid: r[:2] for rid, r in device.items()}, {rid: r[:2] for rid, r in eager.items()})
    assert {rid: r[2] for rid, r in device.items()} == {rid: r[2] for rid, r in eager.items()}
    assert len(device["b"][0]) == STOP_AT + 1 and device["a"][2][2] > 0  # b stopped; a accepted drafts
    assert device["a"][2][1] > device["a"][2][2]  # ... and had one rejected (measured: at every K)
    assert caches[0].keys() == caches[1].keys()
    differ = [name for name in caches[0] if not torch.equal(caches[0][name], caches[1][name])]
    assert not differ, f"cache records differ: {differ}"


# ---- GPU (the device machine) ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("K", [1, 3])
def test_cuda_verify_graphs_replay_what_the_verify_step_runs_eagerly(tiny_checkpoint, K):
    """The verify step's CUDA graphs against the same step run eagerly (graphs off) on CUDA, with the oracle's drafts
    (wrong at chosen positions) and teacher forcing with the eager run's tokens: the same tokens, accept counts,
    logprobs (assert_same_draws) and cache records (bit for bit: the same kernels at the same shapes)."""
    from engine.load import load_model

    model = load_model(tiny_checkpoint, "cuda", progress=False).model
    plain = engine_for(model, K, False, max_draft_tokens=0, max_num_batched_tokens=64)
    target = run(plain, {rid: SamplingParams(max_tokens=NUM_NEW) for rid in PROMPTS})
    sequences = [PROMPTS[rid] + target[rid][0] for rid in PROMPTS]
    params = {rid: SamplingParams(max_tokens=NUM_NEW, logprobs=2) for rid in PROMPTS}
    results, caches = [], []
    for graphs in (False, True):
        engine = engine_for(model, K, True, OracleDrafter(sequences, model.cfg.vocab_size, WRONG),
                            cuda_graphs=graphs, max_num_batched_tokens=64)
        verify = engine.executor.runner.verify
        assert bool(verify._verify_graphs) == graphs
        results.append(run(engine, params))
        caches.append(snapshots(engine))
    assert_same_draws({rid: r[:2] for rid, r in results[1].items()}, {rid: r[:2] for rid, r in results[0].items()})
    assert {rid: r[2] for rid, r in results[1].items()} == {rid: r[2] for rid, r in results[0].items()}
    differ = [name for name in caches[0] if not torch.equal(caches[0][name], caches[1][name])]
    assert not differ, f"cache records differ: {differ}"
