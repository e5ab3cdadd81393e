"""Chat image_url parts -> image bytes (serve_app/image_parts.py) and their placeholders in the rendered prompt."""

from __future__ import annotations

import base64

import pytest

from engine.chat import syntax
from serve_app.errors import APIError
from serve_app.image_parts import chat_images
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
    assert req.images == (b"one", b"two", b"three")
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
        parse_chat_request(body({"role": "user", "content": content}), max_images=2, max_image_bytes=100)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_images_only_in_user_messages():
    with pytest.raises(APIError, match="user messages only"):
        chat_images([{"role": "system", "content": [part(url(b"x"))]}], max_images=8, max_image_bytes=100)
