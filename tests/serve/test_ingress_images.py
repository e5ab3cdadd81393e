"""The ingress's image path in-process (no Serve: the deployment class built directly, its engine handle a fake): a
chat request's context window counts its images' expanded spans, so a prompt that fits with one placeholder token
per image but not with its spans is the ingress's own 400; an allow-listed URL reaches the engine as the image's
bytes."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
from PIL import Image
from starlette.requests import Request

from engine.config import ModelConfig
from engine.vision.layout import plan_image_grid
from serve_app.errors import APIError
from serve_app.records import EngineRejected, EngineStatus, GenerateRequest
from serve_app.settings import ServeSettings

VISION = ModelConfig(vision_min_pixels=64 * 64, vision_max_n_token=200)
MAX_MODEL_LEN = 300


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buf, "PNG")
    return buf.getvalue()


class _Remote:
    def __init__(self, fn):
        self.remote = fn

    def options(self, **_):
        return self


class FakeEngine:
    """What the ingress calls on its engine handle: status (with a vision config) and generate, which records
    the GenerateRequest and refuses it (so the test needs no stream)."""

    def __init__(self):
        self.requests: list[GenerateRequest] = []
        self.status = _Remote(self._status)
        self.generate = _Remote(self._generate)

    async def _status(self) -> EngineStatus:
        return EngineStatus(ready=True, model_name="m", max_model_len=MAX_MODEL_LEN, num_running=0, num_waiting=0,
                            cache_usage=0.0, prefix_hit_rate=0.0, vision_config=VISION)

    def _generate(self, req: GenerateRequest):
        self.requests.append(req)

        async def refuse():
            raise EngineRejected("recorded")
            yield

        return refuse()


@pytest.fixture(scope="module")
def ingress(tok):
    """The ingress class as written (serve.ingress wraps it in a subclass whose __init__ needs a Serve replica)."""
    from serve_app.ingress import OpenAIIngress

    written = OpenAIIngress.__mro__[1]
    assert written.__module__ == "serve_app.ingress" and written is not OpenAIIngress
    settings = ServeSettings(checkpoint=str(tok.path.parent), device="cpu", model_name="m", max_model_len=MAX_MODEL_LEN)
    return written(FakeEngine(), settings)


def post(ingress, body: dict) -> APIError:
    """The chat route's APIError for body."""
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive)
    with pytest.raises(APIError) as e:
        asyncio.run(ingress.chat_completions(request))
    return e.value


def chat(image: bytes, max_tokens: int | None) -> dict:
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "Describe."}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "reasoning_effort": "none"}
    return body if max_tokens is None else body | {"max_tokens": max_tokens}


def test_the_context_window_counts_the_expanded_image(ingress):
    span = plan_image_grid(2000, 2000, VISION).num_tokens
    engine = ingress.engine
    fits = post(ingress, chat(png(2000, 2000), 1))
    assert fits.message == "recorded" and len(engine.requests) == 1  # it reached the engine
    num_text = len(engine.requests[0].prompt_ids) - 1  # the prompt as sent: one placeholder for the image
    room = MAX_MODEL_LEN - num_text - span
    assert engine.requests[0].params.max_tokens == 1 and room > 1
    error = post(ingress, chat(png(2000, 2000), room + 1))
    assert error.code == "context_length_exceeded" and len(engine.requests) == 1, error.message
    assert (f"maximum context length is {MAX_MODEL_LEN} tokens; the request has {num_text + span} prompt tokens "
            f"({span} of them its images' spans) and asks for up to {room + 1} more") in error.message, error.message
    assert post(ingress, chat(png(2000, 2000), room)).message == "recorded"
    assert post(ingress, chat(png(2000, 2000), None)).message == "recorded"  # max_tokens omitted: the rest
    assert [r.params.max_tokens for r in engine.requests] == [1, room, room]
