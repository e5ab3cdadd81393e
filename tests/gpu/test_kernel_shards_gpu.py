"""The kernel path's model-parallel form on GPUs (written on a CPU machine; first to run in a GPU session).

One GPU: rank 0 of 2 built alone (a solo ShardSpec, benchmarks/rank_decode.py's mode) runs its decode step as CUDA
graphs (the fp32-out GEMV of wo_b and the shared W2, the MoE's partials and moe_finish, the solo collectives inside
the capture), and the graph replays draw exactly what the same step run eagerly draws (the same kernels on the same
rows: identical tokens and logprobs).

Two GPUs (multigpu): `--num-shards 2` on CUDA (NCCL, the decode graphs captured on both ranks with the all-reduces and
the all-gather inside) against one shard on one GPU, greedy: the same tokens over 24 decode steps of three requests,
logprobs within 1e-3 (fp32 summation order differs between the two; on the CPU the same comparison was bitwise,
tests/parallel/test_kernel_shard_group.py; a flipped bf16 rounding would show here as a token or logprob
difference: look at it before widening anything).

Speculative decoding (K = 3, greedy; written on a CPU machine, not yet run on a GPU): the solo rank's verify and
draft graphs (engine/core/verify_step.py, draft_step.py, the solo collectives inside) give what the same steps run
eagerly give; and `--num-shards 2` on two GPUs, every rank replaying its own verify and draft graphs (NCCL inside),
gives one GPU's tokens and draft / accept counts at the same K (on the CPU: tests/parallel/
test_kernel_shard_speculative.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.random_model import random_model
from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.parallel import ShardSpec
from engine.presets import tiny_config
from tests.core.conftest import random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

STEPS = 24
PARAMS = [SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.8, seed=5, logprobs=1),
          SamplingParams(max_tokens=STEPS, ignore_eos=True)]


def config(graphs: bool) -> EngineConfig:
    return EngineConfig(runner="kernels", max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=False,
                        max_model_len=512, cache_memory_bytes=128 << 20, decode_step=True, cuda_graphs=graphs)


def run(engine: LLMEngine) -> dict:
    for i, params in enumerate(PARAMS):
        engine.add_request(f"r{i}", random_prompt(5 + 13 * i, seed=i), params)
    out = {}
    while engine.has_unfinished:
        for o in engine.step():
            ids, lps = out.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            lps += [None if lp is None else (lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs]
    return out


def test_solo_rank_decode_graphs_equal_its_eager_step():
    model = random_model(tiny_config(), "cuda", shard=ShardSpec(0, 2, solo=True))
    graph = LLMEngine.local(model, config(graphs=True), eos_token_id=-1)
    assert len(graph.executor.runner.decode._graphs) > 0
    assert run(graph) == run(LLMEngine.local(model, config(graphs=False), eos_token_id=-1))


def on_one_and_two_gpus(ckpt, cfg: EngineConfig, drive) -> tuple[dict, dict]:
    """drive(engine) on the checkpoint in one process on one GPU, then over two GPUs (two shards)."""
    one = drive(LLMEngine.from_checkpoint(ckpt, cfg, "cuda"))
    engine = LLMEngine.from_checkpoint(ckpt, cfg, "cuda", num_shards=2)
    try:
        return one, drive(engine)
    finally:
        engine.close()


@pytest.mark.multigpu
@two_gpus
def test_two_gpus_draw_one_gpus_tokens(tiny_checkpoint):
    one, two = on_one_and_two_gpus(tiny_checkpoint, config(graphs=True), run)
    assert two.keys() == one.keys()
    for rid in one:
        (ids2, lps2), (ids1, lps1) = two[rid], one[rid]
        first = next((i for i, (a, b) in enumerate(zip(ids2, ids1)) if a != b), None)
        assert ids2 == ids1, f"{rid}: tokens differ from output {first}"
        for a, b in zip(lps2, lps1):
            if b is None:
                assert a is None
                continue
            assert a[0] == b[0] and [t for t, _ in a[2]] == [t for t, _ in b[2]], (rid, a, b)
            values = [a[1]] + [v for _, v in a[2]], [b[1]] + [v for _, v in b[2]]
            assert max(abs(x - y) for x, y in zip(*values)) <= 1e-3, (rid, a, b)


SPEC_STEPS = 12
SPEC_PROMPTS = {f"r{i}": random_prompt(5 + 13 * i, seed=i) for i in range(3)}


def spec_config(graphs: bool) -> EngineConfig:
    return replace(config(graphs), speculative_tokens=3)


def run_speculative(engine: LLMEngine) -> dict:
    """Greedy SPEC_PROMPTS -> {id: (output ids, (verify steps, drafts verified, drafts accepted))}."""
    runner = engine.executor.runner
    assert runner.verify is not None and runner.draft_step is not None and runner.decode is None
    for rid, prompt in SPEC_PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=SPEC_STEPS, ignore_eos=True))
    out = {}
    while engine.has_unfinished:
        for o in engine.step():
            ids, _ = out.setdefault(o.request_id, ([], None))
            ids += o.new_token_ids
            if o.finished:
                out[o.request_id] = (ids, (o.stats.num_verify_steps, o.stats.num_draft_tokens,
                                           o.stats.num_accepted_tokens))
    assert all(stats[0] > 0 for _, stats in out.values()), out
    return out


def test_solo_rank_verify_and_draft_graphs_equal_its_eager_steps():
    model = random_model(tiny_config(), "cuda", shard=ShardSpec(0, 2, solo=True), with_mtp=True)
    graph = LLMEngine.local(model, spec_config(graphs=True), eos_token_id=-1)
    runner = graph.executor.runner
    assert len(runner.verify._verify_graphs) > 0 and len(runner.draft_step._graphs) > 0
    assert run_speculative(graph) == run_speculative(LLMEngine.local(model, spec_config(graphs=False),
                                                                     eos_token_id=-1))


@pytest.mark.multigpu
@two_gpus
def test_two_gpus_speculate_as_one_gpu(tiny_checkpoint):
    def captured_then_run(engine: LLMEngine) -> dict:
        runner = engine.executor.runner
        assert len(runner.verify._verify_graphs) > 0 and len(runner.draft_step._graphs) > 0
        return run_speculative(engine)

    one, two = on_one_and_two_gpus(tiny_checkpoint, spec_config(graphs=True), captured_then_run)
    assert two == one, f"two GPUs {two} vs one GPU {one}"
