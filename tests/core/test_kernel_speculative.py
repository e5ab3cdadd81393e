"""Speculative decoding on the kernel runner (engine/core/kernel_layers.py; the Triton interpreter on the CPU), tiny
checkpoint with its DSpark stages (block 3).

The oracle is the kernel runner that never drafts: speculative decoding on, but no draft verified
(max_draft_tokens = 0), so every decode step computes one position as K = 0 does, and the DSpark context is written
from the same tap hiddens. Against it, a run whose drafts (tests/core/oracle_drafter.py: the target's continuation,
wrong at chosen positions) are accepted and rejected must give the same tokens, the accept counts known in advance,
the same logits rows up to the head's fp32 summation order (a verify chunk's K + 1 rows go through the fp32 head
product together; measured on the CPU, 2026-12: <= 2e-7 of the row's largest logit, HEAD_REL_TOL), and, once the
request has ended, the same cache contents: window KV, main KV and index keys, the compressor's pending group and
the DSpark context of every position its snapshot keeps, exactly (measured: the kernel path's bf16 rows do not
depend on how many rows share a chunk on the CPU). The DSpark stages draft in the free-running test (random weights:
nearly every draft is rejected). The interpreter makes each step tens of seconds, so the prompts and outputs are
short.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.kernels import paged
from tests.core.conftest import random_prompt, run_engine
from tests.core.oracle_drafter import OracleDrafter
from tests.core.test_engine_speculative import expected_verifies
from tests.core.test_runner_kernels import row_errors

# each kernel step is tens of seconds under the interpreter (more on a busy machine): about 15 steps in all
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(1800)]

PROMPT = random_prompt(8, seed=61)
HEAD_REL_TOL = 1e-6
NUM_NEW = 6


def kernel_engine(model, K: int, drafter=None, **kw) -> LLMEngine:
    """The kernel runner (decode steps through the eager path too), its scheduler checked after every step."""
    config = EngineConfig(**(dict(max_num_batched_tokens=48, speculative_tokens=K, runner="kernels",
                                  decode_step=False) | kw))
    engine = LLMEngine.local(model, config, eos_token_id=-1, drafter=drafter)
    assert engine.executor.runner.kernels
    step = engine.step

    def step_and_check():
        outputs = step()
        engine.scheduler.check_integrity()
        return outputs

    engine.step = step_and_check
    return engine


def snapshot_records(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """The finished request's cache contents by name, dequantised (float64 [entries, dim]): every layer's window KV and
    every DSpark stage's context at the positions the snapshot keeps for them, every KV source's main-KV and index-key
    entries and its pending group (fp32 rows)."""
    (snap,) = engine.cache.snapshots.values()
    return snapshot_contents(engine, snap)


def snapshot_contents(engine: LLMEngine, snap) -> dict[str, torch.Tensor]:
    """One snapshot's cache contents (snapshot_records)."""
    kv, cfg, layout = engine.executor.kv, engine.cfg, engine.cache.layout
    L, W, S, G = len(snap.token_ids), cfg.window_size, layout.swa_block_size, layout.global_block_size
    out = {}
    swa = paged.swa_slots(snap.swa_blocks, max(0, L - W), L, S)
    for layer, pool in enumerate(kv.swa):
        out[f"swa {layer}"] = paged.gather_swa(pool, swa, cfg.head_dim)
    context = paged.swa_slots(snap.swa_blocks, max(0, L - W - layout.swa_lookback), L, S)
    for stage, pool in enumerate(kv.dspark_swa):
        out[f"dspark {stage}"] = paged.gather_swa(pool, context, cfg.head_dim)
    for source in cfg.kv_source_layers:
        r = cfg.compress_ratios[source]
        entries = paged.entry_slots(snap.global_blocks, 0, L // r, G // r)
        out[f"main {source}"] = paged.gather_main_kv(kv.main_kv[source], entries, cfg.head_dim)
        out[f"index {source}"] = paged.gather_index_k(kv.index_k[source], entries, cfg.index_head_dim)
        if r > 1:
            out[f"pending kv {source}"] = kv.pending_kv[source][snap.pending_slot, :L % r]
            out[f"pending score {source}"] = kv.pending_score[source][snap.pending_slot, :L % r]
    return {name: t.double() for name, t in out.items()}


@pytest.fixture(scope="module")
def never_drafted(tiny_model_mtp):
    engine = kernel_engine(tiny_model_mtp.model, 3, max_draft_tokens=0)
    (tokens, rows, stats) = run_engine(engine, {"k": PROMPT}, SamplingParams(max_tokens=NUM_NEW), keep_logits=True)["k"]
    assert stats.num_draft_tokens == 0 and len(tokens) == NUM_NEW
    return tokens, rows, snapshot_records(engine)


def test_accepted_and_rejected_drafts_leave_the_tokens_logits_and_caches_of_a_run_without_drafts(
        tiny_model_mtp, never_drafted):
    """The drafts are wrong at positions 9 and 12: the first verify (anchor at 8) keeps the anchor's row only, an
    accepted end inside a ratio-2 group (the pending group rolled back to position 8); the second (anchor at 9: the
    pending position 8 completes its group) accepts two drafts and ends at a group's end. Then a plain decode step;
    the snapshot holds 13 positions (position 12 pending)."""
    model = tiny_model_mtp.model
    want_tokens, want_rows, want_caches = never_drafted
    wrong = frozenset({9, 12})
    engine = kernel_engine(model, 3, OracleDrafter([PROMPT + want_tokens], model.cfg.vocab_size, wrong))
    tokens, rows, stats = run_engine(engine, {"k": PROMPT}, SamplingParams(max_tokens=NUM_NEW), keep_logits=True)["k"]
    assert tokens == want_tokens
    steps, accepted = expected_verifies(len(PROMPT), NUM_NEW, 3, wrong)
    assert (stats.num_verify_steps, stats.num_accepted_tokens) == (steps, accepted) and accepted > 0
    assert sorted(rows) == sorted(want_rows)
    rel, _ = row_errors(torch.stack([rows[p] for p in sorted(rows)]), torch.stack([want_rows[p] for p in sorted(rows)]))
    print(f"logits rows: max rel {rel.max():.2e} at position {sorted(rows)[int(rel.argmax())]}")
    assert rel.max() <= HEAD_REL_TOL
    caches = snapshot_records(engine)
    assert caches.keys() == want_caches.keys()
    differ = [name for name in caches if not torch.equal(caches[name], want_caches[name])]
    assert not differ, f"cache records differ after the rejected drafts: {differ}"


def test_dspark_drafts_on_the_kernel_runner_keep_the_greedy_tokens(tiny_model_mtp, never_drafted):
    engine = kernel_engine(tiny_model_mtp.model, 3)
    tokens, _, stats = run_engine(engine, {"k": PROMPT}, SamplingParams(max_tokens=4))["k"]
    assert tokens == never_drafted[0][:4]
    assert stats.num_verify_steps > 0 and stats.num_draft_tokens > stats.num_verify_steps, stats


def test_kernel_dspark_stages_equal_the_golden_ones(tiny_model_mtp):
    """KernelDSpark (engine/core/kernel_drafter.py) against GoldenDSpark on the same pools: the draft block's hidden
    rows, the Markov-corrected logits and the confidences of two requests with different contexts, and the context
    records written from the same tap hiddens. Measured on the CPU (2026-12): equal bit for bit (the tiny model's
    rows are short); the bounds are test_runner_kernels' per-layer ones."""
    from engine.core.drafter import GoldenDSpark
    from engine.core.kernel_drafter import KernelDSpark
    from engine.core.kernel_layers import KernelRunner
    from engine.core.step_rows import Segment
    from tests.core.test_runner_kernels import LAYER_REL_TOL

    model, cfg = tiny_model_mtp.model, tiny_model_mtp.model.cfg
    engine = LLMEngine.local(model, EngineConfig(max_num_batched_tokens=48, speculative_tokens=3), eos_token_id=-1)
    tokens = run_engine(engine, {"g": random_prompt(21, seed=41)}, SamplingParams(max_tokens=3))["g"][0]
    (snap,) = engine.cache.snapshots.values()
    kv, L, S = engine.executor.kv, len(snap.token_ids), engine.cache.layout.swa_block_size
    golden, kernel = GoldenDSpark(model, kv), KernelDSpark(KernelRunner(model, kv))
    anchors = torch.tensor([tokens[-1], snap.token_ids[L - 4]])
    contexts = [(p - 1, paged.swa_slots(snap.swa_blocks, max(0, p - cfg.window_size), p, S)) for p in (L, L - 4)]
    want, got = golden.hidden(anchors, contexts), kernel.hidden(anchors, contexts)
    rel, _ = row_errors(got.flatten(0, 1), want.flatten(0, 1))
    print(f"hidden rows: max rel {rel.max():.2e}")
    assert rel.max() <= LAYER_REL_TOL
    greedy = lambda i, logits: logits.argmax(-1)  # noqa: E731
    want_out, got_out = golden.propose(want, anchors, greedy, 3), kernel.propose(want, anchors, greedy, 3)
    rel, _ = row_errors(got_out.logits.flatten(0, 1), want_out.logits.flatten(0, 1))
    assert rel.max() <= 1e-5 and torch.equal(got_out.tokens, want_out.tokens), rel.max()
    assert torch.allclose(got_out.confidence, want_out.confidence, rtol=1e-4, atol=1e-4)

    hidden = torch.randn(1, 5, len(cfg.dspark_target_layer_ids) * cfg.dim, generator=torch.Generator().manual_seed(5))
    segs, chunks = [Segment(0, L - 5, L, 0)], [engine_chunk(snap.swa_blocks)]
    slots = paged.swa_slots(snap.swa_blocks, L - 5, L, S)
    records = []
    for stages in (golden, kernel):
        stages.write_context(hidden.to(torch.bfloat16), segs, chunks, {0: L - 1})  # the last row not kept
        records.append([paged.gather_swa(pool, slots, cfg.head_dim) for pool in kv.dspark_swa])
    for want_rows, got_rows in zip(*records):
        rel, _ = row_errors(got_rows[:4], want_rows[:4])
        assert rel.max() <= LAYER_REL_TOL


def engine_chunk(swa_blocks: dict[int, int]):
    """A ChunkPlan stand-in with only what write_context reads."""
    from types import SimpleNamespace

    return SimpleNamespace(swa_blocks=swa_blocks)


# ---- GPU (the device machine) ----------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_PROMPTS = {"a": random_prompt(23, seed=71), "b": random_prompt(8, seed=72), "c": random_prompt(40, seed=73)}
GPU_NEW = 10


@pytest.fixture(scope="module")
def cuda_model_mtp(tiny_checkpoint):
    from engine.load import load_model

    return load_model(tiny_checkpoint, "cuda", progress=False).model


@pytest.fixture(scope="module")
def cuda_plain(cuda_model_mtp):
    """K = 0 on the kernel runner (CUDA's default), every logits row kept: each step through the eager step, which a
    step that keeps its logits takes anyway (no decode graphs to capture)."""
    config = EngineConfig(max_num_batched_tokens=64, decode_step=False)
    engine = LLMEngine.local(cuda_model_mtp, config, eos_token_id=-1)
    return run_engine(engine, GPU_PROMPTS, SamplingParams(max_tokens=GPU_NEW), keep_logits=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("K", [1, 2, 3])
def test_cuda_oracle_drafts_keep_the_rows_of_K0(cuda_model_mtp, cuda_plain, K):
    """The kernel runner on CUDA with drafts the oracle makes wrong at chosen positions, teacher-forced with K = 0's
    tokens: the accept counts known in advance, and every logits row within test_runner_kernels' end-to-end bounds of
    K = 0's (a verify chunk of K + 1 rows runs other kernels than the one-row decode graph: not bit for bit)."""
    from tests.core.test_runner_kernels import E2E_COS, E2E_REL_TOL

    model = cuda_model_mtp
    wrong = frozenset({24, 27, 9, 10, 44, 46})
    sequences = [GPU_PROMPTS[r] + cuda_plain[r][0] for r in GPU_PROMPTS]
    engine = LLMEngine.local(model, EngineConfig(max_num_batched_tokens=64, speculative_tokens=K), eos_token_id=-1,
                             drafter=OracleDrafter(sequences, model.cfg.vocab_size, wrong))
    assert engine.executor.runner.kernels and engine.executor.runner.decode is None
    for rid, prompt in GPU_PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=GPU_NEW), force_ids=cuda_plain[rid][0],
                           keep_logits=True)
    got = {rid: ([], {}, None) for rid in GPU_PROMPTS}
    while engine.has_unfinished:
        for o in engine.step():
            tokens, rows, _ = got[o.request_id]
            tokens += o.new_token_ids
            if o.logits is not None:
                rows.update({o.logits[0] + i: o.logits[1][i] for i in range(o.logits[1].size(0))})
            got[o.request_id] = (tokens, rows, o.stats if o.finished else None)
        engine.scheduler.check_integrity()
    for rid, prompt in GPU_PROMPTS.items():
        (want, want_rows, _), (tokens, rows, stats) = cuda_plain[rid], got[rid]
        assert tokens == want and sorted(rows) == sorted(want_rows), rid
        steps, accepted = expected_verifies(len(prompt), GPU_NEW, K, wrong)
        assert (stats.num_verify_steps, stats.num_accepted_tokens) == (steps, accepted), rid
        rel, cos = row_errors(torch.stack([rows[p] for p in sorted(rows)]),
                              torch.stack([want_rows[p] for p in sorted(rows)]))
        print(f"K = {K} {rid}: max rel {rel.max():.2e}, min cos {cos.min():.6f}, {accepted} accepted, {steps} verifies")
        assert rel.max() <= E2E_REL_TOL and cos.min() >= E2E_COS, rid


