"""The golden DeepSeek-V4.1 text model (spec 4.1-4.8): the oracle every faster path is tested against.

One forward call processes tokens at positions start_pos.. for a static batch over a `ModelCache`:
a prefill (start_pos 0), one-token decode steps, or any chunk. Decoder SWA bounded replay (spec 4.8)
is a switch: on, a call with more than `window_size` tokens runs the decoder (layers >= the CED cut)
only on its last window of tokens, after the cut layer has written its KV for every token.

Numerics: the reference's storage formats and roundings (bf16 activations and caches, FP8/FP4 QDQ,
bf16 casts exactly where the reference casts), with every fp32 step of the reference (reductions,
GEMM accumulation, softmax, Sinkhorn, RoPE products) computed in float64 and rounded once. That is
the value an fp32 kernel approximates, independent of batch shape and device, so a prefill, a decode
step, a chunk and a CUDA run of the same position agree bit for bit except where a float64 result
falls on a rounding boundary. Top-k ties go to the lower index (`stable_topk`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.engram_tables import EngramTables, hash_ngrams, initial_history, next_history
from engine.model.block import Block
from engine.model.cache import ModelCache, StepShared
from engine.model.dspark import DSparkStage, DraftOutput, sample
from engine.model.layers import Embedding, ParallelHead, RMSNorm, register
from engine.model.mhc import hc_pre, identity_pre_mix
from engine.model.vision import Aligner, ViT, encode_image, span_layout
from engine.parallel import SINGLE, ShardSpec
from engine.vision.layout import ImageGrid


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # fp32 [B, R, vocab] (full_logits) or [B, vocab] (last position)
    main_hidden: torch.Tensor | None  # [B, R, taps*D] bf16: mean-over-copies inputs of the DSpark tap layers
    first_pos: int  # absolute position of row 0 of logits / main_hidden (R rows end at the last token)


class Transformer(nn.Module):
    """Attribute paths are the checkpoint's tensor names (embed, layers.N.*, norm, head, mtp.S.*; with a vision
    tower vision.*, aligner.*, image_start / image_end / image_newline).

    `shard`: this process's rank among the model's shards (engine/parallel.py); the layers hold their
    slices (layers.py's parallel classes, Attention's heads, MoE's experts) and everything else is whole."""

    def __init__(self, cfg: ModelConfig, engram_tables: EngramTables | None, with_mtp: bool = True,
                 shard: ShardSpec = SINGLE):
        super().__init__()
        self.cfg, self.engram_tables, self.shard = cfg, engram_tables, shard
        if cfg.engram_layer_ids and engram_tables is None:
            raise ValueError("this config has Engram layers: pass the EngramTables built from its tokenizer")
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, cfg.layer_role(i), shard=shard) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = ParallelHead(cfg.vocab_size, cfg.dim, shard)
        n_stages = cfg.n_mtp_layers if with_mtp else 0
        self.mtp = nn.ModuleList(DSparkStage(cfg, cfg.layer_role(cfg.n_layers + s), s, shard) for s in range(n_stages))
        if cfg.has_vision:  # whole on every rank (engine/model/vision.py)
            self.vision = ViT(cfg)
            self.aligner = Aligner(cfg)
            for name in ("image_start", "image_end", "image_newline"):  # the span delimiters' rows
                register(self, name, (cfg.dim,), torch.bfloat16)

    def new_cache(self, batch: int, max_seq_len: int, device: torch.device | str | None = None) -> ModelCache:
        device = device if device is not None else self.embed.weight.device
        cache = ModelCache.allocate(self.cfg, batch, max_seq_len, device)
        if self.engram_tables is not None:
            cache.engram_history = initial_history(self.engram_tables, batch, device)
        return cache

    @torch.inference_mode()
    def span_rows(self, patches: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        """One image's span in the LLM's stream, bf16 [grid.num_tokens, dim]: image_start, then per aligner
        row its n_llm_w tower rows and image_newline, then image_end (spec 4.10)."""
        if not self.cfg.has_vision:
            raise ValueError("this model has no vision tower")
        rows = encode_image(self.vision, self.aligner, patches, grid.n_vit_h, grid.n_vit_w)  # [n_llm_h*n_llm_w, D]
        return span_layout(rows, grid, self.image_start, self.image_newline, self.image_end)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start_pos: int, cache: ModelCache, *, bounded_replay: bool = False,
                full_logits: bool = False, swa_floor: int = 0, global_from: int | None = None,
                image_mask: torch.Tensor | None = None, image_rows: torch.Tensor | None = None) -> ForwardOutput:
        """input_ids [B,S] at positions start_pos.. (must equal cache.seq_len).

        Images (spec 4.10): image_mask bool [B,S] marks the image-span positions, image_rows bf16 [N,D] (N =
        image_mask.sum(), row-major order; `span_rows` gives a whole span's) overwrite their embedding rows;
        those positions take no part in Engram's n-grams (DEAD) and get its gate 0, and route with bias_vl.

        Encoder SWA bounded replay (spec 4.8, a prefix-cache hit at h without its SWA state) is the call
        with start_pos = swa_floor = h - window and global_from = h: every layer's queries see window KV
        at positions >= swa_floor only, and rows below global_from write no global KV (main KV, index
        keys, compressor state): the cache already holds it."""
        cfg = self.cfg
        B, S = input_ids.shape
        if start_pos != cache.seq_len:
            raise ValueError(f"start_pos {start_pos} != cache.seq_len {cache.seq_len}: steps must be contiguous")
        global_from = start_pos if global_from is None else global_from
        if not start_pos <= global_from < start_pos + S:
            raise ValueError(f"global_from {global_from} must lie in this call's positions {start_pos}..{start_pos + S - 1}")
        if start_pos + S > cache.max_seq_len:
            raise ValueError(f"positions up to {start_pos + S} exceed the cache's max_seq_len {cache.max_seq_len}")
        hashes = None
        text_mask = None if image_mask is None else ~image_mask  # Engram's token_mask: False in image spans
        if self.engram_tables is not None:
            hashes = hash_ngrams(self.engram_tables, input_ids, cache.engram_history, start_pos, text_mask)
            cache.engram_history = next_history(self.engram_tables, cache.engram_history, input_ids, text_mask)
        x = self.embed(input_ids)  # [B,S,D]
        if image_mask is not None:
            assert image_rows is not None and image_rows.size(0) == int(image_mask.sum()), "one row per image position"
            x[image_mask] = image_rows.to(x.dtype)
        h = x.unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [B,S,hc,D]
        pre_mix = identity_pre_mix(B, S, cfg.hc_mult, h.device)
        shared = StepShared()
        replay = bounded_replay and S > cfg.window_size
        row_pos = start_pos  # absolute position of h's row 0
        floor = swa_floor
        taps = []
        for i, layer in enumerate(self.layers):
            mask = None if image_mask is None else image_mask[:, -h.size(1):]  # the rows h still holds
            if layer.engram is not None:
                h = layer.engram(h, hashes[:, -h.size(1):, layer.role.engram_index], None if mask is None else ~mask)
            if layer.role.is_dspark_tap:
                taps.append(h.mean(dim=2))
            q_from = 0
            if replay and i == cfg.ced_cut:
                q_from, floor = S - cfg.window_size, max(swa_floor, start_pos + S - cfg.window_size)
            attend = (lambda x, l=layer, p=row_pos, q=q_from, f=floor:
                      l.attn(x, p, cache, shared, q_from=q, window_floor=f, global_from=global_from))
            h, pre_mix = layer(h, pre_mix, attend, q_from, mask)
            row_pos += q_from
        x = self.norm(hc_pre(h, pre_mix))  # final collapse with the last block's FFN pre (no hc_head in V4.1)
        logits = self.head(x if full_logits else x[:, -1])
        main_hidden = torch.cat([t[:, -h.size(1):] for t in taps], dim=-1) if taps else None
        cache.seq_len = start_pos + S
        return ForwardOutput(logits, main_hidden, row_pos)

    # ---- DSpark drafting (spec 4.9; verification belongs to the engine) --------------------------
    @torch.inference_mode()
    def dspark_observe(self, main_hidden: torch.Tensor, first_pos: int, cache: ModelCache) -> None:
        """Write context KV for positions first_pos.. (from the target's tap hiddens) into every stage."""
        main_x = self.mtp[0].main_x(main_hidden)
        for stage in self.mtp:
            stage.observe(main_x, first_pos, cache)
        cache.dspark_len = first_pos + main_hidden.size(1)

    @torch.inference_mode()
    def dspark_draft(self, anchor_ids: torch.Tensor, cache: ModelCache, temperature: float = 0.0,
                     generator: torch.Generator | None = None) -> DraftOutput:
        """anchor_ids [B]: the token sampled at position P+1 after the target processed P = dspark_len-1.
        Returns [anchor, d1..d_block] for positions P+1..P+1+block, the draft logits and confidences."""
        P = cache.dspark_len - 1
        if P < 0:
            raise ValueError("dspark_draft needs context: call dspark_observe first")
        x = self.dspark_hidden(anchor_ids, lambda stage, h: stage.attn.draft(h, P, cache))
        return self.dspark_propose(x, anchor_ids, lambda i, logits: sample(logits, temperature, generator))

    def dspark_hidden(self, anchor_ids: torch.Tensor,
                      attend: Callable[[DSparkStage, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """anchor_ids [B] -> x [B, block, D]: the draft block [anchor, noise, ...] through every stage, collapsed
        (hc_pre with the last pre_mix). attend(stage, x_normed [B,block,D]) -> [B,block,D] is a stage's attention
        over its context KV (the static cache's, or the engine's paged pools)."""
        cfg = self.cfg
        ids = anchor_ids.new_full((anchor_ids.size(0), cfg.dspark_block_size), cfg.dspark_noise_token_id)
        ids[:, 0] = anchor_ids
        X = self.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
        pre_mix = identity_pre_mix(X.size(0), X.size(1), cfg.hc_mult, X.device)
        for stage in self.mtp:
            X, pre_mix = stage(X, pre_mix, lambda h, s=stage: attend(s, h))
        return hc_pre(X, pre_mix)

    def dspark_propose(self, x: torch.Tensor, anchor_ids: torch.Tensor, pick: Callable[[int, torch.Tensor], torch.Tensor],
                       num_tokens: int | None = None) -> DraftOutput:
        """x [B, block, D] (dspark_hidden) -> num_tokens (default the block) drafted tokens by the sequential Markov
        correction: row i's logits are the base logits plus the bigram of token i, and pick(i, logits_i fp32 [B, V])
        -> [B] draws token i+1. Also the confidences of those rows."""
        n = self.cfg.dspark_block_size if num_tokens is None else num_tokens
        assert 0 < n <= self.cfg.dspark_block_size, f"{n} draft tokens from a block of {self.cfg.dspark_block_size}"
        x = x[:, :n]
        last = self.mtp[-1]
        logits = self.head(last.norm(x))  # [B,n,V] fp32
        out = anchor_ids.new_empty(anchor_ids.size(0), n + 1)
        out[:, 0] = anchor_ids
        markov = []
        for i in range(n):  # sequential rank-r bigram correction
            e = last.markov_head.embed(out[:, i])  # [B,r] bf16
            logits[:, i] += last.markov_head.head(e)
            markov.append(e)
            out[:, i + 1] = pick(i, logits[:, i])
        confidence = last.confidence_head.proj(torch.cat([x, torch.stack(markov, dim=1)], dim=-1)).squeeze(-1)
        return DraftOutput(out, logits, confidence)
