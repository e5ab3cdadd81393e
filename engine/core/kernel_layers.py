"""The runner's kernel path: the same step (StepPlan -> StepLogits) as engine/core/runner.py's golden
path, with every op either an `engine.kernels` kernel or plain torch fp32/bf16 math on the device.

The golden path computes each fp32 step of the reference in float64 (exact, slow) and gathers each
request's whole window and global KV before attention. This path runs the reference's own precision
(fp32 reductions and accumulators, bf16 activations, FP8/FP4 weights streamed by the kernels) and
reads the paged pools in place: sparse attention gets per-query flat slot lists (window rows, then
the top-k entries), the indexer scores the request's index-key records where they lie.

Ops live in one table (`OPS`, engine/core/kernel_ops.py), each called from one place; `op_backends()`
says which are kernels. Every op is a kernel now; torch glue remains for the MXFP4 QDQ of the indexer
queries, the grouped wo_a product above 8 tokens (bf16 einsum on a dequantised copy of the FP8 weight;
decode uses fp8_gemv_grouped on the FP8 weight), bf16 linears (cuBLAS bf16 on CUDA; where the reference
computes in fp32, the head and the compressors, bf16_gemv / cuBLAS bf16 -> fp32) and the Engram gate.

Model parallelism: a rank's layer runs as if alone, on the module's local sizes (n_local_heads query heads: its
rows of wq_b and attn_sink; n_local_groups output groups: its rows of wo_a; its routed experts), and the three
parallel ops of kernel_ops (row_parallel wo_b, the MoE's partials, head_logits) hold the collectives.

Step structure (graph-safe by construction): `prepare(plan)` does all host work of a step (slot
arithmetic, Engram hashes, index tensors moved to the device once); `layer_forward` then runs a
decoder layer on device tensors only: no .item(), .tolist(), nonzero or boolean-mask indexing, so a
layer can be captured in a CUDA graph (benchmarks/layer_decode.py). Engram rows are gathered by the
GPU from the host tables (pinned in place) on a side stream at the start of the step (EngramPrefetch)
and joined just before each Engram layer.

Images (spec 4.10): a step whose chunks hold image-span positions runs the bf16 vision tower for the images it
misses (engine/core/kernel_vision.py; span rows kept by engine/core/image_spans.SpanCache, as the golden path keeps
them), and their span rows overwrite those rows' embeddings; those rows route with bias_vl (the MoE op's is_image)
and keep the stream through Engram (gate 0; their n-grams are DEAD in the host-made hashes, step_rows.engram_hashes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.image_spans import SpanCache, stream_image_mask
from engine.core.kernel_ops import (OPS, engram_table, head_logits, linear, mm_fp32, rms_norm_torch, row_parallel,
                                   score_rows)
from engine.core.kernel_vision import VisionTower
from engine.core.kv_cache import PagedKVCache
from engine.core.plan import ChunkPlan, StepPlan
from engine.core.step_rows import (CompressorRows, ForwardState, Segment, StepLogits, decoder_rows, engram_hashes,
                                   head_rows, no_logits, segments, split_logits)
from engine.host_copy import tensor_on, to_device
from engine.kernels import paged
from engine.kernels.compressor import Ratio2Chunk, Ratio2Plan, plan_ratio2
from engine.kernels.engram_gather import EngramPrefetch
from engine.kernels.fp8_gemv import fp8_gemv_grouped, grouped_gemv_applies
from engine.kernels.fp8_linear import stacked_fp8
from engine.kernels.mhc_cuda import mixes_cuda_applies
from engine.kernels.rope import RopeTable, rope_table
from engine.kernels.side_stream import Forked, fork
from engine.model.attention import Attention, Compressor
from engine.model.block import Block
from engine.model.rope import RotaryTable


# ---- step metadata (host work, done once per step) -------------------------------------------------------------

@dataclass(slots=True)
class Phase:
    """The rows one layer reads (segs_in) and keeps (segs_out); `keep` selects segs_out's rows of the
    stream at the CED cut (None elsewhere); is_image marks segs_out's image-span rows (None: none is)."""

    segs_in: list[Segment]
    segs_out: list[Segment]
    keep: Tensor | None
    decoder: bool
    is_image: Tensor | None = None