@gpu
@needs_cuda
def test_cuda_dspark_drafts_keep_the_greedy_tokens_of_K0(cuda_model_mtp, cuda_plain):
    """Free-running greedy with the DSpark stages drafting on the kernel path, K = 1 .. the block: K = 0's tokens up
    to the first position where K = 0's top-2 logit margin is within 2 % of the row's largest logit (a near-tie the
    verify chunk's other kernels may resolve the other way; after it the runs diverge for good)."""
    model = cuda_model_mtp
    for K in range(1, model.cfg.dspark_block_size + 1):
        engine = LLMEngine.local(model, EngineConfig(max_num_batched_tokens=64, speculative_tokens=K), eos_token_id=-1)
        results = run_engine(engine, GPU_PROMPTS, SamplingParams(max_tokens=GPU_NEW))
        engine.scheduler.check_integrity()
        assert engine.stats.num_draft_tokens > 0
        print(f"K = {K}: accept length {engine.stats.accept_length:.2f}")
        for rid, prompt in GPU_PROMPTS.items():
            want, want_rows, _ = cuda_plain[rid]
            got = results[rid][0]
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if first is None:
                assert len(got) == len(want) == GPU_NEW
                continue
            row = want_rows[len(prompt) + first - 1]
            top2 = row.topk(2).values
            assert top2[0] - top2[1] <= 0.02 * row.abs().max(), (
                f"K = {K} {rid}: token {first} differs ({got[first]} vs {want[first]}) at a decided position")
