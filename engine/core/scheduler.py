"""The scheduler: a small CPU state machine with one invariant (no torch).

Each step, every running request's computed positions catch up with its tokens (prompt + output) by
up to `max_chunk_tokens`, within a step budget of `max_num_batched_tokens`: there is no prefill or
decode phase, a prefill is just a request far behind, and it may be cut at any position (chunked
prefill). Running requests go first, in admission order; when a pool runs short the most recently
admitted request is preempted (its blocks released, recomputed later; its full blocks stay in the
prefix cache). Then waiting requests are admitted in arrival order, each starting from its longest
cached prefix.

Decoder SWA bounded replay (spec 4.8) is decided at admission: when the positions still to compute
exceed one window, the decoder layers (>= the CED cut) run only on the last `window` of them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.cache_manager import CopyOp, KVCacheManager
from engine.core.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    window_size: int
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_chunk_tokens: int | None = None  # cap on one request's positions per step; None = the budget
    bounded_replay: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    start: int  # positions start .. end-1 are computed this step
    end: int
    sample: bool  # end reaches the request's tokens: position end-1's logits give the next token


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)  # block copies (forks) to apply before the forward
    preempted: list[str] = field(default_factory=list)
    cannot_grow: list[Request] = field(default_factory=list)  # alone and still short of blocks: finished (length)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCacheManager):
        self.config, self.cache = config, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending_copies: list[CopyOp] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(copies=self.pending_copies)
        self.pending_copies = []
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            end = req.num_computed + self._chunk_len(req, budget)
            while not self.cache.allocate(req, end):
                if len(self.running) == 1:  # nothing left to preempt: the cache cannot hold this request
                    self.finish(req, FinishReason.LENGTH)
                    out.cannot_grow.append(req)
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed, end, end == req.num_tokens))
                budget -= end - req.num_computed
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not self.cache.admit(req, self.cache.find_prefix(req)):
                break
            self._plan_replay(req)
            end = req.num_computed + self._chunk_len(req, budget)
            if not self.cache.allocate(req, end):
                self.cache.release(req)
                _reset(req)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.stats.first_scheduled_time is None:
                req.stats.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed, end, end == req.num_tokens))
            budget -= end - req.num_computed
        return out

    def advance(self, out: SchedulerOutput, register: bool = True) -> None:
        """After the forward (or once it is launched): the chunks' positions are computed; publish newly full
        blocks (register=False: the caller does once their tokens are known)."""
        for c in out.chunks:
            c.request.num_computed = c.end
            c.request.stats.num_iterations += 1
            c.request.stats.num_computed_prompt_tokens += max(0, min(c.end, len(c.request.prompt_ids)) - c.start)
            if register:
                self.cache.register_full_blocks(c.request)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """A running request ends: its state becomes a snapshot for the next turn (released on abort or
        error: a failed request's last KV may be half written, so nothing of it is kept but the blocks that
        were full and registered before)."""
        self.running.remove(req)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.cache.release(req)
        else:
            self.cache.retain(req)
        req.finish(reason)

    def abort(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish(FinishReason.ABORT)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, FinishReason.ABORT)
                return req
        return None

    def fork(self, parent: Request, child: Request) -> bool:
        """n > 1: child continues from parent's computed state (copies applied before the next step)."""
        copies = self.cache.fork(parent, child)
        if copies is None:
            return False
        self.pending_copies += copies
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return True

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.running)
        for req in self.running:
            assert 0 <= req.num_computed <= req.num_tokens, f"{req.request_id}: computed {req.num_computed} of {req.num_tokens}"

    # ---- internals --------------------------------------------------------------------------------
    def _chunk_len(self, req: Request, budget: int) -> int:
        cap = self.config.max_chunk_tokens or budget
        return min(req.num_tokens - req.num_computed, budget, cap)

    def _plan_replay(self, req: Request) -> None:
        W = self.config.window_size
        req.num_prompt_at_admission = req.num_tokens
        if self.config.bounded_replay and req.num_tokens - req.num_computed > W:
            req.decoder_from = req.num_tokens - W
            req.decoder_floor = max(req.swa_floor, req.decoder_from)
        else:
            req.decoder_from, req.decoder_floor = 0, req.swa_floor

    def _preempt(self, req: Request) -> None:
        self.cache.release(req)
        _reset(req)
        req.stats.num_preemptions += 1
        self.waiting.appendleft(req)


def _reset(req: Request) -> None:
    req.status = RequestStatus.WAITING
    req.num_computed = req.global_from = req.swa_floor = req.decoder_from = req.decoder_floor = 0
    req.stats.num_cached_tokens = req.stats.num_replayed_tokens = 0
