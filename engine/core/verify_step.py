"""The verify step on persistent device buffers (issue 22): a speculative step whose chunks are all greedy verify
chunks runs as rows of the decode step (engine/core/decode_step.py), one row per position, so that it can be
captured as a CUDA graph per (request bucket, K, context bucket, logprobs).

A verify chunk of request b is the anchor at position p and its k_b <= K drafts: rows b * (K + 1) + j, j = 0..K,
each a decode row at position p + j (its own window ring, Engram look-back and key (seed, step + j)). Rows past
k_b + 1 and the rows of padding requests are dead: position 0, no window or global writes (global_from =
NO_WRITES, no blocks), so they change nothing and nothing reads their logits. The host stages every row in the
decode step's one record (and each request's stop ids in its anchor row's extra columns), with one copy; then, on
the device:

  1. the decode step's metadata (decode_meta), with the ratio-2 pooling items rewired for chunks: a group whose
     two positions are both in the chunk pools rows j - 1 and j instead of the pending slot and row j, and no row
     writes the pending slot (the rollback below writes what the accepted end needs);
  2. the layers and the head over all rows (DecodeStep.forward), keeping the DSpark tap hiddens and each ratio-2
     source's compressor rows; the target's token of every row (the draw, greedy or teacher-forced, with the
     logprobs when asked): t[b, j];
  3. the acceptance (speculative.accept_drafts with one-hot distributions): m_b = the drafts equal to t[b, j]
     from the first on; the tokens emitted are t[b, 0..m_b] (an accepted draft is t's own token), cut after the
     first stop id: n_b tokens, accepted end e_b = p_b + n_b;
  4. the rollback: where e_b is odd, the pending slot's token 0 gets the compressor rows of position e_b - 1 (the
     group below e_b waits there); entries of groups past e_b are rewritten before they are read, as on the eager
     path (runner._store_global's invariant); and the DSpark context KV of the kept positions p_b .. e_b - 1
     (KernelDSpark.store_context from the tap hiddens).

Then one copy of t, m and n (and the logprobs) back to the host. The drafts themselves are proposed before the
step by the runner's drafter (eager, outside the graph) and staged as the rows' ids. Sampled (temperature > 0)
verify chunks take the eager path (runner._speculative_step), whose rejection sampling is distribution-exact.

Invariant the rollback's scatter relies on: a ratio-r pending slot holds at most r - 1 tokens, so its token r - 1
is never read; rows that write nothing (e even, padding) scatter there instead of branching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.core.decode_buckets import batch_buckets, bucket
from engine.core.decode_step import NO_WRITES, DecodeStep, Views
from engine.core.drafter import Draft
from engine.core.engine_config import DecodeOptions
from engine.core.kernel_layers import KernelRunner, Step
from engine.core.plan import ENGRAM_LOOKBACK, ChunkPlan, SampleSpec, StepPlan, VerifySpec
from engine.core.sampler import UNUSABLE_LOGITS, draw_output
from engine.core.sampling_params import SamplingParams
from engine.core.speculative import Verified

MAX_STOPS = 4  # stop ids a request may have for the verify step (more: the eager path)
GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class Accepted:
    """The device outcome of one verify step (fixed addresses inside a graph's pool)."""

    tokens: Tensor  # int64 [B * (K + 1)]: the target's token of every row, -1 where its logits are unusable
    accepted: Tensor  # int64 [B]: drafts accepted
    emitted: Tensor  # int64 [B]: tokens emitted (the accepted drafts and the target's next, cut after a stop)
    logprob: Tensor | None  # float64 [B * (K + 1)]
    top_logprobs: Tensor | None  # float64 [B * (K + 1), L]
    top_ids: Tensor | None  # int64 [B * (K + 1), L]


def dead_row() -> ChunkPlan:
    """A row that writes and reads nothing (position 0, no blocks)."""
    return ChunkPlan(0, 1, [0], [], True, False, [], {}, None, NO_WRITES, 0, 0, 0)


class VerifyStep(DecodeStep):
    """The kernel path's verify step (see the module docstring): `takes(plan)`, then `execute(plan, drafts)` once
    the runner has drafted (plan: the drafted chunks, anchor + drafts as token_ids). dspark: the stages that store
    the DSpark context (engine/core/kernel_drafter.py)."""

    def __init__(self, runner: KernelRunner, options: DecodeOptions, dspark):
        assert options.max_draft > 0, "the verify step needs speculative decoding on"
        self.max_draft, self.dspark = options.max_draft, dspark
        self.requests = batch_buckets(options.max_batch)
        rows = tuple(sorted({b * (k + 1) for b in self.requests for k in range(options.max_draft + 1)}))
        super().__init__(runner, replace(options, max_batch=rows[-1]), batches=rows, extra_cols=MAX_STOPS)
        self._verify_graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, Accepted]] = {}

    # ---- which steps ------------------------------------------------------------------------------------------
    def takes(self, plan: StepPlan) -> bool:
        """Every chunk verifies greedy drafts (num_draft <= K), one anchor each, within the buckets, with at most
        MAX_STOPS stop ids, no logits kept, no tokens still on the device; no cached global KV or replay skip inside
        the chunk; a pending slot where the model has ratio-2 compressors."""
        chunks, verifies = plan.chunks, plan.verifies
        if not chunks or len(verifies) != len(chunks) or plan.samples or len(chunks) > self.requests[-1]:
            return False
        if plan.from_rows is not None and any(r >= 0 for r in plan.from_rows):
            return False
        max_context, needs_pending = self.contexts[-1], 2 in self.ratios
        return all(v.chunk == i and v.params.is_greedy and len(v.stop_ids) <= MAX_STOPS
                   and 0 < c.num_draft <= self.max_draft and len(c.token_ids) == 1 and not c.keep_logits and not c.images and c.decoder_from <= c.start
                   and c.global_from <= c.start and c.end <= max_context
                   and (c.pending_slot is not None or not needs_pending)
                   for i, (v, c) in enumerate(zip(verifies, chunks)))

    # ---- host: the rows of every chunk ------------------------------------------------------------------------
    def rows_plan(self, plan: StepPlan, K: int, B: int) -> tuple[StepPlan, list[list[int]]]:
        """The decode rows of the drafted verify chunks (B requests of K + 1 rows) and their extra columns."""
        rows, samples, extra = [], [], []
        for c, v in zip(plan.chunks, plan.verifies):
            k = len(c.token_ids) - 1
            history = c.prev_ids + c.token_ids
            for j in range(K + 1):
                row = len(rows)
                if j > k:
                    rows.append(dead_row())
                    samples.append(SampleSpec(row, GREEDY, 0, 0))
                    extra.append([])
                    continue
                at = len(c.prev_ids) + j
                rows.append(replace(c, start=c.start + j, end=c.start + j + 1, token_ids=[c.token_ids[j]],
                                    prev_ids=history[max(0, at - ENGRAM_LOOKBACK):at], num_draft=0))
                force = v.force_ids[j] if j < len(v.force_ids) else None
                samples.append(SampleSpec(row, v.params, v.seed, v.step + j, force))
                extra.append(list(v.stop_ids) if j == 0 else [])
        for row in range(len(rows), B * (K + 1)):  # padding requests
            rows.append(dead_row())
            samples.append(SampleSpec(row, GREEDY, 0, 0))
            extra.append([])
        return StepPlan(rows, [], samples), extra

    # ---- device: the step (graph body) ------------------------------------------------------------------------
    def verify(self, v: Views, K: int, num_logprobs: int) -> Accepted:
        """Forward, draw, accept, roll back and store the kept context (device work only: capturable)."""
        f, N = v.fields, v.B
        B = N // (K + 1)
        step = self.chunk_step(v, K)
        taps: list[Tensor] = []
        self.forward(v, step, taps)
        d = self.draw(v, "greedy", num_logprobs)
        t = d.token_ids.view(B, K + 1)
        ids = f["ids"].view(B, K + 1)  # rows 1.. of a request: its drafts
        live = (f["global_from"] < NO_WRITES).view(B, K + 1)
        j = torch.arange(K + 1, device=self.device)
        accepted = ((ids[:, 1:] == t[:, :-1]) & live[:, 1:]).long().cumprod(dim=1).sum(dim=1)  # [B]
        stops = v.extra.view(B, K + 1, -1)[:, 0]  # [B, MAX_STOPS], -1 = none
        is_stop = ((t[:, :, None] == stops[:, None, :]) & (stops[:, None, :] >= 0)).any(dim=-1)
        is_stop &= j[None, :] <= accepted[:, None]
        first_stop = torch.where(is_stop.any(dim=1), is_stop.long().argmax(dim=1), accepted)
        emitted = torch.minimum(accepted, first_stop) + 1  # [B]
        kept = (j[None, :] < emitted[:, None]) & live  # [B, K + 1]: rows whose positions the request keeps
        start = f["pos"].view(B, K + 1)[:, 0]
        self._roll_back_pending(step, start + emitted, live[:, 0], f["pending"].view(B, K + 1)[:, 0],
                                torch.arange(B, device=self.device) * (K + 1) + emitted - 1)
        write = next(iter(step.meta.values())).swa_write  # every row's window slot
        self.dspark.store_context(torch.cat(taps, dim=-1), f["pos"], torch.where(kept.flatten(), write, -1))
        return Accepted(d.token_ids, accepted, emitted, d.logprob, d.top_logprobs, d.top_ids)

    def chunk_step(self, v: Views, K: int) -> Step:
        """The decode step's metadata with the ratio-2 pooling items of chunks of K + 1 rows (module docstring, 1)
        and every ratio-2 source's compressor rows kept (Step.groups[(-1, source)])."""
        step = self.device_step(v)
        step.groups = {}
        items = None
        for meta in step.meta.values():
            if meta.writes is not None and meta.writes.plan is not None:
                meta.writes.keep_all = True
                items = meta.writes.plan.items  # [N, 6], one tensor shared by every ratio-2 meta
        if items is not None:
            rows = torch.arange(v.B, device=self.device)
            done = items[:, 1] >= 0  # the row completes a group
            items[:, 0] = torch.where(done & (rows % (K + 1) > 0), rows - 1, items[:, 0])
            items[:, 4:] = -1  # no pending writes
        return step

    def _roll_back_pending(self, step: Step, end: Tensor, live: Tensor, slot: Tensor, last_row: Tensor) -> None:
        """Per request: where its accepted end is inside a group (odd), its pending token 0 gets the compressor rows
        of position end - 1 (row last_row); the others scatter into the never-read token r - 1 (module docstring)."""
        kv = self.runner.kv
        for (_, source), rows in step.groups.items():
            r = kv.pending_kv[source].size(1)
            assert r == 2, "the verify step rolls back ratio-2 pending groups"
            waits = live & (end % r != 0)
            flat = torch.where(waits, slot * r, slot.clamp_min(0) * r + r - 1)
            for pool, kept in ((kv.pending_kv[source], rows.kv), (kv.pending_score[source], rows.score)):
                pool.view(-1, pool.size(-1)).index_copy_(0, flat, kept[0, last_row])

    # ---- graphs -----------------------------------------------------------------------------------------------
    def verify_buckets(self) -> list[tuple[int, int, int]]:
        """(requests, K, context) triples a step can reach: its request bucket at its context fits the pool
        (DecodeStep.buckets)."""
        return [(B, K, C) for B, C in self.buckets(self.requests) for K in range(self.max_draft + 1)]

    def capture(self, progress: bool = False) -> dict[str, float]:
        """Warm up and capture every (requests, K, context, logprobs) verify graph (DecodeStep.capture's recipe: one
        stream, two warm-ups, one pool). Returns the capture's seconds, graph count and device memory."""
        assert self.device.type == "cuda" and self.options.graphs
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        mem0, t0 = torch.cuda.memory_reserved(self.device), time.monotonic()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        work = [(B, K, C, lp) for B, K, C in self.verify_buckets() for lp in (0, SamplingParams.MAX_LOGPROBS)]
        for B, K, C, lp in tqdm(work, desc="capturing verify graphs", disable=not progress):
            v = self._views_for(B * (K + 1), C)
            self._verify_graphs[(B, K, C, lp)] = self.capture_one(v, stream, lambda: self.verify(v, K, lp))
        torch.cuda.synchronize(self.device)
        return {"seconds": time.monotonic() - t0, "graphs": len(work),
                "bytes": torch.cuda.memory_reserved(self.device) - mem0}

    # ---- one step ----------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, drafts: list[Draft]) -> list[Verified]:
        """plan: the drafted verify chunks (a plan `takes` accepted, after ModelRunner._draft) -> per verify chunk
        what it emits, as speculative.verify gives it."""
        K = max(len(d.token_ids) for d in drafts)
        B = bucket(len(plan.chunks), self.requests)
        rows, extra = self.rows_plan(plan, K, B)
        v = self.stage(rows, extra)
        num_lp = SamplingParams.MAX_LOGPROBS if any(s.params.logprobs is not None for s in plan.verifies) else 0
        captured = self._verify_graphs.get((B, K, v.C, num_lp))
        if captured is not None:
            captured[0].replay()
            out = captured[1]
        else:
            out = self.verify(v, K, num_lp)
        n, N, L = len(plan.chunks), B * (K + 1), num_lp
        parts = [out.tokens, out.accepted, out.emitted]
        if num_lp:
            parts += [out.logprob.view(torch.int64), out.top_logprobs.view(torch.int64).flatten(),
                      out.top_ids.flatten()]
        host = torch.cat(parts).cpu()  # one copy back
        tokens = host[:N].view(B, K + 1)
        accepted, emitted = host[N:N + n].tolist(), host[N + B:N + B + n].tolist()
        lps = None
        if num_lp:
            at = N + 2 * B
            lps = [host[at:at + N].view(torch.float64).view(B, K + 1),
                   host[at + N:at + N + N * L].view(torch.float64).view(B, K + 1, L),
                   host[at + N + N * L:].view(B, K + 1, L)]
        result = []
        for b, (spec, d) in enumerate(zip(plan.verifies, drafts)):
            result.append(self._verified(b, spec, len(d.token_ids), tokens[b, :emitted[b]].tolist(), accepted[b], lps))
        return result

    @staticmethod
    def _verified(b: int, spec: VerifySpec, num_drafted: int, tokens: list[int], accepted: int,
                  lps: list[Tensor] | None) -> Verified:
        if any(t < 0 for t in tokens):
            return Verified(num_drafted=num_drafted, error=UNUSABLE_LOGITS)
        n = len(tokens)
        if lps is None or spec.params.logprobs is None:
            logprobs = [None] * n
        else:
            lp, top_lp, top_ids = (t[b, :n].tolist() for t in lps)
            logprobs = draw_output(tokens, lp, top_lp, top_ids, [spec.params.logprobs] * n).logprobs
        return Verified(tokens, logprobs, num_drafted, min(accepted, n))
