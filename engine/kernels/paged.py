"""Paged cache access: slot arithmetic, quantise-and-store into the packed pools, gather-and-dequantise.

Torch references (CPU and any device); the kernels issue swaps in fused versions with these names.
A pool is uint8 [num_blocks, slots_per_block, record_bytes]; a flat slot is block_id * slots_per_block
+ offset. Stores are bitwise the golden model's QDQ (see cache_records).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from engine.kernels.cache_records import (pack_index_k, pack_main_kv, pack_swa, unpack_index_k, unpack_main_kv,
                                          unpack_swa)


def window_table(blocks: Mapping[int, int], start: int, end: int, block_size: int) -> tuple[Tensor, int]:
    """The held window blocks of positions start..end-1 in order: (int64 [blocks], CPU; the first block's index);
    every block must be held. A position p's slot is table[p // block_size - first] * block_size + p % block_size."""
    if end <= start:
        return torch.zeros(0, dtype=torch.long), 0
    first = start // block_size
    try:
        return torch.tensor([blocks[b] for b in range(first, (end - 1) // block_size + 1)], dtype=torch.long), first
    except KeyError as e:
        raise AssertionError(f"window block {e.args[0]} (positions {start}..{end - 1}) is not held") from None


def swa_slots(blocks: Mapping[int, int], start: int, end: int, block_size: int) -> Tensor:
    """Flat slots of window positions start..end-1 (int64 [end-start], CPU); every block must be held."""
    table, first = window_table(blocks, start, end, block_size)
    p = torch.arange(start, max(start, end))
    return table[p // block_size - first] * block_size + p % block_size


def entry_slots(blocks: Sequence[int], first: int, end: int, per_block: int) -> Tensor:
    """Flat slots of global entries first..end-1 (entry j lives in blocks[j // per_block])."""
    assert end <= len(blocks) * per_block, f"entries up to {end} need {-(-end // per_block)} blocks, {len(blocks)} held"
    j = torch.arange(first, end)
    return torch.tensor(blocks, dtype=torch.long)[j // per_block] * per_block + j % per_block if end > first else j


def _flat(pool: Tensor) -> Tensor:
    return pool.view(-1, pool.size(-1))


def store_swa(pool: Tensor, slots: Tensor, kv: Tensor) -> None:
    """kv bf16 [N, D] (post-RoPE, unquantised) -> FP8 records at slots [N]."""
    _flat(pool)[slots.to(pool.device)] = pack_swa(kv)


def gather_swa(pool: Tensor, slots: Tensor, dim: int) -> Tensor:
    """-> bf16 [N, D] window KV at slots [N]."""
    return unpack_swa(_flat(pool)[slots.to(pool.device)], dim)


def store_main_kv(pool: Tensor, slots: Tensor, latent: Tensor) -> None:
    _flat(pool)[slots.to(pool.device)] = pack_main_kv(latent)


def gather_main_kv(pool: Tensor, slots: Tensor, dim: int) -> Tensor:
    return unpack_main_kv(_flat(pool)[slots.to(pool.device)], dim)


def store_index_k(pool: Tensor, slots: Tensor, keys: Tensor) -> None:
    _flat(pool)[slots.to(pool.device)] = pack_index_k(keys)


def gather_index_k(pool: Tensor, slots: Tensor, dim: int) -> Tensor:
    return unpack_index_k(_flat(pool)[slots.to(pool.device)], dim)
