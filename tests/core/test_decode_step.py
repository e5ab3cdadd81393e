"""The decode step on device buffers (engine/core/decode_step.py), run eagerly on the CPU (Triton interpreter):
the same tokens and logprobs as the kernel path's eager step with the host sampler, and the rules of which
steps it takes and which buckets it captures. (Its CUDA graphs: tests/gpu/test_decode_graphs.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import engine.core.runner as runner_module
from engine.core.cache_manager import CacheLayout
from engine.core.engine import EngineConfig, LLMEngine, LocalExecutor
from engine.core.engine_config import DecodeOptions
from engine.core.plan import ChunkPlan, SampleSpec, StepPlan
from engine.core.sampling_params import SamplingParams
from engine.core.step_rows import engram_hashes, segments
from engine.kernels.decode_meta import decode_inputs
from engine.vision.inputs import ImageInput
from engine.vision.layout import ImageGrid
from tests.core.conftest import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def kernel_engine(model, decode_step: bool, **kw) -> LLMEngine:
    config = EngineConfig(**(dict(runner="kernels", decode_step=decode_step, max_num_seqs=4, max_num_batched_tokens=64,
                                  enable_prefix_caching=False, max_model_len=512) | kw))
    return LLMEngine.local(model, config, eos_token_id=-1)


def run(engine: LLMEngine, arrivals: dict[str, tuple[list[int], SamplingParams, int]],
        images: dict[str, list[ImageInput]] | None = None) -> dict:
    """Drive the engine to the end: {request id: (token ids, logprobs)}; images: a request's prompt images."""
    out, step = {}, 0
    while step == 0 or engine.has_unfinished:
        for rid, (prompt, params, at) in arrivals.items():
            if at == step:
                engine.add_request(rid, prompt, params, images=(images or {}).get(rid, ()))
        for o in engine.step():
            ids, lps = out.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            lps += [None if lp is None else (lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs]
        step += 1
    return out


def assert_same_draws(got: dict, ref: dict) -> None:
    """Identical tokens, logprob token ids and top ids; logprob values within 1e-4. The head is an fp32 GEMM, and
    CPU BLAS rounds a row differently at different row counts (measured on an AVX512 CPU, this head [129280, 256]:
    1 vs 2 rows differ in 94K of 129K logits, by up to 1.1e-5), so the same request's logprobs may differ in the
    last fp32 places between the two paths' batches."""
    assert got.keys() == ref.keys()
    for rid in ref:
        (ids, lps), (ref_ids, ref_lps) = got[rid], ref[rid]
        assert ids == ref_ids, f"{rid}: tokens {ids} != {ref_ids}"
        assert [lp is None for lp in lps] == [lp is None for lp in ref_lps], rid
        for lp, want in ((a, b) for a, b in zip(lps, ref_lps) if b is not None):
            assert lp[0] == want[0] and [t for t, _ in lp[2]] == [t for t, _ in want[2]], f"{rid}: {lp} != {want}"
            values = [lp[1]] + [v for _, v in lp[2]]
            assert max(abs(a - b) for a, b in zip(values, [want[1]] + [v for _, v in want[2]])) < 1e-4, (rid, lp, want)


def test_decode_step_draws_what_the_eager_kernel_path_draws(tiny_model, monkeypatch):
    """Greedy and seeded top-p (with logprobs) requests, the second arriving later (decode batches of 1, then 2),
    one prompt past the window: identical tokens, the same logprobs (assert_same_draws), and decode steps went
    through the decode step, launched behind the step in flight (their input tokens still on the device); the step
    that prefilled the second beside the first's decode was split (engine/core/split_step.py)."""
    model = tiny_model.model
    splits, split_decodes = [], runner_module.split_decodes
    monkeypatch.setattr(runner_module, "split_decodes",
                        lambda plan, takes: (splits.append(split_decodes(plan, takes)), splits[-1])[1])
    arrivals = {"g": (random_prompt(19, seed=1), SamplingParams(max_tokens=4, logprobs=2), 0),
                "s": (random_prompt(6, seed=2), SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=3,
                                                             logprobs=1), 2)}
    legacy = run(kernel_engine(model, decode_step=False), arrivals)
    engine = kernel_engine(model, decode_step=True)  # async scheduling on: steps launch behind each other
    step, taken = engine.executor.runner.decode, []
    launch = step.launch
    step.launch = lambda plan: (taken.append((len(plan.chunks), plan.from_rows)), launch(plan))[1]
    assert_same_draws(run(engine, arrivals), legacy)
    assert taken and {n for n, _ in taken} == {1, 2}
    assert any(rows and max(rows) >= 0 for _, rows in taken)  # input tokens read from the last draw on the device
    assert [(s.decode_chunks, s.rest_chunks) for s in splits if s is not None] == [([0], [1])], splits


def test_decode_step_scores_its_rows_in_passes(tiny_model, monkeypatch):
    """The batched decode step's indexer rows (each request's own entries, [B, T]) scored one row a pass
    (kernel_ops.SCORE_BYTES tiny): each pass takes its rows' entries, and the draws equal those of one pass."""
    from engine.core import kernel_ops

    model = tiny_model.model
    arrivals = {"a": (random_prompt(40, seed=4), SamplingParams(max_tokens=4), 0),
                "b": (random_prompt(23, seed=5), SamplingParams(max_tokens=4), 0)}
    whole = run(kernel_engine(model, decode_step=True), arrivals)
    monkeypatch.setattr(kernel_ops, "SCORE_BYTES", 2)  # one query row a pass
    assert_same_draws(run(kernel_engine(model, decode_step=True), arrivals), whole)