@dataclass(slots=True)
class RequestRows:
    """One request's queries in a layer with ratio > 0."""

    chunk: int
    rows: slice  # its rows among the layer's query rows
    num_entries: int  # global entries visible at its last position (end // ratio)
    entries: Tensor  # int32 [num_entries]: their flat slots in the source's pools; or [m, num_entries]: each
    #                  query row's own (the batched decode step: rows of different requests)
    visible: Tensor  # int32 [m]: entries visible per query, (pos + 1) // ratio
    max_k: int


@dataclass(slots=True)
class GroupWrite:
    """One chunk's compressor work (ratio > 2, the torch path): its rows >= global_from, its pending
    slot and the global entries its completed groups fill."""

    rows: slice  # input rows of the layer
    pending: int  # tokens already waiting in the pending slot (start % ratio)
    slot: int | None
    complete: int  # (pending + rows) // ratio * ratio
    entries: Tensor  # long [groups] flat entry slots
    gpos: Tensor  # long [groups] first-token positions of the groups (RoPE)
    verify: bool = False  # a verify chunk's: its rows are kept (Step.groups)
    chunk: int = -1
    first: int = 0  # position of its first row: start - pending


@dataclass(slots=True)
class GlobalWrite:
    """A KV source's compressor work for all chunks of the step at once (ratio 1 and 2)."""

    rows: Tensor  # long [n]: input rows at positions >= their chunk's global_from
    entries: Tensor  # long [G]: flat entry slots of the groups completed now, in chunk order
    gpos: Tensor  # long [G]: their RoPE positions (first token of the group)
    plan: Ratio2Plan | None  # ratio 2: the pooling plan over `rows`
    verify: list["VerifyRows"] = field(default_factory=list)  # ratio 2: the verify chunks among `rows`
    # ratio 2, the verify step on device buffers (engine/core/verify_step.py): every row's compressor rows are kept,
    # as Step.groups[(-1, source)] (first = 0: row i of `rows` is row i of the kept tensors)
    keep_all: bool = False


class VerifyRows(NamedTuple):
    """A verify chunk's rows among a GlobalWrite's (speculative decoding: its compressor rows are kept, so the
    pending group can be rolled back to the accepted end)."""

    chunk: int
    row: int  # its first row in GlobalWrite.rows
    n: int
    start: int  # position of that row
    slot: int  # its pending slot


@dataclass(slots=True)
class AttnMeta:
    pos: Tensor  # long [R] positions of the input rows
    swa_write: Tensor  # long [R] their window slots
    q_rows: Tensor | None  # long [R'] input rows that query; None: every input row, in order (no gather)
    qpos: Tensor  # long [R']
    swa_idx: Tensor  # int32 [R', W] window slots each query attends (-1 = none)
    requests: list[RequestRows]
    writes: GlobalWrite | None  # ratio 1 / 2
    groups: list[GroupWrite]  # ratio > 2


@dataclass(slots=True)
class Shared:
    """Per chunk, within one step: published by index sources (topk) and the candidate source."""

    topk: dict[int, Tensor] = field(default_factory=dict)  # layer -> long [m, K] entry ids, -1 = none
    candidates: Tensor | None = None  # bool [m, T]


@dataclass(slots=True)
class Step:
    chunks: list[ChunkPlan]
    segs: list[Segment]
    dec_segs: list[Segment]
    keep: Tensor | None  # long: stream rows the decoder keeps (None: every row, as in a decode step)
    hashes: Tensor | None  # long [T, engram layers, cols] (host-computed)
    shared: list[Shared]
    meta: dict[tuple, AttnMeta] = field(default_factory=dict)
    is_image: Tensor | None = None  # bool [T]: image-span rows of the stream (None: no row is one)
    dec_is_image: Tensor | None = None  # bool: the same of the rows the decoder keeps
    image_at: Tensor | None = None  # long [n]: the image-span rows (their span rows overwrite the embedding)
    # (verify chunk, ratio > 1 source) -> the compressor rows it saw (None: the step verifies no drafts)
    groups: dict[tuple[int, int], CompressorRows] | None = None

    def phase(self, layer: int, ced_cut: int) -> Phase:
        if layer < ced_cut:
            return Phase(self.segs, self.segs, None, False, self.is_image)
        if layer == ced_cut:
            return Phase(self.segs, self.dec_segs, self.keep, True, self.dec_is_image)
        return Phase(self.dec_segs, self.dec_segs, None, True, self.dec_is_image)


