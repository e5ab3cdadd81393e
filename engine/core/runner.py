"""The batched model runner: the golden model's layers over a flat stream of every scheduled chunk's
positions (prefills and decodes of different lengths in one step), reading and writing the paged pools.

Per-position math (embedding, Engram, mHC, norms, projections, MoE, head) runs on the whole stream at
once through the golden modules, so a request's numbers do not depend on what shares its batch. The
per-request parts (window and global KV writes, compressor groups, indexer, sparse attention) loop over
chunks and call `engine.kernels` by name. Decoder bounded replay drops a chunk's rows below its
request's `decoder_from` at the CED cut layer, which still writes KV for all of them.

Images: a chunk that overlaps an image span (plan.images) runs the vision tower for that image (its span rows
are kept for the next few chunks, so a prefill chunked across a span encodes it once: engine/core/image_spans.py)
and its span rows overwrite those positions' embedding rows; they route with bias_vl and are DEAD to Engram
(spec 4.10). The kernel path does the same with its bf16 tower (engine/core/kernel_vision.py).

On CUDA (or with kernels=True) the step runs instead through engine/core/kernel_layers.py: the same
plan and logits, with Triton kernels and fp32 torch ops reading the paged pools in place.

Speculative decoding (the pools hold DSpark context, CacheLayout.num_dspark_layers > 0; either path): a step
drafts for its verify chunks first (engine/core/drafter.py), computes every chunk with the drafts as tokens (on the
kernel path a verify chunk is a short prefill-like chunk over the request's KV, run eagerly: KernelRunner.forward;
the decode step's graphs are off while speculating, as every step writes DSpark context; a step of greedy verify chunks
only runs instead as the verify step on device buffers, its CUDA graphs when captured: engine/core/verify_step.py), lets
engine/core/speculative.py accept or reject them from the verify rows, rolls back the compressor's pending group
to the accepted end, and writes the DSpark context KV of every kept position. Over N shards every rank drafts
from its own slices of the DSpark stages and its own pools and verifies the same tokens (the draft and target logits
are gathered, the noise keyed), which each step checks (_check_lockstep).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.core.drafter import Draft, DraftRequest, Drafter, DSparkDrafter, DSparkStages, GoldenDSpark
from engine.core.engine_config import EngineConfigError
from engine.core.image_spans import SpanCache, image_patches, stream_image_mask
from engine.core.kv_cache import PagedKVCache
from engine.core.plan import ChunkPlan, StepPlan
from engine.core.sampler import SampleOutput, sample_specs
from engine.core.speculative import Verified, verify, verify_lengths
from engine.core.split_step import merge_outputs, split_decodes
from engine.core.step_rows import (CompressorRows, ForwardState, Segment, StepOutput, decoder_rows, engram_hashes,
                                   head_rows, no_logits, sample_step, segments, split_logits)
from engine.kernels import paged
from engine.model.attention import Attention, sparse_attn, window_indices
from engine.model.cache import SourceCache, StepShared
from engine.model.mhc import hc_pre, identity_pre_mix
from engine.model.transformer import Transformer
from engine.parallel import ranks_differing
from engine.vision.inputs import ImageInput

if TYPE_CHECKING:
    from engine.core.decode_step import PendingDraw, PendingForward
    from engine.core.engine_config import DecodeOptions



class ModelRunner:
    """kernels: True runs the kernel path (engine/core/kernel_layers.py: Triton kernels and fp32 torch
    on the device), False the golden modules (float64, exact); None (default) picks the kernels when
    the model is on CUDA. Both take the same plan and return the same logits, up to fp32 rounding.
    drafter: what proposes the verify chunks' drafts (default: the model's DSpark stages, made on first use)."""

    def __init__(self, model: Transformer, kv: PagedKVCache, kernels: bool | None = None,
                 decode: "DecodeOptions | None" = None, drafter: Drafter | None = None):
        self.model, self.kv, self.cfg = model, kv, model.cfg
        self.device = model.embed.weight.device
        self.kernels = self.device.type == "cuda" if kernels is None else kernels
        self.drafter = drafter
        self._kernel_path = None
        self._spans = SpanCache(self._golden_spans)  # the golden path's span rows by image key
        self.decode = None  # the kernel path's decode step on device buffers (engine/core/decode_step.py)
        self.verify = None  # ... and its verify step, speculating (engine/core/verify_step.py)
        self.draft_step = None  # ... and its greedy drafts on device buffers (engine/core/draft_step.py)
        self.dspark: DSparkStages | None = None  # the DSpark stages' math on this path (speculative decoding)
        if kv.dspark_swa:
            if len(model.mtp) != len(kv.dspark_swa):
                raise EngineConfigError(f"speculative decoding needs the checkpoint's DSpark stages: "
                                        f"{len(model.mtp)} loaded, {len(kv.dspark_swa)} expected")
            taps, cut = self.cfg.dspark_target_layer_ids, self.cfg.ced_cut
            assert cut >= self.cfg.n_layers or min(taps) > cut, f"DSpark taps {taps} must follow the CED cut {cut}"
        if self.kernels:
            from engine.core.kernel_layers import KernelRunner  # imports Triton: only on the kernel path

            self._kernel_path = KernelRunner(model, kv)
            if decode is not None and not kv.dspark_swa:  # speculating, every step writes DSpark context: eager
                from engine.core.decode_step import DecodeStep

                self._kernel_path.reserve_positions(decode.max_model_len)
                self.decode = DecodeStep(self._kernel_path, decode)
        if kv.dspark_swa:
            if self._kernel_path is not None:
                from engine.core.kernel_drafter import KernelDSpark

                self.dspark = KernelDSpark(self._kernel_path)
                if decode is not None and decode.max_draft > 0:
                    from engine.core.draft_step import DraftStep
                    from engine.core.verify_step import VerifyStep

                    self._kernel_path.reserve_positions(decode.max_model_len)
                    self.verify = VerifyStep(self._kernel_path, decode, self.dspark)
                    self.draft_step = DraftStep(self.dspark, decode)
            else:
                self.dspark = GoldenDSpark(model, kv)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Runs one step and draws its tokens beside the model (plan.samples); the chunks that keep their
        logits get them too. A decode step on the kernel path runs on device buffers (its CUDA graphs when
        captured) and draws there; so do a mixed step's decode chunks, its other chunks running eagerly after
        them (engine/core/split_step.py)."""
        if self.decode is not None and self.decode.takes(plan):
            self.kv.apply(plan.copies)
            return self.decode.execute(plan)
        if not self.kv.dspark_swa:
            split = None
            if self.decode is not None and self.decode.options.split_mixed:
                split = split_decodes(plan, self.decode.takes)
            if split is None:
                return sample_step(plan, self.forward(plan))
            self.kv.apply(split.decode.copies)
            decodes = self.decode.launch(split.decode)  # the graphs run while the host stages the eager rest
            rest = sample_step(split.rest, self.forward(split.rest))
            return merge_outputs(split, decodes.result(), rest)
        return self._speculative_step(plan)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> "PendingDraw | None":
        """A decode step launched without waiting for its tokens (PendingDraw.result), or None where the step
        cannot run that way (then `execute` it)."""
        if self.decode is None or not self.decode.takes(plan):
            return None
        self.kv.apply(plan.copies)
        return self.decode.launch(plan)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan) -> "PendingForward | None":
        """launch without the draw: a decode step's forward launched, its draw waiting for PendingForward.draw(masks)
        (the plan's own masks are not read), or None where the step cannot run that way."""
        if self.decode is None or not self.decode.takes(plan):
            return None
        self.kv.apply(plan.copies)
        return self.decode.launch_forward(plan)

    @torch.inference_mode()
    def forward(self, out: StepPlan) -> StepLogits:
        """Runs one step's model forward: logits of the sampled chunks' last positions, and of every decoder
        row of chunks whose request keeps its logits (or that verify drafts)."""
        assert out.from_rows is None or all(r < 0 for r in out.from_rows), "tokens still on the device: decode step only"
        if self._kernel_path is not None:
            return self._kernel_path.execute(out)
        return self._forward(out).logits

    def _forward_state(self, plan: StepPlan) -> ForwardState:
        """The step's forward with its tap hiddens and the verify chunks' compressor rows, on either path."""
        if self._kernel_path is None:
            return self._forward(plan)
        return self._kernel_path.forward(plan, taps=True)

    # ---- speculative decoding ---------------------------------------------------------------------------
    def _speculative_step(self, plan: StepPlan) -> StepOutput:
        """Draft, forward, verify, roll back what rejected drafts touched, store the kept positions' context."""
        on_device = self.verify is not None and self.verify.takes(plan)
        plan, drafts = self._draft(plan)
        if on_device:  # the verify step on device buffers (its graphs)
            self.kv.apply(plan.copies)
            verified = self.verify.execute(plan, drafts)
            self._check_lockstep(drafts, verified)
            return StepOutput(SampleOutput([], [], []), {}, verified)
        state = self._forward_state(plan)
        rows = state.logits.rows
        verified = verify([rows[v.chunk][1] for v in plan.verifies], plan.verifies, [d.token_ids for d in drafts],
                          [d.q for d in drafts])
        self._check_lockstep(drafts, verified)
        ends = {v.chunk: plan.chunks[v.chunk].start + len(r.token_ids) for v, r in zip(plan.verifies, verified)}
        self._roll_back_pending(plan, state.groups, ends)
        if state.main_hidden is not None:
            self.dspark.write_context(state.main_hidden, state.segs, plan.chunks, ends)
        kept = {i: (first, r[:ends[i] - first] if i in ends else r) for i, (first, r) in rows.items()
                if plan.chunks[i].keep_logits}
        return StepOutput(sample_specs(state.logits.sample, plan.samples), kept, verified)

    def _draft(self, plan: StepPlan) -> tuple[StepPlan, list[Draft]]:
        """The verify chunks' drafts, as many of each as the plan's DraftPolicy keeps, written into their chunks
        (token_ids = anchor + drafts, end = start + 1 + drafts; num_draft stays the room the scheduler made)."""
        if not plan.verifies:
            return plan, []
        if self.drafter is None:
            self.drafter = DSparkDrafter(self.model, self.kv, self.dspark, self.draft_step)
        requests = []
        for v in plan.verifies:
            c = plan.chunks[v.chunk]
            assert c.num_draft > 0 and len(c.token_ids) == 1, f"chunk {v.chunk} is not a verify chunk"
            requests.append(DraftRequest(c.token_ids[0], c.start, c.prev_ids, c.num_draft, c.swa_blocks, v.params,
                                         v.seed, v.step))
        drafts = self.drafter.propose(requests)
        lengths = verify_lengths([d.confidence for d in drafts], plan.draft_policy)
        drafts = [d.prefix(k) for d, k in zip(drafts, lengths)]
        chunks = list(plan.chunks)
        for v, d in zip(plan.verifies, drafts):
            c = chunks[v.chunk]
            chunks[v.chunk] = replace(c, end=c.start + 1 + len(d.token_ids), token_ids=c.token_ids + d.token_ids)
        return replace(plan, chunks=chunks), drafts

    def _check_lockstep(self, drafts: list[Draft], verified: list[Verified]) -> None:
        """Sharded: every rank must have drafted and kept the same tokens. They are drawn from gathered logits and
        keyed noise, so they are; a rank that differed would store other KV than rank 0's without a sound, so each
        speculative step checks it (one all-gather of a digest) and raises, failing the group."""
        tokens = repr([(d.token_ids, v.token_ids) for d, v in zip(drafts, verified)]).encode()
        differ = ranks_differing(tokens, self.model.shard, self.device)
        if differ:
            raise RuntimeError(f"speculative decoding out of lockstep: ranks {differ} drafted or accepted other tokens "
                               f"than rank 0")

    def _roll_back_pending(self, plan: StepPlan, groups: dict[tuple[int, int], CompressorRows],
                           ends: dict[int, int]) -> None:
        """A ratio-r source's pending slot must hold the incomplete group below the accepted end e (positions
        e - e % r .. e - 1), which the verify overwrote when it computed past e: written back from the rows the
        compressor saw. Completed groups' main KV and index keys need no rollback (see _store_global)."""
        for (index, source), rows in groups.items():
            end = ends[index]
            rest = end % self.cfg.compress_ratios[source]
            if rest == 0:
                continue
            slot, lo = plan.chunks[index].pending_slot, end - rest - rows.first  # >= 0: the rows start at a group
            self.kv.pending_kv[source][slot, :rest] = rows.kv[0, lo:lo + rest]
            self.kv.pending_score[source][slot, :rest] = rows.score[0, lo:lo + rest]

    def _forward(self, out: StepPlan) -> ForwardState:
        """The golden forward over the paged pools (see forward), with its tap hiddens when the pools hold DSpark
        context and the compressor rows of verify chunks."""
        self.kv.apply(out.copies)
        model, cfg, chunks = self.model, self.cfg, out.chunks
        if not chunks:
            return ForwardState(no_logits(cfg.vocab_size, self.device))
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        segs = segments(chunks)
        hashes = engram_hashes(model.engram_tables, chunks, segs, ids)
        rows = torch.arange(ids.numel(), device=self.device)  # stream row -> original row
        x = model.embed(ids)  # [T,D]
        is_image = None  # bool [T]: image-span rows
        mask = stream_image_mask(chunks)
        if mask is not None:
            is_image = torch.tensor(mask, device=self.device)
            if any(mask):  # a chunk may carry an image only for its Engram look-back (decode after it)
                x[is_image] = self._spans.stream_rows(chunks)
        h = x.view(1, -1, cfg.dim).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [1,T,hc,D]
        pre_mix = identity_pre_mix(1, ids.numel(), cfg.hc_mult, self.device)
        shared = [StepShared() for _ in chunks]
        state = ForwardState(no_logits(cfg.vocab_size, self.device))
        taps = []
        for i, layer in enumerate(model.layers):
            mask = None if is_image is None else is_image[rows].view(1, -1)  # the rows h holds
            if layer.engram is not None:
                h = layer.engram(h, hashes[:, rows, layer.role.engram_index], None if mask is None else ~mask)
            if self.kv.dspark_swa and layer.role.is_dspark_tap:
                taps.append(h.mean(dim=2))  # [1,R,D]: the layer's input stream, mean over copies (spec 4.9)
            keep, out_segs = None, segs
            if i == cfg.ced_cut:
                out_segs, keep = decoder_rows(chunks, segs)
                keep = keep.to(self.device)
            decoder = i >= cfg.ced_cut
            attend = (lambda x, a=layer.attn, si=segs, so=out_segs, d=decoder:
                      self._attention(a, x, chunks, si, so, shared, d, state.groups))
            h, pre_mix = layer(h, pre_mix, attend, 0 if keep is None else keep, mask)
            if keep is not None:
                rows, segs = rows[keep], out_segs
        state.segs = segs
        state.main_hidden = torch.cat(taps, dim=-1) if taps else None
        head = head_rows(chunks, segs)
        if head.picks:
            sel = torch.tensor(head.picks, device=self.device)
            logits = model.head(model.norm(hc_pre(h[:, sel], pre_mix[:, sel])))[0]  # fp32 [len(picks), V]
            state.logits = split_logits(logits, head)
        return state

    # ---- pieces -------------------------------------------------------------------------------------
    def _golden_spans(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The golden tower's span rows of each image, one at a time (SpanCache's encoder)."""
        return [self.model.span_rows(image_patches(im).to(self.device), im.grid) for im in images]

    def _attention(self, attn: Attention, x: torch.Tensor, chunks, segs_in: list[Segment], segs_out: list[Segment],
                   shared: list[StepShared], decoder: bool,
                   groups: dict[tuple[int, int], CompressorRows]) -> torch.Tensor:
        """x [1,R,D] normed rows of segs_in -> attention output [1,R',D] for the rows of segs_out."""
        kv, role, W = self.kv, attn.role, self.cfg.window_size
        layer = role.layer_id
        # window KV: every row's is written before any query reads, so a rejected draft's entry (at a position
        # >= its request's num_computed) is rewritten by the step that computes that position before it is read
        pos = torch.cat([torch.arange(s.start, s.end) for s in segs_in]).to(x.device)
        slots = torch.cat([paged.swa_slots(chunks[s.index].swa_blocks, s.start, s.end, kv.layout.swa_block_size)
                           for s in segs_in]).to(x.device)
        paged.store_swa(kv.swa[layer], slots, attn.window_kv_unquantized(x, pos)[0])
        if attn.compressor is not None:
            for si in segs_in:
                self._store_global(attn, x[:, si.offset:si.offset + si.rows], si, chunks[si.index], groups)
        qpos = torch.cat([torch.arange(s.start, s.end) for s in segs_out]).to(x.device)
        if qpos.numel() == 0:
            return x.new_zeros(1, 0, x.size(-1))
        q_rows = torch.cat([torch.arange(si.offset + so.start - si.start, si.offset + si.rows)
                            for si, so in zip(segs_in, segs_out)]).to(x.device)
        xq = x[:, q_rows]
        qr, q = attn.queries(xq, qpos)
        outs = []
        for so in segs_out:
            if so.rows == 0:
                continue
            req = chunks[so.index]
            floor = req.decoder_floor if decoder else req.swa_floor
            qsl = slice(so.offset, so.offset + so.rows)
            lo = max(floor, so.start - W + 1, 0)
            win = paged.gather_swa(kv.swa[layer], paged.swa_slots(req.swa_blocks, lo, so.end, kv.layout.swa_block_size),
                                   self.cfg.head_dim).unsqueeze(0)  # [1, end-lo, hd]
            idx = window_indices(qpos[qsl], W, floor)
            idx = torch.where(idx >= 0, idx - lo, -1).unsqueeze(0)
            rows = win
            if role.ratio > 0:
                main, topk = self._select(attn, xq[:, qsl], qr[:, qsl], qpos[qsl], so.end, req, shared[so.index])
                rows = torch.cat([win, main], dim=1)
                idx = torch.cat([idx, torch.where(topk >= 0, topk + win.size(1), -1)], dim=-1)
            outs.append(sparse_attn(q[:, qsl], rows, attn.attn_sink, idx, attn.head_dim ** -0.5))
        return attn.output(torch.cat(outs, dim=1), qpos)

    def _store_global(self, attn: Attention, x: torch.Tensor, seg: Segment, req: ChunkPlan,
                      groups: dict[tuple[int, int], CompressorRows]) -> None:
        """A KV source: compress this chunk's positions >= global_from and store the completed groups'
        main KV and index keys (the incomplete group waits in the request's pending slot).

        A verify chunk writes entries of groups that end past its accepted positions too. Invariant that makes
        them harmless: entries of groups ending at or past a request's num_computed are never read before the
        step that computes that group's last position rewrites them (a step writes its positions' entries before
        its queries read entries below its end). Only the pending slot carries state into the next step: a
        verify chunk's compressor rows are kept (groups) so it can be rolled back."""
        kv, role = self.kv, attn.role
        ratio, source = role.ratio, role.kv_source
        start = max(seg.start, req.global_from)
        if start >= seg.end:
            return
        if ratio > 1:
            slot = req.pending_slot
            src = SourceCache(None, None, kv.pending_kv[source][slot:slot + 1], kv.pending_score[source][slot:slot + 1])
            kv_rows, score_rows = attn.compressor.group_rows(x[:, start - seg.start:], start, src)
            if req.num_draft:
                groups[(seg.index, source)] = CompressorRows(start - start % ratio, kv_rows, score_rows)
            latent = attn.compressor.pool(kv_rows, score_rows, src, x.dtype)
        else:
            latent = attn.compressor(x[:, start - seg.start:], start, SourceCache(None, None, None, None))
        if latent is None:
            return
        first = start // ratio
        entries = paged.entry_slots(req.global_blocks, first, first + latent.size(1), kv.layout.global_block_size // ratio)
        if attn.indexer is not None:
            paged.store_index_k(kv.index_k[source], entries, attn.indexer.index_keys(latent, first, attn.rope)[0])
        paged.store_main_kv(kv.main_kv[source], entries, attn.rotate_latent(latent, first)[0])

    def _select(self, attn: Attention, xq: torch.Tensor, qr: torch.Tensor, qpos: torch.Tensor, end: int, req: ChunkPlan,
                shared: StepShared) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's main KV [1,E,hd] (E = entries visible at `end`) and the top-k entry ids [1,M,K]
        of its queries: from this layer's indexer, or published by its index source this step."""
        kv, role, cfg = self.kv, attn.role, self.cfg
        ratio, source = role.ratio, role.kv_source
        entries = paged.entry_slots(req.global_blocks, 0, end // ratio, kv.layout.global_block_size // ratio)
        main = paged.gather_main_kv(kv.main_kv[source], entries, cfg.head_dim).unsqueeze(0)
        if attn.indexer is not None:
            index_k = paged.gather_index_k(kv.index_k[source], entries, cfg.index_head_dim).unsqueeze(0)
            topk = attn.indexer(xq, qr, qpos, end, attn.rope, SourceCache(main, index_k, None, None), shared)
            shared.topk[role.layer_id] = topk
        else:
            topk = shared.topk[role.index_source]
            assert topk.size(1) == qpos.numel(), f"layer {role.layer_id}: index source rows differ from its queries"
        return main, topk

