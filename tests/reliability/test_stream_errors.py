"""Errors after a response has begun, through the live Serve app: the real ingress on a MockEngine that fails
on purpose after a few chunks (chosen by the request's seed): it ends the choice with finish_reason "error"
(what LLMEngine does when a step fails), its generate raises (the replica's stream failing), or its process
exits (a replica that dies mid-stream). A stream must then end with OpenAI's error event and `data: [DONE]`
on a connection that closes cleanly; a non-streamed request is a JSON 500; nothing stays counted in flight;
after the death Serve replaces the replica and requests succeed again."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from engine.tokenizer import write_tokenizer_files
from serve_app.settings import ServeSettings
from tests.serve.api_fixtures import ERROR_KEYS, assert_error

API_KEY = "sk-stream-errors-1234"
MODEL = "deepseek-v4.1-flash"
MAX_ONGOING = 4  # the ingress answers 429 above this many requests in flight: a leaked count shows at once
SEED_ERROR_CHUNK, SEED_RAISES, SEED_DIES = 101, 102, 103
FAULT_AFTER = 3  # chunks streamed before the fault


@dataclass(slots=True)
class Sse:
    """A streamed response as the client saw it: its JSON events, whether [DONE] came last, and whether the
    connection ended cleanly (no protocol error while reading)."""

    status: int
    events: list[dict]
    done: bool
    clean: bool

    @property
    def text(self) -> str:
        return "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                       for e in self.events for c in e.get("choices", []))


@pytest.fixture(scope="module")
def base_url(serve_session, tmp_path_factory) -> Iterator[str]:
    from ray import serve

    from serve_app.ingress import OpenAIIngress
    from serve_app.mock_engine import MockEngine
    from serve_app.records import GenerateChunk

    folder = tmp_path_factory.mktemp("tokenizer_only")
    write_tokenizer_files(folder)
    settings = ServeSettings(checkpoint=str(folder), device="cpu", api_key=API_KEY, max_ongoing_requests=MAX_ONGOING,
                             replica_num_cpus=0.5)

    class FaultyEngine(MockEngine):  # local, so Ray ships it by value
        """A MockEngine that, for three seeds, fails after FAULT_AFTER chunks: an error chunk per choice,
        an exception, or the process exiting."""

        async def generate(self, req):
            import os

            num_chunks = 0
            async for chunk in MockEngine.generate(self, req):
                if num_chunks == FAULT_AFTER and req.params.seed == SEED_ERROR_CHUNK:
                    for choice in range(req.params.n):
                        yield GenerateChunk(choice, [], [], "error", len(req.prompt_ids), 0, chunk.num_output_tokens,
                                            error="the model step failed: RuntimeError: injected fault\n  File ...")
                    return
                if num_chunks == FAULT_AFTER and req.params.seed == SEED_RAISES:
                    raise RuntimeError("injected fault in the replica's stream")
                if num_chunks == FAULT_AFTER and req.params.seed == SEED_DIES:
                    os._exit(1)
                num_chunks += 1
                yield chunk

    engine = serve.deployment(FaultyEngine).options(name="FaultyEngine", max_ongoing_requests=MAX_ONGOING,
                                                    ray_actor_options={"num_cpus": 0}).bind(settings, token_interval_s=0.01)
    ingress = serve.deployment(OpenAIIngress).options(name="FaultyIngress", ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(engine, settings), name="stream_errors", route_prefix="/stream-errors")
    yield f"http://127.0.0.1:{serve_session}/stream-errors"
    serve.delete("stream_errors")


def client(base_url: str, timeout_s: float = 60) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=timeout_s)


def body(path: str, seed: int | None, **fields) -> dict:
    common = {"model": MODEL, "max_tokens": 40, "seed": seed, **fields}
    if "chat" in path:
        return common | {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}
    return common | {"prompt": "Once upon a time"}


def read_sse(c: httpx.Client, path: str, payload: dict) -> Sse:
    events, done, clean = [], False, True
    with c.stream("POST", path, json={**payload, "stream": True}) as r:
        if r.status_code != 200:
            return Sse(r.status_code, [json.loads(r.read())], False, True)
        try:
            for line in r.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: ") and not done, line
                if line == "data: [DONE]":
                    done = True
                else:
                    events.append(json.loads(line[len("data: "):]))
        except (httpx.RemoteProtocolError, httpx.ReadError):
            clean = False
    return Sse(200, events, done, clean)


def assert_error_event(sse: Sse, num_text_events: int) -> dict:
    """The stream: 200, some text, then exactly one error event (OpenAI's schema), then [DONE], closed cleanly."""
    assert sse.status == 200 and sse.clean, sse
    assert sse.done, "the stream did not end with data: [DONE]"
    *before, last = sse.events
    assert set(last) == {"error"} and set(last["error"]) == ERROR_KEYS, last
    assert last["error"]["type"] == "server_error" and last["error"]["message"], last
    assert not any("error" in e for e in before), before
    assert sum(bool(e["choices"]) for e in before) >= num_text_events and sse.text, before
    return last["error"]


ROUTES = ("/v1/chat/completions", "/v1/completions")


@pytest.mark.parametrize("path", ROUTES)
def test_an_error_chunk_mid_stream_is_an_error_event_then_done(base_url, path):
    with client(base_url) as c:
        error = assert_error_event(read_sse(c, path, body(path, SEED_ERROR_CHUNK)), FAULT_AFTER - 1)
        assert "injected fault" in error["message"] and "File" not in error["message"], error  # no traceback
        error = assert_error_event(read_sse(c, path, body(path, SEED_ERROR_CHUNK, n=2)), 1)
        ok = read_sse(c, path, body(path, 7, stream_options={"include_usage": True}))
        assert ok.done and not any("error" in e for e in ok.events) and ok.events[-1]["usage"]["completion_tokens"] == 40
        r = c.post(path, json=body(path, SEED_ERROR_CHUNK))
        assert "injected fault" in assert_error(r, 500, type="server_error")["message"]


@pytest.mark.parametrize("path", ROUTES)
def test_a_stream_that_raises_mid_way_is_an_error_event_then_done(base_url, path):
    with client(base_url) as c:
        error = assert_error_event(read_sse(c, path, body(path, SEED_RAISES, stream_options={"include_usage": True})),
                                   FAULT_AFTER - 1)
        assert "RuntimeError" in error["message"] or "RayTaskError" in error["message"], error
        assert "injected" not in error["message"], "the client sees the failure's type, the log its details"
        assert_error(c.post(path, json=body(path, SEED_RAISES)), 500, type="server_error")


def test_failed_requests_are_not_left_in_flight(base_url):
    """After more failures than the ingress's in-flight limit, that many requests at once still all pass."""
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60) as ac:
            rs = await asyncio.gather(*(ac.post("/v1/completions", json=body("/v1/completions", i, max_tokens=30))
                                        for i in range(MAX_ONGOING)))
            return [r.status_code for r in rs]

    with client(base_url) as c:
        for seed in [SEED_ERROR_CHUNK, SEED_RAISES] * MAX_ONGOING:
            assert read_sse(c, "/v1/completions", body("/v1/completions", seed)).events[-1].keys() == {"error"}
    assert asyncio.run(burst()) == [200] * MAX_ONGOING


def test_a_replica_that_dies_mid_stream_ends_it_cleanly_and_is_replaced(base_url):
    with client(base_url) as c:
        t0 = time.monotonic()
        error = assert_error_event(read_sse(c, "/v1/chat/completions", body("/v1/chat/completions", SEED_DIES)),
                                   FAULT_AFTER - 1)
        died = time.monotonic()
        assert "the request can be retried" in error["message"], error
        statuses = []
        while True:  # until Serve has a replica again: meanwhile queued by Serve, or a 503 with Retry-After
            r = c.post("/v1/completions", json=body("/v1/completions", 5, max_tokens=8))
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.headers, r.text)
            assert time.monotonic() - died < 60, f"no replica again within 60 s: {statuses}"
            time.sleep(0.2)
        recovered = time.monotonic()
    print(f"\nreplica died {died - t0:.2f} s into the stream; served again {recovered - died:.1f} s later "
          f"({len(statuses)} tries: {statuses[:6]}{'...' if len(statuses) > 6 else ''})")
