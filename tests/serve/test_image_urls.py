"""http(s) image URLs from allow-listed hosts (serve_app/image_parts.py), against a local HTTP server started here
(127.0.0.1, a thread): the fetch end to end, and each refusal, which names the part and what went wrong. The
server logs every request it gets, so "nothing was fetched" is checked, not assumed."""

from __future__ import annotations

import asyncio
import io
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from engine.presets import tiny_vision_config
from engine.vision.layout import plan_image_grid
from serve_app.errors import APIError
from serve_app.image_parts import AllowedHost, ImagePolicy, fetch_images, image_span_tokens
from serve_app.protocol import parse_chat_request
from serve_app.settings import ServeSettings, SettingsError

PARAM = "messages[0].content[0].image_url.url"
MAX_BYTES = 64 << 10


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, "PNG")
    return buf.getvalue()


CAT = png(300, 200)


@dataclass
class Server:
    port: int
    paths: list[str] = field(default_factory=list)  # every request's path, in order
    body_bytes_sent: dict[str, int] = field(default_factory=dict)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    state: Server

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def send(self, status: int, body: bytes, content_type: str = "image/png", **headers: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            state.paths.append(self.path)
            if self.path == "/cat.png":
                self.send(200, CAT, "image/png; charset=binary")
            elif self.path == "/to-cat":  # a redirect within the allow-list
                self.send(302, b"", "text/plain", Location="/cat.png")
            elif self.path == "/to-elsewhere":  # the same server under a name not on the list
                self.send(302, b"", "text/plain", Location=state.url("/cat.png", host="localhost"))
            elif self.path == "/loop":
                self.send(302, b"", "text/plain", Location="/loop")
            elif self.path == "/endless.png":  # no Content-Length: the body ends only when the client stops reading
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                sent, chunk = 0, b"\x00" * 8192
                try:
                    while sent < 1000 * MAX_BYTES:
                        self.wfile.write(chunk)
                        sent += len(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                state.body_bytes_sent[self.path] = sent
            elif self.path == "/declared-big.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(MAX_BYTES + 1))
                self.end_headers()
            elif self.path == "/page.html":
                self.send(200, b"<html></html>", "text/html")
            elif self.path == "/slow.png":
                time.sleep(1.5)
                self.send(200, CAT)
            else:
                self.send(404, b"not found", "text/plain")

    class QuietServer(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address) -> None:
            """A client that gave up (the timeout tests) is expected: nothing printed. socketserver prints the
            traceback on stderr, from a handler thread that may outlive this module, into a later test's capture."""
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    httpd = QuietServer(("127.0.0.1", 0), Handler)
    state = Server(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()


def policy(server: Server, *entries: str, timeout_s: float = 5.0) -> ImagePolicy:
    hosts = entries or (f"http://127.0.0.1:{server.port}",)
    return ImagePolicy(max_image_bytes=MAX_BYTES, url_hosts=tuple(AllowedHost.parse(h) for h in hosts),
                       fetch_timeout_s=timeout_s)


def chat(*urls: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "What?"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def fetch(server: Server, *urls: str, p: ImagePolicy | None = None):
    p = p or policy(server)
    return asyncio.run(fetch_images(parse_chat_request(chat(*urls), image_policy=p).images, p))


def refusal(server: Server, *urls: str, p: ImagePolicy | None = None) -> APIError:
    with pytest.raises(APIError) as e:
        fetch(server, *urls, p=p)
    assert e.value.status == 400, e.value.message
    return e.value


def test_an_allowed_url_is_fetched_and_sized_like_a_data_url(server):
    import base64

    data_url = "data:image/png;base64," + base64.b64encode(png(40, 900)).decode()
    parts = fetch(server, server.url("/cat.png"), data_url, server.url("/to-cat"))
    assert [p.data for p in parts] == [CAT, png(40, 900), CAT] and all(p.url is None for p in parts)
    assert [p.param for p in parts] == [f"messages[0].content[{j}].image_url.url" for j in range(3)]
    cfg = tiny_vision_config()
    expected = sum(plan_image_grid(w, h, cfg).num_tokens for w, h in ((300, 200), (40, 900), (300, 200)))
    assert image_span_tokens(parts, policy(server), cfg) == expected
    assert sorted(server.paths[-3:]) == ["/cat.png", "/cat.png", "/to-cat"]  # fetched at once: any order


@pytest.mark.parametrize("url_host, entry, why", [
    ("localhost", None, "http://localhost:{port} is not on this server's image URL allow-list"),  # another name
    ("127.0.0.1", "http://127.0.0.1:1", "http://127.0.0.1:{port} is not on"),  # another port
    ("127.0.0.1", "127.0.0.1:{port}", "http://127.0.0.1:{port} is not on"),  # an entry without http:// is https only
])
def test_a_url_off_the_list_is_refused_and_nothing_is_fetched(server, url_host, entry, why):
    before = len(server.paths)
    p = policy(server, entry.format(port=server.port)) if entry else None
    error = refusal(server, server.url("/cat.png", host=url_host), p=p)
    assert error.param == PARAM and error.code == "image_url_not_supported"
    assert why.format(port=server.port) in error.message, error.message
    assert len(server.paths) == before  # the server was never asked


def test_no_allow_list_refuses_every_url(server):
    before = len(server.paths)
    with pytest.raises(APIError) as e:
        parse_chat_request(chat(server.url("/cat.png")))
    assert "does not fetch image URLs" in e.value.message and e.value.code == "image_url_not_supported"
    assert len(server.paths) == before


def test_a_body_past_the_byte_limit_is_refused_while_streaming(server):
    t0 = time.monotonic()
    error = refusal(server, server.url("/endless.png"))
    assert error.param == PARAM and error.code == "image_too_large"
    assert f"above this server's limit of {MAX_BYTES} bytes per image" in error.message, error.message
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5  # the server notices the closed connection on its next writes
    while "/endless.png" not in server.body_bytes_sent:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.body_bytes_sent["/endless.png"] < 100 * MAX_BYTES  # it stopped long before the server's 1000x
    error = refusal(server, server.url("/declared-big.png"))  # a declared length past it: refused before reading
    assert f"about {MAX_BYTES + 1} bytes, above this server's limit" in error.message, error.message


@pytest.mark.parametrize("path, words", [
    ("/to-elsewhere", "redirects to http://localhost:{port}, which is not on this server's image URL allow-list"),
    ("/missing.png", "answered HTTP 404 Not Found"),
    ("/page.html", "is not an image: its Content-Type is 'text/html'"),
    ("/loop", "more than 3 redirects"),
])
def test_failed_fetches_say_what_went_wrong(server, path, words):
    error = refusal(server, server.url(path))
    assert error.param == PARAM and error.code == "image_fetch_failed", error.message
    assert error.message.startswith(f"{PARAM}: the image could not be fetched: ")
    assert words.format(port=server.port) in error.message, error.message
    if path == "/to-elsewhere":
        assert "/cat.png" not in server.paths[server.paths.index("/to-elsewhere"):]


def test_a_slow_server_times_out(server):
    t0 = time.monotonic()
    error = refusal(server, server.url("/slow.png"), p=policy(server, timeout_s=0.3))
    assert error.code == "image_fetch_failed" and "0.3 s" in error.message, error.message
    assert time.monotonic() - t0 < 1.4  # not the server's 1.5 s


def test_a_refused_server_is_a_400_naming_the_part(server):
    error = refusal(server, "http://127.0.0.1:1/cat.png", p=policy(server, "http://127.0.0.1:1"))
    assert error.param == PARAM and error.code == "image_fetch_failed" and "ConnectError" in error.message


@pytest.mark.parametrize("entry, host, port, allow_http", [
    ("images.example.com", "images.example.com", None, False), ("Images.Example.com:8443", "images.example.com", 8443,
                                                                 False),
    ("http://10.0.0.5:8080", "10.0.0.5", 8080, True), ("https://[::1]:9000", "::1", 9000, False),
])
def test_allow_list_entries(entry, host, port, allow_http):
    assert AllowedHost.parse(entry) == AllowedHost(host, port, allow_http)


def test_the_setting_parses_strictly():
    s = ServeSettings.from_mapping({"checkpoint": "/c", "device": "cpu"},
                                   environ={"DSV41_IMAGE_URL_HOSTS": "a.example, http://127.0.0.1:9000"})
    assert s.image_url_hosts == ("a.example", "http://127.0.0.1:9000")
    assert s.image_policy.url_hosts == (AllowedHost("a.example"), AllowedHost("127.0.0.1", 9000, True))
    assert ServeSettings.from_cli(["--checkpoint", "/c", "--device", "cpu"], environ={}).image_policy.url_hosts == ()
    for bad in ("a.example/images", "ftp://a.example", "user@a.example", "a.example:notaport"):
        with pytest.raises(SettingsError, match="--image-url-hosts"):
            ServeSettings.from_cli(["--checkpoint", "/c", "--device", "cpu", "--image-url-hosts", bad], environ={})


def test_the_request_totals_and_timeout_are_settings():
    s = ServeSettings.from_cli(["--checkpoint", "/c", "--device", "cpu", "--max-request-image-bytes", "30MiB",
                                "--max-request-image-pixels", "1000000", "--image-fetch-timeout-s", "2.5"], environ={})
    p = s.image_policy
    assert (p.max_request_image_bytes, p.max_request_image_pixels, p.fetch_timeout_s) == (30 << 20, 1_000_000, 2.5)
    default = ServeSettings.from_cli(["--checkpoint", "/c", "--device", "cpu"], environ={}).image_policy
    assert default == ImagePolicy()  # the settings' defaults are the policy's
    for flag, value, words in (("--max-request-image-pixels", "0", "an integer >= 1"),
                               ("--image-fetch-timeout-s", "0", "> 0")):
        with pytest.raises(SettingsError, match=f"{flag} must be {words}"):
            ServeSettings.from_cli(["--checkpoint", "/c", "--device", "cpu", flag, value], environ={})
