"""A chat request's images: its user messages' `image_url` content parts -> the encoded images' bytes, in prompt
order, within the request's limits (no Pillow, no torch: the ingress unpacks, fetches and reads headers; the engine
replica decodes).

Accepted: `{"type": "image_url", "image_url": {"url": "data:image/<png|jpeg|webp>;base64,<data>"}}` (an optional
`detail` is ignored: the model sizes every image itself), several per message, and http(s) URLs whose host is on the
allow-list (`--image-url-hosts`; empty by default: every URL refused, nothing fetched). Each refusal is a 400 whose
message names the part and, for a limit, the limit.

1. `chat_images` (on a prepare thread, while the body is parsed): data URLs decoded, URLs checked against the
   allow-list and kept for fetching; the count and per-image byte limits.
2. `fetch_images` (on the event loop): the URL parts fetched at once with httpx, each within the fetch timeout
   and the per-image byte limit (enforced while streaming), redirects followed only to allow-listed hosts.
3. `image_span_tokens`: the request's byte and pixel totals, each image's pixels from its header
   (`engine/vision/image_size.py`) and the prompt tokens its span takes (`engine/vision/layout.py`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass

import httpx

from engine.config import ModelConfig
from engine.vision import ImageError
from engine.vision.image_size import read_image_size
from engine.vision.layout import plan_image_grid
from serve_app.errors import APIError, bad_request

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
MAX_REDIRECTS = 3
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)((?:;[\w.+-]+=[\w.+-]+)*);base64,(.*)", re.DOTALL | re.IGNORECASE)
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class AllowedHost:
    """One allow-list entry: `host` or `host:port` admits https only, `http://host[:port]` plain http too.
    Without a port only the scheme's default port (443, or 80 for http) is admitted. Hosts match exactly
    (case-insensitive; no wildcards); an IP literal is a host like any other."""

    host: str
    port: int | None = None
    allow_http: bool = False

    @classmethod
    def parse(cls, entry: str) -> "AllowedHost":
        """'example.com', 'example.com:8443', 'http://10.0.0.5:8080', '[::1]:9000'; ValueError otherwise."""
        text = entry.strip()
        scheme, sep, rest = text.partition("://")
        if not sep:
            scheme, rest = "https", text
        try:
            url = httpx.URL(f"{scheme.lower()}://{rest}")
        except httpx.InvalidURL as e:
            raise ValueError(f"{entry!r} is not a host[:port] ({e})") from None
        if url.scheme not in _DEFAULT_PORTS or not url.host or url.userinfo or url.raw_path not in (b"", b"/") \
                or rest.endswith("/") or url.query or url.fragment:
            raise ValueError(f"{entry!r}: expected host, host:port or http(s)://host[:port]")
        return cls(url.host, url.port, url.scheme == "http")

    def admits(self, url: httpx.URL) -> bool:
        if url.scheme not in _DEFAULT_PORTS or (url.scheme == "http" and not self.allow_http):
            return False
        port = url.port or _DEFAULT_PORTS[url.scheme]
        return url.host == self.host and port == (self.port or _DEFAULT_PORTS[url.scheme])


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """A chat request's image limits (ServeSettings.image_policy). Bytes are encoded bytes; pixels come from the
    header. The totals: OpenAI's 50 MB payload, and two 8K UHD images' worth of pixels to decode."""

    max_images: int = 8
    max_image_bytes: int = 20 << 20  # OpenAI's 20 MB per image
    max_image_pixels: int = 7680 * 4320  # 8K UHD
    max_request_image_bytes: int = 50 << 20
    max_request_image_pixels: int = 2 * 7680 * 4320
    url_hosts: tuple[AllowedHost, ...] = ()  # empty: no fetching
    fetch_timeout_s: float = 10.0  # one fetch, connect to last byte, redirects included


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image_url part: its encoded bytes, or (an allow-listed URL not fetched yet) its URL."""

    param: str  # where it stands: messages[i].content[j].image_url.url
    data: bytes = b""
    url: httpx.URL | None = None


def chat_images(messages: list[dict], policy: ImagePolicy) -> tuple[ImagePart, ...]:
    """Every image_url part of the user messages, in order. Raises APIError 400."""
    out: list[ImagePart] = []
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
            if len(out) == policy.max_images:
                raise bad_request(f"{where}: more than this server's limit of {policy.max_images} images per "
                                  "request", "messages")
            out.append(_image_part(part, f"{where}.image_url.url", policy))
    return tuple(out)


