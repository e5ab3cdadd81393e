"""Serving benchmark against a running server: N concurrent SSE streams, latency percentiles and throughput.

    .venv/bin/python benchmarks/bench_serving.py [--base-url http://localhost:8000/v1] [--api-key KEY]
        [--model NAME] [--concurrency 8] [--requests 32] [--max-tokens 64] [--prompt-len 128]
        [--endpoint chat|completions] [--reasoning-effort none] [--seed 0]

Each request streams (`stream_options.include_usage`) with temperature 1 and its own seed; prompts are
random common English words (chat) or random token ids (completions, exact length), different from the
first word on, so no request hits another's prefix cache. The model can stop early at EOS: the output
counts come from each response's usage. Reported, in ms: TTFT (request sent -> first non-empty text
event), ITL (gaps between a stream's successive text events: with several tokens per event it is per
event, not per token), TPOT ((e2e - TTFT) / (output tokens - 1) per request) and E2E, each p50/p90/p99;
and total output tokens / wall time. Only httpx is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


@dataclass(slots=True)
class StreamTiming:
    """One streamed request, times from time.perf_counter()."""

    sent: float
    text_times: list[float] = field(default_factory=list)  # arrival of each event with non-empty text
    done: float = 0.0  # [DONE] arrived
    response_id: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.text_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.text_times, self.text_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


def _event_text(event: dict) -> str:
    out = []
    for c in event.get("choices", []):
        delta = c.get("delta")
        if delta is None:  # completions
            out.append(c.get("text") or "")
        else:
            out.append((delta.get("content") or "") + (delta.get("reasoning_content") or ""))
    return "".join(out)


async def timed_stream(client: httpx.AsyncClient, path: str, body: dict) -> StreamTiming:
    """POST `body` with stream=true and include_usage; time every event that carries text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    timing = StreamTiming(time.perf_counter())
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            timing.error = f"{r.status_code} {(await r.aread()).decode(errors='replace')[:200]}"
            return timing
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                timing.done = time.perf_counter()
                break
            now, event = time.perf_counter(), json.loads(line[6:])
            timing.response_id = event.get("id", timing.response_id)
            if _event_text(event):
                timing.text_times.append(now)
            if event.get("usage"):
                timing.num_prompt_tokens = event["usage"]["prompt_tokens"]
                timing.num_output_tokens = event["usage"]["completion_tokens"]
    if not timing.done or not timing.text_times:
        timing.error = "the stream ended without [DONE] or without any text"
    return timing


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_row(name: str, seconds: list[float]) -> str:
    p = [percentile(seconds, q) * 1000 for q in (50, 90, 99)]
    return f"| {name} | {p[0]:.2f} | {p[1]:.2f} | {p[2]:.2f} | {len(seconds)} |"


def make_body(args: argparse.Namespace, model: str, i: int, rng: random.Random) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": 1.0, "seed": args.seed + i}
    if args.endpoint == "completions":
        return "/completions", {**common, "prompt": [rng.randrange(1000, 100000) for _ in range(args.prompt_len)]}
    words = [f"{i}"] + [rng.choice(WORDS) for _ in range(args.prompt_len - 1)]
    return "/chat/completions", {**common, "messages": [{"role": "user", "content": " ".join(words)}],
                                 "reasoning_effort": args.reasoning_effort}


async def first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> list[StreamTiming]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600, limits=limits) as client:
        model = args.model or await first_model(client)
        rng = random.Random(args.seed)
        bodies = [make_body(args, model, i, rng) for i in range(args.requests)]
        gate = asyncio.Semaphore(args.concurrency)

        async def one(path: str, body: dict) -> StreamTiming:
            async with gate:
                return await timed_stream(client, path, body)

        return await asyncio.gather(*(one(p, b) for p, b in bodies))


def report(timings: list[StreamTiming], wall: float, concurrency: int) -> None:
    ok = [t for t in timings if t.error is None]
    for t in timings:
        if t.error is not None:
            print(f"failed: {t.error}", file=sys.stderr)
    num_out = sum(t.num_output_tokens for t in ok)
    print(f"requests: {len(ok)} ok, {len(timings) - len(ok)} failed; concurrency {concurrency}; wall {wall:.2f} s")
    if not ok:
        return
    print(f"prompt tokens/request: mean {sum(t.num_prompt_tokens for t in ok) / len(ok):.1f}; "
          f"output tokens/request: mean {num_out / len(ok):.1f} (min {min(t.num_output_tokens for t in ok)})")
    print(f"output throughput: {num_out / wall:.1f} tok/s; {len(ok) / wall:.2f} requests/s\n")
    print("| metric (ms) | p50 | p90 | p99 | samples |\n|---|---|---|---|---|")
    print(latency_row("TTFT", [t.ttft for t in ok]))
    print(latency_row("ITL (per text event)", [x for t in ok for x in t.itl]))
    print(latency_row("TPOT", [t.tpot for t in ok if t.tpot is not None]))
    print(latency_row("E2E", [t.e2e for t in ok]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://localhost:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("DSV41_API_KEY"))
    p.add_argument("--model", help="default: the first of GET /models")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="words (chat) or token ids (completions)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--reasoning-effort", default="none", help="chat only (default none: no thinking)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.concurrency, args.requests, args.max_tokens, args.prompt_len) < 1:
        p.error("--concurrency, --requests, --max-tokens and --prompt-len must be >= 1")
    t0 = time.perf_counter()
    timings = asyncio.run(run(args))
    report(timings, time.perf_counter() - t0, args.concurrency)
    return 0 if all(t.error is None for t in timings) else 1


if __name__ == "__main__":
    sys.exit(main())
