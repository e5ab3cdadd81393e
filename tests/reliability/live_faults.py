"""The live-app side of the fault tests (tests/reliability/test_faults.py, test_shard_faults.py): streams that are
all running when a fault strikes, how each ended, and the recovery that follows (every request meanwhile 200 or
503 with Retry-After, never a 500 or a hang)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from serve_app.settings import ServeSettings
from tests.kv.sharing_fixtures import wait_for
from tests.serve.api_fixtures import ERROR_KEYS

API_KEY = "sk-faults"
MODEL = "deepseek-v4.1-flash"
NUM_STREAMS, STREAM_TOKENS = 8, 200
RECOVERY_LIMIT_S = 90.0


@dataclass(slots=True)
class Live:
    base_url: str
    engine: object  # the EngineReplica's handle


def start_live(settings: ServeSettings, name: str, port: int, ready_within_s: float) -> Live:
    """The whole app for settings on Serve at /<name>, once /readyz answers 200 (stop it with serve.delete(name))."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(settings), name=name, route_prefix=f"/{name}")
    base_url = f"http://127.0.0.1:{port}/{name}"
    wait_for(lambda: httpx.get(base_url + "/readyz", timeout=10).status_code == 200, ready_within_s, "the app is ready",
             0.2)
    return Live(base_url, serve.get_deployment_handle("EngineReplica", name))


def body(i: int, max_tokens: int, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Story {i}: once upon a time"}],
            "reasoning_effort": "none", "max_tokens": max_tokens, "temperature": 0, **fields}


@dataclass(slots=True)
class StreamEnd:
    num_text_events: int
    error: dict | None  # the error event's error object
    done: bool


async def streams_then_fault(base_url: str, fault, num_streams: int = NUM_STREAMS) -> tuple[list[StreamEnd], float]:
    """num_streams streams; once every one has shown text, fault() runs (in a thread); returns how each
    stream ended and when the fault struck (time.monotonic())."""
    all_started, num_started, struck = asyncio.Event(), 0, 0.0

    async def one(c: httpx.AsyncClient, i: int) -> StreamEnd:
        nonlocal num_started
        end = StreamEnd(0, None, False)
        async with c.stream("POST", "/v1/chat/completions", json=body(i, STREAM_TOKENS, stream=True)) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert not end.done and end.error is None or line == "data: [DONE]", f"after the end: {line}"
                if line == "data: [DONE]":
                    end.done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    end.error = event["error"]
                elif any(c["delta"].get("content") for c in event["choices"]):
                    end.num_text_events += 1
                    if end.num_text_events == 1:
                        num_started += 1
                        if num_started == num_streams:
                            all_started.set()
        return end

    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=httpx.Timeout(120, connect=10)) as c:
        tasks = [asyncio.create_task(one(c, i)) for i in range(num_streams)]
        await asyncio.wait_for(all_started.wait(), 120)
        struck = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, fault)
        ends = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # raises on a cut connection (RemoteProtocolError)
    return ends, struck


def assert_ended_with_error_events(ends: list[StreamEnd]) -> None:
    for i, end in enumerate(ends):
        assert end.num_text_events >= 1 and end.done, (i, end)
        assert end.error is not None, f"stream {i} ended without an error event though its engine failed: {end}"
        assert set(end.error) == ERROR_KEYS and end.error["type"] == "server_error", end.error


def recover(base_url: str, since: float) -> tuple[float, list[int]]:
    """Sends a small request every 0.2 s until one is served; every answer before must be 503 with Retry-After.
    Returns the seconds from `since` to that 200 and the statuses seen."""
    statuses = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=RECOVERY_LIMIT_S) as c:
        while True:
            r = c.post("/v1/chat/completions", json=body(99, 4))
            statuses.append(r.status_code)
            if r.status_code == 200:
                return time.monotonic() - since, statuses
            assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.headers, r.text)
            assert time.monotonic() - since < RECOVERY_LIMIT_S, f"not served again within {RECOVERY_LIMIT_S:.0f} s: {statuses}"
            time.sleep(0.2)


def ready_again(base_url: str, since: float) -> float:
    wait_for(lambda: httpx.get(base_url + "/readyz", timeout=10).status_code == 200, RECOVERY_LIMIT_S, "ready again", 0.2)
    return time.monotonic() - since


def summary(statuses: list[int]) -> str:
    return ", ".join(f"{s} x {n}" for s, n in sorted({s: statuses.count(s) for s in statuses}.items()))
