"""The greedy draft step on device buffers (engine/core/draft_step.py), run eagerly on the CPU (Triton interpreter),
against the eager kernel drafter (DSparkDrafter over KernelDSpark, whose contexts the host builds with
paged.swa_slots) on the same requests inside a speculative run: the same drafts and confidences. Its CUDA graphs:
the GPU test at the end (graphs against the same step run eagerly on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.drafter import DraftRequest, DSparkDrafter
from engine.core.engine import EngineConfig, LLMEngine
from engine.core.kernel_drafter import context_slots
from engine.core.sampling_params import SamplingParams
from engine.kernels import paged
from tests.core.conftest import random_prompt

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(3600)]

PROMPTS = [random_prompt(9, seed=91), random_prompt(14, seed=92), random_prompt(5, seed=93)]
NUM_NEW = 4
GREEDY = SamplingParams(max_tokens=NUM_NEW)


def speculative_engine(model, K: int, **kw) -> LLMEngine:
    config = EngineConfig(**(dict(max_num_batched_tokens=64, speculative_tokens=K, runner="kernels", max_num_seqs=4,
                                  decode_step=True, max_model_len=256) | kw))
    return LLMEngine.local(model, config, eos_token_id=-1)


def test_context_slots_are_the_hosts_window_slots(tiny_model_mtp):
    """DraftStep.context_slots (from the staged window blocks) = paged.swa_slots of each context, -1 after it,
    for contexts shorter than the window, crossing blocks, and far into a sequence."""
    step = speculative_engine(tiny_model_mtp.model, 2, max_num_seqs=16).executor.runner.draft_step
    S, W = step.S, step.W
    rng = random.Random(5)
    requests = []
    for position in (0, 1, S - 1, S, W - 1, W, W + 1, W + S + 3, 7 * W + 5):
        blocks = {i: rng.randrange(1000) for i in range(max(0, position - W) // S, position // S + 1)}
        requests.append(DraftRequest(1, position, [], 1, blocks, GREEDY, 0, 0))
    v = step.stage(requests, len(requests))
    got = step.context_slots(v.positions, v.blocks)
    want = context_slots([paged.swa_slots(r.swa_blocks, max(0, r.position - W), r.position, S) for r in requests], W)
    assert torch.equal(got, want)


def test_draft_step_drafts_what_the_eager_drafter_drafts(tiny_model_mtp):
    """Every draft of a greedy speculative run (3 requests: a padded bucket of 4; K = 2, so calls of 1 and 2 drafts
    as the requests near their ends) from the draft step = the eager drafter's on the same requests and pools:
    tokens, and confidences up to the fp32 head's rounding at another row count (the eager drafter runs 3 rows, the
    step 4). (K = 1 passed too when measured; each K costs minutes under the interpreter.)"""
    engine = speculative_engine(tiny_model_mtp.model, 2)
    sizes = []
    runner = engine.executor.runner
    step = runner.draft_step
    eager = DSparkDrafter(runner.model, runner.kv, runner.dspark)
    calls = []
    propose = step.propose

    def checked(requests):
        drafts = propose(requests)
        want = eager.propose(requests)
        calls.append(len(requests))
        sizes.append(max(r.num_tokens for r in requests))
        assert [d.token_ids for d in drafts] == [d.token_ids for d in want]
        for d, w in zip(drafts, want):
            assert d.q is None and len(d.confidence) == len(w.confidence)
            assert torch.allclose(torch.tensor(d.confidence), torch.tensor(w.confidence), rtol=1e-3, atol=1e-3)
        return drafts

    step.propose = checked
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished:
        for o in engine.step():
            outputs[o.request_id] += o.new_token_ids
        engine.scheduler.check_integrity()
    assert calls and max(calls) == 3, calls
    assert set(sizes) == {1, 2}, sizes
    assert all(len(ids) == NUM_NEW for ids in outputs.values())


# ---- GPU (the device machine) ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_draft_graphs_replay_what_the_draft_step_runs_eagerly(tiny_checkpoint):
    """The draft step's CUDA graphs against the same step run eagerly (no graph) on CUDA, on every draft call of a
    greedy speculative run (3 requests: bucket 4): the same drafts and confidences, bit for bit (the same kernels at
    the same shapes, reading the same pools)."""
    from engine.load import load_model

    model = load_model(tiny_checkpoint, "cuda", progress=False).model
    engine = speculative_engine(model, 2, cuda_graphs=True)
    step = engine.executor.runner.draft_step
    assert len(step._graphs) == len(step.requests) * step.max_draft
    calls = []
    propose = step.propose

    def checked(requests):
        drafts = propose(requests)
        graphs, step._graphs = step._graphs, {}
        try:
            want = propose(requests)
        finally:
            step._graphs = graphs
        calls.append(len(requests))
        assert [(d.token_ids, d.confidence) for d in drafts] == [(w.token_ids, w.confidence) for w in want]
        return drafts

    step.propose = checked
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12))
    out = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert calls and max(calls) == 3, calls
    assert all(len(ids) == 12 for ids in out.values())
