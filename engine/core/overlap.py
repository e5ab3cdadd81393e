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
and the pools hold the blocks the next positions need without preempting anyone or dropping a snapshot, and no
running request is constrained by a grammar (its next mask is computed from the token still in flight). Otherwise
the step in flight is read first and the next step runs as it would without overlap. With speculative decoding on
the engine never overlaps: how many drafts a step accepts decides the next step's chunks (their anchors, positions
and blocks), so the next step cannot be planned before this one's tokens are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.request import PENDING_TOKEN, Request
from engine.core.scheduler import Scheduler, SchedulerOutput


class PendingStep(Protocol):
    """A launched step: result() waits for it and returns its StepOutput (engine/core/step_rows.py)."""

    def result(self): ...


@dataclass(slots=True)
class InFlight:
    """A decode step on the device whose tokens the engine has not read."""

    out: SchedulerOutput
    reqs: list[Request]  # the requests it draws for, in draw-row order (one per chunk)
    slots: list[int]  # each one's PENDING_TOKEN index in output_ids
    pending: PendingStep
    t0: float  # when it was launched (time.monotonic)


def can_overlap(scheduler: Scheduler) -> bool:
    """The next schedule() gives every running request one decode position and touches nothing else."""
    cache, cfg = scheduler.cache, scheduler.config
    running = scheduler.running
    if scheduler.waiting or scheduler.pending_copies or not running or len(running) > cfg.max_num_batched_tokens:
        return False
    G, S = cache.layout.global_block_size, cache.layout.swa_block_size
    need_global = need_swa = 0
    for r in running:
        if r.num_tokens - r.num_computed != 1 or r.keep_logits or r.grammar is not None:
            return False  # a grammar's next mask needs the token in flight (engine/core/grammar.py)
        end = r.num_computed + 1
        need_global += max(0, -(-end // G) - len(r.global_blocks))
        need_swa += (end - 1) // S not in r.swa_blocks
    return need_global <= cache.global_pool.num_free and need_swa <= cache.swa_pool.num_free


def from_rows(inflight: InFlight, out: SchedulerOutput) -> list[int]:
    """Per chunk of `out`: the draw row of `inflight` that holds its input token, -1 where the token is known."""
    rows = {id(r): i for i, r in enumerate(inflight.reqs)}
    return [rows[id(c.request)] if c.request.output_ids and c.request.output_ids[-1] == PENDING_TOKEN else -1
            for c in out.chunks]