def _image_part(part: dict, param: str, policy: ImagePolicy) -> ImagePart:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise bad_request(f"{param}: required, a data: URL string", param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return ImagePart(param, url=_allowed_url(url, param, policy.url_hosts))
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise bad_request(f"{param}: expected a base64 data URL (data:image/png;base64,...), got one starting "
                          f"{url[:24]!r}", param)
    media_type = match.group(1).lower()
    if media_type not in IMAGE_MEDIA_TYPES:
        raise bad_request(f"{param}: unsupported media type {media_type!r} (PNG, JPEG or WebP)", param)
    data = match.group(3)
    if len(data) * 3 // 4 > policy.max_image_bytes + 2:  # before decoding: base64 holds 3 bytes per 4 characters
        raise _too_large(param, len(data) * 3 // 4, policy.max_image_bytes)
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the data is not valid base64", param) from None
    if len(decoded) > policy.max_image_bytes:
        raise _too_large(param, len(decoded), policy.max_image_bytes)
    return ImagePart(param, decoded)


def _allowed_url(url: str, param: str, hosts: tuple[AllowedHost, ...]) -> httpx.URL:
    if not hosts:
        raise bad_request(f"{param}: this server does not fetch image URLs; send the image inline as a data URL "
                          "(data:image/png;base64,...)", param, "image_url_not_supported")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise bad_request(f"{param}: not a valid URL ({e})", param) from None
    if not any(h.admits(parsed) for h in hosts):
        raise bad_request(f"{param}: {_origin(parsed)} is not on this server's image URL allow-list (send the "
                          "image inline as a data URL)", param, "image_url_not_supported")
    return parsed


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.host}" + (f":{url.port}" if url.port else "")


def _too_large(param: str, num_bytes: int, max_image_bytes: int) -> APIError:
    return bad_request(f"{param}: the image is about {num_bytes} bytes, above this server's limit of "
                       f"{max_image_bytes} bytes per image", param, "image_too_large")


# ---- 2. fetching -------------------------------------------------------------------------------------------
async def fetch_images(parts: tuple[ImagePart, ...], policy: ImagePolicy,
                       transport: httpx.AsyncBaseTransport | None = None) -> tuple[ImagePart, ...]:
    """The parts with every URL part's bytes fetched, all at once. Raises APIError 400 (the first failure;
    the other fetches are cancelled). transport: for tests."""
    if not any(p.url is not None for p in parts):
        return parts
    # no proxies or netrc from the environment: the allow-list names the hosts this process connects to
    async with httpx.AsyncClient(timeout=policy.fetch_timeout_s, follow_redirects=False, trust_env=False,
                                 transport=transport) as client:
        try:
            async with asyncio.TaskGroup() as tasks:
                fetches = [tasks.create_task(_fetch(client, p, policy)) if p.url is not None else None
                           for p in parts]
        except ExceptionGroup as group:
            refusal = next((e for e in group.exceptions if isinstance(e, APIError)), None)
            if refusal is None:
                raise
            raise refusal from None
    return tuple(p if task is None else ImagePart(p.param, task.result()) for p, task in zip(parts, fetches))


async def _fetch(client: httpx.AsyncClient, part: ImagePart, policy: ImagePolicy) -> bytes:
    assert part.url is not None
    url, param = part.url, part.param
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", url, headers={"Accept": "image/png, image/jpeg, image/webp",
                                                              "Accept-Encoding": "identity"}) as response:
                    if not response.is_redirect:
                        return await _read_image(response, param, policy.max_image_bytes)
                    target = url.join(response.headers["location"])
                    if not any(h.admits(target) for h in policy.url_hosts):
                        raise _fetch_failed(param, f"{url} redirects to {_origin(target)}, which is not on this "
                                                   "server's image URL allow-list")
                    url = target
            raise _fetch_failed(param, f"more than {MAX_REDIRECTS} redirects from {part.url}")
    except TimeoutError:
        raise _fetch_failed(param, f"fetching {url} took longer than {policy.fetch_timeout_s:g} s") from None
    except httpx.TimeoutException:
        raise _fetch_failed(param, f"fetching {url} timed out (limit {policy.fetch_timeout_s:g} s)") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise _fetch_failed(param, f"fetching {url} failed: {type(e).__name__}: {e}") from None


async def _read_image(response: httpx.Response, param: str, max_bytes: int) -> bytes:
    """The body of a 200 with an image media type, at most max_bytes (read no further)."""
    if response.status_code != 200:
        raise _fetch_failed(param, f"{response.url} answered HTTP {response.status_code} {response.reason_phrase}")
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in IMAGE_MEDIA_TYPES:
        raise _fetch_failed(param, f"{response.url} is not an image: its Content-Type is {media_type or 'missing'!r} "
                                   "(PNG, JPEG or WebP)")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(param, int(declared), max_bytes)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(param, len(body), max_bytes)
    return bytes(body)


def _fetch_failed(param: str, why: str) -> APIError:
    return bad_request(f"{param}: the image could not be fetched: {why}", param, "image_fetch_failed")


# ---- 3. totals and span tokens -----------------------------------------------------------------------------
def image_span_tokens(parts: tuple[ImagePart, ...], policy: ImagePolicy, vision: ModelConfig | None) -> int:
    """The prompt tokens the images' spans take (each placeholder expands to its span), with the request's byte
    and pixel totals and each image's pixels checked from its header. vision: the served model's config when it
    has a vision tower, else None (one token each: the replica refuses them). Raises APIError 400."""
    assert all(p.url is None for p in parts), "fetch_images first"
    num_bytes = sum(len(p.data) for p in parts)
    if num_bytes > policy.max_request_image_bytes:
        raise bad_request(f"messages: the request's images are {num_bytes} bytes in all, above this server's limit "
                          f"of {policy.max_request_image_bytes} bytes of images per request", "messages",
                          "image_too_large")
    num_pixels = num_tokens = 0
    for p in parts:
        try:
            width, height = read_image_size(p.data)
        except ImageError as e:
            raise bad_request(f"{p.param}: {e}", p.param) from None
        if width * height > policy.max_image_pixels:
            raise bad_request(f"{p.param}: the image is {width} x {height} = {width * height} pixels, more than the "
                              f"limit of {policy.max_image_pixels} pixels per image", p.param, "image_too_large")
        num_pixels += width * height
        num_tokens += 1 if vision is None else plan_image_grid(width, height, vision).num_tokens
    if num_pixels > policy.max_request_image_pixels:
        raise bad_request(f"messages: the request's images are {num_pixels} pixels in all, above this server's limit "
                          f"of {policy.max_request_image_pixels} pixels of images per request", "messages",
                          "image_too_large")
    return num_tokens
