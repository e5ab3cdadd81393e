"""A mixed step split in two: its decode chunks through the decode step (device buffers, CUDA graphs), the rest
(prefill chunks) through the eager forward (issue 23: decodes beside a long prefill).

Run as one eager forward, a step that carries a prefill chunk also runs its decodes eagerly: per-request launches in
every layer, which made every decode token beside a 32K-token prefill cost ~100 ms against 7.5 ms decoding alone
(eight real-width layers on an H100). Split, the decodes cost one graph replay and the prefill chunk one eager
forward of its own; the requests do not interact within a step (each reads and writes only its own blocks), so the
tokens are those of the unsplit step, up to the decode step's fp32 summation order.

    split_decodes(plan, takes) -> Split | None     where `takes(sub_plan)` is the decode step's test
    merge_outputs(split, decode_out, rest_out) -> StepOutput (the unsplit step's order)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from engine.core.plan import StepPlan
from engine.core.sampler import SampleOutput
from engine.core.step_rows import StepOutput


@dataclass(frozen=True, slots=True)
class Split:
    decode: StepPlan  # the decode chunks, one draw each (the plan's block copies go with this part, run first)
    rest: StepPlan  # every other chunk, their draws
    decode_chunks: list[int]  # the plan's chunk index of each decode chunk, in order
    rest_chunks: list[int]  # ... of each other chunk
    decode_specs: list[int]  # the plan's sample index of each decode draw
    rest_specs: list[int]  # ... of each other draw


def split_decodes(plan: StepPlan, takes: Callable[[StepPlan], bool]) -> Split | None:
    """The plan's decode chunks (those `takes` accepts on their own, one draw each) apart from its other chunks;
    None where there is nothing to split (no decode chunk or nothing else), or the plan holds verify chunks or
    tokens still on the device."""
    if plan.verifies or plan.from_rows is not None or len(plan.chunks) < 2:
        return None
    sampled_row = {}  # chunk index -> its row among the sampled chunks
    for i, c in enumerate(plan.chunks):
        if c.sample:
            sampled_row[i] = len(sampled_row)
    specs_of_row: dict[int, list[int]] = {}
    for j, s in enumerate(plan.samples):
        specs_of_row.setdefault(s.row, []).append(j)
    decode_chunks, rest_chunks = [], []
    for i, c in enumerate(plan.chunks):
        specs = specs_of_row.get(sampled_row.get(i, -1), [])
        alone = StepPlan([c], [], [replace(plan.samples[j], row=0) for j in specs])
        (decode_chunks if len(specs) == 1 and takes(alone) else rest_chunks).append(i)
    if not decode_chunks or not rest_chunks:
        return None
    decode_specs, decode_samples = [], []
    for k, i in enumerate(decode_chunks):
        j = specs_of_row[sampled_row[i]][0]
        decode_specs.append(j)
        decode_samples.append(replace(plan.samples[j], row=k))
    rest_specs, rest_samples = [], []
    rest_rows = {sampled_row[i]: k for k, i in enumerate([i for i in rest_chunks if i in sampled_row])}
    for j, s in enumerate(plan.samples):
        if s.row in rest_rows:
            rest_specs.append(j)
            rest_samples.append(replace(s, row=rest_rows[s.row]))
    decode = StepPlan([plan.chunks[i] for i in decode_chunks], list(plan.copies), decode_samples)
    if not takes(decode):
        return None  # a limit of the whole batch (its bucket sizes)
    rest = StepPlan([plan.chunks[i] for i in rest_chunks], [], rest_samples)
    return Split(decode, rest, decode_chunks, rest_chunks, decode_specs, rest_specs)


def merge_outputs(split: Split, decode: StepOutput, rest: StepOutput) -> StepOutput:
    """The two parts' outputs as the unsplit step's: draws in the plan's sample order, kept logits by the plan's
    chunk index."""
    n = len(split.decode_specs) + len(split.rest_specs)
    token_ids, logprobs, errors = [-1] * n, [None] * n, [None] * n
    for part, specs in ((decode.sample, split.decode_specs), (rest.sample, split.rest_specs)):
        for k, j in enumerate(specs):
            token_ids[j], logprobs[j], errors[j] = part.token_ids[k], part.logprobs[k], part.errors[k]
    rows = {split.rest_chunks[k]: kept for k, kept in rest.rows.items()}
    rows.update({split.decode_chunks[k]: kept for k, kept in decode.rows.items()})
    return StepOutput(SampleOutput(token_ids, logprobs, errors), rows)
