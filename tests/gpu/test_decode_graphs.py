"""The decode step's CUDA graphs (engine/core/decode_step.py) against the eager kernel path, on the GPU.

Graph replays, the same step run eagerly on device buffers, and the legacy eager kernel path with the host
sampler run the same kernels on the same rows, so their tokens must be identical (not just close): a mixed
batch of greedy, seeded temperature, top-k / top-p / min-p and logprob requests over 64 decode steps, at batch
sizes that use their bucket fully (1) and partly (3, 17: padding rows). Then the JIT check: once the graphs
are captured, 300 decode steps that cross context buckets compile no Triton kernel.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from tests.core.conftest import random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 64
PARAMS = [SamplingParams(max_tokens=STEPS, ignore_eos=True),
          SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.8, seed=5),
          SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=1.0, top_k=20, seed=6, logprobs=3),
          SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.7, top_p=0.9, min_p=0.02, seed=7),
          SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=0)]


@pytest.fixture(scope="module")
def cuda_model(tiny_checkpoint):
    from engine.load import load_model

    return load_model(tiny_checkpoint, "cuda", progress=False, with_mtp=False).model


def engine_for(model, mode: str, max_model_len: int = 512) -> LLMEngine:
    flags = {"graph": dict(decode_step=True, cuda_graphs=True), "device": dict(decode_step=True, cuda_graphs=False),
             "legacy": dict(decode_step=False)}[mode]
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False,
                          max_model_len=max_model_len, cache_memory_bytes=256 << 20, **flags)
    return LLMEngine.local(model, config, eos_token_id=-1)


def run(engine: LLMEngine, batch: int) -> dict:
    for i in range(batch):
        engine.add_request(f"r{i}", random_prompt(3 + 11 * i % 70, seed=i), PARAMS[i % len(PARAMS)])
    out = {}
    while engine.has_unfinished:
        for o in engine.step():
            ids, lps = out.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            lps += [None if lp is None else (lp.token_id, round(lp.logprob, 9), [(t, round(v, 9)) for t, v in lp.top]) for lp in o.new_logprobs]
    return out


@pytest.mark.parametrize("batch", [1, 3, 4, 17])
def test_graph_tokens_equal_the_eager_kernel_path(cuda_model, batch):
    """Graph replays = the same step run eagerly, at every batch (3 and 17 fill their buckets of 4 and 32
    with padding rows). The legacy path runs the kernels at the batch's own row count, and some launch shapes
    (split-K of the decode GEMVs) follow the row count, so a row's rounding, then on the tiny random model its
    tokens, can differ from a padded bucket's: it must match where the batch is a bucket (1, 4)."""
    taken = {}
    results = {}
    for mode in ("legacy", "device", "graph"):
        engine = engine_for(cuda_model, mode)
        step = engine.executor.runner.decode
        if step is not None:  # every decode step goes through launch (execute calls it; async scheduling too)
            launch, taken[mode] = step.launch, 0

            def counting(plan, launch=launch, mode=mode):
                taken[mode] += 1
                return launch(plan)
            step.launch = counting
        results[mode] = run(engine, batch)
    assert results["graph"] == results["device"]
    if batch in (1, 4):
        assert results["device"] == results["legacy"]
    assert taken["graph"] >= STEPS - 2 and taken["device"] >= STEPS - 2  # every step after the prefill
    assert len(engine.executor.runner.decode._graphs) > 0


def test_no_jit_compile_after_capture_across_context_buckets(cuda_model):
    import triton

    engine = engine_for(cuda_model, "graph", max_model_len=1024)
    for i in range(4):
        engine.add_request(f"j{i}", random_prompt(200 + i, seed=40 + i),
                           SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.9, top_p=0.95, seed=i))
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prefill (eager: it may compile)
    compiles = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiles.append(kw.get("repr")) and False
    try:
        steps = 0
        while engine.has_unfinished:
            engine.step()
            steps += 1
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert steps >= 299  # contexts ~200 -> ~500: across the 256 bucket
    assert compiles == [], f"{len(compiles)} Triton compiles in {steps} decode steps: {compiles[:5]}"


