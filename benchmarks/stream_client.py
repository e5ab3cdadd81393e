"""Stream one chat completion with the `openai` client, printing the text as it arrives, then its speed.

    .venv/bin/python benchmarks/stream_client.py [--base-url http://localhost:8000/v1] [--api-key KEY]
        [--max-tokens 2048] [--prompt TEXT] [--model NAME] [--reasoning-effort none]

Thinking is off by default (reasoning_effort "none"); with it on, reasoning is printed too. At the end
(on stderr): completion tokens (from usage), TTFT, and completion tok/s, both over the whole request and
over the decode alone (first text -> last text, the rate the engine and the serving path sustain).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import openai

DEFAULT_PROMPT = "implement the tetris game. output HTML code directly - no explanation."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://localhost:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("DSV41_API_KEY") or "none")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--model", help="default: the first of GET /models")
    p.add_argument("--reasoning-effort", default="none")
    args = p.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=3600)
    model = args.model or client.models.list().data[0].id
    t_sent = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"reasoning_effort": args.reasoning_effort})
    first = last = None
    usage, finish_reason = None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text = (choice.delta.model_extra or {}).get("reasoning_content") or ""
            text += choice.delta.content or ""
            if text:
                last = time.perf_counter()
                first = first or last
                sys.stdout.write(text)
                sys.stdout.flush()
            finish_reason = choice.finish_reason or finish_reason
    t_done = time.perf_counter()
    print()
    if usage is None or first is None:
        print("no text or no usage came back", file=sys.stderr)
        return 1
    n = usage.completion_tokens
    decode = f"{(n - 1) / (last - first):.1f} tok/s" if n > 1 and last > first else "n/a"
    print(f"\n[{model}] {usage.prompt_tokens} prompt + {n} completion tokens, finish_reason {finish_reason}; "
          f"TTFT {(first - t_sent) * 1000:.1f} ms; {n / (t_done - t_sent):.1f} tok/s over the request, "
          f"{decode} decode", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
