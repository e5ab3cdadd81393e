"""Bad input at the door, through the live Serve app (the real ingress on a MockEngine, which costs nothing
per token): each request here once got a plain-text 500 (issue 20), one by an exception no handler
expects, or stalled the ingress. Every answer must be OpenAI's error schema; a large body being tokenized
must not hold up other requests."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from engine.tokenizer import write_tokenizer_files
from serve_app.json_body import MAX_JSON_DEPTH
from serve_app.mock_engine import MockEngine, build_mock_app
from serve_app.settings import ServeSettings
from tests.serve.api_fixtures import assert_error

API_KEY = "sk-reliability-1234"
MODEL = "deepseek-v4.1-flash"
MAX_PROMPT_CHARS = 2_000_000
BIG_PROMPT_CHARS = 1_500_000  # ~1.3 s of tokenizing on one idle core of the 2-core CI machine
ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass(slots=True)
class Live:
    client: httpx.Client  # sends the API key, base URL = the mock app's prefix
    broken: httpx.Client  # the ingress on an engine whose status() raises


@pytest.fixture(scope="module")
def live(serve_session, tmp_path_factory) -> Iterator[Live]:
    from ray import serve

    from serve_app.ingress import OpenAIIngress

    folder = tmp_path_factory.mktemp("tokenizer_only")  # the mock and the ingress read only the tokenizer
    write_tokenizer_files(folder)
    settings = ServeSettings(checkpoint=str(folder), device="cpu", api_key=API_KEY,
                             max_prompt_chars=MAX_PROMPT_CHARS, replica_num_cpus=0.5)
    serve.run(build_mock_app(settings), name="reliability_mock", route_prefix="/reliability")

    class StatusFails(MockEngine):  # local, so Ray ships it by value (this test package is not on workers' path)
        """A MockEngine whose status call raises: the ingress gets an exception it has no handler for."""

        async def status(self):
            raise RuntimeError("status is broken in this test")

    broken = serve.deployment(StatusFails).options(name="StatusFails", ray_actor_options={"num_cpus": 0}).bind(settings)
    ingress = serve.deployment(OpenAIIngress).options(name="BrokenIngress", ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(broken, settings), name="reliability_broken", route_prefix="/broken")
    base = f"http://127.0.0.1:{serve_session}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (httpx.Client(base_url=base + "/reliability", headers=headers, timeout=120) as client,
          httpx.Client(base_url=base + "/broken", headers=headers, timeout=60) as broken_client):
        yield Live(client, broken_client)
    serve.delete("reliability_mock")
    serve.delete("reliability_broken")


def chat_body(content: str = "hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


def post_raw(client: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def test_deep_nesting_is_a_400_naming_the_limit(live):
    deep = b'{"model": "deepseek-v4.1-flash", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    with pytest.raises(RecursionError):
        json.loads(deep)  # what the ingress used to hand it to
    for path in ROUTES:
        error = assert_error(post_raw(live.client, path, deep), 400)
        assert str(MAX_JSON_DEPTH) in error["message"] and "levels" in error["message"], error
    for extra, status in ((MAX_JSON_DEPTH - 1, 200), (MAX_JSON_DEPTH, 400)):  # the body object is level 1
        body = json.dumps(chat_body(extra="@")).replace('"@"', "[" * extra + "]" * extra).encode()
        assert post_raw(live.client, "/v1/chat/completions", body).status_code == status, extra


def test_a_lone_surrogate_is_a_400_naming_the_field(live):
    cases = {  # raw JSON (the escape is valid JSON, the text is no Unicode) -> the field named
        "/v1/chat/completions": [
            (b'{"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
             "messages[0].content"),
            (b'{"model": "deepseek-v4.1-flash\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "model"),
            (b'{"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}',
             "stop[0]"),
        ],
        "/v1/completions": [(b'{"model": "deepseek-v4.1-flash", "prompt": "x\\ud83d"}', "prompt")],
    }
    for path, bodies in cases.items():
        for raw, field in bodies:
            error = assert_error(post_raw(live.client, path, raw), 400, param=field)
            assert "surrogate" in error["message"], error
    paired = b'{"model": "deepseek-v4.1-flash", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert post_raw(live.client, "/v1/chat/completions", paired).status_code == 200  # a pair is one character


def test_a_prompt_above_the_character_limit_is_refused_before_tokenizing(live):
    r = live.client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_PROMPT_CHARS + 1)})
    error = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert str(MAX_PROMPT_CHARS) in error["message"]
    r = live.client.post("/v1/chat/completions", json=chat_body("y" * MAX_PROMPT_CHARS))  # + the chat template
    assert_error(r, 400, param="messages", code="context_length_exceeded")


def test_an_unexpected_exception_is_a_json_500(live):
    for path in ROUTES:
        body = chat_body() if "chat" in path else {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = live.broken.post(path, json=body)
        error = assert_error(r, 500, type="server_error")
        assert "error id" in error["message"] and "RuntimeError" in error["message"], error
    assert live.broken.get("/v1/models").status_code == 200  # the ingress itself is fine


def test_a_large_body_does_not_stall_other_requests(live):
    """While one big chat body is parsed, rendered and tokenized, GET /v1/models keeps answering: the
    slowest of them takes under a quarter of the big request's time (it used to wait for all of it)."""
    text = "The serving path carries every token from the engine to the client. "
    body = chat_body(text * (BIG_PROMPT_CHARS // len(text)), max_tokens=1)
    latencies: list[float] = []
    with httpx.Client(base_url=live.client.base_url, headers=dict(live.client.headers), timeout=120) as other, \
            ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        big = pool.submit(live.client.post, "/v1/chat/completions", json=body)
        while not big.done():
            sent = time.monotonic()
            assert other.get("/v1/models").status_code == 200
            latencies.append(time.monotonic() - sent)
        big_s = time.monotonic() - t0
    r = big.result()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > BIG_PROMPT_CHARS // 10
    print(f"\nbig body: {len(json.dumps(body)) / 1e6:.2f} MB, {r.json()['usage']['prompt_tokens']} prompt tokens, "
          f"{big_s:.2f} s; /v1/models during it: {len(latencies)} calls, slowest {max(latencies) * 1000:.0f} ms, "
          f"median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms")
    assert big_s > 0.5, "the big request was too quick to tell a stall from none"
    assert len(latencies) >= 3 and max(latencies) < big_s / 4, (big_s, latencies)


def test_an_unexpected_exception_is_logged_with_its_traceback(caplog):
    from serve_app.ingress import unexpected_error

    try:
        {}["missing"]
    except KeyError as e:
        with caplog.at_level(logging.ERROR, logger="dsv41.ingress"):
            response = unexpected_error("POST", "/v1/chat/completions", e)
    error = json.loads(response.body)["error"]
    assert response.status_code == 500 and (error["type"], error["param"], error["code"]) == ("server_error", None, None)
    [record] = caplog.records
    error_id = record.getMessage().split()[2]
    assert f"error id {error_id}" in error["message"] and "POST /v1/chat/completions" in record.getMessage()
    assert record.exc_info[0] is KeyError and "test_bad_input.py" in caplog.text  # the traceback, to the frame
