"""Load on the embedded default (issue 20): the app as `python -m serve_app` deploys it by default (the tiny
random-weight checkpoint on the CPU, one replica, max_num_seqs 16, 64 requests in flight; an API key added),
256 concurrent greedy streams with small max_tokens. Promised: every request is answered, a 200 stream that
ends with [DONE] or a 429/503 carrying Retry-After (the client here retries after it, as a client should, and
every request then completes); none hangs (each attempt has a timeout); a prompt's streamed text is the same in
every copy and equals its non-streamed answer; clients that disconnect mid-stream free their engine slots (the
replica idle afterwards, its integrity check passing, one abort counted per disconnect) and their in-flight
places (the ingress's whole in-flight limit is usable afterwards).

Bounded: about 2 minutes on the 2-core CI machine (the figures print with -s)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from serve_app.settings import ServeSettings
from tests.serve.api_fixtures import wait_idle

pytestmark = [pytest.mark.slow]
API_KEY = "sk-load-test"
MODEL = "deepseek-v4.1-flash"
NUM_STREAMS, NUM_PROMPTS, MAX_TOKENS = 256, 32, 4
ATTEMPT_TIMEOUT_S = 120.0  # one attempt (connect to [DONE]); above it the request counts as hung
DEADLINE_S = 600.0  # all retries of one request


@dataclass(slots=True)
class Load:
    base_url: str
    settings: ServeSettings
    engine: object  # the EngineReplica's handle


@pytest.fixture(scope="module")
def load(serve_session, tiny_checkpoint) -> Iterator[Load]:
    from ray import serve

    from serve_app.app import build_app

    settings = ServeSettings.from_cli(["--checkpoint", str(tiny_checkpoint), "--api-key", API_KEY, "--device", "cpu"],
                                      environ={})
    serve.run(build_app(settings), name="load", route_prefix="/load")
    base_url = f"http://127.0.0.1:{serve_session}/load"
    deadline = time.monotonic() + 60
    while httpx.get(base_url + "/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready in 60 s"
        time.sleep(0.2)
    yield Load(base_url, settings, serve.get_deployment_handle("EngineReplica", "load"))
    serve.delete("load")


def body(i: int, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Request {i}: count from {i} to {i + 9}."}],
            "reasoning_effort": "none", "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


@dataclass(slots=True)
class Outcome:
    text: str = ""
    statuses: list[int] = field(default_factory=list)  # one per attempt
    seconds: float = 0.0  # first attempt sent -> [DONE]
    usage: dict | None = None


async def stream_until_done(client: httpx.AsyncClient, payload: dict) -> Outcome:
    """POST a stream, retrying 429/503 after their Retry-After; the text and usage of the stream that completed."""
    out, t0 = Outcome(), time.monotonic()
    while True:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            out.statuses.append(r.status_code)
            if r.status_code in (429, 503):
                retry_after = r.headers.get("retry-after")
                assert retry_after is not None and retry_after.isdigit(), f"{r.status_code} without Retry-After"
                await r.aread()
                assert time.monotonic() - t0 < DEADLINE_S, f"still refused after {DEADLINE_S:.0f} s: {out.statuses}"
                await asyncio.sleep(int(retry_after))
                continue
            assert r.status_code == 200, (r.status_code, await r.aread())
            done, parts = False, []
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert not done, f"an event after [DONE]: {line}"
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                out.usage = event.get("usage") or out.usage
                parts += [c["delta"].get("content") or "" for c in event["choices"]]
            assert done, "the stream ended without [DONE]"
            out.text, out.seconds = "".join(parts), time.monotonic() - t0
            return out


def client(load: Load) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=load.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                             timeout=httpx.Timeout(ATTEMPT_TIMEOUT_S, connect=30),
                             limits=httpx.Limits(max_connections=NUM_STREAMS + 16))


def test_256_concurrent_streams_all_complete_and_equal_the_non_streamed_text(load):
    payloads = [body(k % NUM_PROMPTS, stream=True, stream_options={"include_usage": True}) for k in range(NUM_STREAMS)]

    async def run() -> tuple[list[Outcome], list[str], float]:
        async with client(load) as c:
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*(asyncio.wait_for(stream_until_done(c, p), DEADLINE_S) for p in payloads))
            wall = time.monotonic() - t0
            unstreamed = []
            for i in range(NUM_PROMPTS):
                r = await c.post("/v1/chat/completions", json=body(i))
                assert r.status_code == 200, r.text
                unstreamed.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]))
            return outcomes, unstreamed, wall

    outcomes, unstreamed, wall = asyncio.run(run())
    first = Counter(o.statuses[0] for o in outcomes)
    num_tokens = sum(o.usage["completion_tokens"] for o in outcomes)
    latencies = sorted(o.seconds for o in outcomes)
    print(f"\n{NUM_STREAMS} concurrent streams x {MAX_TOKENS} tokens: all done in {wall:.1f} s "
          f"({NUM_STREAMS / wall:.1f} req/s, {num_tokens / wall:.1f} tok/s); first answers {dict(first)}; "
          f"attempts per request max {max(len(o.statuses) for o in outcomes)}; latency p50 "
          f"{statistics.median(latencies):.1f} s, p99 {latencies[int(0.99 * len(latencies))]:.1f} s")
    assert set(first) <= {200, 429, 503}, first
    assert first[200] >= load.settings.max_ongoing_requests // 2, f"too few taken at once: {first}"
    for k, o in enumerate(outcomes):
        i = k % NUM_PROMPTS
        assert (o.text, o.usage["completion_tokens"]) == unstreamed[i], f"stream {k} (prompt {i}): {o.text!r}, " \
            f"{o.usage['completion_tokens']} tokens != unstreamed {unstreamed[i]!r}"
    assert len({text for text, _ in unstreamed}) > NUM_PROMPTS // 4, "the answers barely differ: the check would be weak"
    wait_idle(load, timeout_s=60.0)


def test_disconnects_under_load_free_their_slots(load):
    """48 streams of 48 tokens, every other one dropped after its first content event: the engine ends idle (its
    integrity check passes), one abort is counted per dropped stream, and afterwards the ingress's whole
    in-flight limit of requests is taken at once (no place left held by a dropped stream)."""
    num, keep_tokens = 48, 48

    def aborts() -> float:
        return load.engine.metrics_snapshot.remote().result().get("dsv41_request_total{finish_reason=abort}", 0)

    async def one(c: httpx.AsyncClient, i: int, drop: bool) -> str:
        payload = body(1000 + i, max_tokens=keep_tokens, stream=True)
        async with c.stream("POST", "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if drop and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return "done"

    async def burst(c: httpx.AsyncClient, n: int) -> list[int]:
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body(2000 + i, max_tokens=1)) for i in range(n)))
        return [r.status_code for r in rs]

    before = aborts()

    async def run() -> tuple[list[str], list[int], float]:
        async with client(load) as c:
            ends = await asyncio.gather(*(asyncio.wait_for(one(c, i, i % 2 == 0), ATTEMPT_TIMEOUT_S) for i in range(num)))
            idle_s = await asyncio.get_running_loop().run_in_executor(None, wait_idle, load, 60.0)
            return ends, await burst(c, load.settings.max_ongoing_requests), idle_s

    ends, statuses, idle_s = asyncio.run(run())
    deadline = time.monotonic() + 10  # each abort is counted as its replica-side stream closes, just after the engine's
    while aborts() - before < num // 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"\n{num} streams, {ends.count('dropped')} dropped mid-stream: engine idle {idle_s:.2f} s after the last "
          f"ended; aborts counted {aborts() - before:.0f}; then {len(statuses)} at once: {dict(Counter(statuses))}")
    assert ends.count("dropped") == num // 2 and ends.count("done") == num // 2
    assert aborts() - before == num // 2, "every dropped stream aborts its engine request (and only those)"
    assert statuses == [200] * load.settings.max_ongoing_requests
    wait_idle(load, timeout_s=60.0)
