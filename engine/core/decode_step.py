"""The decode step on persistent device buffers: one CUDA graph per (batch, context) bucket (issue 19).

A step in which every chunk is one sampled token (decode) runs here instead of KernelRunner.execute's eager
path. The host's work is to fill a pinned staging buffer (one of two, in turn) with the step's rows (token id, position, window
blocks, floors, pending slot, Engram look-back (image-span positions as DEAD: the steps right after an image that
ends a prompt), sampling parameters) and the entries of the global block tables that changed since the last step
(engine/core/block_table.py: the tables live on the device), copy it to the device with one non-blocking copy and
write the changed entries (one launch, none in most steps); everything else happens on the device, inside the graph:

  1. inputs and metadata, two launches (engine/kernels/decode_meta.py): the input ids and the Engram hash ids
     from the ids and their look-back; window write slots and the window each query reads, from a ring of its
     window's blocks; every global entry's flat slot from the block table (the indexer's rows [B, C / ratio], C
     the context bucket); the completed compressor groups and pending writes (ratio 1 and 2);
  2. the layers, through KernelRunner.layer_forward (the indexer and top-k batched over all rows: one
     RequestRows for the whole batch, each row reading its own entries), the final norm and the head;
  3. the draw (sampler.sample_device), in a second small graph per (batch, sampling variant, logprobs, grammar
     masks); a step whose draws have grammar masks stages them too (one bitmask row per request, all ones where
     a request has none) and the draw applies them first (engine/kernels/token_mask.py); over several shards the head's logits stay vocab-parallel and greedy / plain draws gather only each rank's
     maxima (sharded_draw.py), other draws the logits.

Then one copy of the drawn ids (and logprobs when asked) back to the host. A step launches in two halves, the same
code on CUDA and on the CPU: `launch_forward` stages the record and runs 1-2, `PendingForward.draw(masks)` stages the
grammar masks (into the same staging buffer, its copy behind the forward) and runs 3; `launch` runs both at once.
The engine calls the halves apart when a constrained request's mask needs the tokens of the step in flight
(engine/core/overlap.py): the host computes the masks while the device runs the forward. Rows past a request's context
are padding: their entries are never read (index_scores_batched stops at each row's visible count) and
their scores are -inf, so the top-k is the per-request top-k with -1 columns after it.

Buckets: batch 1, 2, 4, ... 256 (up to max_batch), context 256, 512, ... up to max_model_len; a bucket pair
is captured only where such a batch fits the KV pool. On the CPU (tests) the same code runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.core.block_table import BlockTableMirror
from engine.core.decode_buckets import batch_buckets, bucket, context_buckets, decode_takes
from engine.core.engine_config import DecodeOptions
from engine.core.kernel_layers import AttnMeta, GlobalWrite, KernelRunner, RequestRows, Shared, Step
from engine.core.plan import ENGRAM_LOOKBACK, ChunkPlan, StepPlan
from engine.core.sampler import SampleTensors, draw_output, sample_device, sample_row_values, sample_variant
from engine.core.sampling_params import SamplingParams
from engine.core.sharded_draw import draws_sharded, sample_sharded
from engine.core.step_rows import StepOutput
from engine.engram_tables import DEAD
from engine.kernels.compressor import Ratio2Plan
from engine.kernels.decode_meta import decode_inputs, decode_meta
from engine.kernels.token_mask import token_mask
from engine.parallel import all_gather
from engine.vision.inputs import image_mask

VARIANTS = ("greedy", "plain", "filtered")
# the staging record: one int64 row of length max_batch per field (floats as float64 bit patterns)
FIELDS = ("ids", "from_row", "pos", "swa_floor", "dec_floor", "global_from", "pending", "greedy", "top_k", "seed", "step",
          "force", "temperature", "top_p", "min_p")
FLOAT_FIELDS = ("temperature", "top_p", "min_p")
NO_WRITES = 1 << 62  # global_from of padding rows: no position of theirs writes global KV or pending state


@dataclass(slots=True)
class Views:
    """The device buffers of one (batch, context) bucket: fixed addresses, so a graph captured on them reads
    every later step's staged values."""

    B: int
    C: int
    fields: dict[str, Tensor]  # [B] each (int64, float64 for FLOAT_FIELDS)
    prev: Tensor  # int64 [B, ENGRAM_LOOKBACK] raw ids before the position, -1 = none (oldest first)
    ring: Tensor  # int64 [B, R] window block ids of blocks lo .. lo + R - 1 (lo: the window's first), -1 = none
    gtable: Tensor  # int64 [B, C / global_block_size] global block ids, -1 past the request's (rows of self.tables)
    rows: Tensor  # int64 [B]: 0 .. B - 1 (every row writes its own global entry)
    mask: Tensor  # int32 [B, mask words]: the draws' grammar bitmasks (staged only for a step that has one)
    extra: Tensor  # int64 [B, extra_cols]: a user's own per-row columns (the verify step's stop ids), -1 = none