def _chunk(start: int, end: int, **kw) -> ChunkPlan:
    fields = dict(token_ids=[5] * (end - start), prev_ids=[], sample=True, keep_logits=False, global_blocks=[0],
                  swa_blocks={0: 0}, pending_slot=0, global_from=0, swa_floor=0, decoder_from=0, decoder_floor=0)
    return ChunkPlan(start, end, **(fields | kw))


def test_which_steps_and_buckets(tiny_model):
    model = tiny_model.model
    layout = CacheLayout(64, 16, 16, 20, 40, 6, 0)  # 20 global blocks of 64: 1,280 positions
    step = LocalExecutor(model, layout, True, DecodeOptions(5, 1000)).runner.decode
    assert step.batches == (1, 2, 4, 8) and step.contexts == (256, 512, 1024)
    spec = SampleSpec(0, SamplingParams(), 1, 0)
    assert step.takes(StepPlan([_chunk(9, 10)], [], [spec]))
    assert not step.takes(StepPlan([_chunk(8, 10)], [], [spec]))  # two tokens: a prefill chunk
    assert not step.takes(StepPlan([_chunk(9, 10, sample=False)], [], []))
    assert not step.takes(StepPlan([_chunk(9, 10, keep_logits=True)], [], [spec]))
    assert not step.takes(StepPlan([_chunk(9, 10)], [], [spec, SampleSpec(0, SamplingParams(), 2, 0)]))  # n > 1
    assert not step.takes(StepPlan([_chunk(1024, 1025)], [], [spec]))  # past the largest context bucket
    im = ImageInput(2, ImageGrid(112, 112, 8, 8, 3, 3), b"", -5)  # an image span at positions 2..15
    assert not step.takes(StepPlan([_chunk(15, 16, images=(im,))], [], [spec]))  # its last token: a span row, bias_vl
    assert step.takes(StepPlan([_chunk(16, 17, images=(im,))], [], [spec]))  # in the look-back only: staged DEAD


def test_image_lookback_is_staged_dead(tiny_model):
    """Decode rows right after an image span (their look-backs hold 3, 2 and 1 of its positions) and one past it: the
    decode step's Engram hashes (the staged look-back through decode_inputs) equal the eager path's
    (step_rows.engram_hashes: image positions DEAD), which differ from those of the same ids taken as text."""
    model = tiny_model.model
    tables = model.engram_tables
    step = LocalExecutor(model, CacheLayout(64, 16, 16, 20, 40, 6, 0), True, DecodeOptions(8, 1000)).runner.decode
    image = 129264
    im = ImageInput(2, ImageGrid(112, 112, 8, 8, 3, 3), b"", -5)  # an image span at positions 2..15
    chunks = [_chunk(16, 17, token_ids=[7], prev_ids=[image, image, image], images=(im,)),
              _chunk(17, 18, token_ids=[8], prev_ids=[image, image, 7], images=(im,)),
              _chunk(18, 19, token_ids=[9], prev_ids=[image, 7, 8], images=(im,)),
              _chunk(19, 20, token_ids=[5], prev_ids=[7, 8, 9])]
    plan = StepPlan(chunks, [], [SampleSpec(i, SamplingParams(), 1, 0) for i in range(len(chunks))])
    assert step.takes(plan)
    v = step.stage(plan)
    f = v.fields
    ids, hashes = decode_inputs(f["ids"], f["from_row"], step.last_ids, f["pos"], v.prev, step.engram)
    flat = torch.tensor([c.token_ids[0] for c in chunks])
    want = engram_hashes(tables, chunks, segments(chunks), flat)[0]
    assert torch.equal(ids[:len(chunks)], flat) and torch.equal(hashes[:len(chunks)], want)
    as_text = engram_hashes(tables, [replace(c, images=()) for c in chunks], segments(chunks), flat)[0]
    assert [torch.equal(want[i], as_text[i]) for i in range(4)] == [False, False, False, True]
    many = [SampleSpec(i, SamplingParams(), 1, 0) for i in range(9)]
    assert not step.takes(StepPlan([_chunk(9, 10)] * 9, [], many))  # past the largest batch bucket
    # a bucket is captured when its smallest batch fits at its smallest context: (b_prev + 1) * (c_prev + 1) <= 1280
    assert step.buckets() == [(1, 256), (1, 512), (1, 1024), (2, 256), (2, 512), (2, 1024), (4, 256), (4, 512),
                              (8, 256)]


def test_staged_block_tables_equal_the_plans_tables(tiny_model):
    """The decode step's device block tables (updated in place, engine/core/block_table.py) hold each step's global
    block lists and -1 after them, across appends, a truncation, rows that move and a batch that shrinks."""
    layout = CacheLayout(64, 16, 16, 20, 40, 6, 0)
    step = LocalExecutor(tiny_model.model, layout, True, DecodeOptions(5, 1000)).runner.decode
    spec = SampleSpec(0, SamplingParams(), 1, 0)
    steps = [[[3], [4, 5]], [[3, 6], [4, 5]], [[4, 5, 7], [3, 6]], [[4]], [[4], [8, 9, 10], [11], [12]]]
    for tables in steps:
        chunks = [_chunk(9, 10, global_blocks=t) for t in tables]
        v = step.stage(StepPlan(chunks, [], [spec] * len(chunks)))
        want = torch.full(tuple(v.gtable.shape), -1, dtype=torch.int64)
        for b, t in enumerate(tables):
            want[b, :len(t)] = torch.tensor(t)
        assert torch.equal(v.gtable.cpu(), want), f"{tables}: {v.gtable}"
