"""N model shards in N local processes (`engine.run --num-shards N`): this process is rank 0 and the
engine's executor; ranks 1..N-1 are spawned processes that follow rank 0's commands (the step protocol, the
same as for the server's Ray shard actors, is engine/core/shard_lead.py).

Start-up: rank 0 opens the rendezvous, spawns the other ranks, loads its shard while they load theirs (the first
to get there copies the Engram tables into the node's shared memory, the others map that copy), waits for each
one's report over its pipe (its memory line, or a load error as the exception it was, naming the rank), then
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

from engine.core.cache_manager import CacheLayout
from engine.core.drafter import Drafter
from engine.core.engine import capture_decode_graphs
from engine.core.engine_config import DecodeOptions
from engine.core.plan import StepPlan
from engine.core.shard_lead import RankMemory, RankShard, ShardLeader, follow, load_shard
from engine.core.step_rows import StepOutput
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
    drafter: Drafter | None = None  # what drafts when speculating, each rank its own copy (None: the DSpark stages)


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def _picklable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- any pickling failure: send its text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def follower_main(rank: int, launch: ShardLaunch, conn: Connection) -> None:
    """Process entry of rank >= 1: load, report, wait for rank 0's go, join the group, follow its commands."""
    if launch.num_threads is not None:
        torch.set_num_threads(launch.num_threads)
    shard = ShardSpec(rank, launch.num_shards)
    device = rank_device(launch.device, rank)
    try:
        mine = load_shard(launch.checkpoint, device, launch.layout, shard, launch.kernels, launch.decode,
                          launch.drafter)
    except BaseException as e:  # noqa: BLE001 -- reported to rank 0, which raises it
        conn.send(("failed", _picklable(e)))
        return
    conn.send(("loaded", mine.memory))
    try:
        conn.recv()  # rank 0's go: every rank has loaded
    except EOFError:
        return  # rank 0 gave up (another rank failed) or went away
    groups = ProcessGroups.join(shard, launch.address, device, launch.step_timeout)
    try:
        capture_decode_graphs(mine.runner)  # in step with rank 0's capture (CUDA only)
        follow(groups, mine.runner, mine.kv)
    except BaseException as e:  # noqa: BLE001 -- rank 0's next collective fails; tell it why
        try:
            conn.send(("failed", _picklable(e)))
        except OSError:
            pass  # rank 0 has closed the pipe: it is stopping this rank anyway
        raise
    groups.close()


class ShardGroupExecutor:
    """The engine's Executor over the shard group; this process is rank 0 (see the module docstring).
    `memory`: every rank's RankMemory, in rank order."""

    def __init__(self, rank0: RankShard, groups: ProcessGroups, procs: list[mp.Process], conns: list[Connection],
                 memory: list[RankMemory]):
        self.runner, self.kv, self.groups, self.memory = rank0.runner, rank0.kv, groups, memory
        self.engram_host = rank0.loaded.engram_host
        self.procs, self.conns = procs, conns  # ranks 1.. in order
        self.leader = ShardLeader(self.runner, self.kv, groups, self._explain)
        self.closed = False

    @classmethod
    def start(cls, checkpoint: str, device: str, layout: CacheLayout, num_shards: int, *,
              step_timeout: timedelta = STEP_TIMEOUT, num_threads: int | None = None, kernels: bool = False,
              decode: DecodeOptions | None = None, drafter: Drafter | None = None) -> "ShardGroupExecutor":
        """Spawn ranks 1..num_shards-1, load rank 0 here, wait until every rank has loaded, join the group (and,
        on CUDA with the kernel path's decode step, capture every rank's decode graphs). drafter: speculating, what
        drafts (pickled to every rank; it must draft alike on all of them); None: the DSpark stages. A rank's load
        error is raised here (CheckpointError / ShardingError as it was raised there)."""
        assert num_shards > 1, "one shard runs in-process (LocalExecutor)"
        rendezvous = Rendezvous(num_shards, step_timeout)
        launch = ShardLaunch(checkpoint, device, layout, num_shards, rendezvous.address, step_timeout, num_threads,
                             kernels, decode, drafter)
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
            rank0 = load_shard(checkpoint, rank_device(device, 0), layout, ShardSpec(0, num_shards), kernels,
                               decode, drafter)
            memory = [rank0.memory] + _wait_loaded(procs, conns)
            for conn in conns:
                conn.send("go")
            groups = ProcessGroups.join(ShardSpec(0, num_shards), rendezvous.address, rank_device(device, 0),
                                        step_timeout, rendezvous)
            capture_decode_graphs(rank0.runner)
        except BaseException:
            _stop_processes(procs, conns)
            raise
        return cls(rank0, groups, procs, conns, memory)

    @property
    def failure(self) -> BaseException | None:
        return self.leader.failure

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.leader.execute(plan)

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        return self.leader.read_blocks(block_ids)

    def read_blocks_checked(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return self.leader.read_blocks_checked(block_ids)

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        self.leader.write_blocks(block_ids, data)

    def close(self) -> None:
        """Stop the other ranks (politely when the group is healthy), leave the process group, and give up this
        process's use of the shared Engram tables (the last rank to go unlinks them)."""
        if self.closed:
            return
        self.closed = True
        self.leader.stop()
        _stop_processes(self.procs, self.conns, STOP_TIMEOUT_S if self.failure is None else 0.0)
        self.groups.close()
        if self.engram_host is not None:
            self.engram_host.release()

    def _explain(self, error: Exception) -> str:
        """Why the group is out of lockstep (a rank's own report, else the ranks that exited: a dying rank's
        sockets close before its exit code is known, hence the short wait); stops the other ranks."""
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
        _stop_processes(self.procs, self.conns, 0.0)
        return "; ".join(reports or exited) or f"no rank reported; rank 0 saw {type(error).__name__}: {error}"


def _wait_loaded(procs: list[mp.Process], conns: list[Connection]) -> list[RankMemory]:
    """Every rank > 0 reported a loaded shard (its memory, returned in rank order); raises the first one's load
    error, or names a rank that died."""
    waiting = dict(enumerate(conns, start=1))
    memory: dict[int, RankMemory] = {}
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
                memory[rank] = error
                del waiting[rank]
            elif not procs[rank - 1].is_alive():
                raise RuntimeError(f"rank {rank} exited during load (exit code {procs[rank - 1].exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not load their shards within {LOAD_TIMEOUT_S:.0f} s")
    return [memory[rank] for rank in sorted(memory)]


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
