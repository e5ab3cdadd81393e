"""Fixtures and helpers for the HTTP API tests (`test_api.py`): the real Serve app on the embedded default (the
tiny-vision checkpoint: the tiny checkpoint's text tensors plus a tiny vision tower),
deployed once on the session's Ray and Serve (tests/conftest.py), the offline engine that is the
oracle for what it streams, and the ingress on a MockEngine that plays a scripted completion (reasoning,
content with emoji split across tokens, a tool call), which the random tiny model never writes.

The app requires an API key; every helper sends it unless told otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import httpx
import pytest

from engine.chat import syntax
from engine.core.engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from serve_app.protocol import chat_prompt, parse_chat_request
from serve_app.settings import ServeSettings
from serve_app.streaming import TokenStrings

APP = "api_test"
MOCK_APP, MOCK_PREFIX = "api_mock_test", "/mock"
API_KEY = "sk-api-test-1234"
MAX_MODEL_LEN = 320  # small, so that a too-long prompt is cheap to send; a tools prompt is ~270 tokens
MAX_N = 4
MAX_BODY_BYTES = 64 << 10
MAX_IMAGE_BYTES = 16 << 10  # small, so that a too-large image is cheap to send
MAX_IMAGE_PIXELS = 1000 * 1000
MAX_IN_FLIGHT = 32  # the ingress answers 429 above this many requests in flight (one replica)
ERROR_KEYS = {"message", "type", "param", "code"}
USER = [{"role": "user", "content": "Say hello in three languages."}]
SCRIPT_REASONING = "The user wants the weather 🦜 in Paris."
SCRIPT_CONTENT = "Checking 龘 now 👩‍🚀."
SCRIPT_CALL = ("get_weather", {"city": "Paris", "days": 2})
SCRIPT = SCRIPT_REASONING + syntax.THINK_END + SCRIPT_CONTENT + syntax.render_tool_calls([SCRIPT_CALL])


@dataclass(slots=True)
class Api:
    base_url: str  # http://127.0.0.1:<port>, the app at route prefix "/"
    settings: ServeSettings
    engine: object  # DeploymentHandle of the app's EngineReplica
    client: httpx.Client  # sends the API key


@dataclass(slots=True)
class Stream:
    """A parsed SSE response: the JSON events in order and whether `data: [DONE]` closed it."""

    events: list[dict] = field(default_factory=list)
    done: bool = False
    ttft: float = 0.0  # seconds from sending the request to the first event with text

    def choices(self, index: int = 0) -> list[dict]:
        return [c for e in self.events for c in e["choices"] if c["index"] == index]

    def text(self, index: int = 0, key: str = "content") -> str:
        """Chat: the deltas' `key` joined; completions: the choices' text joined."""
        return "".join((c["delta"].get(key) or "") if "delta" in c else c["text"] for c in self.choices(index))

    def finish_reason(self, index: int = 0) -> str | None:
        reasons = [c["finish_reason"] for c in self.choices(index) if c["finish_reason"] is not None]
        assert len(reasons) == 1, f"choice {index}: finish reasons {reasons}"
        return reasons[0]

    @property
    def usage(self) -> dict | None:
        return self.events[-1].get("usage") if self.events else None


@pytest.fixture(scope="module")
def api_settings(tiny_vision_checkpoint) -> ServeSettings:
    return ServeSettings(checkpoint=str(tiny_vision_checkpoint), device="cpu", cache_memory_bytes=16 << 20,
                         max_num_seqs=32, max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN,
                         api_key=API_KEY, max_n=MAX_N, max_body_bytes=MAX_BODY_BYTES,
                         max_ongoing_requests=MAX_IN_FLIGHT, replica_num_cpus=1,
                         health_check_period_s=60, graceful_shutdown_timeout_s=1,
                         max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_IMAGE_PIXELS)


@pytest.fixture(scope="module")
def api(serve_session, api_settings) -> Iterator[Api]:
    """The whole app (ingress + EngineReplica) at route prefix "/" of the session's proxy, deleted after
    the module. Yields once /readyz answers 200."""
    from ray import serve

    from serve_app.app import build_app

    t0 = time.monotonic()
    serve.run(build_app(api_settings), name=APP, route_prefix="/")
    base_url = f"http://127.0.0.1:{serve_session}"
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the app did not become ready in 30 s"
            time.sleep(0.1)
        print(f"\napp deployed and ready in {time.monotonic() - t0:.1f} s")
        yield Api(base_url, api_settings, serve.get_deployment_handle("EngineReplica", APP), client)
    serve.delete(APP)


@pytest.fixture(scope="module")
def mock_api(api, api_settings) -> Iterator[str]:
    """The ingress on a MockEngine playing `SCRIPT` then EOS, at route prefix /mock; yields its base URL."""
    from ray import serve

    from serve_app.mock_engine import build_mock_app

    settings = replace(api_settings, max_model_len=None)  # the mock has no context window
    serve.run(build_mock_app(settings, text=SCRIPT, once=True), name=MOCK_APP, route_prefix=MOCK_PREFIX)
    yield api.base_url + MOCK_PREFIX
    serve.delete(MOCK_APP)


@pytest.fixture(scope="module")
def reference(tiny_vision_checkpoint, api_settings) -> LLMEngine:
    """The offline engine with the app's engine configuration: the oracle for token ids and logprobs."""
    return LLMEngine.from_checkpoint(tiny_vision_checkpoint, api_settings.to_engine_config())


