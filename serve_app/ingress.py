"""The HTTP ingress: OpenAI's API on FastAPI inside a Ray Serve deployment.

A chat request's body is parsed, validated (`json_body`, `protocol`), rendered and tokenized here, on a
thread pool of the ingress's own (the event loop keeps serving other requests meanwhile), sent to the engine
deployment as a `GenerateRequest`, and its streamed `GenerateChunk`s are detokenized and parsed into OpenAI deltas
(`streaming`). The engine deployment's handle is a constructor argument, so tests can pass another;
with KV sharing on, so is the KVRouter's: it decides which replica should take the prompt (a KVHint
inside the GenerateRequest, which the engine handle's request router follows).
The API key guards every route but /healthz and /readyz (one middleware, before routing and validation).
Errors are OpenAI's error schema, an unexpected exception too (a 500 of type server_error, its traceback
logged); an error after a stream began is its last SSE event, then `data: [DONE]`; overload is 429/503 with
Retry-After; a client that goes away cancels its engine request.
"""


import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.exceptions import RayActorError

from engine.tokenizer import load_tokenizer
from serve_app.errors import APIError, overloaded, payload_too_large, rate_limited, server_error, unauthorized
from serve_app.image_parts import fetch_images, image_span_tokens
from serve_app.json_body import parse_json_body
from serve_app.metrics_export import scrape_project_metrics
from serve_app.protocol import (ChatCompletionRequest, CompletionLogprobs, CompletionRequest, chat_chunk,
                                chat_completion_response, chat_choice, chat_logprobs, chat_prompt_ids,
                                chat_stream_choice, check_model, completion_choice, completion_chunk,
                                completion_prompt_ids, completion_response, models_response, parse_chat_request,
                                parse_completion_request, to_sampling_params, usage)
from serve_app.records import EngineRejected, EngineStatus, GenerateChunk, GenerateRequest, KVHint, ReplicaUnavailable
from serve_app.schemas import ChatCompletionBody, CompletionBody, openapi_document, request_body
from serve_app.settings import ServeSettings
from serve_app.streaming import SSE_DONE, ChatChoiceStream, CompletionChoiceStream, TokenStrings, sse_event

RETRY_AFTER_S = 1
ROUTE_TIMEOUT_S = 2.0  # a KVRouter slower than this (or restarting) leaves the request to load-only routing
NUM_PREPARE_THREADS = 2  # bodies parsed, rendered and tokenized at once; more wait for a thread
logger = logging.getLogger("dsv41.kv")
error_logger = logging.getLogger("dsv41.ingress")
OPEN_ROUTES = ("/healthz", "/readyz")

# /openapi.json is the ingress's own route (below): its request-body schemas name this deployment's max_n
app = FastAPI(title="dsv41-serve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (unknown path 404, wrong method 405) in OpenAI's error schema too."""
    message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
    return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)


@app.middleware("http")
async def _door(request: Request, call_next) -> Response:
    """Every request: the API key (on every route but OPEN_ROUTES, unknown paths included, so a new route
    is never open by omission), then the route, with any exception it did not handle as a JSON error."""
    try:
        if app_path(request.scope) not in OPEN_ROUTES:
            authorize(request, serve.get_replica_context().servable_object.settings.api_key)
        return await call_next(request)
    except APIError as e:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
    except Exception as e:  # noqa: BLE001 - the one place a bug becomes a response; logged with its traceback
        return unexpected_error(request.method, request.url.path, e)


def app_path(scope: dict) -> str:
    """The request's path below the app's route prefix (Serve's route_prefix is the ASGI root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def authorize(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (no key configured: open)."""
    if api_key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                       f"Bearer {api_key}".encode()):
        raise unauthorized()


def unexpected_error(method: str, path: str, e: Exception) -> JSONResponse:
    """A 500 in OpenAI's error schema (type server_error) for an exception nothing handled; the traceback
    goes to the log under an id that the message names."""
    error_id = uuid.uuid4().hex[:12]
    error_logger.error("unexpected error %s in %s %s", error_id, method, path, exc_info=e)
    error = server_error(f"internal server error ({type(e).__name__}, error id {error_id}; the server log has "
                         "its traceback)")
    return JSONResponse(error.body(), status_code=error.status)


class _Chunks:
    """The engine's chunk stream with its first chunk already taken; cancels the engine request when
    closed early (client gone, all choices stopped on stop strings)."""

    def __init__(self, first: GenerateChunk, gen, ingress: "OpenAIIngress"):
        self.first, self.gen, self.ingress, self.done = first, gen, ingress, False

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        try:
            yield self.first
            async for chunk in self.gen:
                yield chunk
            self.done = True
        finally:
            self.ingress.in_flight -= 1
            if not self.done:
                self.gen.cancel()