class DecodeStep:
    """The kernel path's decode step (see the module docstring): `takes(plan)`, then `execute(plan)`.
    batches: the row-count buckets (default: batch_buckets(options.max_batch)); extra_cols: int64 columns per row
    staged after the record's own (engine/core/verify_step.py's stop ids)."""

    def __init__(self, runner: KernelRunner, options: DecodeOptions, batches: tuple[int, ...] | None = None,
                 extra_cols: int = 0):
        self.runner, self.options = runner, options
        cfg, layout = runner.cfg, runner.kv.layout
        self.cfg, self.device = cfg, runner.device
        self.G, self.S, self.W = layout.global_block_size, layout.swa_block_size, cfg.window_size
        self.R = (self.W - 1) // self.S + 2  # window blocks a query can span
        self.ratios = sorted({cfg.compress_ratios[i] for i in range(cfg.n_layers)})
        self.batches = batches or batch_buckets(options.max_batch)
        self.contexts = context_buckets(options.max_model_len)
        self.max_B, self.max_C = self.batches[-1], self.contexts[-1]
        self.capacity = layout.num_global_blocks * self.G  # positions the pool holds
        self.extra_cols = extra_cols
        self.num_cols = len(FIELDS) + ENGRAM_LOOKBACK + self.R + extra_cols
        rec = self.num_cols * self.max_B
        pinned = self.device.type == "cuda"
        # the global block tables, on the device across steps; the host stages the entries that change
        self.table_mirror = BlockTableMirror(self.max_B, self.max_C // self.G)
        self.tables = torch.full((self.max_B, self.max_C // self.G), -1, dtype=torch.int64, device=self.device)
        # two staging buffers, used in turn: step k+1 is staged while step k's copy may not have run yet; after
        # the record, a step's changed table entries: their flat indices, then their values
        # then the grammar bitmasks, a row of 32-bit words per request (an even count: int64 staging)
        self.mask_words = ((cfg.vocab_size + 31) // 32 + 1) // 2 * 2
        self.mask_base = rec + 2 * self.table_mirror.capacity
        size = self.mask_base + self.max_B * self.mask_words // 2
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._hosts_np = [h.numpy() for h in self.hosts]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each one's last copy to the device
        self._num_staged = 0
        self.dev = torch.zeros(size, dtype=torch.int64, device=self.device)
        # a vocab-parallel head's slice (several shards: the draw gathers only what it needs, sharded_draw.py)
        self.shard = runner.model.head.shard
        self.logits = torch.empty(self.max_B, runner.model.head.weight.size(0), dtype=torch.float32, device=self.device)
        self.masked_logits = torch.empty_like(self.logits)  # a masked draw's copy (the logprobs read self.logits)
        self.last_ids = torch.zeros(self.max_B, dtype=torch.int64, device=self.device)  # the last draw's tokens
        L = SamplingParams.MAX_LOGPROBS  # the read-back: ids, then logprob, top logprobs and top ids when asked
        self._results = [torch.empty(self.max_B * (2 + 2 * L), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._num_launched = 0
        tables = getattr(runner.model, "engram_tables", None)
        self.engram = None if tables is None else tables.to(self.device)
        assert self.engram is None or self.engram.max_ngram_size - 1 <= ENGRAM_LOOKBACK
        self._views: dict[tuple[int, int], Views] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._draws: dict[tuple, object] = {}
        self._pool = None

    # ---- which steps ------------------------------------------------------------------------------------------
    def takes(self, plan: StepPlan) -> bool:
        return decode_takes(plan, self.options, 2 in self.ratios)

    # ---- host: one staging buffer, one copy -------------------------------------------------------------------
    def stage(self, plan: StepPlan, extra: list[list[int]] | None = None) -> Views:
        """extra: per chunk, its extra_cols values (-1 where not given)."""
        chunks, V = plan.chunks, self.cfg.vocab_size
        B = bucket(len(chunks), self.batches)
        C = bucket(max(c.end for c in chunks), self.contexts)
        nb = C // self.G
        which = self._num_staged % 2
        self._num_staged += 1
        if self._copied[which] is not None:
            self._copied[which].synchronize()  # the device has read this buffer's last contents
        host, host_np = self.hosts[which], self._hosts_np[which]
        base = self.num_cols * self.max_B
        rec = host_np[:base].reshape(self.num_cols, self.max_B)
        recf = rec.view(np.float64)
        rec[:, :B] = 0  # padding rows (past the chunks): position 0 of a request that writes nothing
        rec[FIELDS.index("global_from"), :B] = NO_WRITES
        rec[FIELDS.index("pending"), :B] = -1
        rec[FIELDS.index("from_row"), :B] = -1
        rec[FIELDS.index("force"), :B] = -1
        rec[FIELDS.index("greedy"), :B] = 1
        recf[FIELDS.index("temperature"), :B] = 1.0
        recf[FIELDS.index("top_p"), :B] = 1.0
        recf[FIELDS.index("min_p"), :B] = -np.inf
        rec[FIELDS.index("top_k"), :B] = V
        prev0, ring0 = len(FIELDS), len(FIELDS) + ENGRAM_LOOKBACK
        rec[prev0:, :B] = -1
        from_rows = plan.from_rows or [-1] * len(chunks)
        for b, (c, spec, from_row) in enumerate(zip(chunks, plan.samples, from_rows)):
            pos = c.start
            greedy, temp, top_k, top_p, thr, seed, step, force = sample_row_values(spec.params, spec.seed, spec.step,
                                                                                   spec.force_id, V)
            rec[:len(FIELDS) - len(FLOAT_FIELDS), b] = (max(c.token_ids[0], 0), from_row, pos, c.swa_floor, c.decoder_floor,
                                                        c.global_from, -1 if c.pending_slot is None else c.pending_slot,
                                                        greedy, top_k, seed, step, force)
            recf[len(FIELDS) - len(FLOAT_FIELDS):len(FIELDS), b] = (temp, top_p, thr)
            if c.prev_ids:  # image-span positions staged as DEAD (-1), as engram_hashes marks them
                rec[ring0 - len(c.prev_ids):ring0, b] = lookback_ids(c)
            lo = max(pos - self.W + 1, 0) // self.S
            rec[ring0:ring0 + self.R, b] = [c.swa_blocks.get(lo + j, -1) for j in range(self.R)]
            assert len(c.global_blocks) <= nb, f"row {b}: {len(c.global_blocks)} global blocks past the bucket's {nb}"
            if extra is not None and extra[b]:
                assert len(extra[b]) <= self.extra_cols, f"row {b}: {len(extra[b])} extra columns of {self.extra_cols}"
                rec[ring0 + self.R:ring0 + self.R + len(extra[b]), b] = extra[b]
        idx, vals = self.table_mirror.updates([c.global_blocks for c in chunks], B)
        u = idx.size
        host_np[base:base + u], host_np[base + u:base + 2 * u] = idx, vals
        n = base + 2 * u
        self.dev[:n].copy_(host[:n], non_blocking=True)
        if u:
            self.tables.view(-1).index_copy_(0, self.dev[base:base + u], self.dev[base + u:n])
        self._record_copy(which)
        return self._views_for(B, C)

    def _record_copy(self, which: int) -> None:
        if self.device.type == "cuda":
            self._copied[which] = torch.cuda.Event()
            self._copied[which].record()

    def _stage_masks(self, allowed: list[bytes | None], B: int) -> None:
        """The B rows' bitmasks (llguidance's bytes; all ones for a draw without one) into the mask region of the
        staging buffer the step's record went into, and one copy to the device (behind the step's forward)."""
        which = (self._num_staged - 1) % 2
        host, host_np = self.hosts[which], self._hosts_np[which]
        row_bytes = 4 * self.mask_words
        need = (self.cfg.vocab_size + 31) // 32 * 4
        region = host_np[self.mask_base:self.mask_base + B * self.mask_words // 2].view(np.uint8).reshape(B, row_bytes)
        region.fill(0xFF)
        for b, mask in enumerate(allowed):
            if mask is not None:
                assert len(mask) >= need, f"a bitmask of {len(mask)} bytes, {need} needed"
                n = min(len(mask), row_bytes)
                region[b, :n] = np.frombuffer(mask, dtype=np.uint8, count=n)
        end = self.mask_base + B * self.mask_words // 2
        self.dev[self.mask_base:end].copy_(host[self.mask_base:end], non_blocking=True)
        self._record_copy(which)  # the next stage() into this buffer waits for this copy too

    def _views_for(self, B: int, C: int) -> Views:
        v = self._views.get((B, C))
        if v is None:
            rec = self.dev[:self.num_cols * self.max_B].view(self.num_cols, self.max_B)
            fields = {f: (rec.view(torch.float64) if f in FLOAT_FIELDS else rec)[i, :B] for i, f in enumerate(FIELDS)}
            prev0, ring0 = len(FIELDS), len(FIELDS) + ENGRAM_LOOKBACK
            gtable = self.tables[:B, :C // self.G]
            mask = self.dev[self.mask_base:self.mask_base + B * self.mask_words // 2].view(torch.int32)
            v = self._views[(B, C)] = Views(B, C, fields, rec[prev0:ring0, :B].t(), rec[ring0:ring0 + self.R, :B].t(),
                                            gtable, torch.arange(B, device=self.device), mask.view(B, self.mask_words),
                                            rec[ring0 + self.R:, :B].t())
        return v

    # ---- device: the step (graph body) ------------------------------------------------------------------------
    def forward(self, v: Views, step: Step | None = None, taps: list[Tensor] | None = None) -> None:
        """The model over the staged rows -> self.logits[:B] (device work only: capturable). step: the metadata
        (default: device_step(v)); taps: gets the DSpark tap layers' inputs (KernelRunner.run_layers)."""
        r, f = self.runner, v.fields
        # the input ids (a token the previous step drew and the host has not read yet: its row of that step's draw)
        # and the Engram hash ids, one launch
        ids, hashes = decode_inputs(f["ids"], f["from_row"], self.last_ids, f["pos"], v.prev, self.engram)
        h, pre_mix = r.run_layers(ids, self.device_step(v) if step is None else step, hashes, taps=taps)
        self.logits[:v.B].copy_(r.head(h, pre_mix, gather=False))

    def draw(self, v: Views, variant: str, num_logprobs: int, masked: bool = False):
        """The step's tokens from self.logits[:B] (masked: drawn from a copy with the staged grammar bitmasks
        applied); also kept in self.last_ids for the next step's input."""
        f = v.fields
        t = SampleTensors(f["greedy"].bool(), f["temperature"].float(), f["top_k"], f["top_p"], f["min_p"].float(),
                          f["seed"], f["step"], f["force"])
        logits = drawn = self.logits[:v.B]
        if masked:  # the draw takes only allowed tokens; logprobs stay the model's (sampler.sample's raw logprobs)
            drawn = self.masked_logits[:v.B]
            drawn.copy_(logits)
            token_mask(drawn, v.mask, self.shard.rank * logits.size(1))
        if self.shard.is_single:
            d = sample_device(drawn, t, variant, num_logprobs, logits if masked else None)
        elif draws_sharded(variant, num_logprobs):
            d = sample_sharded(drawn, t, variant, self.shard)
        else:
            raw = all_gather(logits, self.shard, dim=-1) if masked and num_logprobs else None
            d = sample_device(all_gather(drawn, self.shard, dim=-1), t, variant, num_logprobs, raw)
        self.last_ids[:v.B].copy_(d.token_ids)
        return d

    def device_step(self, v: Views) -> Step:
        """The step's metadata for every (decoder, ratio) the layers ask for, from one decode_meta launch."""
        f = v.fields
        m = decode_meta(f["pos"], f["swa_floor"], f["dec_floor"], f["global_from"], f["pending"], v.ring, v.gtable,
                        self.W, self.S, self.G, tuple(self.ratios))
        rows: list = []  # the step's one segment list: every row is its own request, every row is kept
        step = Step([], rows, rows, None, None, [Shared()])
        pos = f["pos"]
        for decoder in (False, True):
            swa_idx = m.swa[int(decoder)]
            for ratio in self.ratios:
                if ratio == 0:
                    meta = AttnMeta(pos, m.write, None, pos, swa_idx, [], None, [])
                else:
                    T = v.C // ratio
                    index_rows = RequestRows(0, slice(0, v.B), T, m.entries[ratio], m.visible[ratio],
                                             min(self.cfg.index_topk, T))
                    plan = None if ratio == 1 else Ratio2Plan(m.items, [], m.gpos[2], v.B)
                    write = GlobalWrite(v.rows, m.slots[ratio], m.gpos[ratio], plan)
                    meta = AttnMeta(pos, m.write, None, pos, swa_idx, [index_rows], write, [])
                step.meta[(id(rows), id(rows), decoder, ratio)] = meta
        return step

    # ---- graphs -----------------------------------------------------------------------------------------------
    def buckets(self, batches: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
        """(batch, context) pairs a batch can reach: its smallest batch at its smallest context fits the pool.
        batches: the batch buckets (default: the step's)."""
        batches, out = batches or self.batches, []
        for i, B in enumerate(batches):
            b_min = batches[i - 1] + 1 if i else 1
            for j, C in enumerate(self.contexts):
                c_min = self.contexts[j - 1] + 1 if j else 1
                if b_min * c_min <= self.capacity:
                    out.append((B, C))
        return out

    def capture(self, progress: bool = False) -> dict[str, float]:
        """Warm up and capture every bucket's model graph and every (batch, variant, logprobs) draw graph.
        Returns the capture's seconds, graph count and the device memory it took."""
        assert self.device.type == "cuda" and self.options.graphs
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        mem0, t0 = torch.cuda.memory_reserved(self.device), time.monotonic()
        self._pool = torch.cuda.graph_pool_handle()
        # Warm-ups and captures on one stream: per-stream state (fp8_linear's split-K tickets, cuBLAS workspaces) is
        # made and zeroed by the warm-up. Made inside a capture instead, the tickets' zeroing would run only when that
        # one graph replays, and every later-captured graph would start from uninitialised tickets.
        stream = torch.cuda.Stream(self.device)
        work = [("model", B, C) for B, C in self.buckets()]
        work += [("draw", B, (variant, lp, masked)) for B in self.batches for variant in VARIANTS
                 for lp in (0, SamplingParams.MAX_LOGPROBS) for masked in (False, True)]
        for kind, B, key in tqdm(work, desc="capturing decode graphs", disable=not progress):
            v = self._views_for(B, key if kind == "model" else self.contexts[0])
            graph, out = self.capture_one(v, stream, (lambda: self.forward(v)) if kind == "model"
                                          else (lambda: self.draw(v, *key)))
            if kind == "model":
                self._graphs[(B, key)] = graph
            else:
                self._draws[(B, *key)] = (graph, out)
        torch.cuda.synchronize(self.device)
        return {"seconds": time.monotonic() - t0, "graphs": len(work),
                "bytes": torch.cuda.memory_reserved(self.device) - mem0}

    def capture_one(self, v: Views, stream: torch.cuda.Stream, run) -> tuple[torch.cuda.CUDAGraph, object]:
        """One graph of run() over v's buffers (reset to harmless rows), captured on `stream` into the step's pool
        after two warm-ups: (the graph, what run returned inside it)."""
        self._reset_rows(v)
        return capture_graph(self.device, stream, self._pool, run)

    def _reset_rows(self, v: Views) -> None:
        """Harmless rows for warm-up and capture: position 0 of nothing (every write skipped)."""
        for name, value in (("ids", 0), ("from_row", -1), ("pos", 0), ("swa_floor", 0), ("dec_floor", 0), ("global_from", NO_WRITES),
                            ("pending", -1), ("greedy", 1), ("top_k", self.cfg.vocab_size), ("force", -1)):
            v.fields[name].fill_(value)
        for name, value in (("temperature", 1.0), ("top_p", 1.0), ("min_p", -float("inf"))):
            v.fields[name].fill_(value)
        v.prev.fill_(-1), v.ring.fill_(-1), v.mask.fill_(-1), v.extra.fill_(-1)
        self.tables.fill_(-1)
        self.table_mirror.reset()

    # ---- one step ----------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> "PendingDraw":
        """Stage the step, replay its graphs (or run it eagerly) and queue the copy of its tokens to the host;
        returns before the device is done (PendingDraw.result waits). Two launches may be outstanding."""
        return self.launch_forward(plan).draw([s.allowed for s in plan.samples])

    def launch_forward(self, plan: StepPlan) -> "PendingForward":
        """launch's first half: stage the step and replay its model graph (or run it eagerly). Its draw follows with
        PendingForward.draw(masks), which may wait for the host to compute the grammar masks (while the device runs
        the forward: engine/core/overlap.py); nothing else may be staged or launched in between. The plan's own
        masks (SampleSpec.allowed) are not read here."""
        v = self.stage(plan)
        params = [s.params for s in plan.samples]
        graph = self._graphs.get((v.B, v.C))
        if graph is not None:
            graph.replay()
        else:
            self.forward(v)
        ks = [p.logprobs for p in params]
        num_lp = SamplingParams.MAX_LOGPROBS if any(k is not None for k in ks) else 0
        return PendingForward(self, v, sample_variant(params), num_lp, ks, len(plan.chunks), self._num_staged)

    def launch_draw(self, f: "PendingForward", allowed: list[bytes | None]) -> "PendingDraw":
        """launch's second half (PendingForward.draw): stage the masks (one per chunk, None: unconstrained), replay
        the draw graph (or draw eagerly) and queue the copy of its tokens to the host."""
        assert self._num_staged == f.num_staged, "a step was staged between a forward and its draw"
        assert len(allowed) == f.n, f"{len(allowed)} masks for {f.n} draws"
        v, num_lp = f.views, f.num_logprobs
        masked = any(a is not None for a in allowed)
        if masked:
            self._stage_masks(allowed, v.B)
        drawn = self._draws.get((v.B, f.variant, num_lp, masked))
        if drawn is not None:
            drawn[0].replay()
            d = drawn[1]
        else:
            d = self.draw(v, f.variant, num_lp, masked)
        n = f.n
        parts = [d.token_ids[:n]] + ([] if num_lp == 0 else [d.logprob[:n].view(torch.int64),
                                                            d.top_logprobs[:n].view(torch.int64).flatten(),
                                                            d.top_ids[:n].flatten()])
        host = self._results[self._num_launched % 2][:n * (2 + 2 * num_lp) if num_lp else n]
        self._num_launched += 1
        host.copy_(torch.cat(parts), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return PendingDraw(host, n, num_lp, f.ks, done)


@dataclass(slots=True)
class PendingForward:
    """A decode step whose forward is launched and whose draw is not: `draw(masks)` launches it (once)."""

    step: DecodeStep
    views: Views
    variant: str
    num_logprobs: int
    ks: list[int | None]
    n: int
    num_staged: int  # the step's staging count (nothing may be staged before its draw)

    @torch.inference_mode()
    def draw(self, allowed: list[bytes | None]) -> "PendingDraw":
        """allowed: per draw row (chunk), its grammar bitmask or None."""
        return self.step.launch_draw(self, allowed)


def capture_graph(device: torch.device, stream: torch.cuda.Stream, pool, run) -> tuple[torch.cuda.CUDAGraph, object]:
    """One CUDA graph of run() on `stream` into `pool`, after two warm-ups outside it (Triton compiles, side streams,
    cached weights): (the graph, what run returned inside it)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode():
        with torch.cuda.stream(stream):
            run(), run()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = run()
    return graph, out


def lookback_ids(c: ChunkPlan) -> list[int]:
    """A chunk's Engram look-back ids (plan.prev_ids), image-span positions as DEAD (-1: decode_inputs blocks there,
    as step_rows.engram_hashes does): the decode steps right after an image that ends a prompt."""
    if not c.images:
        return c.prev_ids
    mask = image_mask(c.start - len(c.prev_ids), c.start, c.images)
    return [DEAD if m else t for t, m in zip(c.prev_ids, mask)]


@dataclass(slots=True)
class PendingDraw:
    """A launched decode step's tokens on their way to the host (pinned memory, behind `done`)."""

    host: Tensor
    n: int
    num_logprobs: int
    ks: list[int | None]
    done: "torch.cuda.Event | None"

    def result(self) -> StepOutput:
        if self.done is not None:
            self.done.synchronize()
        n, L, host = self.n, self.num_logprobs, self.host
        ids = host[:n].tolist()
        if L == 0:
            return StepOutput(draw_output(ids, None, None, None, self.ks), {})
        lp = host[n:2 * n].view(torch.float64).tolist()
        top_lp = host[2 * n:2 * n + n * L].view(torch.float64).view(n, L).tolist()
        top_ids = host[2 * n + n * L:].view(n, L).tolist()
        return StepOutput(draw_output(ids, lp, top_lp, top_ids, self.ks), {})
