"""Global KV blocks as flat bytes: export from and import into a PagedKVCache (cross-replica KV sharing).

A global block (`global_block_size` positions) is, per KV source s in `cfg.kv_source_layers` order,
its main-KV rows then its index-key rows:

    block = main_kv[s0][b] | index_k[s0][b] | main_kv[s1][b] | index_k[s1][b] | ...
            (G/r_s rows of 288 B)  (G/r_s rows of 68 B)                    # real config: 56,960 B = 890 B/token

That is all the persistent state a full block has (spec 4.8: SWA KV is rebuilt by encoder replay, a
block boundary leaves no compressor group pending, and Engram looks back at token ids), so a block
written here and registered under its chain hash is a local prefix-cache hit like any other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ModelConfig
from engine.core.block_checksum import block_checksums
from engine.core.kv_cache import PagedKVCache
from engine.kernels.cache_records import INDEX_K_BLOCK, MAIN_KV_BLOCK, fp4_record_bytes


class PrefixImportError(ValueError):
    """An ExportedPrefix this replica cannot use (another model, weights or layout); nothing was written."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One pool's rows of a block inside the flat record: bytes offset .. offset + rows * record_bytes."""

    pool: str  # "main_kv" | "index_k"
    source: int  # KV source layer id
    rows: int  # global_block_size / compress ratio
    record_bytes: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.record_bytes


@dataclass(frozen=True, slots=True)
class ExportedPrefix:
    """Full global blocks of one token prefix, as a replica exported them.

    hashes[i] is the chain hash of the prefix up to the end of the i-th exported block (salted with
    `fingerprint`); data[i] is that block's flat record. The blocks need not start at block 0: a
    receiver that already holds the head may be sent only the tail (the chain hashes still name it).
    """

    fingerprint: bytes  # the exporting replica's salt (model config + weights + block format: engine.prefix_salt)
    hashes: list[bytes]
    data: np.ndarray  # uint8 [len(hashes), block_bytes], C-contiguous
    checksums: np.ndarray | None = None  # int64 [len(hashes)]: data's block checksums where the exporter has them

    def __post_init__(self) -> None:
        assert self.data.dtype == np.uint8 and self.data.ndim == 2 and self.data.shape[0] == len(self.hashes), \
            f"data {self.data.dtype} {self.data.shape} for {len(self.hashes)} hashes"
        assert self.checksums is None or (self.checksums.dtype == np.int64 and self.checksums.shape == (
            len(self.hashes),)), f"checksums {self.checksums.dtype} {self.checksums.shape}"

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


def block_segments(cfg: ModelConfig, global_block_size: int) -> list[Segment]:
    """Where each pool's rows sit inside a flat block record (the order of the module docstring)."""
    main_rec = fp4_record_bytes(cfg.head_dim, MAIN_KV_BLOCK)
    index_rec = fp4_record_bytes(cfg.index_head_dim, INDEX_K_BLOCK)
    segments, offset = [], 0
    for s in cfg.kv_source_layers:
        rows = global_block_size // cfg.compress_ratios[s]
        for pool, rec in (("main_kv", main_rec), ("index_k", index_rec)):
            segments.append(Segment(pool, s, rows, rec, offset))
            offset += rows * rec
    return segments


def block_bytes(cfg: ModelConfig, global_block_size: int) -> int:
    """Bytes of one flat block record (= kv_cache.global_bytes_per_block)."""
    return sum(seg.nbytes for seg in block_segments(cfg, global_block_size))


def layout_fingerprint(cfg: ModelConfig, global_block_size: int) -> bytes:
    """16 bytes naming the flat record's format (segments, record sizes): two replicas whose records
    have the same layout fingerprint can exchange bytes; whether the *contents* mean the same is the
    engine salt's job (it also covers the weights)."""
    doc = {"block_size": global_block_size,
           "segments": [[s.pool, s.source, s.rows, s.record_bytes] for s in block_segments(cfg, global_block_size)],
           "records": "nvfp4-288/mxfp4-68"}
    return hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=16).digest()


def _pools(kv: PagedKVCache) -> list[tuple[Segment, torch.Tensor]]:
    segments = block_segments(kv.cfg, kv.layout.global_block_size)
    return [(seg, getattr(kv, seg.pool)[seg.source]) for seg in segments]


