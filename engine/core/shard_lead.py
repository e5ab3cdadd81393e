"""The shard group's step protocol, however its ranks were started (local processes: engine/core/shard_group.py;
Ray actors: serve_app/shard_worker.py): building one rank's shard (`load_shard`, which prints what the rank
holds), the commands rank 0 broadcasts, rank 0's side (`ShardLeader`) and the loop of the other ranks (`follow`).

Each command rank 0 broadcasts over the control group (the picklable StepPlan, or a block write) then runs on
every rank over its own shard; the forward's collectives keep the ranks in lockstep, and rank 0's StepOutput is
the step's. The KV pools are replicated (the single KV head, the compressors and the indexers are whole on every
rank), so rank 0 alone answers block reads; a block write reaches every rank.

Invariant: every rank runs the same commands in the same order. A command that raises on rank 0 (its own error,
a rank that died, a collective past the step timeout) may have run on some ranks and not on others, so the
leader fails for good: `ShardGroupFailed` now, and at once for every later command. Rank 0 may send commands from
two threads (a shard actor's steps, and a KV pull's chunk writes beside them): ShardLeader runs one command at a
time, from its broadcast to its end on rank 0, so no two commands' collectives interleave.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.core import kv_blocks
from engine.core.cache_manager import CacheLayout
from engine.core.drafter import Drafter
from engine.core.engine_config import DecodeOptions
from engine.core.kv_cache import PagedKVCache
from engine.core.plan import StepPlan
from engine.core.runner import ModelRunner
from engine.core.step_rows import StepOutput
from engine.load import LoadedModel, load_model
from engine.parallel import ProcessGroups, ShardSpec
from engine.shared_tables import backing_file


@dataclass(frozen=True, slots=True)
class Execute:
    plan: StepPlan


@dataclass(frozen=True, slots=True)
class WriteBlocks:
    block_ids: list[int]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class Stop:
    pass


class ShardGroupFailed(RuntimeError):
    """The shard group is out of lockstep: this command and every later one fail (the message says why)."""


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank holds, measured after loading: its model tensors on the device (Engram tables aside), its
    paged KV pools, and the Engram tables in host memory with the file that backs them (per /proc/self/maps:
    the node's shared copy in /dev/shm, a checkpoint file mapped privately, or None for anonymous memory)."""

    rank: int
    world_size: int
    device: str
    weights_bytes: int
    kv_bytes: int
    engram_bytes: int
    engram_file: str | None
    engram_inode: int | None
    engram_shared: bool  # mapped from the node's one shared copy (engine/shared_tables.py)

    @classmethod
    def measure(cls, loaded: LoadedModel, kv: PagedKVCache, shard: ShardSpec) -> "RankMemory":
        weights = engram = 0
        first_table: torch.Tensor | None = None
        for name, t in loaded.model.state_dict(keep_vars=True).items():
            if ".engram.embed." in name:
                engram += t.nbytes
                first_table = t if first_table is None else first_table
            else:
                weights += t.nbytes
        where = backing_file(first_table.data_ptr()) if first_table is not None else None
        path, inode = where if where is not None and where[1] else (None, None)
        return cls(shard.rank, shard.world_size, str(loaded.model.embed.weight.device), weights, kv.nbytes, engram,
                   path, inode, loaded.engram_host is not None)

    def line(self) -> str:
        engram = "none"
        if self.engram_bytes:
            how = "shared" if self.engram_shared else "private"
            engram = f"{_gib(self.engram_bytes)} ({how}" + (f", {self.engram_file} inode {self.engram_inode})"
                                                             if self.engram_file else ")")
        return (f"rank {self.rank}/{self.world_size} on {self.device}: weights {_gib(self.weights_bytes)}, "
                f"KV pools {_gib(self.kv_bytes)}, Engram host tables {engram}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(slots=True)
class RankShard:
    """One rank's model shard, its paged pools and runner, and what it holds in memory."""

    loaded: LoadedModel
    kv: PagedKVCache
    runner: ModelRunner
    memory: RankMemory


def load_shard(checkpoint: str, device: torch.device, layout: CacheLayout, shard: ShardSpec,
               kernels: bool | None = False, decode: DecodeOptions | None = None,
               drafter: Drafter | None = None) -> RankShard:
    """One rank's shard of the model (its slices of the DSpark stages when the pools hold their context, i.e.
    speculative decoding is on; the Engram tables mapped from the node's shared copy), its paged pools and its
    runner (kernels: None picks by device; drafter: what drafts, None for the DSpark stages); prints its memory line
    on stderr."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    loaded = load_model(checkpoint, device, with_mtp=layout.num_dspark_layers > 0, progress=False, shard=shard,
                        shared_engram=True)
    kv = PagedKVCache(loaded.cfg, layout, device)
    memory = RankMemory.measure(loaded, kv, shard)
    print(memory.line(), file=sys.stderr, flush=True)
    return RankShard(loaded, kv, ModelRunner(loaded.model, kv, kernels, decode, drafter), memory)


def follow(groups: ProcessGroups, runner: ModelRunner, kv: PagedKVCache) -> None:
    """Ranks > 0: run rank 0's commands until Stop (or until rank 0's death breaks the broadcast, which raises)."""
    while True:
        cmd = groups.broadcast_object()
        if isinstance(cmd, Stop):
            return
        if isinstance(cmd, Execute):
            runner.execute(cmd.plan)
        elif isinstance(cmd, WriteBlocks):
            kv_blocks.write_blocks(kv, cmd.block_ids, cmd.data)
        else:
            raise TypeError(f"unknown shard command {cmd!r}")


class ShardLeader:
    """Rank 0's side of the group: broadcast each command, then run it here. `explain(error)` says why a command
    failed (default: rank 0's own view of the error); the launcher may also stop the other ranks there."""

    def __init__(self, runner: ModelRunner, kv: PagedKVCache, groups: ProcessGroups,
                 explain: Callable[[Exception], str] | None = None):
        self.runner, self.kv, self.groups = runner, kv, groups
        self.explain = explain or (lambda e: f"rank 0 saw {type(e).__name__}: {e}")
        self.failure: ShardGroupFailed | None = None
        self.stopped = False
        self._command = threading.Lock()  # held from a command's broadcast to its end on rank 0

    def execute(self, plan: StepPlan) -> StepOutput:
        with self._command:
            self.check()
            try:
                self.groups.broadcast_object(Execute(plan))
                return self.runner.execute(plan)
            except Exception as e:
                raise self._fail(e) from e

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        self.check()
        return kv_blocks.read_blocks(self.kv, block_ids)

    def read_blocks_checked(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        self.check()
        return kv_blocks.read_blocks_checked(self.kv, block_ids)

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        with self._command:
            self.check()
            try:
                self.groups.broadcast_object(WriteBlocks(list(block_ids), data))
                kv_blocks.write_blocks(self.kv, block_ids, data)
            except Exception as e:
                raise self._fail(e) from e

    def stop(self) -> None:
        """Tell the other ranks to leave their loop (once; only while the group is in lockstep: a failed group's
        ranks are stopped by their launcher). A rank already gone is no error here."""
        with self._command:
            if self.stopped or self.failure is not None:
                return
            self.stopped = True
            try:
                self.groups.broadcast_object(Stop())
            except Exception:  # noqa: BLE001 -- a rank already gone: its launcher stops it all the same
                pass

    def check(self) -> None:
        if self.failure is not None:
            raise ShardGroupFailed(f"the shard group failed earlier: {self.failure}") from self.failure
        if self.stopped:
            raise ShardGroupFailed("the shard group is stopped")

    def _fail(self, error: Exception) -> ShardGroupFailed:
        self.failure = ShardGroupFailed(f"a model shard failed mid-step ({self.explain(error)})")
        return self.failure
