"""ShardExecutor.launch: decode steps sent to the shard actor without waiting run there one at a time, in the
order sent (a plan may read the previous step's draws on the device), while health pings still answer; steps the
decode step does not take are not launched."""

from __future__ import annotations

import time

import pytest
import ray

from engine.core.engine_config import DecodeOptions
from engine.core.plan import ChunkPlan, SampleSpec, StepPlan
from engine.core.sampler import SampleOutput
from engine.core.sampling_params import SamplingParams
from engine.core.step_rows import StepOutput
from serve_app.settings import ServeSettings
from serve_app.shard_worker import ShardExecutor, shard_actor_options


def plan_at(pos: int, **kw) -> StepPlan:
    chunk = ChunkPlan(pos, pos + 1, [5], [1, 2, 3], True, False, [0], {0: 0}, 0, 0, 0, 0, 0)
    return StepPlan([chunk], [], [SampleSpec(0, SamplingParams(), 1, 0)], **kw)


def test_launched_steps_run_in_order_one_at_a_time(ray_session, tiny_checkpoint):
    class RecordingShard:
        """A stand-in shard actor with ShardWorker's concurrency groups: the first step is slow."""

        def __init__(self):
            self.log: list[tuple[str, int]] = []

        def ready(self) -> dict:
            return {"log": list(self.log)}

        @ray.method(concurrency_group="step")
        def execute(self, plan: StepPlan) -> StepOutput:
            step = plan.chunks[0].start
            self.log.append(("start", step))
            if step == 10:
                time.sleep(1.0)
            self.log.append(("end", step))
            return StepOutput(SampleOutput([step], [None], [None]), {})

    settings = ServeSettings.from_mapping({"checkpoint": str(tiny_checkpoint)}, environ={})
    actor = ray.remote(**shard_actor_options(settings))(RecordingShard).remote()
    ray.get(actor.ready.remote())  # started
    executor = ShardExecutor([actor], DecodeOptions(max_batch=4, max_model_len=512), needs_pending=True)
    assert ShardExecutor([actor]).launch(plan_at(10)) is None  # the actor has no decode step
    assert executor.launch(StepPlan(plan_at(10).chunks, [], [])) is None  # nothing sampled: not a decode step
    first = executor.launch(plan_at(10))
    second = executor.launch(plan_at(11, from_rows=[0]))
    t0 = time.monotonic()
    pinged = ray.get(actor.ready.remote())  # answers while the slow step runs
    assert time.monotonic() - t0 < 0.9 and ("end", 10) not in pinged["log"]
    assert second.result().sample.token_ids == [11] and first.result().sample.token_ids == [10]
    assert ray.get(actor.ready.remote())["log"] == [("start", 10), ("end", 10), ("start", 11), ("end", 11)]
    ray.kill(actor)


def test_a_group_takes_each_step_and_launch_through_rank_0_only(ray_session, tiny_checkpoint):
    """With several shards the replica makes one call per step, to rank 0 (which broadcasts to the others): the
    other ranks' actors get none, launched steps included, and run in rank 0's order."""

    class CountingShard:
        def __init__(self):
            self.steps: list[int] = []

        def ready(self) -> dict:
            return {"steps": list(self.steps)}

        @ray.method(concurrency_group="step")
        def execute(self, plan: StepPlan) -> StepOutput:
            self.steps.append(plan.chunks[0].start)
            return StepOutput(SampleOutput([plan.chunks[0].start], [None], [None]), {})

        @ray.method(concurrency_group="step")
        def close(self) -> None:
            pass

    settings = ServeSettings.from_mapping({"checkpoint": str(tiny_checkpoint)}, environ={})
    rank0, rank1 = (ray.remote(**shard_actor_options(settings))(CountingShard).remote() for _ in range(2))
    executor = ShardExecutor([rank0, rank1], DecodeOptions(max_batch=4, max_model_len=512), needs_pending=True)
    assert executor.execute(plan_at(3)).sample.token_ids == [3]
    pending = [executor.launch(plan_at(4)), executor.launch(plan_at(5, from_rows=[0]))]
    assert [p.result().sample.token_ids for p in pending] == [[4], [5]]
    assert ray.get(rank0.ready.remote())["steps"] == [3, 4, 5] and ray.get(rank1.ready.remote())["steps"] == []
    executor.shutdown()  # closes, then kills, every rank
    assert_dies(rank0) and assert_dies(rank1)


def assert_dies(actor, within_s: float = 30.0) -> bool:
    """ray.kill is asynchronous: a call sent just after it may still be answered, so poll until the actor is gone."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the actor still answers {within_s:.0f} s after it was killed")
