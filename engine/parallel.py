"""Model parallelism's one seam to torch.distributed: who this process is (`ShardSpec`), the process group,
and the few collectives the model and the shard group use. No other module imports torch.distributed.

Every collective takes the caller's ShardSpec and is the identity at world size 1, so a single-shard run
never touches torch.distributed (and needs no process group). A `solo` ShardSpec is a measurement mode, never
served: rank r of N built and run alone in one process (benchmarks/rank_decode.py), its collectives stand-ins
that need no peers (all_reduce_sum returns its input, all_gather tiles it): the shapes, slices and local work
of rank r, not its numbers. Two groups are made at start-up:
- the default group (gloo on CPU, NCCL on CUDA) carries the forward's all-reduces and all-gathers, with
  the step timeout: a rank that dies or stalls mid-step fails the others' collective instead of hanging them;
- a control group (gloo, CPU) carries the per-step plan broadcast from rank 0. Its timeout is each process's
  own: long on ranks > 0, which wait there between steps for as long as the engine is idle; the step timeout
  on rank 0, whose broadcast waits for every receiver (a gloo send to a rank that stalled blocks until it
  answers or the timeout passes).
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.shard_spec import SINGLE, ShardingError, ShardSpec  # noqa: F401 (the model imports them from here)

IDLE_TIMEOUT = timedelta(days=7)  # how long ranks > 0 may wait for rank 0's next plan


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where rank 0's rendezvous store listens (the port is the OS's pick, never hard-coded)."""

    host: str
    port: int


class Rendezvous:
    """Rank 0's rendezvous store, listening before the other ranks start so that they can be told its port."""

    def __init__(self, world_size: int, timeout: timedelta, host: str = "127.0.0.1"):
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        self.address = GroupAddress(host, self.store.port)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class ProcessGroups:
    """The default (step) group and the control group of one process, made by `join`; `close` leaves both."""

    def __init__(self, shard: ShardSpec, control: dist.ProcessGroup):
        self.shard, self.control = shard, control

    @classmethod
    def join(cls, shard: ShardSpec, address: GroupAddress, device: torch.device, step_timeout: timedelta,
             rendezvous: Rendezvous | None = None) -> "ProcessGroups":
        """Blocks until every rank has joined (at most step_timeout); rank 0 passes its Rendezvous. On CUDA the
        device must be set first."""
        assert not shard.is_single, "a single shard needs no process group"
        assert not shard.solo, "a solo shard (measurement) has no peers to join"
        assert (rendezvous is not None) == (shard.rank == 0), "rank 0, and only rank 0, hosts the rendezvous"
        store = rendezvous.store if rendezvous is not None else dist.TCPStore(
            address.host, address.port, shard.world_size, is_master=False, timeout=step_timeout)
        dist.init_process_group(backend_for(device), store=store, rank=shard.rank, world_size=shard.world_size,
                                timeout=step_timeout)
        control = dist.new_group(backend="gloo", timeout=step_timeout if shard.rank == 0 else IDLE_TIMEOUT)
        return cls(shard, control)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's picklable obj, on every rank (one size broadcast and one byte broadcast)."""
        if self.shard.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        if self.shard.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.control)
        return obj if self.shard.rank == 0 else pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """The elementwise sum of every rank's x (same shape and dtype everywhere), identical on every rank.
    The golden model reduces float64 partial products here, before their one rounding."""
    if shard.is_single or shard.solo:
        return x  # solo: the collective's time is not measured (benchmarks/rank_decode.py adds it)
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_gather(x: torch.Tensor, shard: ShardSpec, dim: int = -1) -> torch.Tensor:
    """Every rank's x (same shape everywhere) concatenated in rank order along dim, on every rank."""
    if shard.is_single:
        return x
    if shard.solo:
        return torch.cat([x] * shard.world_size, dim=dim)  # the gathered shape and bytes, rank r's values
    parts = [torch.empty_like(x) for _ in range(shard.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def ranks_differing(data: bytes, shard: ShardSpec, device: torch.device | str = "cpu") -> list[int]:
    """The ranks whose data differs from rank 0's, known on every rank: one all-gather of an 8-byte digest (device:
    where the default group's tensors live). [] at world size 1 and solo."""
    if shard.is_single or shard.solo:
        return []
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    every = all_gather(torch.tensor([digest], dtype=torch.int64, device=device), shard, dim=0).tolist()
    return [rank for rank, d in enumerate(every) if d != every[0]]
