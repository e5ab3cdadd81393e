"""N model shards in N local processes (`engine.run --num-shards N`): this process is rank 0 and the
engine's executor; ranks 1..N-1 are spawned processes that follow rank 0's step plans.

Each step rank 0 broadcasts one command (the picklable `StepPlan`, or a block write) over the shard group's
control group, and every rank runs `ModelRunner.execute` on the same plan over its own shard; the forward's
collectives (engine/parallel.py) keep them in lockstep, and rank 0's `StepOutput` is the step's. The KV
pools are replicated (the single KV head, the compressors and the indexers are whole on every rank), so
rank 0 alone answers block reads.

Start-up: rank 0 opens the rendezvous, spawns the other ranks, loads its shard while they load theirs, waits
for each one's report over its pipe (a load error comes back as the exception it was, naming the rank), then
every rank joins the process group. The runner is the golden one or the kernel path (with its decode step); on
CUDA every rank then captures its decode graphs, in the same bucket order, so that the collectives inside them
(NCCL, captured) pair up across the ranks. Failure: anything that raises inside a step (a rank's error, a rank that
died, a collective past the step timeout) fails the whole group: rank 0 stops the other ranks and every later
step raises at once with the first error; nothing waits forever. Ranks > 0 exit when rank 0 goes away.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine.core import kv_blocks
from engine.core.cache_manager import CacheLayout
from engine.core.engine import capture_decode_graphs
from engine.core.engine_config import DecodeOptions
from engine.core.kv_cache import PagedKVCache
from engine.core.plan import StepPlan
from engine.core.runner import ModelRunner
from engine.core.step_rows import StepOutput
from engine.load import LoadedModel, load_model
from engine.parallel import GroupAddress, ProcessGroups, Rendezvous, ShardSpec

STEP_TIMEOUT = timedelta(minutes=5)  # a collective inside a step waits at most this long for the other ranks
LOAD_TIMEOUT_S = 3600.0  # every rank has loaded its shard within this
STOP_TIMEOUT_S = 10.0  # ranks > 0 exit within this after a Stop, else they are terminated
POLL_S = 0.05
REPORT_WAIT_S = 1.0  # after a failed step: how long rank 0 waits for the other ranks' reports or exit codes


@dataclass(frozen=True, slots=True)
class ShardLaunch:
    """What a rank > 0 needs to build its shard (picklable: it crosses the spawn)."""

    checkpoint: str
    device: str  # "cpu" or "cuda" (rank r takes cuda:r)
    layout: CacheLayout
    num_shards: int
    address: GroupAddress
    step_timeout: timedelta
    num_threads: int | None  # torch intra-op threads of the rank (None: torch's default)
    kernels: bool = False  # the kernel path (engine/core/kernel_layers.py) instead of the golden modules
    decode: DecodeOptions | None = None  # the kernel path's decode step (None: off)


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


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def _picklable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- any pickling failure: send its text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def load_shard(checkpoint: str, device: torch.device, layout: CacheLayout, shard: ShardSpec, kernels: bool = False,
               decode: DecodeOptions | None = None) -> tuple[LoadedModel, PagedKVCache, ModelRunner]:
    """One rank's shard of the model (no DSpark stages), its paged pools and its runner (golden, or the kernel
    path with its decode step when decode is given). Decode graphs are captured later, once the group is joined
    (`capture_decode_graphs`: their collectives need every rank)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    loaded = load_model(checkpoint, device, with_mtp=False, progress=False, shard=shard)
    kv = PagedKVCache(loaded.cfg, layout, device)
    return loaded, kv, ModelRunner(loaded.model, kv, kernels, decode if kernels else None)


def follower_main(rank: int, launch: ShardLaunch, conn: Connection) -> None:
    """Process entry of rank >= 1: load, report, wait for rank 0's go, join the group, follow its commands."""
    if launch.num_threads is not None:
        torch.set_num_threads(launch.num_threads)
    shard = ShardSpec(rank, launch.num_shards)
    device = rank_device(launch.device, rank)
    try:
        _, kv, runner = load_shard(launch.checkpoint, device, launch.layout, shard, launch.kernels, launch.decode)
    except BaseException as e:  # noqa: BLE001 -- reported to rank 0, which raises it
        conn.send(("failed", _picklable(e)))
        return
    conn.send(("loaded", None))
    try:
        conn.recv()  # rank 0's go: every rank has loaded
    except EOFError:
        return  # rank 0 gave up (another rank failed) or went away
    groups = ProcessGroups.join(shard, launch.address, device, launch.step_timeout)
    try:
        capture_decode_graphs(runner)  # in step with rank 0's capture (CUDA only)
        follow(groups, runner, kv)
    except BaseException as e:  # noqa: BLE001 -- rank 0's next collective fails; tell it why
        try:
            conn.send(("failed", _picklable(e)))
        except OSError:
            pass  # rank 0 has closed the pipe: it is stopping this rank anyway
        raise
    groups.close()


def follow(groups: ProcessGroups, runner: ModelRunner, kv: PagedKVCache) -> None:
    """Run rank 0's commands until Stop (or until rank 0's death breaks the broadcast)."""
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


