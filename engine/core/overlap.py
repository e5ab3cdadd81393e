"""Overlap of the host's work with the device's (issue 19; vLLM's async scheduling, SGLang's overlap scheduler):
while decode step k runs on the device, the engine schedules and launches step k+1, and only then reads step k's
tokens. No torch here: this is the engine's bookkeeping.

Step k+1's input tokens are step k's draws, which the host does not know when it launches k+1: each request's
output holds a PENDING_TOKEN, and the plan names per chunk the row of step k's draws that holds it
(StepPlan.from_rows; the decode step reads it on the device). When step k's tokens come back they replace the
placeholders. A request that ends at step k (a stop token, its length, an error) had step k+1 compute one position
for nothing: the engine rolls that position back (num_computed, the placeholder) and drops its draw, so every
request's tokens, cache state and snapshot are those of the synchronous order.

The engine overlaps only where that cannot change what the scheduler decides (can_overlap): every running request
decodes one position, nothing waits to be admitted, no fork copies are pending, the token budget covers the batch,
and the pools hold the blocks the next positions need without preempting anyone or dropping a snapshot. Otherwise
the step in flight is read first and the next step runs as it would without overlap. With speculative decoding on
the engine never overlaps: how many drafts a step accepts decides the next step's chunks (their anchors, positions
and blocks), so the next step cannot be planned before this one's tokens are read.

A request constrained by a grammar (engine/core/grammar.py) needs its token of step k for its mask of step k+1, but
only step k+1's draw reads the mask, not its forward. So where the executor can launch a decode step in two halves
(`launch_forward`, then `PendingForward.draw(masks)`: the in-process decode step, engine/core/decode_step.py), the
engine launches step k+1's forward (its input tokens read on the device as above), then reads step k's tokens, which
advance each grammar (a request ending there drops its draw of step k+1, as any other), computes the masks of the
requests still running (all at once, GrammarCompiler.masks) while the device runs the forward, and launches step
k+1's draw (InFlight.awaits_masks until then). The draw takes the same logits, parameters and masks as in the
synchronous order, so the tokens and logprobs are the same. An executor without `launch_forward` (a shard group, the
Ray shard executor: their plan carries its masks, SampleSpec.allowed) does not overlap while a request with a
grammar runs (can_overlap's masks_after_launch False): the step in flight is read, then the masks are computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.request import PENDING_TOKEN, Request
from engine.core.scheduler import Scheduler, SchedulerOutput


class PendingStep(Protocol):
    """A launched step: result() waits for it and returns its StepOutput (engine/core/step_rows.py)."""

    def result(self): ...


class PendingForward(Protocol):
    """A decode step whose forward is launched: draw(masks) launches its draw (one grammar bitmask or None per draw
    row) and returns the PendingStep."""

    def draw(self, allowed: list[bytes | None]) -> PendingStep: ...


@dataclass(slots=True)
class FailedLaunch:
    """A launch whose second half raised: result() raises it (the step's requests end with ERROR)."""

    error: Exception

    def result(self):
        raise self.error


@dataclass(slots=True)
class InFlight:
    """A decode step on the device whose tokens the engine has not read."""

    out: SchedulerOutput
    reqs: list[Request]  # the requests it draws for, in draw-row order (one per chunk)
    slots: list[int]  # each one's PENDING_TOKEN index in output_ids
    pending: PendingStep | PendingForward  # a PendingForward while awaits_masks
    t0: float  # when it was launched (time.monotonic)
    awaits_masks: bool = False  # its forward is launched, its draw waits for the step before to be read


def can_overlap(scheduler: Scheduler, masks_after_launch: bool) -> bool:
    """The next schedule() gives every running request one decode position and touches nothing else.
    masks_after_launch: the executor can launch a step before its grammar masks are known (launch_forward);
    without it no request may have a grammar."""
    cache, cfg = scheduler.cache, scheduler.config
    running = scheduler.running
    if scheduler.waiting or scheduler.pending_copies or not running or len(running) > cfg.max_num_batched_tokens:
        return False
    G, S = cache.layout.global_block_size, cache.layout.swa_block_size
    need_global = need_swa = 0
    for r in running:
        if r.num_tokens - r.num_computed != 1 or r.keep_logits:
            return False
        if r.grammar is not None and not masks_after_launch:
            return False  # a grammar's next mask needs the token in flight, and the plan would carry it
        end = r.num_computed + 1
        need_global += max(0, -(-end // G) - len(r.global_blocks))
        need_swa += (end - 1) // S not in r.swa_blocks
    return need_global <= cache.global_pool.num_free and need_swa <= cache.swa_pool.num_free


def from_rows(inflight: InFlight, out: SchedulerOutput) -> list[int]:
    """Per chunk of `out`: the draw row of `inflight` that holds its input token, -1 where the token is known."""
    rows = {id(r): i for i, r in enumerate(inflight.reqs)}
    return [rows[id(c.request)] if c.request.output_ids and c.request.output_ids[-1] == PENDING_TOKEN else -1
            for c in out.chunks]
