"""A mixed step split in two (engine/core/split_step.py): the decode chunks that the decode step takes go there,
one draw each, the rest (prefills, n > 1 draws, kept logits) to the eager forward; the two outputs merge back in the
plan's order. (Through the engine, a split step draws what the unsplit eager step draws:
tests/core/test_decode_step.py.)"""

from __future__ import annotations

import torch

from engine.core.plan import ChunkPlan, SampleSpec, StepPlan
from engine.core.sampler import SampleOutput
from engine.core.sampling_params import SamplingParams
from engine.core.split_step import merge_outputs, split_decodes
from engine.core.step_rows import StepOutput


def chunk(start: int, end: int, sample: bool = True, keep: bool = False) -> ChunkPlan:
    return ChunkPlan(start, end, [5] * (end - start), [], sample, keep, [0], {0: 0}, 0, 0, 0, 0, 0)


def one_token_one_draw(plan: StepPlan) -> bool:
    """A stand-in for DecodeStep.takes: every chunk one sampled token with one draw."""
    return len(plan.samples) == len(plan.chunks) and all(c.end - c.start == 1 and c.sample and not c.keep_logits
                                                         for c in plan.chunks)


def spec(row: int, seed: int) -> SampleSpec:
    return SampleSpec(row, SamplingParams(), seed, 0)


def test_decodes_go_apart_one_draw_each_and_merge_back_in_plan_order():
    chunks = [chunk(0, 40), chunk(9, 10), chunk(3, 4), chunk(0, 8, sample=False), chunk(7, 8), chunk(5, 6, keep=True)]
    # sampled rows: chunk 0 -> 0, 1 -> 1, 2 -> 2 (two draws: n = 2), 4 -> 3, 5 -> 4
    samples = [spec(0, 10), spec(1, 11), spec(2, 12), spec(2, 13), spec(3, 14), spec(4, 15)]
    plan = StepPlan(chunks, ["copy"], samples)
    split = split_decodes(plan, one_token_one_draw)
    assert split.decode_chunks == [1, 4] and split.rest_chunks == [0, 2, 3, 5]
    assert split.decode.copies == ["copy"] and split.rest.copies == []
    assert [(s.row, s.seed) for s in split.decode.samples] == [(0, 11), (1, 14)]
    assert [(s.row, s.seed) for s in split.rest.samples] == [(0, 10), (1, 12), (1, 13), (2, 15)]
    assert split.decode_specs == [1, 4] and split.rest_specs == [0, 2, 3, 5]
    decoded = StepOutput(SampleOutput([101, 104], [None, "lp4"], [None, None]), {})
    kept = torch.zeros(1, 3)
    rest = StepOutput(SampleOutput([100, 102, 103, -1], ["lp0", None, None, None], [None, None, None, "bad"]),
                      {3: (5, kept)})
    merged = merge_outputs(split, decoded, rest)
    assert merged.sample.token_ids == [100, 101, 102, 103, 104, -1]
    assert merged.sample.logprobs == ["lp0", None, None, None, "lp4", None]
    assert merged.sample.errors == [None, None, None, None, None, "bad"]
    assert merged.rows.keys() == {5} and merged.rows[5][1] is kept


def test_nothing_to_split():
    decode, prefill = chunk(9, 10), chunk(0, 40)
    assert split_decodes(StepPlan([decode, chunk(3, 4)], [], [spec(0, 1), spec(1, 2)]), one_token_one_draw) is None
    assert split_decodes(StepPlan([prefill, chunk(0, 9)], [], [spec(0, 1), spec(1, 2)]), one_token_one_draw) is None
    assert split_decodes(StepPlan([decode], [], [spec(0, 1)]), one_token_one_draw) is None
    with_rows = StepPlan([prefill, decode], [], [spec(0, 1), spec(1, 2)], from_rows=[-1, 0])
    assert split_decodes(with_rows, one_token_one_draw) is None  # a token still on the device: not an eager step
    batch_limit = lambda p: one_token_one_draw(p) and len(p.chunks) < 2  # noqa: E731 -- the bucket refuses two
    assert split_decodes(StepPlan([prefill, decode, chunk(3, 4)], [], [spec(0, 1), spec(1, 2), spec(2, 3)]),
                         batch_limit) is None