def window_slots(blocks: dict[int, int], start: int, end: int, window: int, floor: int, block_size: int,
                  device: torch.device) -> Tensor:
    """int32 [end - start, window] on `device`: for each query position p in start..end-1, the flat window slots of
    positions p - window + 1 .. p (golden window_indices), -1 where a position is < floor or < 0. Made on the device
    from the held blocks' table (host work O(blocks), not O(queries x window): at a 16K chunk the host-made matrix
    cost ~50 ms a step with the device idle); every block a query reads must be held."""
    low = max(floor, 0)
    table, first = paged.window_table(blocks, max(start - window + 1, low), end, block_size)
    table = to_device(table, device)
    p = torch.arange(start, end, device=device)
    wpos = p[:, None] + torch.arange(1 - window, 1, device=device)[None, :]  # [m, W]
    valid = wpos >= low
    if table.numel() == 0:  # no query reads a position
        return torch.full(wpos.shape, -1, dtype=torch.int32, device=device)
    blk = table[(wpos.clamp_min(first * block_size) // block_size - first).clamp_max(table.numel() - 1)]
    return torch.where(valid, blk * block_size + wpos % block_size, -1).to(torch.int32)


# ---- the runner ------------------------------------------------------------------------------------------------

class KernelRunner:
    """ModelRunner's kernel path (same inputs and outputs). `model` needs cfg, and for `execute` also
    embed, layers, norm, head and engram_tables (and the vision tower where cfg has one); `layer_forward` needs
    only cfg and the layer."""

    def __init__(self, model, kv: PagedKVCache):
        self.model, self.kv, self.cfg = model, kv, model.cfg
        self.device = kv.swa[0].device
        has_tower = getattr(model, "vision", None) is not None  # (layer_forward's callers may pass cfg alone)
        self.vision = VisionTower(model, self.device) if has_tower else None  # its weights taken once, here
        self._spans = SpanCache(self.vision.span_rows) if self.vision is not None else None
        self._max_pos = 1
        self._tables: dict[tuple, RopeTable] = {}
        self._wo_a: dict[int, tuple[Tensor, Tensor]] = {}
        self._prefetch: EngramPrefetch | None = None
        self.no_main = torch.empty(0, self.cfg.main_kv_entry_bytes, dtype=torch.uint8, device=self.device)

    # ---- one step ---------------------------------------------------------------------------------------------
    def reserve_positions(self, num_positions: int) -> None:
        """Build the RoPE tables for positions up to num_positions (e.g. max_model_len) when first used, so they
        never grow later (a growth syncs the host: not inside a CUDA graph)."""
        self._max_pos = max(self._max_pos, num_positions)

    @torch.inference_mode()
    def execute(self, out: StepPlan) -> StepLogits:
        return self.forward(out).logits

    @torch.inference_mode()
    def forward(self, out: StepPlan, taps: bool = False) -> ForwardState:
        """The step (execute's logits) and what speculative decoding needs besides (as the golden runner's
        _forward): with taps, the DSpark tap hiddens of the decoder rows [1, R, taps*D]; the compressor rows each
        verify chunk (num_draft > 0: a prefill-like chunk of anchor + drafts over its request's KV) saw."""
        self.kv.apply(out.copies)
        cfg, chunks = self.cfg, out.chunks
        if not chunks:
            return ForwardState(no_logits(cfg.vocab_size, self.device))
        step = self.prepare(out)
        ids = tensor_on([t for c in chunks for t in c.token_ids], self.device, torch.long)
        tapped: list[Tensor] | None = [] if taps else None
        image_rows = None if step.image_at is None else self._spans.stream_rows(chunks)
        h, pre_mix = self.run_layers(ids, step, None if step.hashes is None else step.hashes.to(self.device),
                                     image_rows, tapped)
        segs = step.dec_segs if cfg.ced_cut < cfg.n_layers else step.segs
        state = ForwardState(no_logits(cfg.vocab_size, self.device), torch.cat(tapped, -1)[None] if tapped else None,
                             segs, step.groups or {})
        head = head_rows(chunks, segs)
        if head.picks:
            sel = tensor_on(head.picks, self.device, torch.long)
            state.logits = split_logits(self.head(h[sel], pre_mix[sel]), head)
        return state

    def run_layers(self, ids: Tensor, step: Step, hashes: Tensor | None, image_rows: Tensor | None = None,
                   taps: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The embedding and every layer over the stream ids [T] (device work only, given `step`'s metadata):
        -> (h [T', hc, D], pre_mix fp32 [T', hc]) of the rows the last layer keeps. hashes: the Engram hash ids
        [T, layers, cols] on the device (None without Engram). image_rows bf16 [len(step.image_at), D]: the span rows
        that replace the embedding of rows step.image_at. taps: a list that gets each DSpark tap layer's input
        stream, mean over the copies (bf16 [rows, D]; spec 4.9), as the golden runner takes it."""
        model, cfg = self.model, self.cfg
        x = F.embedding(ids, model.embed.weight)  # [T, D]
        if image_rows is not None:
            x = x.index_copy(0, step.image_at, image_rows.to(x.dtype))
        h = x.unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [T, hc, D]
        pre_mix = torch.zeros(ids.numel(), cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre_mix[:, 0] = 1.0  # the first collapse takes copy 0
        prefetch, kept_rows = None, None  # Engram rows of every layer, gathered while layers run
        if hashes is not None:
            prefetch = self._engram_prefetch()
            prefetch.launch(hashes.contiguous())
        for i, layer in enumerate(model.layers):
            if layer.engram is not None:
                rows = prefetch.wait(layer.role.engram_index)
                h = OPS.engram(layer.engram, h, rows if kept_rows is None else rows[kept_rows],
                               step.is_image if kept_rows is None else step.dec_is_image)
            if taps is not None and layer.role.is_dspark_tap:
                taps.append(h.mean(dim=1))
            phase = step.phase(i, cfg.ced_cut)
            h, pre_mix = self.layer_forward(layer, h, pre_mix, step, phase)
            if phase.keep is not None:
                kept_rows = phase.keep
        return h, pre_mix

    def head(self, h: Tensor, pre_mix: Tensor, gather: bool = True) -> Tensor:
        """The final collapse + norm and the head: h [N, hc, D] -> fp32 logits [N, V] (gather False: this rank's
        vocabulary slice [N, V / shards])."""
        model = self.model
        return head_logits(OPS.hc_pre_norm(h, pre_mix, model.norm.weight, model.norm.eps), model.head, gather)

    def _engram_prefetch(self) -> EngramPrefetch:
        if self._prefetch is None:
            layers = [self.model.layers[i].engram.embed for i in self.cfg.engram_layer_ids]
            self._prefetch = EngramPrefetch([engram_table(e) for e in layers], self.device)
        return self._prefetch

    def prepare(self, out: StepPlan) -> Step:
        """Host work of a step: segments, decoder rows, Engram hashes, image-span rows."""
        chunks = out.chunks
        segs = segments(chunks)
        dec_segs, keep = decoder_rows(chunks, segs)
        hashes = None
        tables = getattr(self.model, "engram_tables", None)
        if tables is not None:
            ids = tensor_on([t for c in chunks for t in c.token_ids], self.device, torch.long)
            hashes = engram_hashes(tables, chunks, segs, ids)[0]  # [T, layers, cols]
        self._max_pos = max(self._max_pos, max(c.end for c in chunks))
        step = Step(chunks, segs, dec_segs, to_device(keep, self.device), hashes, [Shared() for _ in chunks],
                    groups={} if any(c.num_draft for c in chunks) else None)
        mask = stream_image_mask(chunks)
        if mask is not None and any(mask):  # else images only in a chunk's Engram look-back: the hashes hold them
            assert self._spans is not None, "image positions for a model without a vision tower (the engine refuses)"
            is_image = torch.tensor(mask)
            step.is_image, step.dec_is_image = to_device(is_image, self.device), to_device(is_image[keep], self.device)
            step.image_at = to_device(is_image.nonzero()[:, 0], self.device)
        return step

    # ---- one layer --------------------------------------------------------------------------------------------
    def layer_forward(self, layer: Block, h: Tensor, pre_mix: Tensor, step: Step | None, phase: Phase | None,
                      attend: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """h [N, hc, D], pre_mix fp32 [N, hc] -> (h [N', hc, D], the FFN sublayer's pre), as Block.forward.
        attend(x_normed bf16 [N, D]) -> [N, D]: an attention of the caller's instead of the step's over the pools
        (a DSpark stage's draft attention: engine/core/kernel_drafter.py; step and phase are then unused)."""
        c = self.cfg
        x = OPS.hc_pre_norm(h, pre_mix, layer.attn_norm.weight, layer.attn_norm.eps)
        resid = h if phase is None or phase.keep is None else h[phase.keep]
        # At decode (the CUDA mixes: N <= 8 on sm_90) both sublayers' mHC mixes run on a side stream with few CTAs
        # (beside=True), off the critical path of latency-bound kernels: the attention's beside the attention (they
        # read only the layer input), the FFN's beside the MoE (only the last hc_post needs them). The attention's
        # are forked just after the wkv | wq_a GEMV's launch (`after_first_gemv`): forked before it, their CTAs
        # slowed that GEMV 7 -> 14-18 us (a single-wave grid ends with its slowest SM), and every layer was 3-13 us
        # slower at T = 1. The FFN's position did not matter (before the gate, after the plan or after the experts'
        # up launch: equal; after the route: ~18 us slower; H200, benchmarks/RESULTS.md, seventh pass). Only there:
        # the CUDA mixes share one ticket buffer, and both calls are on the one side stream.
        beside = mixes_cuda_applies(resid, c.hc_mult)

        def mixes(stream: Tensor, fn: Tensor, scale: Tensor, base: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return OPS.hc_mixes(stream, fn, scale, base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps,
                                beside=beside)

        def attn_mixes() -> tuple[Tensor, Tensor, Tensor]:
            return mixes(resid, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base)

        forked: list[Forked] = []
        if attend is not None:
            if beside:
                forked.append(fork("mhc_mixes", h.device, attn_mixes))
            y = attend(x)
        else:
            y = self._attention(layer.attn, x, step, phase,
                                after_first_gemv=(lambda: forked.append(fork("mhc_mixes", h.device, attn_mixes)))
                                if beside else None)
        a_pre, a_post, a_comb = forked.pop().join() if beside else attn_mixes()
        # hc_post then hc_mixes: the fused hc_post_mixes was slower on the H200 (benchmarks/RESULTS.md)
        h = OPS.hc_post(y, resid, a_post, a_comb)

        def ffn_mixes() -> tuple[Tensor, Tensor, Tensor]:
            return mixes(h, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base)

        # the FFN collapses with the attention sublayer's pre (Block.forward)
        x = OPS.hc_pre_norm(h, a_pre, layer.ffn_norm.weight, layer.ffn_norm.eps)
        ffn_forked = fork("mhc_mixes", h.device, ffn_mixes) if beside else None
        y = OPS.moe(x, layer.ffn, None if phase is None else phase.is_image)  # a DSpark stage: no image rows
        f_pre, f_post, f_comb = ffn_forked.join() if beside else ffn_mixes()
        return OPS.hc_post(y, h, f_post, f_comb), f_pre

    def table_for(self, rope: RotaryTable) -> RopeTable:
        """The layer kind's rotation table (the golden's values), grown to the step's positions (a host sync
        only when it grows: outside graph capture)."""
        table = self._tables.get(rope.args)
        if table is None or table.length < self._max_pos + 1:
            table = rope_table(rope, self.device, 1 << max(self._max_pos, 1).bit_length())
            self._tables[rope.args] = table
        return table

    def _attention(self, attn: Attention, x: Tensor, step: Step, phase: Phase,
                   after_first_gemv: Callable[[], object] | None = None) -> Tensor:
        """x bf16 [R, D] normed rows of phase.segs_in -> attention output [R', D] for phase.segs_out.
        after_first_gemv (side work to start) is called once, just after the wkv (| wq_a) GEMV's launch."""
        kv, role = self.kv, attn.role
        layer = role.layer_id
        meta = self._meta(step, phase, role.ratio)
        table = self.table_for(attn.rope)
        # every row queries (decode): wkv and wq_a read the same x, as one launch over their stacked rows
        both = stacked_fp8(attn.wkv, attn.wq_a) if meta.q_rows is None else None
        qa = None
        if both is None:
            kv_rows = linear(attn.wkv, x)
        else:
            kv_q = linear(both, x)
            kv_rows, qa = kv_q[:, :attn.wkv.out_features].contiguous(), kv_q[:, attn.wkv.out_features:]
        if after_first_gemv is not None:
            after_first_gemv()
        OPS.store_window(kv_rows, attn.kv_norm.weight, attn.kv_norm.eps, meta.pos, table, kv.swa[layer],
                         meta.swa_write)
        if attn.compressor is not None:
            self._store_global(attn, x, meta, table, step.groups)
        if meta.qpos.numel() == 0:
            return x.new_zeros(0, x.size(-1))
        xq = x if meta.q_rows is None else x[meta.q_rows]
        if qa is None:
            qa = linear(attn.wq_a, xq)
        qr = OPS.rms_norm(qa, attn.q_norm.weight, attn.q_norm.eps)  # [M, q_lora]
        q = OPS.rope(linear(attn.wq_b, qr).unflatten(-1, (attn.n_local_heads, attn.head_dim)), meta.qpos, table)
        main_pool, main_idx = self.no_main, meta.swa_idx.new_empty(meta.qpos.numel(), 0)
        if role.ratio > 0:
            main_pool = kv.main_kv[role.kv_source]
            # every query row belongs to one request, whose topk_slots writes all its columns (-1 past its K)
            main_idx = torch.empty((meta.qpos.numel(), max((r.max_k for r in meta.requests), default=0)),
                                   dtype=torch.int32, device=x.device)
            for r in meta.requests:
                topk = self._topk(attn, xq[r.rows], qr[r.rows], meta.qpos[r.rows], r, step.shared[r.chunk], table)
                OPS.topk_slots(topk, r.entries, main_idx[r.rows])  # their slots, -1 = none
        o = OPS.sparse_attn(q, kv.swa[layer], meta.swa_idx, main_pool, main_idx, attn.attn_sink,
                            attn.head_dim ** -0.5)
        return self.attention_output(attn, o, meta.qpos, table)

    def _topk(self, attn: Attention, xq: Tensor, qr: Tensor, qpos: Tensor, r: RequestRows, shared: Shared,
              table: RopeTable) -> Tensor:
        """Top-k entry ids int [m, K] (-1 = none): from this layer's indexer, or its index source's."""
        role, ix = attn.role, attn.indexer
        if ix is None:
            topk = shared.topk[role.index_source]
            assert topk.size(0) == qpos.numel(), f"layer {role.layer_id}: index source rows differ from its queries"
            return topk
        if r.num_entries == 0:
            topk = torch.empty(qpos.numel(), 0, dtype=torch.long, device=xq.device)
        else:
            q = linear(ix.wq_b, qr).unflatten(-1, (ix.n_heads, ix.head_dim))
            q = OPS.rope_mxfp4_qdq(q, qpos, table)  # [m, H, ihd]: RoPE then MXFP4 QDQ, one launch
            w = linear(ix.weights_proj, xq) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)  # bf16 [m, H]
            w = w.contiguous()
            rows = score_rows(q.size(0), r.num_entries)
            parts, candidates = [], []
            for i in range(0, q.size(0), rows):  # at most SCORE_BYTES of scores at a time (long prompts)
                b = slice(i, i + rows)
                entries = r.entries if r.entries.dim() == 1 else r.entries[b]  # [m, E]: each row's own (decode)
                score = OPS.index_scores(q[b], w[b], self.kv.index_k[role.kv_source], entries, r.visible[b])
                if role.is_candidate_source:
                    candidates.append(OPS.candidate_blocks(score, r.visible[b], ix.cand_blocks, ix.cand_block))
                elif role.uses_candidates:
                    score = score.masked_fill(~shared.candidates[b], float("-inf"))
                parts.append(OPS.index_topk(score, min(ix.topk, r.num_entries)))
            if role.is_candidate_source:
                shared.candidates = candidates[0] if len(candidates) == 1 else torch.cat(candidates)
            topk = parts[0] if len(parts) == 1 else torch.cat(parts)
        shared.topk[role.layer_id] = topk
        return topk

    def _store_global(self, attn: Attention, x: Tensor, meta: AttnMeta, table: RopeTable,
                      groups: dict[tuple[int, int], CompressorRows] | None = None) -> None:
        """A KV source: compress the rows >= global_from of every chunk; store the completed groups' main
        KV and index keys (incomplete groups wait in their request's pending slot). groups (a step with verify
        chunks): gets each verify chunk's compressor rows, from its first group's start (the runner rolls the
        pending slot back from them; entries of groups past the accepted end are rewritten before any query reads
        them, as on the golden path: runner._store_global)."""
        kv, role, comp = self.kv, attn.role, attn.compressor
        source = role.kv_source
        if meta.writes is None:  # ratio > 2: per chunk, torch
            for g in meta.groups:
                latent = self._compress(comp, x[g.rows], g, source, groups)
                if latent is not None:
                    self._store_latent(attn, latent, g.entries, g.gpos, table, main=True)
            return
        w = meta.writes
        if w.rows.numel() == 0:
            return
        xr = x[w.rows]
        if comp.ratio == 1:
            latent = OPS.rms_norm(linear(comp.wkv, xr), comp.norm.weight, comp.norm.eps)
            self._store_latent(attn, latent, w.entries, w.gpos, table, main=True)
            return
        kv_rows, score_rows = mm_fp32(xr, comp.wkv.weight), mm_fp32(xr, comp.wgate.weight)  # fp32 [n, hd]
        if groups is not None and w.keep_all:
            groups[(-1, source)] = CompressorRows(0, kv_rows[None], score_rows[None])
        if groups is not None:
            for v in w.verify:  # before the launch, which overwrites the pending slot
                p = v.start % comp.ratio
                groups[(v.chunk, source)] = CompressorRows(
                    v.start - p, torch.cat([kv.pending_kv[source][v.slot, :p], kv_rows[v.row:v.row + v.n]])[None],
                    torch.cat([kv.pending_score[source][v.slot, :p], score_rows[v.row:v.row + v.n]])[None])
        latent = OPS.compress_ratio2(kv_rows, score_rows, kv.pending_kv[source], kv.pending_score[source], w.plan,
                                     comp.norm.weight, comp.norm.eps, kv.main_kv[source], w.entries, table)
        self._store_latent(attn, latent, w.entries, w.gpos, table, main=False)

    def _store_latent(self, attn: Attention, latent: Tensor, entries: Tensor, gpos: Tensor, table: RopeTable,
                      main: bool) -> None:
        """Pre-RoPE latents [G, hd] -> index keys (an index source) and, if `main`, main-KV records."""
        kv, source, ix = self.kv, attn.role.kv_source, attn.indexer
        if ix is not None and latent.size(0):
            OPS.store_index_keys(linear(ix.wk, latent), ix.k_norm.weight, ix.k_norm.eps, gpos, table,
                                 kv.index_k[source], entries)
        if main:
            OPS.store_main_kv(kv.main_kv[source], entries, latent, gpos, table)

    def _compress(self, comp: Compressor, x: Tensor, g: GroupWrite, source: int,
                  groups: dict[tuple[int, int], CompressorRows] | None = None) -> Tensor | None:
        """bf16 rows -> pre-RoPE latents bf16 [groups, hd] of the groups completed now (Compressor math in
        fp32 torch, any ratio > 1); a verify chunk's rows go into groups (see _store_global)."""
        r = comp.ratio
        kv, score = mm_fp32(x, comp.wkv.weight), mm_fp32(x, comp.wgate.weight)  # fp32 [n, hd]
        pend_kv, pend_score = self.kv.pending_kv[source][g.slot], self.kv.pending_score[source][g.slot]
        if g.pending:
            kv, score = torch.cat([pend_kv[:g.pending], kv]), torch.cat([pend_score[:g.pending], score])
        if groups is not None and g.verify:
            groups[(g.chunk, source)] = CompressorRows(g.first, kv[None], score[None])
        rest = kv.size(0) - g.complete
        if rest:
            pend_kv[:rest] = kv[g.complete:]
            pend_score[:rest] = score[g.complete:]
        if g.complete == 0:
            return None
        kv, score = kv[:g.complete].unflatten(0, (-1, r)), score[:g.complete].unflatten(0, (-1, r))
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)  # [G, hd]
        return rms_norm_torch(pooled.to(x.dtype), comp.norm.weight, comp.norm.eps)

    def attention_output(self, attn: Attention, o: Tensor, qpos: Tensor, table: RopeTable) -> Tensor:
        """Undo the K=V rotation, the grouped wo_a over the rank's groups (decode on CUDA: the FP8 weight read
        directly by fp8_gemv_grouped, bf16-exact products summed in fp32; else bf16 weights, fp32 accumulation),
        then wo_b (row-parallel over the groups' features)."""
        groups = attn.n_local_groups
        o = OPS.rope(o, qpos, table, inverse=True).view(o.size(0), groups, -1)
        wo_a = attn.wo_a
        if wo_a.fmt == "fp8" and o.is_contiguous() and grouped_gemv_applies(o, wo_a.weight, groups):
            o = fp8_gemv_grouped(o, wo_a.weight, wo_a.scale, groups, quant_x=False)
        else:
            w = self._wo_a.get(id(wo_a))
            if w is None or w[0] is not wo_a.weight:
                w = (wo_a.weight, wo_a.dequantized(torch.bfloat16).view(groups, attn.o_lora, -1))
                self._wo_a[id(wo_a)] = w
            if o.is_cuda:
                o = torch.einsum("mgd,grd->mgr", o, w[1])  # bf16 operands, fp32 accumulation (the reference)
            else:
                o = torch.einsum("mgd,grd->mgr", o.float(), w[1].float()).to(o.dtype)
        return row_parallel(attn.wo_b, o.flatten(1))

    # ---- metadata -------------------------------------------------------------------------------------------
    def _meta(self, step: Step, phase: Phase, ratio: int) -> AttnMeta:
        key = (id(phase.segs_in), id(phase.segs_out), phase.decoder, ratio)
        meta = step.meta.get(key)
        if meta is None:
            meta = step.meta[key] = self._build_meta(step.chunks, phase, ratio)
        return meta

    def _build_meta(self, chunks: list[ChunkPlan], phase: Phase, ratio: int) -> AttnMeta:
        cfg, layout, dev = self.cfg, self.kv.layout, self.device
        W, S = cfg.window_size, layout.swa_block_size
        per_block = layout.global_block_size // max(ratio, 1)
        empty = torch.empty(0, dtype=torch.long)
        cat = lambda ts: torch.cat(ts or [empty])  # noqa: E731
        pos = cat([torch.arange(s.start, s.end) for s in phase.segs_in])
        write = cat([paged.swa_slots(chunks[s.index].swa_blocks, s.start, s.end, S) for s in phase.segs_in])
        q_rows, qpos, swa_idx, requests, groups = [], [], [], [], []
        g_rows, g_entries, g_pos, r2_chunks, verify = [], [], [], [], []
        for si, so in zip(phase.segs_in, phase.segs_out):
            q_rows.append(torch.arange(si.offset + so.start - si.start, si.offset + si.rows))
            p = torch.arange(so.start, so.end)
            qpos.append(p)
            req = chunks[so.index]
            floor = max(req.decoder_floor if phase.decoder else req.swa_floor, 0)
            swa_idx.append(window_slots(req.swa_blocks, so.start, so.end, W, floor, S, dev))
            if ratio > 0 and so.rows:
                n = so.end // ratio
                entries = paged.entry_slots(req.global_blocks, 0, n, per_block)
                requests.append(RequestRows(so.index, slice(so.offset, so.offset + so.rows), n,
                                            to_device(entries, dev, torch.int32),
                                            to_device((p + 1) // ratio, dev, torch.int32), min(cfg.index_topk, n)))
            start = max(si.start, req.global_from)
            if ratio == 0 or start >= si.end:
                continue
            first, count = start // ratio, (si.end // ratio) - start // ratio  # groups completed now
            entries = paged.entry_slots(req.global_blocks, first, first + count, per_block)
            gpos = (first + torch.arange(count)) * ratio
            if ratio <= 2:
                if ratio == 2:
                    row = sum(r.numel() for r in g_rows)
                    r2_chunks.append(Ratio2Chunk(row, si.end - start, start, req.pending_slot))
                    if req.num_draft:
                        verify.append(VerifyRows(si.index, row, si.end - start, start, req.pending_slot))
                g_rows.append(torch.arange(si.offset + start - si.start, si.offset + si.rows))
                g_entries.append(entries)
                g_pos.append(gpos)
            else:
                pending = start % ratio
                groups.append(GroupWrite(slice(si.offset + start - si.start, si.offset + si.rows), pending,
                                         req.pending_slot, count * ratio, to_device(entries, dev), to_device(gpos, dev),
                                         req.num_draft > 0, si.index, start - pending))
        writes = None
        if 0 < ratio <= 2:
            writes = GlobalWrite(to_device(cat(g_rows), dev), to_device(cat(g_entries), dev),
                                 to_device(cat(g_pos), dev),
                                 plan_ratio2(r2_chunks, dev) if ratio == 2 else None, verify)
        q_rows = cat(q_rows)
        every_row = 0 < q_rows.numel() == pos.numel() and bool((q_rows == torch.arange(pos.numel())).all())
        swa = swa_idx[0] if len(swa_idx) == 1 else torch.cat(swa_idx or [torch.empty(0, W, dtype=torch.int32,
                                                                                       device=dev)])
        return AttnMeta(to_device(pos, dev), to_device(write, dev), None if every_row else to_device(q_rows, dev),
                        to_device(cat(qpos), dev), swa, requests, writes, groups)
