"""What the serving path costs on its own: Serve's HTTP proxy -> OpenAIIngress -> DeploymentHandle stream ->
SSE, with `serve_app.mock_engine.MockEngine` (tokens at no cost) in place of the engine.

    .venv/bin/python benchmarks/serving_overhead.py [--tokens 4000] [--repeats 3] [--ttft-requests 40]
        [--concurrency 8] [--chunk-sizes 1,4,16] [--paced-tok-s 2000]

Starts its own Ray (4 logical CPUs) and Serve (a free port), deploys the ingress + MockEngine once per
`tokens_per_chunk` setting, and prints, per setting:
  (a) tok/s one chat SSE stream carries (httpx; tokens from usage / first -> last text event; the median
      of --repeats runs), and for comparison the engine -> ingress handle hop alone (MockEngine.generate
      streamed to this process through a DeploymentHandle);
  (b) TTFT the path adds with a zero-cost engine: client send -> MockEngine.generate entered (request
      path: proxy, ingress validation, render + tokenize, handle call), -> first chunk yielded (the mock,
      ~0), -> first content event at the client (response path); p50/p90 over sequential requests, plus
      a /healthz round trip (proxy + ingress, no engine) for scale;
  (c) the same stream rate and TTFT with `--concurrency` streams at once;
and once: the ingress's per-token Python work in this process (detokenize + delta + JSON + SSE framing),
and the stream rate with the mock paced at `--paced-tok-s` per stream (what a real engine that fast
would see). The mock's tokens cycle over an English text, so detokenization is realistic.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local Ray; Ray 2.60 turns token auth on by default

from bench_serving import StreamTiming, percentile, timed_stream  # noqa: E402

APP = "serving_overhead"
MODEL = "deepseek-v4.1-flash"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(max_tokens: int, i: int = 0) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Write a story, part {i}."}],
            "reasoning_effort": "none", "max_tokens": max_tokens}


def stream_rate(t: StreamTiming) -> float:
    """Tokens per second between the first and the last text event."""
    return (t.num_output_tokens - 1) / (t.text_times[-1] - t.text_times[0])


async def measure(base_url: str, mock, args: argparse.Namespace) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=args.concurrency + 2)) as client:
        await timed_stream(client, "/v1/chat/completions", chat(64))  # warm-up: tokenizer caches, routes
        singles = [await timed_stream(client, "/v1/chat/completions", chat(args.tokens)) for _ in range(args.repeats)]
        assert all(t.error is None and t.num_output_tokens == args.tokens for t in singles), singles[0].error
        hop = [await handle_hop_rate(mock, args.tokens) for _ in range(args.repeats)]

        health, request_path, response_path, ttft = [], [], [], []
        for i in range(args.ttft_requests):
            t0 = time.perf_counter()
            (await client.get("/healthz")).raise_for_status()
            health.append(time.perf_counter() - t0)
            sent_wall = time.time()
            t = await timed_stream(client, "/v1/chat/completions", chat(2, i))
            first_wall = sent_wall + t.ttft  # the client's perf_counter interval on the wall clock
            marks = await mock.timings.remote(t.response_id)
            request_path.append(marks.entered - sent_wall)
            response_path.append(first_wall - marks.first_chunk)
            ttft.append(t.ttft)

        many = await asyncio.gather(*(timed_stream(client, "/v1/chat/completions", chat(args.tokens // 4, i))
                                      for i in range(args.concurrency)))
        assert all(t.error is None for t in many), [t.error for t in many]
        wall = max(t.done for t in many) - min(t.sent for t in many)
    return {"single_tok_s": percentile([stream_rate(t) for t in singles], 50), "hop_tok_s": percentile(hop, 50),
            "health_ms": percentile(health, 50) * 1000,
            "ttft_ms": (percentile(ttft, 50) * 1000, percentile(ttft, 90) * 1000),
            "request_path_ms": (percentile(request_path, 50) * 1000, percentile(request_path, 90) * 1000),
            "response_path_ms": (percentile(response_path, 50) * 1000, percentile(response_path, 90) * 1000),
            "many_tok_s_per_stream": percentile([stream_rate(t) for t in many], 50),
            "many_tok_s_total": sum(t.num_output_tokens for t in many) / wall,
            "many_ttft_ms": percentile([t.ttft for t in many], 50) * 1000}


async def handle_hop_rate(mock, num_tokens: int) -> float:
    """Tokens/s of MockEngine.generate streamed straight to this process through a DeploymentHandle: the
    engine -> ingress hop alone (no HTTP, no ingress work)."""
    from engine.core.sampling_params import SamplingParams
    from serve_app.records import GenerateRequest

    req = GenerateRequest(f"hop-{time.monotonic_ns()}", [1, 2, 3], SamplingParams(max_tokens=num_tokens))
    num, t0 = 0, time.perf_counter()
    async for chunk in mock.options(stream=True).generate.remote(req):
        num += len(chunk.token_ids)
    assert num == num_tokens
    return num / (time.perf_counter() - t0)


def ingress_cpu_per_token(checkpoint: str, num_tokens: int = 20000) -> float:
    """Microseconds of the ingress's own work per token, one chunk per token: ChatChoiceStream.feed, the
    chunk dict, JSON and SSE framing (no Ray, no HTTP)."""
    from engine.tokenizer import load_tokenizer
    from serve_app.mock_engine import SAMPLE_TEXT
    from serve_app.protocol import chat_chunk, chat_stream_choice
    from serve_app.streaming import ChatChoiceStream, sse_event

    tokenizer = load_tokenizer(Path(checkpoint))
    ids = tokenizer.encode(SAMPLE_TEXT)
    stream = ChatChoiceStream(tokenizer, thinking=False, stop_token_ids=(tokenizer.eos_id,))
    t0 = time.perf_counter()
    for i in range(num_tokens):
        for delta in stream.feed([ids[i % len(ids)]]):
            sse_event(chat_chunk("chatcmpl-x", 0, MODEL, [chat_stream_choice(0, delta)]))
    return (time.perf_counter() - t0) / num_tokens * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000, help="tokens of the single stream (concurrent ones: 1/4)")
    p.add_argument("--repeats", type=int, default=3, help="single-stream runs per setting (the median is shown)")
    p.add_argument("--ttft-requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chunk-sizes", default="1,4,16", help="MockEngine tokens_per_chunk settings to run")
    p.add_argument("--paced-tok-s", type=float, default=2000.0, help="0 skips the paced run")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # keep the table readable
    from engine.tokenizer import write_tokenizer_files
    from serve_app.mock_engine import build_mock_app
    from serve_app.settings import ServeSettings

    tmp = tempfile.TemporaryDirectory(prefix="mock_ckpt_")  # the ingress and the mock read only the tokenizer
    checkpoint = tmp.name
    write_tokenizer_files(Path(checkpoint))
    settings = ServeSettings(checkpoint=checkpoint, device="cpu", max_ongoing_requests=64)
    print(f"ingress per-token Python work (this process): {ingress_cpu_per_token(checkpoint):.1f} us/token")

    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"
    runs = [(int(k), 0.0) for k in args.chunk_sizes.split(",")]
    runs += [(1, 1 / args.paced_tok_s)] if args.paced_tok_s else []
    print(f"| tokens/chunk | mock pace | handle hop alone tok/s | 1 stream tok/s | TTFT p50/p90 ms | "
          f"request path p50/p90 ms | response path p50/p90 ms | {args.concurrency} streams: tok/s each (p50) | "
          f"total tok/s | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for tokens_per_chunk, interval in runs:
            serve.run(build_mock_app(settings, tokens_per_chunk=tokens_per_chunk, token_interval_s=interval),
                      name=APP, route_prefix="/")
            mock = serve.get_deployment_handle("MockEngine", APP)
            r = asyncio.run(measure(base_url, mock, args))
            pace = f"{1 / interval:.0f} tok/s" if interval else "none"
            print(f"| {tokens_per_chunk} | {pace} | {r['hop_tok_s']:.0f} | {r['single_tok_s']:.0f} | "
                  f"{r['ttft_ms'][0]:.1f} / {r['ttft_ms'][1]:.1f} | "
                  f"{r['request_path_ms'][0]:.1f} / {r['request_path_ms'][1]:.1f} | "
                  f"{r['response_path_ms'][0]:.1f} / {r['response_path_ms'][1]:.1f} | "
                  f"{r['many_tok_s_per_stream']:.0f} | {r['many_tok_s_total']:.0f} | {r['many_ttft_ms']:.1f} |",
                  flush=True)
        print(f"/healthz round trip (proxy + ingress, no engine) p50: {r['health_ms']:.1f} ms")
    finally:
        serve.shutdown()
        ray.shutdown()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
