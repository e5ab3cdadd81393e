"""KV-aware routing: the KVRouter deployment decides which replica should take a request and whether
another one should pull; the engine deployment's Serve request router carries the decision out.

1. The ingress tokenizes the prompt (once) and asks `KVRouter.route(request_id, prompt_ids)`.
2. KVRouter hashes the prompt's full blocks under the engine salt, reads from the ownership index (Redis)
   the longest prefix one live replica holds, and returns a KVHint: target = that owner; pull_from = the
   owner too when the cost model says reading the blocks beats recomputing them (else None: a replica
   other than the owner recomputes). Every decision is logged as a `kv_route` JSON line and counted.
   KVRouter keeps no ownership state: each decision reads Redis, so a restarted router routes by
   ownership from its first request (only its cost estimates restart from their defaults).
3. The ingress sends the GenerateRequest (hint inside) through the engine handle, whose request router is
   KVAffinityRequestRouter: the target replica when its load allows (its queue within
   `max_owner_excess` requests of the least loaded other replica, and not full), else the least loaded
   other replica -- which then pulls from the owner before admitting the prompt (serve_app/kv_sharing.py).
   A request without a target goes by power of two choices, as Serve's default router does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from engine.config import load_config
from engine.core.engine import prefix_salt
from engine.core.kv_blocks import block_bytes
from engine.core.prefix_hash import block_hashes
from serve_app.kv_metrics import KVMetrics
from serve_app.ownership import OwnershipIndex, OwnershipUnavailable
from serve_app.records import KVHint
from serve_app.settings import ServeSettings

ROUTE_LOGGER = "dsv41.kv_route"
DEFAULT_PULL_BANDWIDTH = 1.0e9  # B/s: NIXL (UCX) host-to-host over loopback/TCP reaches 1-2.5 GiB/s here
DEFAULT_PULL_LATENCY_S = 0.005  # a Redis lookup, a NIXL post and an import, for a small pull
DEFAULT_PREFILL_TOK_S = 10_000.0  # until a replica reports its own
MIN_BANDWIDTH_SAMPLE_BYTES = 1 << 20  # smaller pulls measure latency, larger ones bandwidth
MIN_PREFILL_SAMPLE_TOKENS = 64
RECENT_DECISIONS = 256


@dataclass(slots=True)
class CostModel:
    """Pull or recompute. Pulling n tokens costs latency + n * bytes_per_token / bandwidth; recomputing
    costs the prefill of the tokens the pull saves: n - window, since a pulled prefix still replays its
    last window. Bandwidth, latency and prefill speed follow what replicas measure (EWMA, weight alpha)."""

    bytes_per_token: float
    window: int
    pull_bandwidth: float = DEFAULT_PULL_BANDWIDTH
    pull_latency_s: float = DEFAULT_PULL_LATENCY_S
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S
    alpha: float = 0.2

    def pull_s(self, num_tokens: int) -> float:
        return self.pull_latency_s + num_tokens * self.bytes_per_token / self.pull_bandwidth

    def recompute_s(self, num_tokens: int) -> float:
        return max(0, num_tokens - self.window) / self.prefill_tok_s

    def should_pull(self, num_tokens: int) -> bool:
        return self.pull_s(num_tokens) < self.recompute_s(num_tokens)

    def observe_pull(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        if num_bytes >= MIN_BANDWIDTH_SAMPLE_BYTES:  # includes the latency: errs toward recomputing
            self.pull_bandwidth += self.alpha * (num_bytes / seconds - self.pull_bandwidth)
        else:
            self.pull_latency_s += self.alpha * (seconds - self.pull_latency_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            self.prefill_tok_s += self.alpha * (num_tokens / seconds - self.prefill_tok_s)


class KVRouter:
    """The router deployment (one replica; Serve restarts it if it dies)."""

    def __init__(self, settings: ServeSettings):
        checkpoint = Path(settings.checkpoint)
        cfg = load_config(checkpoint)
        self.block_size = settings.to_engine_config().global_block_size
        # the same salt every EngineReplica of these settings computes (LLMEngine: weights_identity = the path)
        self.salt = prefix_salt(cfg, str(checkpoint.resolve()), self.block_size)
        self.index = OwnershipIndex(settings.redis_url, replica_id=f"router-{uuid.uuid4().hex[:8]}",
                                    region=settings.region, fingerprint=self.salt)
        self.cost = CostModel(block_bytes(cfg, self.block_size) / self.block_size, cfg.window_size)
        self.metrics = KVMetrics(settings.model_name)
        self.log = _route_logger()
        self.recent: deque[dict] = deque(maxlen=RECENT_DECISIONS)

    async def route(self, request_id: str, prompt_ids: list[int]) -> KVHint | None:
        """The decision for one prompt; None when no replica owns a usable prefix (or Redis is down)."""
        B = self.block_size
        usable = max(0, (len(prompt_ids) - 1) // B)  # a prefix hit leaves one position to compute
        record: dict[str, object] = {"event": "kv_route", "request_id": request_id, "prompt_tokens": len(prompt_ids)}
        hint = None
        if usable == 0:
            decision = "short"
        else:
            hashes = block_hashes(prompt_ids[:usable * B], B, self.salt)
            try:
                num_blocks, owner, _ = await asyncio.to_thread(self.index.longest_owned_prefix, hashes)
            except OwnershipUnavailable as e:
                num_blocks, owner, decision = 0, None, "redis_unavailable"
                record["error"] = str(e)
            else:
                decision = "none"
            if owner is not None:
                n = num_blocks * B
                pull = self.cost.should_pull(n)
                hint = KVHint(self.salt, owner.replica_id, owner.replica_id if pull else None, num_blocks)
                decision = "owner_or_pull" if pull else "owner_or_recompute"
                record.update(owner=owner.replica_id, owned_tokens=n, pull_ms=round(self.cost.pull_s(n) * 1e3, 3),
                              recompute_ms=round(self.cost.recompute_s(n) * 1e3, 3))
        record["decision"] = decision
        self.metrics.observe_decision(decision)
        self.recent.append(record)
        self.log.info(json.dumps(record, separators=(",", ":")))
        return hint

    async def observe_pull(self, num_bytes: int, seconds: float) -> None:
        """A replica's measured pull (lookup + read + import) of num_bytes."""
        self.cost.observe_pull(num_bytes, seconds)

    async def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A replica's measured prefill of num_tokens prompt positions."""
        self.cost.observe_prefill(num_tokens, seconds)

    async def status(self) -> dict[str, object]:
        """The cost model's current estimates, recent decisions (newest last), this actor's name."""
        return {"cost": asdict(self.cost), "recent": list(self.recent), "metrics": self.metrics.snapshot(),
                "actor_name": ray.get_runtime_context().get_actor_name()}


