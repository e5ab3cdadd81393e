"""The engine deployment: one replica = one LLMEngine (scheduler, cache manager, sampler in this process)
driving its model shard actors (one, or `num_shards` in one group: serve_app/shard_worker.py), wrapped in an
AsyncEngine that streams each request's outputs.

The ingress calls `handle.options(stream=True).generate.remote(GenerateRequest)` and gets one
`GenerateChunk` per engine output. When the ingress cancels the call (client disconnect), Ray cancels
this generator; the AsyncEngine then aborts the request group and frees its cache.

With KV sharing on (settings.kv_sharing), a request's KVHint may first make the replica pull the prompt's
blocks from their owner, and every request's full blocks are published when it ends
(serve_app/kv_sharing.py, imported only then: through kv_transfer it loads NIXL and UCX); the replica
reports its measured pulls and prefills to the KVRouter.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray import serve

from engine.config import load_config
from engine.core.async_engine import AsyncEngine, EngineShutdownError, EngineStuckError
from engine.core.engine import LLMEngine, RequestError, RequestOutput
from engine.core.grammar import GrammarCompiler
from engine.core.request import RequestStats
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.vision import ImageError
from engine.vision.image_processing import ImageLimits, prepare_image_prompt
from engine.tokenizer import load_tokenizer
from serve_app import router as kv_router
from serve_app.kv_metrics import KVMetrics
from serve_app.metrics import ServeMetrics, log_request_end, request_end_record, request_logger
from serve_app.records import (EngineRejected, EngineStatus, GenerateChunk, GenerateRequest, ReplicaUnavailable,
                               RequestMetrics)
from serve_app.settings import ServeSettings
from serve_app.shard_worker import ShardExecutor, make_shard_executor, shard_resources

if TYPE_CHECKING:  # imported when KV sharing is on (EngineReplica.__init__): it brings NIXL and UCX
    from serve_app.kv_sharing import KVSharing, PullOutcome

WARM_UP_TEXT = "Hello, world"
WARM_UP_TOKENS = 2
GAUGE_PERIOD_S = 1.0  # engine-state gauges refresh at most this often from the streaming path
SHARD_PING_TIMEOUT_S = 20.0
ROUTER_REPORT_TIMEOUT_S = 5.0
KV_CLOSE_TIMEOUT_S = 10.0
logger = logging.getLogger("dsv41.kv")


@dataclass(slots=True)
class _Choice:
    stats: RequestStats | None = None  # a copy of the engine's record as of the latest output
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    last_token_time: float | None = None
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Group:
    """One request's choices as the stream delivers them; choice 0 computed the prompt."""

    request_id: str
    num_choices: int
    num_prompt_tokens: int
    choices: dict[int, _Choice] = field(default_factory=dict)
    kv: PullOutcome | None = None  # what the KV prefetch did (KV sharing on and a hint given)

    @property
    def first(self) -> RequestStats | None:
        c = self.choices.get(0)
        return c.stats if c else None


