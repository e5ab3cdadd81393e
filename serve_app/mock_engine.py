"""A stand-in for the engine deployment that costs (almost) nothing per token, to measure the serving
path alone: Serve's HTTP proxy -> `OpenAIIngress` -> handle stream -> SSE (`benchmarks/serving_overhead.py`).

`MockEngine` answers what the ingress calls on `EngineReplica`: `generate(GenerateRequest)` streams
`GenerateChunk`s (choices interleaved, `tokens_per_chunk` tokens per chunk) and `status()` returns an
`EngineStatus`. The tokens cycle over the ids of an English text (choice i starts i tokens in) until
max_tokens ("length"), so the ingress detokenizes realistic text; with `once` every choice is the text's
ids then EOS ("stop"), a scripted completion for tests. `token_interval_s` > 0 paces the tokens like an
engine of 1 / interval tokens/s per stream; 0 yields them as fast as Serve takes them.

It records, per request id, the wall-clock time (`time.time()`, shared by the processes of one machine)
at which `generate` was entered and its first chunk was yielded, so a client can split its TTFT into
the request path, the engine and the response path (`timings`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve
from ray.serve import Application

from engine.core.request import TokenLogprob
from engine.tokenizer import load_tokenizer
from serve_app.ingress import OpenAIIngress
from serve_app.records import EngineRejected, EngineStatus, GenerateChunk, GenerateRequest
from serve_app.settings import ServeSettings

DEFAULT_MAX_MODEL_LEN = 1 << 20  # no window to speak of: the ingress's context check never bites
MAX_TIMINGS = 4096  # most recent requests whose timings are kept

SAMPLE_TEXT = (
    "The serving path carries every token from the engine to the client: the replica yields a chunk, "
    "the ingress detokenizes it, holds back partial characters and possible stop strings, wraps the "
    "new text in an OpenAI delta and writes one server-sent event. None of that may cost more than "
    "the engine spends computing the token, or the server, not the model, sets the pace. "
)


@dataclass(frozen=True, slots=True)
class MockTimings:
    entered: float  # time.time() when generate was called
    first_chunk: float | None  # time.time() just before the first chunk was yielded


class MockEngine:
    def __init__(self, settings: ServeSettings, tokens_per_chunk: int = 1, token_interval_s: float = 0.0,
                 text: str = SAMPLE_TEXT, once: bool = False):
        if tokens_per_chunk < 1 or token_interval_s < 0:
            raise ValueError(f"tokens_per_chunk must be >= 1 and token_interval_s >= 0, got "
                             f"{tokens_per_chunk}, {token_interval_s}")
        self.settings = settings
        tokenizer = load_tokenizer(settings.checkpoint)
        self.text_ids = tokenizer.encode(text)
        self.eos_id = tokenizer.eos_id
        assert self.text_ids and self.eos_id not in self.text_ids
        self.tokens_per_chunk, self.token_interval_s, self.once = tokens_per_chunk, token_interval_s, once
        self.max_model_len = settings.max_model_len or DEFAULT_MAX_MODEL_LEN
        self._timings: OrderedDict[str, MockTimings] = OrderedDict()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        entered = time.time()
        params = req.params
        if not req.prompt_ids or params.n > self.settings.max_n:
            raise EngineRejected(f"empty prompt or n above {self.settings.max_n}")
        self._record(req.request_id, MockTimings(entered, None))
        num_prompt, k = len(req.prompt_ids), self.tokens_per_chunk
        script = self.text_ids + [self.eos_id] if self.once else None
        num_tokens = min(params.max_tokens, len(script)) if script else params.max_tokens
        reason = "stop" if script and num_tokens == len(script) else "length"
        start = time.monotonic()
        for first in range(0, num_tokens, k):
            if self.token_interval_s:  # pace by the clock, not by sleeps, so late wake-ups do not add up
                await asyncio.sleep(max(0.0, start + first * self.token_interval_s - time.monotonic()))
            last = min(first + k, num_tokens)
            for choice in range(params.n):
                ids = script[first:last] if script else [self.text_ids[(choice + i) % len(self.text_ids)]
                                                         for i in range(first, last)]
                logprobs = [TokenLogprob(t, -1.0, [(t, -1.0)] * params.logprobs) if params.logprobs is not None
                            else None for t in ids]  # placeholder values, the shape the ingress expects
                if first == 0 and choice == 0:
                    self._record(req.request_id, MockTimings(entered, time.time()))
                yield GenerateChunk(choice, ids, logprobs, reason if last == num_tokens else None, num_prompt, 0, last)
            if not self.token_interval_s:
                await asyncio.sleep(0)  # let cancellation and other streams in

    async def status(self) -> EngineStatus:
        return EngineStatus(ready=True, model_name=self.settings.model_name, max_model_len=self.max_model_len,
                            num_running=0, num_waiting=0, cache_usage=0.0, prefix_hit_rate=0.0)

    async def timings(self, request_id: str) -> MockTimings | None:
        """When `generate` was entered and yielded its first chunk for this request id (the response's "id")."""
        return self._timings.get(request_id)

    def _record(self, request_id: str, timings: MockTimings) -> None:
        self._timings[request_id] = timings
        self._timings.move_to_end(request_id)
        while len(self._timings) > MAX_TIMINGS:
            self._timings.popitem(last=False)


def build_mock_app(settings: ServeSettings, **mock_options) -> Application:
    """`serve_app.app.build_app` with a MockEngine (`mock_options`: its constructor's keywords) in place of
    the EngineReplica, with the same ingress options. The checkpoint folder needs only the tokenizer files."""
    engine = serve.deployment(MockEngine).options(
        name="MockEngine", num_replicas=1, max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0.5},
    ).bind(settings, **mock_options)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", num_replicas=1,
        max_ongoing_requests=settings.max_ongoing_requests * settings.num_replicas + 16,
        ray_actor_options={"num_cpus": 0.5},
    )
    return ingress.bind(engine, settings)
