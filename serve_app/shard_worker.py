"""The model's process: a Ray actor that owns one shard's weights and paged KV pools on its device, and
the engine-side `Executor` that sends it each step's plan.

Only plain data crosses: a picklable `StepPlan` in, a `StepOutput` (token ids; CPU tensors for kept logits) out. The actor is
owned by the replica that made it, so it dies with the replica (and the replica's health check fails
when the actor dies first).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch

from engine.core import kv_blocks
from engine.core.cache_manager import CacheLayout
from engine.config import ModelConfig
from engine.core.decode_buckets import decode_takes
from engine.core.engine import capture_decode_graphs
from engine.core.engine_config import DecodeOptions, RunnerKind, decode_options, kernels_for
from engine.core.kv_cache import PagedKVCache
from engine.core.plan import StepPlan
from engine.core.runner import ModelRunner
from engine.core.step_rows import StepOutput
from engine.load import load_model
from serve_app.settings import ServeSettings


CONCURRENCY_GROUPS = {"step": 1}  # a ShardWorker actor's: steps and block reads/writes one at a time, in order


class ShardWorker:
    """One model shard: weights (engine.load.load_model; the DSpark stages with speculative decoding), its
    PagedKVCache for `layout`, a ModelRunner. Decorate at the use site with `ray.remote(**shard_actor_options(settings))`."""

    def __init__(self, checkpoint: str, device: str, layout: CacheLayout, rank: int = 0, num_shards: int = 1,
                 runner: RunnerKind = "auto", decode: DecodeOptions | None = None):
        if num_shards != 1:
            raise NotImplementedError("the model has no tensor or expert parallelism yet: one shard per replica")
        self.rank, self.device = rank, torch.device(device)
        # the DSpark stages only when the pools hold their context (speculative decoding on)
        loaded = load_model(checkpoint, self.device, with_mtp=layout.num_dspark_layers > 0, progress=False)
        self.kv = PagedKVCache(loaded.cfg, layout, self.device)
        self.runner = ModelRunner(loaded.model, self.kv, kernels_for(runner), decode)
        self.graphs = capture_decode_graphs(self.runner, progress=True)  # the capture's time and memory, logged

    def ready(self) -> dict[str, object]:
        """Answers once the weights and pools are in place (and while a step runs: max_concurrency=2).
        placement_group: the replica's (the actor is captured into it), None when started outside one."""
        pg = ray.get_runtime_context().get_placement_group_id()
        return {"rank": self.rank, "device": str(self.device), "pid": os.getpid(), "placement_group": pg,
                "cache_bytes": self.kv.nbytes, "decode_step": self.runner.decode is not None, "graphs": self.graphs}

    def memory(self) -> int:
        """Bytes of the paged KV pools."""
        return self.kv.nbytes

    @ray.method(concurrency_group="step")
    def execute(self, plan: StepPlan) -> StepOutput:
        """One step: its drawn token ids (sampled beside the model); kept logits come back on the CPU so
        nothing device-bound crosses the process boundary. Steps run one at a time in the order sent (the
        "step" concurrency group): a plan may read the previous step's draws on the device (from_rows)."""
        out = self.runner.execute(plan)
        return replace(out, rows={i: (first, rows.cpu()) for i, (first, rows) in out.rows.items()})

    @ray.method(concurrency_group="step")
    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Global blocks' flat records on the host, uint8 [n, block_bytes] (engine/core/kv_blocks.py)."""
        return kv_blocks.read_blocks(self.kv, block_ids)

    @ray.method(concurrency_group="step")
    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        kv_blocks.write_blocks(self.kv, block_ids, data)


def shard_resources(settings: ServeSettings) -> dict[str, float]:
    """What one shard actor holds: a CPU, and the GPU when the device is cuda (a placement-group bundle)."""
    return {"CPU": 1.0, "GPU": 1.0} if settings.device == "cuda" else {"CPU": 1.0}


def shard_actor_options(settings: ServeSettings) -> dict[str, object]:
    # `ready` (health pings) answers from the default group while a step runs in the "step" group, which
    # runs one call at a time in submission order (the engine may send step k+1 before reading step k).
    res = shard_resources(settings)
    return {"num_cpus": res["CPU"], "num_gpus": res.get("GPU", 0.0), "max_concurrency": 2,
            "concurrency_groups": CONCURRENCY_GROUPS}


class ShardExecutor:
    """The engine's Executor over shard actors (one today). `execute` blocks on the actor; the AsyncEngine
    calls it from its worker thread, never from the event loop. `launch` sends a decode step without waiting
    (when the actor runs the decode step: decode, needs_pending as engine/core/decode_buckets.decode_takes)."""

    def __init__(self, actors: list[ray.actor.ActorHandle], decode: DecodeOptions | None = None,
                 needs_pending: bool = True):
        assert len(actors) == 1, "one shard per replica until the model has tensor/expert parallelism"
        self.actors, self.decode, self.needs_pending = actors, decode, needs_pending
        self.failure: BaseException | None = None  # the first shard death: the replica cannot recover from it

    def execute(self, plan: StepPlan) -> StepOutput:
        """A step that raises inside the actor fails only that step's requests (LLMEngine); a dead actor
        also marks this executor failed, so the replica's health check fails and Serve replaces it."""
        return self._wait(self.actors[0].execute.remote(plan))

    def launch(self, plan: StepPlan) -> "ShardPending | None":
        if self.decode is None or not decode_takes(plan, self.decode, self.needs_pending):
            return None
        return ShardPending(self, self.actors[0].execute.remote(plan))

    def _wait(self, ref: ray.ObjectRef) -> StepOutput:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self.failure = self.failure or e
            raise

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        return ray.get(self.actors[0].read_blocks.remote(block_ids))

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        ray.get(self.actors[0].write_blocks.remote(block_ids, data))

    async def check(self, timeout_s: float) -> None:
        """Raises if a shard actor is dead or does not answer within timeout_s (also if a step has failed)."""
        if self.failure is not None:
            raise RuntimeError(f"a shard actor died: {self.failure!r}") from self.failure
        await asyncio.wait_for(asyncio.gather(*(a.ready.remote() for a in self.actors)), timeout_s)

    async def info(self) -> list[dict[str, object]]:
        return list(await asyncio.gather(*(a.ready.remote() for a in self.actors)))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


@dataclass(slots=True)
class ShardPending:
    """A step sent to the shard actor and not yet read back."""

    executor: ShardExecutor
    ref: ray.ObjectRef

    def result(self) -> StepOutput:
        return self.executor._wait(self.ref)


def make_shard_executor(settings: ServeSettings, cfg: ModelConfig) -> Callable[[CacheLayout], ShardExecutor]:
    """For LLMEngine(cfg, config, make_executor): starts the shard actors for the engine's cache layout and
    waits until they have loaded and captured their decode graphs (a load error is raised here, in the
    replica's constructor)."""
    decode = decode_options(settings.to_engine_config(), cfg)

    def make(layout: CacheLayout) -> ShardExecutor:
        worker = ray.remote(**shard_actor_options(settings))(ShardWorker)
        actors = [worker.remote(settings.checkpoint, settings.device, layout, rank, settings.num_shards, settings.runner,
                                decode) for rank in range(settings.num_shards)]
        infos = ray.get([a.ready.remote() for a in actors])
        on = all(info["decode_step"] for info in infos)
        return ShardExecutor(actors, decode if on else None, 2 in cfg.compress_ratios[:cfg.n_layers])

    return make
