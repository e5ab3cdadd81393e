"""Who a process is among the model's shards (`ShardSpec`), and whether a config can be split over N of them
(`check_shardable`, raising `ShardingError` that names the dimension). Plain data, no torch: the server's
settings refuse a shard count at the edge with it (serve_app/settings.py), before anything is loaded.
engine/parallel.py (process groups, collectives) and engine/checkpoint/sharding.py (the layout) build on it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ConfigError, ModelConfig

FP8_BLOCK = 32  # FP8 scales cover 32 x 32 blocks: a rank's share of a split FP8 dimension is a multiple of it


class ShardingError(ConfigError):
    """A model that cannot be split over the requested number of shards; the message names the dimension."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """This process's place among the model's shards: rank in 0..world_size-1. solo: a measurement mode
    (engine/parallel.py: no peers, the collectives are stand-ins, its outputs are not the model's)."""

    rank: int = 0
    world_size: int = 1
    solo: bool = False

    def __post_init__(self) -> None:
        assert self.world_size >= 1 and 0 <= self.rank < self.world_size, self

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def split(self, n: int, dim: str) -> int:
        """The local size of a dimension of n split evenly over the ranks (n_local_heads = split(n_heads))."""
        if n % self.world_size:
            raise ShardingError(f"{dim}={n} is not divisible by {self.world_size} shards")
        return n // self.world_size

    def local_range(self, n: int, dim: str) -> range:
        """This rank's contiguous part of 0..n-1 (its experts, its vocabulary rows)."""
        k = self.split(n, dim)
        return range(self.rank * k, (self.rank + 1) * k)


SINGLE = ShardSpec()


def split_dims(cfg: ModelConfig, include_mtp: bool) -> dict[str, int]:
    """Every dimension the layout splits evenly, by config name, with its size."""
    dims = {"n_heads": cfg.n_heads, "o_groups": cfg.o_groups, "n_routed_experts": cfg.n_routed_experts,
            "moe_inter_dim": cfg.moe_inter_dim, "vocab_size": cfg.vocab_size}
    if include_mtp and cfg.n_mtp_layers:
        dims["dspark_n_routed_experts"] = cfg.dspark_n_routed_experts
    return dims


def check_shardable(cfg: ModelConfig, num_shards: int, include_mtp: bool = False) -> None:
    """Raises ShardingError naming the first dimension num_shards cannot split (evenly, and for the FP8
    blocks of moe_inter_dim in multiples of 32 per rank)."""
    if num_shards < 1:
        raise ShardingError(f"the number of shards must be >= 1, got {num_shards}")
    for dim, n in split_dims(cfg, include_mtp).items():
        if n % num_shards:
            raise ShardingError(f"{dim}={n} is not divisible by {num_shards} shards")
    per_rank = cfg.moe_inter_dim // num_shards
    if per_rank % FP8_BLOCK:
        raise ShardingError(f"moe_inter_dim={cfg.moe_inter_dim} over {num_shards} shards gives {per_rank} features "
                            f"a rank, not a multiple of the {FP8_BLOCK}-wide FP8 blocks")
