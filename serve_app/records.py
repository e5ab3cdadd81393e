"""Plain records passed between the ingress and the engine deployment (picklable, no Ray, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.core.request import TokenLogprob
from engine.core.sampling_params import SamplingParams


class EngineRejected(ValueError):
    """The engine refused the request before queueing it (bad ids, prompt too long for the context window,
    bad sampling parameters, n above the server's limit, a request id in use); the message says why.
    The ingress answers 400. Through a DeploymentHandle it arrives as a RayTaskError that is also an
    instance of EngineRejected, so `except EngineRejected` works."""


class ReplicaUnavailable(RuntimeError):
    """This replica cannot serve (a shard actor died, the engine loop failed) and its health check fails, so
    Serve replaces it; raised before any chunk. The ingress answers 503 with Retry-After: a retry reaches a
    healthy replica. Through a handle it is a RayTaskError that is also an instance of this class."""


@dataclass(frozen=True, slots=True)
class KVHint:
    """The KV router's decision for one request (serve_app/router.py): which replica should take it, and
    whether another replica that takes it instead should pull the owner's blocks first."""

    fingerprint: bytes  # the engine salt the decision's chain hashes are under
    target: str | None  # the replica to try first (the owner of the longest prefix); None: the least loaded
    pull_from: str | None  # the owner a non-owner replica pulls from; None: it recomputes
    num_blocks: int  # leading global blocks of the prompt the owner holds


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # stop strings are the ingress's business; stop ids go to the engine
    kv_hint: KVHint | None = None  # set by the ingress when KV sharing is on
    # encoded images, one per image placeholder of prompt_ids, in order (the replica decodes and expands them)
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One choice's timing, sent with its last chunk (for the request_end log line and metrics)."""

    ttft_s: float  # arrival at the engine -> first token
    e2e_s: float  # arrival -> finish
    queue_s: float  # arrival -> first scheduled
    num_iterations: int
    average_iteration_ms: float
    average_accept_length: float  # tokens per verify step (1.0 without speculative decoding)
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this choice
    num_accepted_tokens: int = 0  # ... and accepted
    num_pulled_tokens: int = 0  # prompt tokens whose KV was pulled from another replica (choice 0)
    kv_fallback: str | None = None  # why a pull the router asked for was not used (kv_sharing.FallbackReason)


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """What one engine step produced for one choice of a request."""

    choice_index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the choice's last chunk
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # this choice's tokens so far
    metrics: RequestMetrics | None = None  # on the last chunk
    error: str | None = None  # finish_reason "error": what failed


@dataclass(frozen=True, slots=True)
class EngineStatus:
    ready: bool  # weights loaded and a warm-up step ran
    model_name: str
    max_model_len: int
    num_running: int
    num_waiting: int
    cache_usage: float  # fraction of global blocks in use
    prefix_hit_rate: float
    num_global_blocks: int = 0  # the pool's size
    num_global_blocks_in_use: int = 0  # held by requests or prefix-cache snapshots
    num_global_blocks_cached: int = 0  # free but still indexed by hash (evictable prefix cache)
    num_swa_blocks_in_use: int = 0
    # the served model's config when it has a vision tower: the ingress sizes image spans with it
    # (engine/vision/layout.py) to check the context window; None: text only (the replica refuses images)
    vision_config: ModelConfig | None = None