@pytest.fixture(scope="module")
def strings(reference) -> TokenStrings:
    return TokenStrings(reference.tokenizer)


# ---- requests ---------------------------------------------------------------------------------------------
def run_replica(settings: ServeSettings, app: str, label: str = "EngineReplica"):
    """One EngineReplica deployment for settings on Serve as app (no HTTP route), warmed up; its handle."""
    from ray import serve

    from serve_app.engine_replica import deployment

    t0 = time.monotonic()
    handle = serve.run(deployment(settings).bind(settings), name=app, route_prefix=None)
    print(f"{label} deployed and warmed up in {time.monotonic() - t0:.1f} s")
    return handle


def chat_body(**fields) -> dict:
    """A chat request for the served model: USER's message, chat mode (no thinking), 8 tokens; `fields` override."""
    return {"model": "deepseek-v4.1-flash", "messages": USER, "reasoning_effort": "none", "max_tokens": 8,
            **fields}


def completion_body(**fields) -> dict:
    return {"model": "deepseek-v4.1-flash", "prompt": "The capital of France is", "max_tokens": 8, **fields}


def post_stream(client: httpx.Client, path: str, body: dict) -> Stream:
    """POST with stream=true and parse the SSE response (asserts 200 and the event framing)."""
    out = Stream()
    sent = time.monotonic()
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not out.done, line
            if line == "data: [DONE]":
                out.done = True
            else:
                out.events.append(json.loads(line[len("data: "):]))
                if not out.ttft and any(c.get("text") or (c.get("delta") or {}).get("content")
                                        for c in out.events[-1]["choices"]):
                    out.ttft = time.monotonic() - sent
    assert out.done, "the stream did not end with data: [DONE]"
    return out


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> dict:
    """The response is `status` with exactly OpenAI's error schema; returns the error object."""
    assert r.status_code == status, f"{r.status_code} {r.text}"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert (error["type"], error["param"], error["code"]) == (type, param, code), body
    return error


# ---- the offline oracle -------------------------------------------------------------------------------------
def chat_prompt_ids(reference: LLMEngine, body: dict) -> list[int]:
    """The prompt the ingress sends for this chat body: serve_app.protocol.chat_prompt, encoded."""
    return reference.tokenizer.encode(chat_prompt(parse_chat_request(body, max_n=MAX_N)))


@dataclass(slots=True)
class Offline:
    ids: list[int]
    logprobs: list  # TokenLogprob per id (when asked for)


def run_offline(reference: LLMEngine,
                requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[Offline]]:
    """Run the requests together to completion; request id -> its choices' ids and logprobs."""
    for rid, (prompt, params) in requests.items():
        reference.add_request(rid, prompt, params)
    out = {rid: [Offline([], []) for _ in range(params.n)] for rid, (_, params) in requests.items()}
    while reference.has_unfinished:
        for o in reference.step():
            choice = out[o.group_id][o.choice_index]
            choice.ids += o.new_token_ids
            choice.logprobs += o.new_logprobs
    return out


def visible_text(reference: LLMEngine, ids: list[int]) -> str:
    """What the API shows for these ids by default: the decoded text without special tokens (skip_special_tokens
    true, as vLLM: the end-of-sentence token, placeholders)."""
    return reference.tokenizer.decode(ids, skip_special_tokens=True)


def num_split_chars(strings: TokenStrings, ids: list[int]) -> int:
    """Tokens whose bytes are not whole UTF-8 characters (a character split across tokens)."""
    def whole(raw: bytes) -> bool:
        try:
            raw.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    return sum(not whole(strings.bytes(t)) for t in ids)


def wait_idle(api, timeout_s: float = 10.0) -> float:
    """Poll api.engine (the replica's handle) until nothing runs or waits, then run its integrity check; returns
    the seconds waited."""
    t0 = time.monotonic()
    while True:
        status = api.engine.status.remote().result()
        if status.num_running == 0 and status.num_waiting == 0:
            break
        assert time.monotonic() - t0 < timeout_s, f"engine still busy after {timeout_s} s: {status}"
        time.sleep(0.02)
    api.engine.check_integrity.remote().result()
    return time.monotonic() - t0