def _copy_unit(pools: list[tuple[Segment, torch.Tensor]]) -> tuple[torch.dtype, int]:
    """The element the pools' rows are copied as: int32 words where every record is whole words (the real
    config's 288 and 68 B: a quarter of the elements a byte-wise gather or scatter indexes), bytes otherwise."""
    whole_words = all(seg.record_bytes % 4 == 0 and seg.offset % 4 == 0 for seg, _ in pools)
    return (torch.int32, 4) if whole_words else (torch.uint8, 1)


def _gather(kv: PagedKVCache, block_ids: list[int]) -> torch.Tensor:
    """The blocks' flat records on the pools' device, uint8 [len(block_ids), block_bytes] (one gather per pool)."""
    pools = _pools(kv)
    idx = torch.tensor(block_ids, dtype=torch.long, device=pools[0][1].device)
    unit, _ = _copy_unit(pools)
    flat = torch.cat([t.view(unit).index_select(0, idx).reshape(len(block_ids), -1) for _, t in pools], dim=1)
    flat = flat.view(torch.uint8)  # [n, bytes]
    assert flat.shape[1] == block_bytes(kv.cfg, kv.layout.global_block_size)
    return flat


def _to_host(t: torch.Tensor) -> np.ndarray:
    """t on the host as numpy; from a GPU through page-locked memory (torch's caching host allocator: a copy at
    the link's rate, where a pageable destination ran at ~5-8 GB/s on the H100 machines' hosts)."""
    if t.device.type == "cpu":
        return t.numpy()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)  # blocking: the array is complete when returned
    return out.numpy()


@torch.inference_mode()
def read_blocks(kv: PagedKVCache, block_ids: list[int]) -> np.ndarray:
    """uint8 [len(block_ids), block_bytes] on the host: the blocks' flat records (one device gather
    per pool, one copy to the host)."""
    if not block_ids:
        return np.empty((0, block_bytes(kv.cfg, kv.layout.global_block_size)), dtype=np.uint8)
    return _to_host(_gather(kv, block_ids))


@torch.inference_mode()
def read_blocks_checked(kv: PagedKVCache, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """read_blocks and each record's checksum (int64 [n], engine/core/block_checksum.py), computed where the records
    are: on a GPU by one kernel before the copy to the host, so an export never sums its bytes on the host."""
    if not block_ids:
        return read_blocks(kv, []), np.empty(0, dtype=np.int64)
    flat = _gather(kv, block_ids)
    sums = block_checksums(flat)
    return _to_host(flat), _to_host(sums)


@torch.inference_mode()
def write_blocks(kv: PagedKVCache, block_ids: list[int], data: np.ndarray) -> None:
    """Writes data (uint8 [len(block_ids), block_bytes]) into those blocks of every global pool."""
    nbytes = block_bytes(kv.cfg, kv.layout.global_block_size)
    assert data.dtype == np.uint8 and data.shape == (len(block_ids), nbytes), \
        f"data {data.dtype} {data.shape}, expected uint8 ({len(block_ids)}, {nbytes})"
    if not block_ids:
        return
    device = next(iter(kv.main_kv.values())).device
    write_rows(kv, block_ids, torch.from_numpy(np.require(data, requirements="CW")).to(device))  # Ray hands out read-only arrays


@torch.inference_mode()
def write_rows(kv: PagedKVCache, block_ids: list[int], src: torch.Tensor) -> None:
    """write_blocks for rows already in a tensor (uint8 [len(block_ids), block_bytes], C-contiguous, on the pools'
    device: then the copies are queued on the current stream; or on the host for CPU pools)."""
    nbytes = block_bytes(kv.cfg, kv.layout.global_block_size)
    assert src.dtype == torch.uint8 and src.shape == (len(block_ids), nbytes) and src.is_contiguous(), \
        f"rows {src.dtype} {tuple(src.shape)}, expected uint8 ({len(block_ids)}, {nbytes})"
    pools = _pools(kv)
    device = pools[0][1].device
    idx = torch.tensor(block_ids, dtype=torch.long, pin_memory=device.type == "cuda")
    idx = idx.to(device, non_blocking=True)  # queued on the current stream: no wait for the work before it
    unit, size = _copy_unit(pools)
    src_units = src.view(unit)
    for seg, t in pools:
        first = seg.offset // size
        rows = src_units[:, first:first + seg.nbytes // size].reshape(len(block_ids), seg.rows, -1)
        t.view(unit).index_copy_(0, idx, rows)
