"""The scheduler: a small CPU state machine with one invariant (no torch).

Each step, every running request's computed positions catch up with its tokens (prompt + output) by
up to `max_chunk_tokens`, within a step budget of `max_num_batched_tokens`: there is no prefill or
decode phase, a prefill is just a request far behind, and it may be cut at any position (chunked
prefill). Running requests go first, in admission order; when a pool runs short the most recently
admitted request is preempted (its blocks released, recomputed later; its full blocks stay in the
prefix cache); a decoding request's position is reserved before any prefill chunk ahead of it takes the budget,
and with max_prefill_beside_decode a step that has decodes gives its prefill chunks at most that many positions
together (a stream's inter-token latency stays near a decode step's while a long prompt prefills beside it). Then
waiting requests are admitted in arrival order, each starting from its longest cached prefix. Blocks a KV pull in
flight holds (KVCacheManager.imports) come back when it ends: a request alone and short of blocks then waits for
them instead of ending.

Speculative decoding (speculative_tokens K > 0): a request that decodes (one position behind its tokens, past its
first output) gets a verify chunk: its anchor position plus room for up to K drafts, within its remaining outputs
and the budget; the runner drafts them and keeps what it accepts, and the engine sets num_computed to the accepted
positions. Drafts never preempt: a request whose drafts' blocks do not fit verifies none.

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
    speculative_tokens: int = 0  # drafts a decoding request may verify per step (0: off)
    # while a request decodes in the step, all prefill chunks together take at most this many positions (None: the
    # budget): a decode's inter-token latency stays near a decode step's while a long prompt prefills beside it
    max_prefill_beside_decode: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.max_prefill_beside_decode is not None and self.max_prefill_beside_decode < 1:
            raise ValueError(f"max_prefill_beside_decode must be >= 1, got {self.max_prefill_beside_decode}")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    start: int  # positions start .. end-1 are computed this step
    end: int
    sample: bool  # end reaches the request's tokens: position end-1's logits give the next token
    num_draft: int = 0  # a verify chunk: positions end - num_draft .. end - 1 are room for drafts


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
        # decoding requests' positions are reserved ahead of any prefill chunk before them in admission order, and
        # with max_prefill_beside_decode the prefill chunks of a step with decodes share that many positions
        room = 1 + self.config.speculative_tokens  # what a decode may take (its anchor and drafts)
        decodes = [_decodes(r) for r in self.running]
        reserved = room * sum(decodes)
        cap = self.config.max_prefill_beside_decode
        prefill_left = budget if cap is None or not reserved else cap
        i = 0
        stalled = False  # the one running request waits for blocks a KV pull in flight holds
        while i < len(self.running) and budget > 0 and not stalled:
            req = self.running[i]
            if decodes[i]:
                reserved -= room
                allowed = budget
            else:
                allowed = min(budget - reserved, prefill_left)
                if allowed <= 0:  # the decodes after it take this step's room
                    i += 1
                    continue
            num_draft = self._num_draft(req, allowed)
            end = req.num_computed + self._chunk_len(req, allowed) + num_draft
            while not self.cache.allocate(req, end):
                if num_draft:  # drafts never preempt: verify none first
                    end, num_draft = end - num_draft, 0
                    continue
                if len(self.running) == 1 and self.cache.imports:  # they come back when the pull ends
                    stalled = True
                    break
                if len(self.running) == 1:  # nothing left to preempt: the cache cannot hold this request
                    self.finish(req, FinishReason.LENGTH)
                    out.cannot_grow.append(req)
                    break
                victim = self.running.pop()
                if decodes.pop() and victim is not req:
                    reserved -= room
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                sample = end - num_draft == req.num_tokens
                out.chunks.append(ScheduledChunk(req, req.num_computed, end, sample, num_draft))
                budget -= end - req.num_computed
                if not decodes[i]:
                    prefill_left -= end - req.num_computed
                i += 1
        while (self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.config.max_num_seqs
               and not out.preempted and not stalled):
            req = self.waiting[0]
            if not self.cache.admit(req, self.cache.find_prefix(req)):
                break
            self._plan_replay(req)
            end = req.num_computed + self._chunk_len(req, min(budget, prefill_left))
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
            prefill_left -= end - req.num_computed
        return out

    def advance(self, out: SchedulerOutput, register: bool = True, computed: dict[int, int] | None = None) -> None:
        """After the forward (or once it is launched): the chunks' positions are computed; publish newly full
        blocks (register=False: the caller does once their tokens are known). computed: per verify chunk (index in
        out.chunks), the end of its accepted positions; the blocks past it are given back."""
        for i, c in enumerate(out.chunks):
            c.request.num_computed = c.end if computed is None or i not in computed else computed[i]
            if c.num_draft:
                self.cache.trim(c.request)
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
        """Between steps: the pools are consistent, and no running request holds blocks past its computed
        positions (beyond its prefix hit): what a verify chunk allocated for rejected drafts was given back."""
        self.cache.check_integrity(self.running)
        G, S = self.cache.layout.global_block_size, self.cache.layout.swa_block_size
        for req in self.running:
            assert 0 <= req.num_computed <= req.num_tokens, f"{req.request_id}: computed {req.num_computed} of {req.num_tokens}"
            assert len(req.global_blocks) <= max(-(-req.num_computed // G), req.global_from // G), \
                f"{req.request_id}: {len(req.global_blocks)} global blocks for {req.num_computed} computed positions"
            past = [i for i in req.swa_blocks if i * S >= max(req.num_computed, req.global_from)]
            assert not past, f"{req.request_id}: window blocks {past} past its {req.num_computed} computed positions"

    # ---- internals --------------------------------------------------------------------------------
    def _num_draft(self, req: Request, budget: int) -> int:
        """Room for drafts in a decoding request's verify chunk: K, fewer near its output limit (the step emits up
        to num_draft + 1 tokens) or the budget's end; none with a grammar (each draft would need its mask)."""
        K = self.config.speculative_tokens
        if not K or req.num_tokens - req.num_computed != 1 or not req.output_ids or req.grammar is not None:
            return 0
        return max(0, min(K, req.max_output_len - len(req.output_ids) - 1, budget - 1))

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


def _decodes(req: Request) -> bool:
    """req decodes this step: past its first output, one position behind its tokens (the last drawn one)."""
    return bool(req.output_ids) and req.num_tokens - req.num_computed == 1


def _reset(req: Request) -> None:
    req.status = RequestStatus.WAITING
    req.num_computed = req.global_from = req.swa_floor = req.decoder_from = req.decoder_floor = 0
    req.stats.num_cached_tokens = req.stats.num_replayed_tokens = 0