def test_graph_draws_apply_grammar_masks(cuda_model, tok):
    """Grammar-constrained requests (greedy, sampled with logprobs) beside free ones, batch 4 (a full bucket): the
    graph draw applies the staged bitmasks (engine/kernels/token_mask.py) and gives the legacy path's tokens, whose
    host sampler applies them; the constrained outputs are JSON the grammar allows so far. With async scheduling the
    decode steps behind the first launch their forward before their masks are known and their draw after the step in
    flight is read (DecodeStep.launch_forward, PendingForward.draw)."""
    from engine.chat.constraints import json_grammar
    from engine.core.grammar import GrammarCompiler
    from engine.core.sampling_params import GrammarSpec

    grammars = GrammarCompiler(tok.path.read_text(encoding="utf-8"), tok.eos_id)
    spec = GrammarSpec(json_grammar({"type": "object", "properties": {"n": {"type": "integer"},
                                                                      "tag": {"enum": ["x", "yy"]}},
                                     "required": ["n", "tag"], "additionalProperties": False}))
    params = [SamplingParams(max_tokens=24, grammar=spec),
              SamplingParams(max_tokens=24, temperature=1.0, seed=3, grammar=spec, logprobs=2),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=4),
              SamplingParams(max_tokens=24, ignore_eos=True)]
    results, masked, late = {}, [], {}
    for mode in ("legacy", "graph"):
        engine = engine_for(cuda_model, mode)
        engine.grammars = grammars
        step = engine.executor.runner.decode
        if step is not None:
            launch = step.launch
            step.launch = lambda plan, launch=launch: (masked.append(any(s.allowed for s in plan.samples)),
                                                       launch(plan))[1]
        for i, p in enumerate(params):
            engine.add_request(f"c{i}", random_prompt(5 + 7 * i, seed=60 + i), p)
        out = {}
        while engine.has_unfinished:
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        results[mode] = out
        late[mode] = engine.stats.num_late_mask_steps
    assert results["graph"] == results["legacy"]
    assert any(masked), "no masked draw went through the decode step"
    assert late["graph"] >= 10 and late["legacy"] == 0, late  # the constrained graph steps overlapped
    for rid in ("c0", "c1"):
        assert tok.decode(results["graph"][rid]).lstrip().startswith("{")


def test_split_mixed_steps_replay_the_graphs_and_draw_what_the_eager_decode_step_draws(cuda_model):
    """Requests arriving every other step (prompts of 3..90 tokens), so most steps carry a prefill beside decodes:
    those steps are split (engine/core/split_step.py), their decodes replay the graphs, and every request draws what
    the same engine draws with the decode step run eagerly (no graphs)."""
    import engine.core.runner as runner_module

    real, splits = runner_module.split_decodes, []
    results = {}
    for mode in ("device", "graph"):
        engine = engine_for(cuda_model, mode)
        runner_module.split_decodes = lambda plan, takes: (splits.append((mode, real(plan, takes))), splits[-1][1])[1]
        try:
            out, step = {}, 0
            while step < 10 or engine.has_unfinished:
                if step % 2 == 0 and step < 10:
                    i = step // 2
                    engine.add_request(f"m{i}", random_prompt(3 + 29 * i % 90, seed=80 + i), PARAMS[i % len(PARAMS)])
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
                step += 1
        finally:
            runner_module.split_decodes = real
        results[mode] = out
    assert results["graph"] == results["device"]
    assert len(results["graph"]) == 5 and all(len(ids) == STEPS for ids in results["graph"].values())
    for mode in ("device", "graph"):
        assert sum(s is not None for m, s in splits if m == mode) >= 3, f"{mode}: too few split steps"
