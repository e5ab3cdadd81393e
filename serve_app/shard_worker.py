"""The model's processes: one Ray actor per model shard, owning that shard's weights and paged KV pools on its
device, and the engine-side `Executor` that drives them.

Only plain data crosses: a picklable `StepPlan` in, a `StepOutput` (token ids; CPU tensors for kept logits) out.
The actors are owned by the replica that made them, so they die with it (and the replica's health check fails
when one dies first).

With N > 1 shards (engine/core/shard_lead.py has the protocol): rank 0's actor opens the rendezvous, every actor
loads its shard (mapping the node's one shared copy of the Engram tables), then all join the process groups and
ranks 1.. run their follow loop in their own concurrency group ("follow"), so that `ready` still answers. Per
step the replica makes one Ray call, to rank 0, which broadcasts the plan to the others and runs it; steps
launched ahead run there one at a time in the order sent ("step" group). Rank 0 answers block reads; a block
write reaches every rank through it. A KV pull runs in its own group ("pull"), beside the steps: it writes only
blocks the engine holds for it, unpublished, so no step reads them (engine/core/async_engine.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import numpy as np
import ray
import torch

from engine.config import ModelConfig
from engine.core.cache_manager import CacheLayout
from engine.core import kv_blocks
from engine.core.decode_buckets import decode_takes
from engine.core.engine import capture_decode_graphs
from engine.core.engine_config import DecodeOptions, RunnerKind, decode_options, kernels_for
from engine.core.kv_import import BlockImporter, BlockReader
from engine.core.plan import StepPlan
from engine.core.shard_group import STEP_TIMEOUT
from engine.core.shard_lead import ShardGroupFailed, ShardLeader, follow, load_shard
from engine.core.step_rows import StepOutput
from engine.parallel import GroupAddress, ProcessGroups, Rendezvous, ShardSpec
from serve_app.settings import ServeSettings

# a ShardWorker actor's: steps, block reads/writes and `close` one at a time in the order sent ("step"); the follow
# loop of ranks > 0 ("follow"); KV pulls into the staging buffer, one at a time beside the steps ("pull"); `ready`
# (health pings) in the default group, answering while the others run
CONCURRENCY_GROUPS = {"step": 1, "follow": 1, "pull": 1}
CLOSE_TIMEOUT_S = 5.0  # shutdown: how long the actors get to stop the group and give up the shared tables


class ShardWorker:
    """One model shard (rank `rank` of `num_shards`): weights (engine.load.load_model; its slices of the DSpark
    stages with speculative decoding), its PagedKVCache for `layout`, a ModelRunner. Decorate at the use site with
    `ray.remote(**shard_actor_options(settings))`. With num_shards > 1: `join` the group once every rank is `ready`,
    then ranks > 0 `follow`."""

    def __init__(self, checkpoint: str, device: str, layout: CacheLayout, rank: int = 0, num_shards: int = 1,
                 runner: RunnerKind = "auto", decode: DecodeOptions | None = None,
                 step_timeout_s: float = STEP_TIMEOUT.total_seconds()):
        self.shard = ShardSpec(rank, num_shards)
        # Ray shows each shard actor its own GPU only (num_gpus=1, or a fraction of one it shares), as cuda:0
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
        kernels = kernels_for(runner)
        self.step_timeout = timedelta(seconds=step_timeout_s)
        self.rendezvous = Rendezvous(num_shards, self.step_timeout) if rank == 0 and num_shards > 1 else None
        # with its slices of the DSpark stages when the pools hold their context (speculative decoding on)
        mine = load_shard(checkpoint, self.device, layout, self.shard, kernels, decode)  # prints its memory line
        self.loaded, self.kv, self.runner, self.memory = mine.loaded, mine.kv, mine.runner, mine.memory
        # the capture's time and memory, logged; a group's ranks capture after the join (collectives inside)
        self.graphs = capture_decode_graphs(self.runner, progress=True) if self.shard.is_single else None
        self.groups: ProcessGroups | None = None
        self.leader: ShardLeader | None = None  # rank 0 of a group
        self.follow_error: BaseException | None = None  # ranks > 0: why the follow loop ended
        self.importer: BlockImporter | None = None  # the pinned staging buffer of pulls, made at the first one

    def ready(self) -> dict[str, object]:
        """Answers once the weights and pools are in place (and while a step runs); raises once this rank is out
        of its group's lockstep. placement_group: the replica's (the actor is captured into it), None when started
        outside one. rendezvous: where rank 0 of a group listens (None otherwise)."""
        if self.follow_error is not None:
            raise ShardGroupFailed(f"rank {self.shard.rank}: the follow loop ended: {self.follow_error!r}")
        if self.leader is not None and self.leader.failure is not None:
            raise self.leader.failure
        pg = ray.get_runtime_context().get_placement_group_id()
        return {"rank": self.shard.rank, "num_shards": self.shard.world_size, "device": str(self.device),
                "pid": os.getpid(), "placement_group": pg, "cache_bytes": self.kv.nbytes,
                "decode_step": self.runner.decode is not None, "graphs": self.graphs, "memory": asdict(self.memory),
                "rendezvous": self.rendezvous.address if self.rendezvous is not None else None}

    @ray.method(concurrency_group="step")
    def join(self, address: GroupAddress) -> None:
        """Join the group's process groups (every rank calls it at once; returns when all have joined)."""
        self.groups = ProcessGroups.join(self.shard, address, self.device, self.step_timeout, self.rendezvous)
        # every rank captures the same buckets in the same order: the NCCL collectives inside pair up (CUDA only)
        self.graphs = capture_decode_graphs(self.runner, progress=True)
        if self.shard.rank == 0:
            self.leader = ShardLeader(self.runner, self.kv, self.groups)

    @ray.method(concurrency_group="follow")
    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it stops the group; raises when the group breaks."""
        assert self.groups is not None and self.shard.rank > 0, "follow runs on a joined rank > 0"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread (it is cuda:0 already; say so)
        try:
            follow(self.groups, self.runner, self.kv)
        except BaseException as e:
            self.follow_error = e
            raise

    @ray.method(concurrency_group="step")
    def execute(self, plan: StepPlan) -> StepOutput:
        """One step (on rank 0 of a group: broadcast, then run): its drawn token ids (sampled beside the model);
        kept logits come back on the CPU so nothing device-bound crosses the process boundary. Steps run one
        at a time in the order sent (the "step" concurrency group): a plan may read the previous step's draws on
        the device (from_rows). A group out of lockstep raises ShardGroupFailed."""
        out = self.leader.execute(plan) if self._leads() else self.runner.execute(plan)
        return replace(out, rows={i: (first, rows.cpu()) for i, (first, rows) in out.rows.items()})

    @ray.method(concurrency_group="step")
    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Global blocks' flat records on the host, uint8 [n, block_bytes] (engine/core/kv_blocks.py)."""
        return self.leader.read_blocks(block_ids) if self._leads() else kv_blocks.read_blocks(self.kv, block_ids)

    @ray.method(concurrency_group="step")
    def read_blocks_checked(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """read_blocks and the records' checksums, int64 [n] (summed on the device)."""
        if self._leads():
            return self.leader.read_blocks_checked(block_ids)
        return kv_blocks.read_blocks_checked(self.kv, block_ids)

    @ray.method(concurrency_group="step")
    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        if self._leads():
            self.leader.write_blocks(block_ids, data)
        else:
            kv_blocks.write_blocks(self.kv, block_ids, data)

    @ray.method(concurrency_group="step")
    def barrier(self) -> None:
        """Returns once every step-group call sent before it has run (ShardExecutor.import_blocks' fence)."""

    @ray.method(concurrency_group="pull")
    def prepare_pulls(self) -> str:
        """With KV sharing on, at the replica's start: the staging buffer, and this process's NIXL agent with the
        buffer registered, so that the first pull pays neither (~0.5 s of agent start-up here). Returns the
        agent's name. (kv_transfer, and so NIXL, is imported only here.)"""
        from serve_app.kv_transfer import process_agent

        if self.importer is None:
            self.importer = BlockImporter(self.kv)
        agent = process_agent()
        agent.register(self.importer.buffer)
        return agent.name

    @ray.method(concurrency_group="pull")
    def import_blocks(self, block_ids: list[int], reader: BlockReader) -> None:
        """Pulled blocks into the pools through this actor's staging buffer (engine/core/kv_import.py): the reader
        arrives as a small record (a NIXL reader: the owner's metadata and block addresses) and reads the bytes
        into the buffer here, so they never pass through Ray. Runs in the "pull" group while steps run in theirs:
        the engine holds block_ids for it, unpublished, so no step reads or writes them; on CUDA the copies run
        on the importer's stream and have ended when this returns. A group's leader broadcasts each chunk to the
        other ranks between two steps (ShardLeader runs one command at a time)."""
        if self.importer is None:
            self.importer = BlockImporter(self.kv)
        sink = (lambda ids, rows: self.leader.write_blocks(ids, rows.numpy())) if self._leads() else None
        self.importer.import_blocks(block_ids, reader, sink)

    @ray.method(concurrency_group="step")
    def close(self) -> None:
        """Before the actor is killed: rank 0 stops the group's follow loops (after the steps already sent), and
        every rank gives up its use of the shared Engram tables (the last user on the node unlinks them)."""
        if self.leader is not None:
            self.leader.stop()
        if self.loaded.engram_host is not None:
            self.loaded.engram_host.release()

    def _leads(self) -> bool:
        """True on rank 0 of a group (it broadcasts), False on a single shard; ranks > 0 take commands only
        from rank 0's broadcast."""
        assert self.shard.is_single or self.leader is not None, (
            f"rank {self.shard.rank} of a group: steps go to rank 0 only (and only once the group is joined)")
        return self.leader is not None


def shard_resources(settings: ServeSettings) -> dict[str, float]:
    """What one shard actor holds: a CPU, and on cuda its GPU, or the fraction --gpu-fraction names (a placement-
    group bundle; Ray shows every actor that shares a GPU the same device)."""
    return {"CPU": 1.0, "GPU": settings.gpu_fraction} if settings.device == "cuda" else {"CPU": 1.0}


def shard_actor_options(settings: ServeSettings) -> dict[str, object]:
    # `ready` (health pings) answers from the default group while a step runs in the "step" group, which
    # runs one call at a time in submission order (the engine may send step k+1 before reading step k).
    res = shard_resources(settings)
    return {"num_cpus": res["CPU"], "num_gpus": res.get("GPU", 0.0), "max_concurrency": 2,
            "concurrency_groups": CONCURRENCY_GROUPS}


class ShardExecutor:
    """The engine's Executor over the replica's shard actors (rank 0 first). `execute` blocks on rank 0's actor;
    the AsyncEngine calls it from its worker thread, never from the event loop. `launch` sends a decode step
    without waiting (when the actors run the decode step: decode, needs_pending as
    engine/core/decode_buckets.decode_takes). follows: the follow-loop calls of ranks 1.. (they end only when the
    group stops or breaks)."""

    def __init__(self, actors: list[ray.actor.ActorHandle], decode: DecodeOptions | None = None,
                 needs_pending: bool = True, follows: list[ray.ObjectRef] | None = None):
        self.actors, self.decode, self.needs_pending = actors, decode, needs_pending
        self.follows = list(follows or [])
        self.failure: BaseException | None = None  # a shard died or the group broke: the replica cannot recover

    def execute(self, plan: StepPlan) -> StepOutput:
        """A step that raises inside the actor fails only that step's requests (LLMEngine); a dead actor or a
        group out of lockstep also marks this executor failed, so the replica's health check fails and Serve
        replaces it."""
        return self._wait(self.actors[0].execute.remote(plan))

    def launch(self, plan: StepPlan) -> "ShardPending | None":
        if self.decode is None or not decode_takes(plan, self.decode, self.needs_pending):
            return None
        return ShardPending(self, self.actors[0].execute.remote(plan))

    def _wait(self, ref: ray.ObjectRef):
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self.failure = self.failure or e
            raise
        except ShardGroupFailed as e:  # Ray's RayTaskError that is also the actor's error: raise that, its text first
            cause = getattr(e, "cause", e)
            self.failure = self.failure or cause
            raise cause from None

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        return self._wait(self.actors[0].read_blocks.remote(block_ids))

    def read_blocks_checked(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return self._wait(self.actors[0].read_blocks_checked.remote(block_ids))

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        self._wait(self.actors[0].write_blocks.remote(block_ids, data))

    def import_blocks(self, block_ids: list[int], reader: BlockReader) -> None:
        """Called on the engine's pull thread while steps go on. First a fence through the step group: a step
        sent before these blocks were held (a launched step of a request aborted since, whose blocks were freed
        and are among block_ids now) has run before the import writes them, so it cannot write them after."""
        self._wait(self.actors[0].barrier.remote())
        self._wait(self.actors[0].import_blocks.remote(block_ids, reader))

    def prepare_pulls(self) -> None:
        self._wait(self.actors[0].prepare_pulls.remote())

    async def check(self, timeout_s: float) -> None:
        """Raises if a shard actor is dead, out of its group's lockstep, or does not answer within timeout_s (also
        if a step has failed). A dead or failed shard marks the executor failed (the replica then refuses
        requests until Serve replaces it); a slow answer does not."""
        if self.failure is not None:
            raise RuntimeError(f"a shard actor died or its group broke: {self.failure!r}") from self.failure
        ended, _ = ray.wait(self.follows, num_returns=len(self.follows), timeout=0) if self.follows else ([], [])
        try:
            for ref in ended:
                ray.get(ref)
                raise ShardGroupFailed("a shard's follow loop ended while the group was running")
            await asyncio.wait_for(asyncio.gather(*(a.ready.remote() for a in self.actors)), timeout_s)
        except (ray.exceptions.RayError, ShardGroupFailed) as e:
            self.failure = self.failure or e
            raise

    async def info(self) -> list[dict[str, object]]:
        return list(await asyncio.gather(*(a.ready.remote() for a in self.actors)))

    def shutdown(self) -> None:
        """Stop the group and release the shared tables where the actors still answer, then kill them all."""
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=CLOSE_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # a dead or stuck shard: killed below all the same (the kernel drops its hold on the tables)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.follows = [], []


@dataclass(slots=True)
class ShardPending:
    """A step sent to the shard actor and not yet read back."""

    executor: ShardExecutor
    ref: ray.ObjectRef

    def result(self) -> StepOutput:
        return self.executor._wait(self.ref)


def make_shard_executor(settings: ServeSettings, cfg: ModelConfig) -> Callable[[CacheLayout], ShardExecutor]:
    """For LLMEngine(cfg, config, make_executor): starts the replica's shard actors for the engine's cache layout,
    waits until they have loaded and captured their decode graphs, and with several shards joins them into one
    group and starts the follow loops (a load error is raised here, in the replica's constructor)."""
    decode = decode_options(settings.to_engine_config(), cfg)

    def make(layout: CacheLayout) -> ShardExecutor:
        worker = ray.remote(**shard_actor_options(settings))(ShardWorker)
        actors = [worker.remote(settings.checkpoint, settings.device, layout, rank, settings.num_shards,
                                settings.runner, decode) for rank in range(settings.num_shards)]
        try:
            infos = ray.get([a.ready.remote() for a in actors])
            follows = []
            if len(actors) > 1:
                ray.get([a.join.remote(infos[0]["rendezvous"]) for a in actors])
                follows = [a.follow.remote() for a in actors[1:]]
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise
        on = all(info["decode_step"] for info in infos)
        return ShardExecutor(actors, decode if on else None, 2 in cfg.compress_ratios[:cfg.n_layers], follows)

    return make