class _Turn:
    """Shared accounting of one request's choices."""

    def __init__(self, rid: str, created: int, model: str, streams: list, strings: TokenStrings, logprobs: bool):
        self.rid, self.created, self.model, self.streams, self.strings = rid, created, model, streams, strings
        self.want_logprobs = logprobs
        self.num_prompt = self.num_cached = 0
        self.finished = [False] * len(streams)

    def _account(self, chunk: GenerateChunk) -> None:
        self.num_prompt = chunk.num_prompt_tokens
        if chunk.choice_index == 0:
            self.num_cached = chunk.num_cached_tokens

    def _consumed(self, chunk: GenerateChunk, stream, before: int) -> list:
        return chunk.logprobs[:stream.num_tokens - before]

    async def events(self, chunks: "_Chunks") -> AsyncIterator[dict]:
        """OpenAI payloads as the engine's chunks arrive; ends once every choice finished. Raises APIError
        when the engine ends a choice with an error, and whatever the engine stream raises (a replica that
        died); either way the engine request is closed (cancelled) before the exception leaves."""
        engine_chunks = chunks.__aiter__()
        try:
            async for chunk in engine_chunks:
                self._account(chunk)
                i, stream = chunk.choice_index, self.streams[chunk.choice_index]
                if self.finished[i]:
                    continue
                before = stream.num_tokens
                out = stream.feed(chunk.token_ids)  # chat: delta dicts; completions: text
                consumed = self._consumed(chunk, stream, before)
                reason = self._check_reason(chunk)
                if reason is not None or stream.is_stopped:
                    out += stream.finish(reason)
                    self.finished[i] = True
                for payload in self._payloads(i, stream, out, consumed):
                    yield payload
                if all(self.finished):
                    return
        finally:
            await engine_chunks.aclose()

    @staticmethod
    def _check_reason(chunk: GenerateChunk) -> str | None:
        reason = chunk.finish_reason
        if reason in ("abort", "error"):
            why = (chunk.error or reason).strip().splitlines()[0]  # the first line: no remote traceback
            raise server_error(f"the engine ended the request ({why})")
        return reason

    def usage(self, reasoning: int = 0) -> dict:
        return usage(self.num_prompt, sum(s.num_tokens for s in self.streams), self.num_cached, reasoning)


class _ChatTurn(_Turn):
    def __init__(self, *args):
        super().__init__(*args)
        self.logprob_rows: list[list[dict]] = [[] for _ in self.streams]

    def _payloads(self, i: int, stream, deltas: list[dict], consumed: list) -> Iterator[dict]:
        lp = chat_logprobs(self.strings, consumed) if self.want_logprobs else None
        if lp:
            self.logprob_rows[i] += lp
        for k, delta in enumerate(deltas or ([{"content": ""}] if lp else [])):
            yield chat_chunk(self.rid, self.created, self.model, [chat_stream_choice(i, delta, logprobs=lp if k == 0 else None)])
        if self.finished[i]:
            yield chat_chunk(self.rid, self.created, self.model,
                             [chat_stream_choice(i, {}, finish_reason=stream.finish_reason)])

    def response(self) -> dict:
        choices = [chat_choice(i, s.message(), s.finish_reason, self.logprob_rows[i] if self.want_logprobs else None)
                   for i, s in enumerate(self.streams)]
        return chat_completion_response(self.rid, self.created, self.model, choices, self.full_usage())

    def full_usage(self) -> dict:
        return self.usage(sum(s.num_reasoning_tokens for s in self.streams))

    def usage_chunk(self) -> dict:
        return chat_chunk(self.rid, self.created, self.model, [], usage=self.full_usage())


class _CompletionTurn(_Turn):
    def __init__(self, *args):
        super().__init__(*args)
        self.logprobs = [CompletionLogprobs(self.strings) for _ in self.streams]
        self.logprob_docs: list[dict | None] = [None] * len(self.streams)

    def _payloads(self, i: int, stream, text: str, consumed: list) -> Iterator[dict]:
        lp = self.logprobs[i].add(consumed) if self.want_logprobs else None
        if lp is not None:
            self.logprob_docs[i] = _merge(self.logprob_docs[i], lp)
        if text or lp or self.finished[i]:
            reason = stream.finish_reason if self.finished[i] else None
            yield completion_chunk(self.rid, self.created, self.model, [completion_choice(i, text, reason, lp)])

    def response(self) -> dict:
        choices = [completion_choice(i, s.text, s.finish_reason, self.logprob_docs[i]) for i, s in enumerate(self.streams)]
        return completion_response(self.rid, self.created, self.model, choices, self.usage())

    def usage_chunk(self) -> dict:
        return completion_chunk(self.rid, self.created, self.model, [], usage=self.usage())


def _merge(into: dict | None, part: dict) -> dict:
    if into is None:
        return {k: list(v) for k, v in part.items()}
    for k, v in part.items():
        into[k] += v
    return into


