"""Greedy DSpark drafts on persistent device buffers (issue 22): one CUDA graph per (request bucket, drafts n).

The eager draft (engine/core/drafter.py's DSparkDrafter over engine/core/kernel_drafter.py) builds each request's
context on the host and launches the stages' kernels one by one: milliseconds per step. Here the host stages, per
request, its anchor, its position and the window blocks its context spans (one pinned record, one copy); on the
device (the graph body):

  1. each request's context slots: the window positions max(0, p - W) .. p - 1 in order, read from the staged
     blocks (a block not held: -1), as paged.swa_slots gives them on the host;
  2. the stages' forward (KernelDSpark.hidden_rows) and the sequential Markov correction with greedy picks
     (KernelDSpark.propose, pick = argmax: what draw_draft draws for a greedy request, its q being one-hot);

then one copy of the drafted tokens and their confidences back. The drafts equal the eager drafter's (the same
device code; tests/core/test_draft_step.py). Sampled drafts (temperature > 0: keyed Gumbel noise and their q) stay
eager. Padding requests (anchor 0 at position 0, no context) compute in scratch rows only: nothing they do is
written to a pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.core.decode_buckets import batch_buckets, bucket
from engine.core.decode_step import capture_graph
from engine.core.drafter import Draft, DraftRequest
from engine.core.engine_config import DecodeOptions
from engine.core.kernel_drafter import KernelDSpark


@dataclass(slots=True)
class DraftViews:
    """One request bucket's staged inputs (fixed addresses: a graph captured on them reads later steps' values)."""

    B: int
    anchors: Tensor  # int64 [B]
    positions: Tensor  # int64 [B]: each anchor's position
    blocks: Tensor  # int64 [B, R]: window blocks first .. first + R - 1 (first: the context's first position's), -1


class DraftStep:
    """`takes(requests)`, then `propose(requests)` -> one Draft per request (q None: greedy, one-hot at each token).
    Graphs are captured by `capture` (CUDA); without them (the CPU) the same body runs eagerly."""

    def __init__(self, dspark: KernelDSpark, options: DecodeOptions):
        runner = dspark.runner
        cfg, layout = runner.cfg, runner.kv.layout
        assert options.max_draft > 0, "the draft step needs speculative decoding on"
        self.dspark, self.cfg, self.device, self.options = dspark, cfg, runner.device, options
        self.max_draft = min(options.max_draft, cfg.dspark_block_size)
        self.requests = batch_buckets(options.max_batch)
        self.S, self.W = layout.swa_block_size, cfg.window_size
        self.R = (self.W - 1) // self.S + 2  # window blocks a context can span
        self.max_B = self.requests[-1]
        pinned = self.device.type == "cuda"
        self.host = torch.zeros((2 + self.R) * self.max_B, dtype=torch.int64, pin_memory=pinned)
        self._host_np = self.host.numpy()
        self.dev = torch.zeros_like(self.host, device=self.device)
        self._result = torch.empty(2 * self.max_B * self.max_draft, dtype=torch.int64, pin_memory=pinned)
        runner.reserve_positions(options.max_model_len + cfg.dspark_block_size)
        self._views: dict[int, DraftViews] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        self._pool = None

    def takes(self, requests: list[DraftRequest]) -> bool:
        """Greedy requests within the buckets, each wanting 1..max_draft drafts below max_model_len."""
        return (0 < len(requests) <= self.max_B
                and all(r.params.is_greedy and 0 < r.num_tokens <= self.max_draft
                        and r.position < self.options.max_model_len for r in requests))

    # ---- host: staging -------------------------------------------------------------------------------------------
    def views(self, B: int) -> DraftViews:
        v = self._views.get(B)
        if v is None:
            rec = self.dev.view(2 + self.R, self.max_B)
            v = self._views[B] = DraftViews(B, rec[0, :B], rec[1, :B], rec[2:, :B].t())
        return v

    def stage(self, requests: list[DraftRequest], B: int) -> DraftViews:
        """Fill the record (padding requests: anchor 0 at position 0, no blocks) and copy it to the device."""
        rec = self._host_np.reshape(2 + self.R, self.max_B)
        rec[:, :B] = 0
        rec[2:, :B] = -1
        for b, r in enumerate(requests):
            rec[0, b], rec[1, b] = r.anchor, r.position
            first = max(0, r.position - self.W) // self.S
            for i in range(self.R):
                rec[2 + i, b] = r.swa_blocks.get(first + i, -1)
        self.dev.copy_(self.host, non_blocking=True)
        return self.views(B)

    # ---- device: the body ------------------------------------------------------------------------------------------
    def context_slots(self, positions: Tensor, blocks: Tensor) -> Tensor:
        """int64 [B, W]: the window slots of positions max(0, p - W) .. p - 1, then -1 (paged.swa_slots' order)."""
        W, S = self.W, self.S
        lo = (positions - W).clamp_min(0)
        q = lo[:, None] + torch.arange(W, device=positions.device)
        block = blocks.gather(1, (q // S - (lo // S)[:, None]).clamp(0, self.R - 1))
        return torch.where((q < positions[:, None]) & (block >= 0), block * S + q % S, -1)

    def body(self, v: DraftViews, n: int) -> tuple[Tensor, Tensor]:
        """The drafts (device work only: capturable) -> (tokens int64 [B, n], confidences float64 [B, n])."""
        x = self.dspark.hidden_rows(v.anchors, v.positions, self.context_slots(v.positions, v.blocks))
        out = self.dspark.propose(x, v.anchors, lambda i, logits: logits.argmax(dim=-1), n)
        return out.tokens[:, 1:], out.confidence.double()

    # ---- graphs --------------------------------------------------------------------------------------------------
    def capture(self, progress: bool = False) -> dict[str, float]:
        """Capture every (request bucket, n) graph on one stream into one pool (decode_step.capture_graph). Returns
        the capture's seconds, graph count and device memory."""
        assert self.device.type == "cuda" and self.options.graphs
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        mem0, t0 = torch.cuda.memory_reserved(self.device), time.monotonic()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        work = [(B, n) for B in self.requests for n in range(1, self.max_draft + 1)]
        for B, n in tqdm(work, desc="capturing draft graphs", disable=not progress):
            v = self.views(B)
            v.anchors.zero_(), v.positions.zero_(), v.blocks.fill_(-1)  # harmless rows: no context
            self._graphs[(B, n)] = capture_graph(self.device, stream, self._pool, lambda: self.body(v, n))
        torch.cuda.synchronize(self.device)
        return {"seconds": time.monotonic() - t0, "graphs": len(work),
                "bytes": torch.cuda.memory_reserved(self.device) - mem0}

    # ---- one step --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        n = max(r.num_tokens for r in requests)
        B = bucket(len(requests), self.requests)
        v = self.stage(requests, B)
        captured = self._graphs.get((B, n))
        if captured is not None:
            captured[0].replay()
            tokens, confidence = captured[1]
        else:
            tokens, confidence = self.body(v, n)
        size = B * n
        out = self._result[:2 * size]
        out.copy_(torch.cat([tokens.flatten(), confidence.flatten().view(torch.int64)]))  # one copy back
        ids = out[:size].view(B, n).tolist()
        conf = out[size:].view(torch.float64).view(B, n).tolist()
        return [Draft(ids[b][:r.num_tokens], None, conf[b][:r.num_tokens]) for b, r in enumerate(requests)]