class EngineReplica:
    def __init__(self, settings: ServeSettings, router=None):
        """router: the KVRouter deployment's handle (KV sharing on), told of measured pulls and prefills."""
        self.settings, self.router = settings, router
        ckpt = Path(settings.checkpoint)
        cfg = self.cfg = load_config(ckpt)
        self.image_limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels)
        tokenizer = load_tokenizer(ckpt)
        grammars = GrammarCompiler(tokenizer.path.read_text(encoding="utf-8"), tokenizer.eos_id)
        self.engine = LLMEngine(cfg, settings.to_engine_config(), make_shard_executor(settings, cfg),
                                eos_token_id=tokenizer.eos_id, weights_identity=str(ckpt.resolve()),
                                grammars=grammars)
        self.executor: ShardExecutor = self.engine.executor
        self.metrics = ServeMetrics(settings.model_name)
        self.request_log = request_logger(settings.request_log_file)
        self._loop_failure: BaseException | None = None  # the engine loop raised: unhealthy from then on
        self._gauges_at = 0.0
        # a real step on the shard before the replica reports ready (runs to completion, nothing left queued)
        warm_ids = tokenizer.encode(WARM_UP_TEXT) or [tokenizer.bos_id]
        self.engine.generate([warm_ids], SamplingParams(max_tokens=WARM_UP_TOKENS, ignore_eos=True))
        self.aengine = AsyncEngine(self.engine)
        self.kv: KVSharing | None = None
        self._reports: set[asyncio.Task] = set()
        if settings.kv_sharing:
            from serve_app.kv_sharing import KVSharing

            self.kv_metrics = KVMetrics(settings.model_name)
            self.kv = KVSharing.create(self.aengine, serve.get_replica_context().replica_id.unique_id,
                                       settings.redis_url, region=settings.region,
                                       host_kv_bytes=settings.host_kv_bytes, metrics=self.kv_metrics,
                                       same_node_reads=settings.kv_same_node_reads,
                                       on_pull=lambda nbytes, seconds: self._report("observe_pull", nbytes, seconds))
        self._update_gauges(force=True)

    @property
    def failure(self) -> BaseException | None:
        """Why this replica cannot serve (the engine loop raised, or a shard actor died), else None. A
        request's own failure (a step that raised, unusable logits) ends only that request."""
        return self._loop_failure or self.executor.failure

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """One GenerateChunk per engine output of every choice; a choice's last chunk carries its finish
        reason and metrics. Raises EngineRejected (before any chunk) for a request the engine refuses, and
        ReplicaUnavailable while this replica is failing."""
        if self.failure is not None:
            raise ReplicaUnavailable(f"this replica is failing (Serve will replace it): {self.failure!r}")
        try:
            req.params.validate()
        except SamplingError as e:
            raise EngineRejected(str(e)) from None
        if req.params.n > self.settings.max_n:
            raise EngineRejected(f"n must be at most {self.settings.max_n}, got {req.params.n}")
        prompt_ids, images = list(req.prompt_ids), []
        if req.images:  # decoded, resized and expanded off the event loop (and off the engine's thread)
            try:
                prompt_ids, images = await asyncio.to_thread(prepare_image_prompt, prompt_ids, req.images, self.cfg,
                                                             self.image_limits)
            except ImageError as e:
                raise EngineRejected(str(e)) from None
        group = _Group(req.request_id, req.params.n, len(prompt_ids))
        end_reason = "abort"  # for choices left unfinished: the consumer went away
        share_kv = self.kv is not None and not images  # image spans are not shared between replicas (yet)
        if share_kv:
            self.kv.start_renewal()
            group.kv = await self.kv.prefetch(prompt_ids, req.kv_hint)  # falls back, never raises
        stream = self.aengine.generate(req.request_id, prompt_ids, req.params, images=images)
        try:
            async for out in stream:
                yield self._chunk(group, out)
                self._update_gauges()
        except RequestError as e:
            end_reason = None
            raise EngineRejected(str(e)) from None
        except (EngineStuckError, EngineShutdownError):
            end_reason = "error"
            raise
        except Exception as e:
            end_reason = "error"
            self._loop_failure = self._loop_failure or e
            raise
        finally:
            await stream.aclose()  # a closed (not cancelled) consumer: abort the group before counting
            if end_reason is not None:
                for index in range(group.num_choices):
                    choice = group.choices.setdefault(index, _Choice(num_prompt_tokens=group.num_prompt_tokens))
                    if not choice.finished:
                        self._end_choice(group, index, choice, end_reason)
                if share_kv and end_reason == "abort":  # finished or aborted, not failed
                    first = group.choices.get(0)
                    self.kv.publish_soon(list(req.prompt_ids) + (first.token_ids if first else []))
            self._update_gauges(force=True)

    async def status(self) -> EngineStatus:
        cache = self.engine.cache
        self._update_gauges(force=True)
        return EngineStatus(ready=self.failure is None, model_name=self.settings.model_name,
                            max_model_len=self.engine.max_model_len, num_running=len(self.engine.scheduler.running),
                            num_waiting=len(self.engine.scheduler.waiting), cache_usage=cache.usage,
                            prefix_hit_rate=cache.hit_rate, num_global_blocks=cache.layout.num_global_blocks,
                            num_global_blocks_in_use=cache.global_pool.num_in_use,
                            num_global_blocks_cached=cache.global_pool.num_cached,
                            num_swa_blocks_in_use=cache.swa_pool.num_in_use,
                            vision_config=self.cfg if self.cfg.has_vision else None)

    async def check_health(self) -> None:
        """Serve's health hook: raises if a step failed, a shard actor is dead or unresponsive, or the shards'
        group is out of lockstep (Serve then replaces the replica, shard actors and all)."""
        if self.failure is not None:
            raise RuntimeError(f"this replica cannot serve: {self.failure!r}") from self.failure
        await self.executor.check(SHARD_PING_TIMEOUT_S)
        if self.kv is not None:
            self.kv.start_renewal()  # keeps the peer record alive on an idle replica too
        self._update_gauges(force=True)

    async def check_integrity(self) -> None:
        """When idle (nothing running, waiting or held by a request): the scheduler's and cache manager's
        self-checks pass and the pools hold exactly what prefix-cache snapshots hold. Raises otherwise."""
        engine, sched = self.engine, self.engine.scheduler
        if sched.running or sched.waiting or engine.requests:
            raise RuntimeError(f"not idle: {len(sched.running)} running, {len(sched.waiting)} waiting, "
                               f"{len(engine.requests)} requests held")
        sched.check_integrity()
        snapshots = engine.cache.snapshots.values()
        in_use = engine.cache.global_pool.num_in_use, engine.cache.swa_pool.num_in_use
        held = len({b for s in snapshots for b in s.global_blocks}), sum(len(s.swa_blocks) for s in snapshots)
        assert in_use == held, f"blocks in use (global, swa) {in_use}, snapshots hold {held}"

    async def shard_info(self) -> list[dict[str, object]]:
        """Each shard actor's rank, device, process id, KV pool bytes and memory (weights, KV pools, Engram host
        tables and the file backing them), rank 0 first."""
        return await self.executor.info()

    async def metrics_snapshot(self) -> dict[str, float]:
        """This replica's recorded metric values (see ServeMetrics.snapshot)."""
        return self.metrics.snapshot()

    async def kv_status(self) -> dict[str, object]:
        """KV sharing as this replica sees it: its replica id and actor name, blocks in its host store, the
        engine's counters and the kv metrics it recorded."""
        if self.kv is None:
            return {"enabled": False}
        return {"enabled": True, "replica_id": self.kv.replica_id, "actor_name": ray.get_runtime_context().get_actor_name(),
                "num_stored_blocks": self.kv.store.num_blocks, "engine": asdict(self.engine.stats),
                "metrics": self.kv_metrics.snapshot()}

    async def kv_flush(self) -> None:
        """Waits until the blocks of every request ended so far are stored and published."""
        if self.kv is not None:
            await self.kv.flush()

    async def __del__(self) -> None:
        """Serve's graceful shutdown: publish what ended, withdraw this replica's KV records, fail the
        remaining streams, stop the shard actors."""
        if self.kv is not None:
            try:
                await asyncio.wait_for(self.kv.flush(), KV_CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("KV sharing: publishes still pending after %.0f s at shutdown", KV_CLOSE_TIMEOUT_S)
            await self.kv.close()
        await self.aengine.shutdown()
        self.executor.shutdown()

    # ---- internals ----------------------------------------------------------------------------------
    def _chunk(self, group: _Group, out: RequestOutput) -> GenerateChunk:
        now = time.monotonic()
        choice = group.choices.setdefault(out.choice_index, _Choice())
        is_first = choice.stats is None
        choice.stats, choice.num_prompt_tokens = out.stats, out.num_prompt_tokens  # each output carries a fresh copy
        choice.token_ids += out.new_token_ids
        inter_token = None if choice.last_token_time is None else now - choice.last_token_time
        choice.last_token_time, choice.num_output_tokens = now, out.num_output_tokens
        if is_first and out.choice_index == 0:
            self.metrics.observe_prompt(out.num_prompt_tokens, out.stats.num_cached_tokens)
            if out.stats.first_token_time is not None:  # None: it failed before its first token
                self.metrics.observe_first_token(out.stats.first_token_time - out.stats.arrival_time)
            if self.kv is not None:
                self.kv.observe_hits(group.kv, out.stats.num_cached_tokens)
        self.metrics.observe_tokens(len(out.new_token_ids), inter_token)
        metrics = None
        if out.finished:
            choice.finished = True
            metrics = self._end_choice(group, out.choice_index, choice, out.finish_reason.value)
        return GenerateChunk(out.choice_index, out.new_token_ids, out.new_logprobs,
                             out.finish_reason.value if out.finish_reason else None, out.num_prompt_tokens,
                             _cached_tokens(group, choice), out.num_output_tokens, metrics, out.error)

    def _end_choice(self, group: _Group, index: int, choice: _Choice, finish_reason: str) -> RequestMetrics:
        metrics = _request_metrics(group, choice)
        if index == 0 and group.kv is not None:
            metrics = replace(metrics, num_pulled_tokens=group.kv.num_pulled_tokens, kv_fallback=group.kv.fallback)
        self.metrics.observe_finish(finish_reason, None if math.isnan(metrics.e2e_s) else metrics.e2e_s)
        if choice.stats is not None and choice.stats.num_verify_steps:
            self.metrics.observe_accept_length(metrics.average_accept_length)
        request_id = group.request_id if index == 0 else f"{group.request_id}/{index}"
        record = request_end_record(request_id, choice.num_prompt_tokens, _cached_tokens(group, choice),
                                    choice.num_output_tokens, metrics, finish_reason)
        if self.kv is not None and index == 0:
            record["kv"] = (group.kv or self.kv.NO_PULL).log_fields()
            stats = choice.stats
            if stats is not None and stats.prefill_time > 0:
                self._report("observe_prefill", stats.num_computed_prompt_tokens, stats.prefill_time)
        log_request_end(self.request_log, record)
        return metrics

    def _report(self, method: str, *args) -> None:
        """Tells the KVRouter a measurement, in the background (a router down or restarting misses it)."""
        if self.router is None:
            return

        async def send() -> None:
            try:
                await asyncio.wait_for(getattr(self.router, method).remote(*args), ROUTER_REPORT_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 -- a lost measurement only delays the cost model
                logger.info("KV router did not take %s%s: %r", method, args, e)

        task = asyncio.get_running_loop().create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _update_gauges(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._gauges_at < GAUGE_PERIOD_S:
            return
        self._gauges_at = now
        sched, cache = self.engine.scheduler, self.engine.cache
        self.metrics.set_engine_state(len(sched.running), len(sched.waiting), cache.usage, cache.hit_rate)


def _forked(stats: RequestStats) -> bool:
    """A choice > 0 that copied choice 0's prompt state was never scheduled from the waiting queue."""
    return stats.first_scheduled_time is None


def _cached_tokens(group: _Group, choice: _Choice) -> int:
    stats = choice.stats
    if stats is None:
        return 0
    if _forked(stats) and group.first is not None:
        return group.first.num_cached_tokens
    return stats.num_cached_tokens


def _request_metrics(group: _Group, choice: _Choice) -> RequestMetrics:
    """Times from the group's arrival (a forked choice's own record starts when it was forked). NaN where
    a time is unknown (an aborted choice that never got a token)."""
    stats, first = choice.stats, group.first
    if stats is None and first is None:
        return RequestMetrics(math.nan, math.nan, math.nan, 0, 0.0, 1.0, 0)
    stats = stats or RequestStats(arrival_time=first.arrival_time)
    first = first or stats
    arrival = first.arrival_time
    scheduled = stats.first_scheduled_time or first.first_scheduled_time
    finish = stats.finish_time if stats.finish_time is not None else time.monotonic()

    def since(t: float | None) -> float:
        return math.nan if t is None else t - arrival

    iterations = stats.num_iterations
    busy = stats.prefill_time + stats.decode_time
    return RequestMetrics(ttft_s=since(stats.first_token_time), e2e_s=since(finish), queue_s=since(scheduled),
                          num_iterations=iterations, average_iteration_ms=busy / iterations * 1000 if iterations else 0.0,
                          average_accept_length=stats.average_accept_length, num_preemptions=stats.num_preemptions,
                          num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens)


def deployment(settings: ServeSettings) -> serve.Deployment:
    """The EngineReplica deployment with its options from settings; bind it with the same settings (and
    the KVRouter's handle when KV sharing is on): `deployment(s).bind(s, router)`. Each replica reserves a
    placement group: bundle 0 for the replica process, one bundle per shard actor (its GPU when the
    device is cuda), packed on one node. With KV sharing, handles route by the request's KVHint."""
    bundles = [{"CPU": settings.replica_num_cpus}] + [shard_resources(settings)] * settings.num_shards
    routing = {"request_router_config": kv_router.request_router_config()} if settings.kv_sharing else {}
    return serve.deployment(EngineReplica).options(
        **routing,
        num_replicas=settings.num_replicas,
        max_ongoing_requests=settings.max_ongoing_requests,
        health_check_period_s=settings.health_check_period_s,
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": settings.replica_num_cpus},
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK",
    )
