"""The model-parallel layout of the checkpoint: which part of each tensor a rank holds, whether a number of
shards can split the model at all, and the bytes each rank holds (docs/architecture.md's layout table).

The rule, one line per kind of tensor (N ranks, rank r):
- attention: `wq_b` rows and `attn_sink` by query head, `wo_a` rows by output group (tensor-parallel, the
  heads of a rank are the heads of its groups); `wo_b` columns by output group (row-parallel: an all-reduce);
- routed experts: `experts.e` only on the rank owning e (expert-parallel, n_experts / N contiguous each);
- shared expert: `w1` / `w3` rows and `w2` columns by intermediate feature (tensor-parallel);
- the head and the DSpark Markov head: rows by vocabulary id (vocab-parallel, the logits all-gathered);
- everything else whole on every rank: embedding, norms, mHC, router, the single KV head `wkv`, the
  compressors, the indexers (so the KV pools are the same on every rank), Engram, DSpark's projections.
FP8 scales are split with their weights (32 x 32 blocks: every local row / column count is a multiple of 32).
The model's classes make the same split (engine/model/layers.py); the loader checks that the two agree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.checkpoint.layout import COMPONENTS, TensorSpec, component_of, expected_tensors
from engine.config import ModelConfig
from engine.shard_spec import ShardSpec, check_shardable  # noqa: F401 (check_shardable: callers import it here)

# (name pattern, dim split, what splits it); a pattern's group "part" is weight or scale
_SPLITS: tuple[tuple[re.Pattern, int, str], ...] = tuple((re.compile(p), d, w) for p, d, w in (
    (r"\.attn\.wq_b\.(weight|scale)$", 0, "n_heads"),
    (r"\.attn\.attn_sink$", 0, "n_heads"),
    (r"\.attn\.wo_a\.(weight|scale)$", 0, "o_groups"),
    (r"\.attn\.wo_b\.(weight|scale)$", 1, "o_groups"),
    (r"\.ffn\.shared_experts\.w[13]\.(weight|scale)$", 0, "moe_inter_dim"),
    (r"\.ffn\.shared_experts\.w2\.(weight|scale)$", 1, "moe_inter_dim"),
    (r"^head\.weight$", 0, "vocab_size"),
    (r"\.markov_head\.head\.weight$", 0, "vocab_size"),
))
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """A rank's part of one checkpoint tensor: indices start..stop-1 along dim (dim None: the whole tensor)."""

    dim: int | None
    start: int = 0
    stop: int = 0

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return full
        return full[:self.dim] + (self.stop - self.start,) + full[self.dim + 1:]


WHOLE = TensorSlice(None)


def _experts_of(cfg: ModelConfig, kind: str, layer: int) -> tuple[int, str]:
    layer_id = layer if kind == "layers" else cfg.n_layers + layer
    return cfg.moe_experts(layer_id)[0], "n_routed_experts" if kind == "layers" else "dspark_n_routed_experts"


def tensor_slice(spec: TensorSpec, cfg: ModelConfig, shard: ShardSpec) -> TensorSlice | None:
    """The part of `spec` that rank `shard.rank` holds; None when the rank holds none of it (another
    rank's routed expert). Shapes are the stored ones (a scale's blocks, packed FP4 bytes)."""
    m = _EXPERT.match(spec.name)
    if m:
        n_experts, dim = _experts_of(cfg, m.group(1), int(m.group(2)))
        return WHOLE if int(m.group(3)) in shard.local_range(n_experts, dim) else None
    if shard.is_single:
        return WHOLE
    for pattern, axis, dim in _SPLITS:
        if pattern.search(spec.name):
            full = spec.shape[axis]
            size = shard.split(full, f"{spec.name} axis {axis} ({dim})")
            return TensorSlice(axis, shard.rank * size, (shard.rank + 1) * size)
    return WHOLE


def bytes_per_rank(cfg: ModelConfig, num_shards: int, include_mtp: bool = True) -> dict[str, int]:
    """Checkpoint bytes rank 0 holds (every rank holds as many), by layout component, for text-only serving
    (no vision tower). Engram tables are included: they stay in host memory, one copy per node shared by its
    ranks (engine/shared_tables.py)."""
    check_shardable(cfg, num_shards, include_mtp)
    shard = ShardSpec(0, num_shards)
    out = dict.fromkeys(COMPONENTS, 0)
    for spec in expected_tensors(cfg, include_mtp=include_mtp).values():
        part = tensor_slice(spec, cfg, shard)
        if part is None:
            continue
        out[component_of(spec.name)] += part_bytes(spec, part)
    return {c: b for c, b in out.items() if b}


def part_bytes(spec: TensorSpec, part: TensorSlice) -> int:
    """Stored bytes of a rank's part of a tensor."""
    return spec.nbytes * math.prod(part.shape(spec.shape)) // math.prod(spec.shape)

