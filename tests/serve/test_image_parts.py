"""Chat image_url parts -> image bytes (serve_app/image_parts.py) and their placeholders in the rendered prompt."""

from __future__ import annotations

import base64

import pytest

from engine.chat import syntax
from serve_app.errors import APIError
from serve_app.image_parts import ImagePolicy, chat_images
from serve_app.protocol import chat_prompt, parse_chat_request


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def body(*messages: dict) -> dict:
    return {"model": "m", "messages": list(messages), "reasoning_effort": "none"}


def test_images_in_order_and_placeholders_where_they_stand():
    user1 = {"role": "user", "content": [part(url(b"one")), {"type": "text", "text": "and"}, part(url(b"two", "image/jpeg"))]}
    user2 = {"role": "user", "content": [{"type": "text", "text": "then"}, part(url(b"three", "image/webp"))]}
    req = parse_chat_request(body(user1, {"role": "assistant", "content": "ok"}, user2))
    assert [p.data for p in req.images] == [b"one", b"two", b"three"]
    assert [p.param for p in req.images] == ["messages[0].content[0].image_url.url",
                                             "messages[0].content[2].image_url.url",
                                             "messages[2].content[1].image_url.url"]
    prompt = chat_prompt(req)
    assert prompt.count(syntax.IMAGE) == 3
    assert f"{syntax.IMAGE}\n\nand\n\n{syntax.IMAGE}" in prompt and f"then\n\n{syntax.IMAGE}" in prompt
    assert parse_chat_request(body({"role": "user", "content": "text only"})).images == ()


def test_the_tokenizer_writes_one_image_id_per_placeholder(tok):
    from serve_app.protocol import chat_prompt_ids

    req = parse_chat_request(body({"role": "user", "content": [part(url(b"x")), {"type": "text", "text": "hi"}]}))
    ids = chat_prompt_ids(req, tok, max_chars=10_000)
    assert ids.count(129264) == 1 and tok.token_to_id(syntax.IMAGE) == 129264
    spelled = parse_chat_request(body({"role": "user", "content": syntax.IMAGE}))  # a user's text is plain text
    assert 129264 not in chat_prompt_ids(spelled, tok, max_chars=10_000)


@pytest.mark.parametrize("content, param, words", [
    ([part("http://example.com/a.png")], "messages[0].content[0].image_url.url", "does not fetch image URLs"),
    ([part("https://example.com/a.png")], "messages[0].content[0].image_url.url", "does not fetch image URLs"),
    ([part("data:image/png;base64,@@@")], "messages[0].content[0].image_url.url", "not valid base64"),
    ([part("data:image/gif;base64,R0lG")], "messages[0].content[0].image_url.url", "unsupported media type"),
    ([part("file:///etc/passwd")], "messages[0].content[0].image_url.url", "expected a base64 data URL"),
    ([{"type": "image_url"}], "messages[0].content[0].image_url.url", "required"),
    ([part(url(b"x" * 101))], "messages[0].content[0].image_url.url", "limit of 100 bytes per image"),
    ([part(url(b"x"))] * 3, "messages", "limit of 2 images per request"),
])
def test_refusals_name_the_part_and_the_limit(content, param, words):
    with pytest.raises(APIError) as e:
        parse_chat_request(body({"role": "user", "content": content}),
                           image_policy=ImagePolicy(max_images=2, max_image_bytes=100))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_images_only_in_user_messages():
    with pytest.raises(APIError, match="user messages only"):
        chat_images([{"role": "system", "content": [part(url(b"x"))]}], ImagePolicy())


# ---- per-request totals, header sizes and span tokens (image_span_tokens) ------------------------------------
def png(width: int, height: int, noise: bool = False) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else \
        np.zeros((height, width, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def parts(*images: bytes, policy: ImagePolicy = ImagePolicy()) -> tuple:
    content = [part(url(data)) for data in images]
    return parse_chat_request(body({"role": "user", "content": content}), image_policy=policy).images


def span_tokens_refusal(images: tuple, policy: ImagePolicy) -> APIError:
    from serve_app.image_parts import image_span_tokens

    with pytest.raises(APIError) as e:
        image_span_tokens(images, policy, None)
    assert e.value.status == 400
    return e.value


def test_request_totals_are_limits_at_their_bound():
    from serve_app.image_parts import image_span_tokens

    a, b = png(60, 50, noise=True), png(70, 40, noise=True)
    exact = ImagePolicy(max_request_image_bytes=len(a) + len(b), max_request_image_pixels=60 * 50 + 70 * 40)
    assert image_span_tokens(parts(a, b), exact, None) == 2  # no vision config: one token each
    error = span_tokens_refusal(parts(a, b), ImagePolicy(max_request_image_bytes=len(a) + len(b) - 1))
    assert error.param == "messages" and error.code == "image_too_large"
    assert (f"the request's images are {len(a) + len(b)} bytes in all, above this server's limit of "
            f"{len(a) + len(b) - 1} bytes of images per request") in error.message, error.message
    error = span_tokens_refusal(parts(a, b), ImagePolicy(max_request_image_pixels=60 * 50 + 70 * 40 - 1))
    assert error.param == "messages" and error.code == "image_too_large"
    assert f"are {60 * 50 + 70 * 40} pixels in all, above this server's limit of {60 * 50 + 70 * 40 - 1} pixels of " \
           "images per request" in error.message, error.message


def test_each_image_is_sized_from_its_header_before_decoding():
    big = png(1100, 1000)  # one colour: a few KB
    error = span_tokens_refusal(parts(png(8, 8), big), ImagePolicy(max_image_pixels=1_000_000))
    assert error.param == "messages[0].content[1].image_url.url" and error.code == "image_too_large"
    assert "1100 x 1000 = 1100000 pixels, more than the limit of 1000000 pixels per image" in error.message
    error = span_tokens_refusal(parts(b"GIF89a not ours"), ImagePolicy())
    assert error.param == "messages[0].content[0].image_url.url"
    assert error.message.endswith("the data is not a PNG, JPEG or WebP image"), error.message


def test_span_tokens_are_the_layouts():
    from engine.config import ModelConfig
    from engine.vision.layout import plan_image_grid
    from serve_app.image_parts import image_span_tokens

    cfg = ModelConfig(vision_min_pixels=64 * 64, vision_max_n_token=200)
    sizes = [(300, 200), (17, 900), (2000, 2000)]
    images = parts(*(png(w, h) for w, h in sizes), policy=ImagePolicy(max_image_bytes=1 << 20))
    expected = [plan_image_grid(w, h, cfg).num_tokens for w, h in sizes]
    assert image_span_tokens(images, ImagePolicy(), cfg) == sum(expected) and 150 < max(expected) <= 200  # shrunk to fit


def test_the_context_window_counts_image_spans():
    from serve_app.protocol import to_sampling_params

    req = parse_chat_request(body({"role": "user", "content": [part(url(png(8, 8)))]}) | {"max_tokens": 10})
    assert to_sampling_params(req, num_prompt_tokens=90, max_model_len=100, num_image_tokens=80).max_tokens == 10
    with pytest.raises(APIError) as e:
        to_sampling_params(req, num_prompt_tokens=91, max_model_len=100, num_image_tokens=80)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert ("this model's maximum context length is 100 tokens; the request has 91 prompt tokens (80 of them its "
            "images' spans) and asks for up to 10 more") in e.value.message, e.value.message
