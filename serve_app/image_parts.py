"""A chat request's images: its user messages' `image_url` content parts -> the encoded images' bytes, in prompt
order, with the request's limits (no Pillow, no torch: the ingress only unpacks; the engine replica decodes).

Accepted: `{"type": "image_url", "image_url": {"url": "data:image/<png|jpeg|webp>;base64,<data>"}}` (an optional
`detail` is ignored: the model sizes every image itself), several per message. http(s) URLs are refused: this
server fetches nothing (no allow-list yet). Each refusal is a 400 whose message names the part and, for a limit,
the limit.
"""

from __future__ import annotations

import base64
import binascii
import re

from serve_app.errors import APIError, bad_request

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)((?:;[\w.+-]+=[\w.+-]+)*);base64,(.*)", re.DOTALL | re.IGNORECASE)


def chat_images(messages: list[dict], *, max_images: int, max_image_bytes: int) -> tuple[bytes, ...]:
    """The bytes of every image_url part of the user messages, in order. Raises APIError 400."""
    out: list[bytes] = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            if msg.get("role") != "user":
                raise bad_request(f"{where}: image_url parts are accepted in user messages only", where)
            if len(out) == max_images:
                raise bad_request(f"{where}: more than this server's limit of {max_images} images per request",
                                  "messages")
            out.append(_image_bytes(part, where, max_image_bytes))
    return tuple(out)


def _image_bytes(part: dict, where: str, max_image_bytes: int) -> bytes:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url.url: required, a data: URL string", f"{where}.image_url.url")
    param = f"{where}.image_url.url"
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad_request(f"{param}: this server does not fetch image URLs; send the image inline as a data URL "
                          "(data:image/png;base64,...)", param, "image_url_not_supported")
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise bad_request(f"{param}: expected a base64 data URL (data:image/png;base64,...), got one starting "
                          f"{url[:24]!r}", param)
    media_type = match.group(1).lower()
    if media_type not in IMAGE_MEDIA_TYPES:
        raise bad_request(f"{param}: unsupported media type {media_type!r} (PNG, JPEG or WebP)", param)
    data = match.group(3)
    if len(data) * 3 // 4 > max_image_bytes + 2:  # before decoding: base64 holds 3 bytes per 4 characters
        raise _too_large(param, len(data) * 3 // 4, max_image_bytes)
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the data is not valid base64", param) from None
    if len(decoded) > max_image_bytes:
        raise _too_large(param, len(decoded), max_image_bytes)
    return decoded


def _too_large(param: str, num_bytes: int, max_image_bytes: int) -> APIError:
    return bad_request(f"{param}: the image is about {num_bytes} bytes, above this server's limit of "
                       f"{max_image_bytes} bytes per image", param, "image_too_large")