def mid_request_error(request_id: str, e: Exception) -> APIError:
    """The error a request answers once the engine has started on it: an APIError as raised (the engine
    ended a choice with an error), else a 500 naming only the exception's type (a replica that died
    mid-stream: Ray's message names hosts and processes), logged with its traceback under the request id."""
    if isinstance(e, APIError):
        error_logger.warning("request %s ended with an error: %s", request_id, e.message)
        return e
    error_logger.error("request %s failed after the engine started on it", request_id, exc_info=e)
    return server_error(f"the engine failed during the request ({type(e).__name__}); the request can be retried")


def _ray_message(e: BaseException) -> str:
    """The original message of an exception that crossed a Ray call (RayTaskError wraps it)."""
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).strip().splitlines()[-1]


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, settings: ServeSettings, router=None):
        self.engine, self.settings, self.router = engine, settings, router
        self.tokenizer = load_tokenizer(settings.checkpoint)
        self.strings = TokenStrings(self.tokenizer)
        self.max_in_flight = settings.max_ongoing_requests * settings.num_replicas
        self.image_policy = settings.image_policy
        self.in_flight = 0
        self._status: EngineStatus | None = None
        self._openapi: dict | None = None
        # CPU-heavy work per request (JSON, rendering, tokenizing) runs here, not on the event loop
        self._prepare_pool = ThreadPoolExecutor(NUM_PREPARE_THREADS, thread_name_prefix="ingress-prepare")

    # ---- open routes --------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        if self._openapi is None:
            s = self.settings
            self._openapi = openapi_document(app, max_n=s.max_n, model_names=[s.model_name], max_messages=s.max_messages,
                                             max_output_tokens=s.max_output_tokens)
        return JSONResponse(self._openapi)

    @app.get("/readyz")
    async def readyz(self) -> JSONResponse:
        try:
            status = await asyncio.wait_for(self.engine.status.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 - any failure to answer means not ready
            return JSONResponse({"ready": False, "reason": type(e).__name__}, status_code=503)
        self._status = status
        return JSONResponse({"ready": status.ready}, status_code=200 if status.ready else 503)

    # ---- API ----------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self) -> dict:
        return models_response([self.settings.model_name], int(time.time()))

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        async with httpx.AsyncClient(timeout=5) as client:
            text = await scrape_project_metrics(client)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionBody))
    async def chat_completions(self, request: Request) -> Response:
        req, prompt_ids = await self._prepare(self._prepare_chat, await self._body(request))
        images = await fetch_images(req.images, self.image_policy)  # allow-listed URLs; data URLs as they are
        status = await self._engine_status()
        num_image_tokens = image_span_tokens(images, self.image_policy, status.vision_config)
        params = to_sampling_params(req, num_prompt_tokens=len(prompt_ids) - len(images) + num_image_tokens,
                                    max_model_len=status.max_model_len, max_output_tokens=self.settings.max_output_tokens,
                                    num_image_tokens=num_image_tokens if status.vision_config else 0)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stop_ids = (self.tokenizer.eos_id, *req.stop_token_ids)
        streams = [ChatChoiceStream(self.tokenizer, thinking=req.thinking, tools=req.prompt_tools,
                                    parse_tool_calls=req.tool_choice != "none", stop=req.stop,
                                    stop_token_ids=stop_ids, id_salt=f"{rid}-{i}",
                                    skip_special_tokens=req.skip_special_tokens) for i in range(req.n)]
        chunks = await self._start(GenerateRequest(rid, prompt_ids, params, images=tuple(p.data for p in images)))
        turn = _ChatTurn(rid, int(time.time()), req.model, streams, self.strings, req.logprobs)
        if req.stream:
            return StreamingResponse(self._sse(turn.events(chunks), req.include_usage, turn),
                                     media_type="text/event-stream")
        return JSONResponse(await self._collect(turn, chunks))

    @app.post("/v1/completions", openapi_extra=request_body(CompletionBody))
    async def completions(self, request: Request) -> Response:
        req, prompt_ids = await self._prepare(self._prepare_completion, await self._body(request))
        status = await self._engine_status()
        params = to_sampling_params(req, num_prompt_tokens=len(prompt_ids), max_model_len=status.max_model_len,
                                    max_output_tokens=self.settings.max_output_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stop_ids = (self.tokenizer.eos_id, *req.stop_token_ids)
        streams = [CompletionChoiceStream(self.tokenizer, stop=req.stop, stop_token_ids=stop_ids,
                                          skip_special_tokens=req.skip_special_tokens) for _ in range(req.n)]
        chunks = await self._start(GenerateRequest(rid, prompt_ids, params))
        turn = _CompletionTurn(rid, int(time.time()), req.model, streams, self.strings, req.logprobs is not None)
        if req.stream:
            return StreamingResponse(self._sse(turn.events(chunks), req.include_usage, turn),
                                     media_type="text/event-stream")
        return JSONResponse(await self._collect(turn, chunks))

    # ---- plumbing -----------------------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            raise payload_too_large(f"the request body of {declared} bytes is above the limit of "
                                    f"{self.settings.max_body_bytes} bytes")
        return await request.body()

    async def _prepare(self, fn: Callable[[bytes], tuple], raw: bytes) -> tuple:
        """fn(raw) on the prepare pool; its APIError comes back as raised."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, raw)

    def _prepare_chat(self, raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        """On a prepare thread: body bytes -> the validated request and its prompt ids."""
        s = self.settings
        req = parse_chat_request(parse_json_body(raw, s.max_body_bytes), max_n=s.max_n, max_messages=s.max_messages,
                                 max_output_tokens=s.max_output_tokens, image_policy=self.image_policy)
        check_model(req.model, [s.model_name])
        return req, chat_prompt_ids(req, self.tokenizer, max_chars=s.max_prompt_chars)

    def _prepare_completion(self, raw: bytes) -> tuple[CompletionRequest, list[int]]:
        s = self.settings
        req = parse_completion_request(parse_json_body(raw, s.max_body_bytes), max_n=s.max_n,
                                       max_output_tokens=s.max_output_tokens)
        check_model(req.model, [s.model_name])
        return req, completion_prompt_ids(req, self.tokenizer, max_chars=s.max_prompt_chars)

    async def _engine_status(self) -> EngineStatus:
        if self._status is None:
            self._status = await self.engine.status.remote()
        return self._status

    async def _start(self, gen_req: GenerateRequest) -> "_Chunks":
        """Submit to the engine and wait for its first chunk, so a refusal is still a 4xx."""
        if self.in_flight >= self.max_in_flight:
            raise rate_limited(f"{self.in_flight} requests in flight; try again shortly", RETRY_AFTER_S)
        gen_req = replace(gen_req, kv_hint=await self._kv_hint(gen_req))
        self.in_flight += 1
        gen = self.engine.generate.options(stream=True).remote(gen_req)
        try:
            first = await gen.__anext__()
        except EngineRejected as e:
            self.in_flight -= 1
            raise APIError(400, _ray_message(e), param=None) from None
        except (ReplicaUnavailable, RayActorError) as e:  # nothing started: a retry reaches a healthy replica
            self.in_flight -= 1
            gen.cancel()
            error_logger.warning("request %s: the engine replica is unavailable (%s)", gen_req.request_id, type(e).__name__)
            raise overloaded("the engine replica is being replaced; try again shortly", RETRY_AFTER_S) from None
        except Exception as e:
            self.in_flight -= 1
            gen.cancel()
            if type(e).__name__ in ("BackPressureError", "DeploymentUnavailableError"):
                raise overloaded("the engine is at capacity; try again shortly", RETRY_AFTER_S) from None
            raise server_error(f"the engine failed: {type(e).__name__}") from None
        except BaseException:  # cancelled: the client went away while its prompt was computed
            self.in_flight -= 1
            gen.cancel()
            raise
        return _Chunks(first, gen, self)

    async def _kv_hint(self, gen_req: GenerateRequest) -> KVHint | None:
        """The KVRouter's decision for the prompt; None (route by load only) without a router or when it
        fails or does not answer within ROUTE_TIMEOUT_S."""
        if self.router is None or gen_req.images:  # image spans are not shared between replicas (yet)
            return None
        try:
            return await asyncio.wait_for(self.router.route.remote(gen_req.request_id, gen_req.prompt_ids),
                                          ROUTE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 -- routing without the hint is slower, never wrong
            logger.warning("KV router gave no decision for %s (%r): routing by load only", gen_req.request_id, e)
            return None

    async def _sse(self, events: AsyncGenerator[dict, None], include_usage: bool, turn) -> AsyncIterator[str]:
        """The SSE body. An error once the stream has begun (its 200 is sent) is its last event, OpenAI's
        `data: {"error": {...}}`, then `data: [DONE]` as after any stream: the client sees why, not a cut."""
        try:
            async for payload in events:
                yield sse_event(payload)
            if include_usage:
                yield sse_event(turn.usage_chunk())
        except Exception as e:  # noqa: BLE001 -- not swallowed: it becomes the stream's error event
            yield sse_event(mid_request_error(turn.rid, e).body())
        finally:
            await events.aclose()  # a client gone mid-stream closes this generator: cancel the engine's now
        yield SSE_DONE

    @staticmethod
    async def _collect(turn, chunks: "_Chunks") -> dict:
        try:
            async for _ in turn.events(chunks):
                pass
        except Exception as e:  # noqa: BLE001 -- answered as an OpenAI error
            raise mid_request_error(turn.rid, e) from None
        return turn.response()
