"""The paged device pools behind the cache manager's block ids (spec 4.7), in packed record formats.

- swa[layer]: uint8 [num_swa_blocks, swa_block_size, 528]: FP8 window KV of every layer.
- dspark_swa[stage] (speculative decoding): the same records, the DSpark stages' context KV (spec 4.9: from the
  target's tap hiddens), in the same window blocks.
- main_kv[source]: uint8 [num_global_blocks, global_block_size / ratio, 288]: FP4 main KV.
- index_k[source]: uint8 [num_global_blocks, global_block_size / ratio, 68]: MXFP4 index keys.
- pending_kv / pending_score[source] (ratio > 1): fp32 [num_pending_slots, ratio, head_dim].

`size_layout` turns a memory budget into block counts: window blocks for every sequence slot (plus
one step's chunk), the rest global blocks.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.core.cache_manager import CacheLayout, CopyOp
from engine.kernels.cache_records import fp4_record_bytes, swa_record_bytes

DEFAULT_GLOBAL_BLOCK = 64
DEFAULT_SWA_BLOCK = 16


def global_bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
    """Main KV + index keys of every KV source for block_size positions (890 B/token on the real config)."""
    per_entry = fp4_record_bytes(cfg.head_dim, 16) + fp4_record_bytes(cfg.index_head_dim, 32)
    return sum(block_size // cfg.compress_ratios[s] * per_entry for s in cfg.kv_source_layers)


def swa_bytes_per_block(cfg: ModelConfig, block_size: int, num_dspark_layers: int = 0) -> int:
    return (cfg.n_layers + num_dspark_layers) * block_size * swa_record_bytes(cfg.head_dim)


def pending_bytes_per_slot(cfg: ModelConfig) -> int:
    return sum(2 * cfg.compress_ratios[s] * cfg.head_dim * 4 for s in cfg.kv_source_layers if cfg.compress_ratios[s] > 1)


def size_layout(cfg: ModelConfig, memory_bytes: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                max_snapshots: int = 8, global_block_size: int = DEFAULT_GLOBAL_BLOCK,
                swa_block_size: int = DEFAULT_SWA_BLOCK, speculative: bool = False) -> CacheLayout:
    """speculative: the window blocks also hold the DSpark stages' context KV, one position further back."""
    ratios = {cfg.compress_ratios[s] for s in cfg.kv_source_layers}
    if any(global_block_size % r for r in ratios):
        raise ValueError(f"global_block_size {global_block_size} must be a multiple of every compress ratio {sorted(ratios)}")
    holders = max_num_seqs + max_snapshots
    num_dspark, lookback = (cfg.n_mtp_layers, 1) if speculative else (0, 0)
    per_seq = -(-(cfg.window_size + lookback) // swa_block_size) + 1
    num_swa = holders * per_seq + -(-max_num_batched_tokens // swa_block_size) + max_num_seqs
    fixed = num_swa * swa_bytes_per_block(cfg, swa_block_size, num_dspark) + holders * pending_bytes_per_slot(cfg)
    num_global = (memory_bytes - fixed) // global_bytes_per_block(cfg, global_block_size)
    if num_global < 1:
        raise ValueError(f"cache memory {memory_bytes} B is too small: the window blocks for {holders} sequences "
                         f"alone take {fixed} B")
    return CacheLayout(global_block_size, swa_block_size, cfg.window_size, int(num_global), num_swa, holders,
                       max_snapshots, num_dspark, lookback)


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device: torch.device | str):
        self.cfg, self.layout = cfg, layout
        G, S = layout.global_block_size, layout.swa_block_size

        def zeros(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.swa = [zeros(layout.num_swa_blocks, S, swa_record_bytes(cfg.head_dim)) for _ in range(cfg.n_layers)]
        self.dspark_swa = [zeros(layout.num_swa_blocks, S, swa_record_bytes(cfg.head_dim))
                           for _ in range(layout.num_dspark_layers)]
        self.main_kv, self.index_k, self.pending_kv, self.pending_score = {}, {}, {}, {}
        for s in cfg.kv_source_layers:
            r = cfg.compress_ratios[s]
            self.main_kv[s] = zeros(layout.num_global_blocks, G // r, fp4_record_bytes(cfg.head_dim, 16))
            self.index_k[s] = zeros(layout.num_global_blocks, G // r, fp4_record_bytes(cfg.index_head_dim, 32))
            if r > 1:
                self.pending_kv[s] = zeros(layout.num_pending_slots, r, cfg.head_dim, dtype=torch.float32)
                self.pending_score[s] = zeros(layout.num_pending_slots, r, cfg.head_dim, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        pools = [*self.swa, *self.dspark_swa, *self.main_kv.values(), *self.index_k.values(), *self.pending_kv.values(),
                 *self.pending_score.values()]
        return sum(t.numel() * t.element_size() for t in pools)

    def apply(self, copies: list[CopyOp]) -> None:
        """Block copies for forks, before the step that writes into the copies."""
        for op in copies:
            if op.pool == "swa":
                for t in (*self.swa, *self.dspark_swa):
                    t[op.dst] = t[op.src]
            elif op.pool == "global":
                for t in (*self.main_kv.values(), *self.index_k.values()):
                    t[op.dst] = t[op.src]
            else:
                for t in (*self.pending_kv.values(), *self.pending_score.values()):
                    t[op.dst] = t[op.src]