class ShardGroupExecutor:
    """The engine's Executor over the shard group; this process is rank 0 (see the module docstring)."""

    def __init__(self, runner: ModelRunner, kv: PagedKVCache, groups: ProcessGroups,
                 procs: list[mp.Process], conns: list[Connection]):
        self.runner, self.kv, self.groups = runner, kv, groups
        self.procs, self.conns = procs, conns  # ranks 1.. in order
        self.failure: BaseException | None = None
        self.closed = False

    @classmethod
    def start(cls, checkpoint: str, device: str, layout: CacheLayout, num_shards: int, *,
              step_timeout: timedelta = STEP_TIMEOUT, num_threads: int | None = None, kernels: bool = False,
              decode: DecodeOptions | None = None) -> "ShardGroupExecutor":
        """Spawn ranks 1..num_shards-1, load rank 0 here, wait until every rank has loaded, join the group (and,
        on CUDA with the kernel path's decode step, capture every rank's decode graphs). A rank's load error is
        raised here (CheckpointError / ShardingError as it was raised there)."""
        assert num_shards > 1, "one shard runs in-process (LocalExecutor)"
        rendezvous = Rendezvous(num_shards, step_timeout)
        launch = ShardLaunch(checkpoint, device, layout, num_shards, rendezvous.address, step_timeout, num_threads,
                             kernels, decode)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        try:
            for rank in range(1, num_shards):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=follower_main, args=(rank, launch, theirs), name=f"dsv41-shard-{rank}",
                                   daemon=True)
                proc.start()
                theirs.close()
                procs.append(proc)
                conns.append(ours)
            _, kv, runner = load_shard(checkpoint, rank_device(device, 0), layout, ShardSpec(0, num_shards), kernels,
                                       decode)
            _wait_loaded(procs, conns)
            for conn in conns:
                conn.send("go")
            groups = ProcessGroups.join(ShardSpec(0, num_shards), rendezvous.address, rank_device(device, 0),
                                        step_timeout, rendezvous)
            capture_decode_graphs(runner)
        except BaseException:
            _stop_processes(procs, conns)
            raise
        return cls(runner, kv, groups, procs, conns)

    def execute(self, plan: StepPlan) -> StepOutput:
        self._check()
        try:
            self.groups.broadcast_object(Execute(plan))
            return self.runner.execute(plan)
        except Exception as e:
            raise self._fail(e) from e

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        self._check()
        return kv_blocks.read_blocks(self.kv, block_ids)

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        self._check()
        try:
            self.groups.broadcast_object(WriteBlocks(list(block_ids), data))
            kv_blocks.write_blocks(self.kv, block_ids, data)
        except Exception as e:
            raise self._fail(e) from e

    def close(self) -> None:
        """Stop the other ranks (politely when the group is healthy) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None:
            try:
                self.groups.broadcast_object(Stop())
            except Exception:  # noqa: BLE001 -- a rank already gone: it is stopped below all the same
                pass
        _stop_processes(self.procs, self.conns, STOP_TIMEOUT_S if self.failure is None else 0.0)
        self.groups.close()

    def _check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the shard group failed earlier: {self.failure}") from self.failure
        if self.closed:
            raise RuntimeError("the shard group is closed")

    def _fail(self, error: Exception) -> RuntimeError:
        """The group is out of lockstep: note why (a rank's own report, else the ranks that exited: a dying
        rank's sockets close before its exit code is known, hence the short wait), stop the ranks."""
        deadline = time.monotonic() + REPORT_WAIT_S
        reports = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    kind, err = conn.recv()
                    if kind == "failed":
                        reports.append(f"rank {rank}: {type(err).__name__}: {err}")
            except (EOFError, OSError):
                continue
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        exited = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.procs, 1)
                  if not p.is_alive() and p.exitcode not in (0, None)]
        detail = "; ".join(reports or exited) or f"no rank reported; rank 0 saw {type(error).__name__}: {error}"
        self.failure = RuntimeError(f"a model shard failed mid-step ({detail})")
        _stop_processes(self.procs, self.conns, 0.0)
        return self.failure


def _wait_loaded(procs: list[mp.Process], conns: list[Connection]) -> None:
    """Every rank > 0 reported a loaded shard; raises the first one's load error, or names a rank that died."""
    waiting = dict(enumerate(conns, start=1))
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while waiting:
        for rank, conn in list(waiting.items()):
            if conn.poll(POLL_S):
                try:
                    kind, error = conn.recv()
                except EOFError:
                    kind, error = "failed", RuntimeError(f"rank {rank} exited during load "
                                                         f"(exit code {procs[rank - 1].exitcode})")
                if kind == "failed":
                    raise error
                del waiting[rank]
            elif not procs[rank - 1].is_alive():
                raise RuntimeError(f"rank {rank} exited during load (exit code {procs[rank - 1].exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not load their shards within {LOAD_TIMEOUT_S:.0f} s")


def _stop_processes(procs: list[mp.Process], conns: list[Connection], grace_s: float = 0.0) -> None:
    """Join each process within grace_s, then terminate, then kill; close the pipes."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def default_threads(num_shards: int) -> int:
    """torch intra-op threads per rank: the machine's cores shared evenly (at least one)."""
    return max(1, (os.cpu_count() or 1) // num_shards)
