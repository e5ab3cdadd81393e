"""Schemathesis against the live embedded server (the real app on the tiny checkpoint, CPU), from the
/openapi.json it serves: its request-body schemas (serve_app/schemas.py) drive generation. Valid bodies
(positive) and bodies that break the schema (negative) for both POST routes, and every GET route.

Bounded to run in about 80 s here (464 requests): a fixed number of examples per route and mode, derandomized (the
same cases each run), generation capped so each request is cheap (max_tokens / max_completion_tokens at
most 2, put in where absent; the window is 320 tokens). Promise checked: no 5xx at all, and every 4xx is
OpenAI's error schema."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings  # schemathesis's own dependency
from schemathesis.generation import GenerationMode

from tests.serve.api_fixtures import API_KEY, ERROR_KEYS, api, api_settings  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]
MAX_GEN_TOKENS = 2
EXAMPLES = {"positive": 150, "negative": 80}  # per POST route; the GET routes get 5 each
ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error"}


@dataclass(slots=True)
class Tally:
    """What the fuzzer saw: status counts per route and the responses that broke the promise."""

    statuses: dict[str, dict[int, int]] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)

    def record(self, route: str, body: object, r: httpx.Response) -> None:
        counts = self.statuses.setdefault(route, {})
        counts[r.status_code] = counts.get(r.status_code, 0) + 1
        why = _broken_promise(r)
        if why is not None:
            self.broken.append(f"{route} {r.status_code} ({why}): body {str(body)[:300]} -> {r.text[:300]}")


def _broken_promise(r: httpx.Response) -> str | None:
    if r.status_code >= 500:
        return "a 5xx"
    if r.status_code < 400:
        return None
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "a 4xx that is not OpenAI's error schema"
    if set(r.json()) != {"error"} or set(error) != ERROR_KEYS or not (isinstance(error["message"], str) and error["message"]):
        return "a 4xx that is not OpenAI's error schema"
    return None if error["type"] in ERROR_TYPES else f"error type {error['type']!r}"


def capped(body: object) -> object:
    """The body with generation bounded: a valid max_tokens/max_completion_tokens above MAX_GEN_TOKENS, or
    none, becomes MAX_GEN_TOKENS (invalid values stay, for the server to refuse)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = out.get(key)
        if value is None or (type(value) is int and value > MAX_GEN_TOKENS):
            out[key] = MAX_GEN_TOKENS
    return out


def fuzz(strategy, num_examples: int, send) -> None:
    @given(case=strategy)
    @settings(max_examples=num_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        send(case)

    run()


def test_schemathesis_finds_no_5xx_and_only_openai_shaped_4xx(api):
    t0 = time.monotonic()
    doc = api.client.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    tally = Tally()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=api.base_url, headers=headers, timeout=120) as client:
        def send(case) -> None:
            route = f"{case.method.upper()} {case.path}"
            body = capped(case.body) if case.method.upper() == "POST" else None
            if isinstance(body, bytes):  # negative cases may send bytes that are no JSON text at all
                r = client.post(case.path, content=body, headers={"Content-Type": "application/json"})
            elif case.method.upper() == "POST":
                r = client.post(case.path, json=body)
            else:
                r = client.get(case.path)
            tally.record(route, body, r)

        for path, methods in doc["paths"].items():
            for method in methods:
                operation = schema[path][method.upper()]
                if method == "post":
                    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                        fuzz(operation.as_strategy(generation_mode=mode), EXAMPLES[mode.value], send)
                else:
                    fuzz(operation.as_strategy(), 5, send)
    seconds = time.monotonic() - t0
    print(f"\nschemathesis: {sum(sum(c.values()) for c in tally.statuses.values())} requests in {seconds:.0f} s: "
          + "; ".join(f"{route} {dict(sorted(c.items()))}" for route, c in sorted(tally.statuses.items())))
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= set(tally.statuses)
    for route in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert tally.statuses[route].get(200, 0) > 0, f"{route}: no case was accepted, so the fuzzing only hit the door"
    assert not tally.broken, f"{len(tally.broken)} responses broke the promise:\n" + "\n".join(tally.broken[:20])
