"""Static per-batch state of the golden model: what a request owns between steps (spec 4.7).

Storage is position-indexed (no ring): `swa[l][:, p]` is layer l's window KV of position p, so prefill,
decode, chunked prefill and multi-token steps all read the same way. Values are the reference's QDQ
bf16 (FP8 SWA, FP4 main KV, MXFP4 index keys), bit-equivalent to the packed formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig


@dataclass(slots=True)
class SourceCache:
    """Global KV of one KV-source layer: entry j covers tokens j*ratio .. j*ratio+ratio-1."""

    main_kv: torch.Tensor  # [B, max_entries, head_dim] bf16, post-RoPE FP4 QDQ
    index_k: torch.Tensor  # [B, max_entries, index_head_dim] bf16, post-RoPE MXFP4 QDQ
    pending_kv: torch.Tensor | None  # [B, ratio, head_dim] fp32: tokens of the incomplete group
    pending_score: torch.Tensor | None


@dataclass(slots=True)
class ModelCache:
    batch: int
    max_seq_len: int
    swa: list[torch.Tensor]  # per layer incl. DSpark stages: [B, max_seq_len, head_dim] bf16
    sources: dict[int, SourceCache]
    engram_history: torch.Tensor  # [B, max_ngram-1] int64 compressed ids of the last tokens
    seq_len: int = 0  # positions written so far (the next step's start_pos)
    dspark_len: int = 0  # context positions written into the DSpark stages' window KV

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_seq_len: int, device: torch.device | str) -> "ModelCache":
        def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        swa = [zeros(batch, max_seq_len, cfg.head_dim) for _ in range(cfg.n_total_layers)]
        sources = {}
        for s in cfg.kv_source_layers:
            r = cfg.compress_ratios[s]
            entries = max_seq_len // r + 1
            pending = (zeros(batch, r, cfg.head_dim, dtype=torch.float32), zeros(batch, r, cfg.head_dim, dtype=torch.float32)) if r > 1 else (None, None)
            sources[s] = SourceCache(zeros(batch, entries, cfg.head_dim), zeros(batch, entries, cfg.index_head_dim), *pending)
        history = torch.empty((batch, 0), dtype=torch.long, device=device)  # set from the Engram tables by the model
        return cls(batch, max_seq_len, swa, sources, history)


@dataclass(slots=True)
class StepShared:
    """Handed down the stack within one forward: published by sources, read by the layers after them."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [B, M, K] entry ids (-1 = none)
    candidates: torch.Tensor | None = None  # [B, M, T] bool from the candidate source