def deployment(settings: ServeSettings) -> serve.Deployment:
    """The KVRouter deployment; bind it with the same settings."""
    return serve.deployment(KVRouter).options(name="KVRouter", num_replicas=1, max_ongoing_requests=1024,
                                              health_check_period_s=settings.health_check_period_s,
                                              ray_actor_options={"num_cpus": 0})


def request_router_config(max_owner_excess: int = 2) -> RequestRouterConfig:
    """The engine deployment's request router (used by every handle to it, the ingress's included)."""
    return RequestRouterConfig(request_router_class=KVAffinityRequestRouter,
                               request_router_kwargs={"max_owner_excess": max_owner_excess})


class KVAffinityRequestRouter(RequestRouter):
    """Serve's request router for the engine deployment: a request goes to its KVHint's target when the
    target's load allows, else to the least loaded other replica; without a target, the less loaded of
    two random replicas. (No FIFOMixin: a chosen replica serves the request it was chosen for.)"""

    def initialize_state(self, max_owner_excess: int = 2) -> None:
        self.max_owner_excess = max_owner_excess

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank refused: back off, then retry
        target = _target(pending_request)
        owner = next((r for r in candidate_replicas if r.replica_id.unique_id == target), None)
        if owner is None:  # no hint, or its target is gone
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        others = [r for r in candidate_replicas if r is not owner]
        if self._load_allows(owner, others):
            return [[owner], others]
        return [others, [owner]]

    def _load_allows(self, owner: RunningReplica, others: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        queued = cache.get(owner.replica_id)
        if queued is None:  # unknown: Serve probes it, and passes over it when it is full
            return True
        known = [q for q in (cache.get(r.replica_id) for r in others) if q is not None]
        return queued < owner.max_ongoing_requests and queued - min(known, default=0) <= self.max_owner_excess


def _target(pending_request: PendingRequest | None) -> str | None:
    for arg in pending_request.args if pending_request is not None else ():
        hint = getattr(arg, "kv_hint", None)
        if hint is not None:
            return hint.target
    return None


def _route_logger() -> logging.Logger:
    """`dsv41.kv_route` at INFO: bare JSON lines on stderr (the router replica's log)."""
    logger = logging.getLogger(ROUTE_LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    return logger
