"""OpenAI-compatible request validation and response bodies (no Ray, no HTTP framework).

Requests: `parse_chat_request` / `parse_completion_request` turn a parsed JSON body into a frozen
record or raise `APIError` 400 whose message starts with the offending field (`temperature: must be
...`) and whose `param` is that field. Choices made here:
- Unknown top-level fields are accepted and ignored (as vLLM does; OpenAI would answer 400), so
  clients that send vendor extras keep working. Known fields that would change the output in a way
  this server cannot honour are rejected: non-zero presence/frequency penalties, a non-neutral
  repetition_penalty, a non-empty logit_bias, echo, suffix, best_of > 1. A null value counts as absent.
- tool_choice: "none" renders no tools and returns any DSML the model writes anyway as content; "auto" (the
  default when tools are given) renders all tools and parses calls; "required" renders them and constrains the
  output to one or more calls (a grammar, `serve_app/structured.py`); a named function renders only that tool
  and constrains the output to one call of it (in thinking mode the reasoning before them can open no calls
  block). Under "auto" a tool with `strict: true` has its calls' arguments
  constrained (the rest of the output stays free). response_format json_object / json_schema constrains the
  output to JSON, on chat and legacy completions alike.
- reasoning_effort mirrors `engine.chat.render_chat`: null (= "high"), "none" (chat mode), OpenAI's
  "minimal"/"low"/"medium"/"high"/"xhigh" and V4.1's "max" (budgets 50/50/75/75/75/100, `EFFORT_PRESETS`), or an
  integer 1-100, also as a decimal string ("30"); anything else is a 400 listing what is accepted.
- Defaults follow OpenAI: temperature 1, top_p 1; chat max_tokens = the rest of the context window,
  completions max_tokens 16; max_completion_tokens wins over max_tokens.

Prompts: `chat_prompt_ids` / `completion_prompt_ids` bound the prompt text's characters before tokenising
(a 400 with code context_length_exceeded) and tokenize without holding the GIL, so the ingress runs them
on a worker thread. In a chat prompt only the template writes special tokens: every text of the request
(contents, reasoning, tool schemas, call names and arguments) is encoded as plain text, so a message that
spells `<｜end▁of▁sentence｜>`, `<｜User｜>`, `<think>` or a DSML tag cannot end its turn or inject a call.
A completions prompt is the client's own raw prompt, template included: its special-token spellings are
special tokens (as vLLM's completions do).

Responses: plain dicts in OpenAI's shapes (the tests validate them with the `openai` package's types).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.chat import EFFORT_NAMES, ChatFormatError, PromptPart, is_thinking, render_chat_parts
from engine.core.request import TokenLogprob
from engine.core.sampling_params import GrammarSpec, SamplingError, SamplingParams
from serve_app.errors import APIError, bad_request, model_not_found
from serve_app.image_parts import ImagePart, ImagePolicy, chat_images
from serve_app.json_body import json_kind
from serve_app.streaming import TokenStrings
from serve_app.structured import check_strict, output_grammar, response_schema

# What one request may ask for (docs/reliability.md lists them; each is a 400 naming the field). The server's
# settings set max_n, max_messages and max_output_tokens; the others are the API's (OpenAI's where it has one).
DEFAULT_MAX_N = 8
DEFAULT_MAX_MESSAGES = 2048  # OpenAI's limit on a chat request's messages
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # a stop string's characters: streaming holds back up to this many minus one
MAX_STOP_TOKEN_IDS = 64  # every generated token is checked against them
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
DEFAULT_COMPLETION_MAX_TOKENS = 16
MIN_LOGPROB = -9999.0  # what -inf is reported as (JSON has no infinity)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
REASONING_EFFORTS = EFFORT_NAMES  # and the integers 1-100
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; also keeps names DSML-safe

ToolChoice = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class ChatCompletionRequest:
    model: str
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: ToolChoice = "none"  # "function": the one named by tool_choice_name
    tool_choice_name: str | None = None
    reasoning_effort: str | int | None = None  # as render_chat takes it
    max_tokens: int | None = None  # None: the rest of the context window
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    skip_special_tokens: bool = True  # vLLM's: tokens flagged special are not text
    spaces_between_special_tokens: bool = True  # vLLM's; no effect with this tokenizer (serve_app/streaming.py)
    grammar: str | None = None  # the output's llguidance grammar (serve_app/structured.py), compiled once here
    # the user messages' image_url parts, in prompt order (URL parts are fetched by the ingress: image_parts.py)
    images: tuple[ImagePart, ...] = field(default=(), repr=False)

    @property
    def thinking(self) -> bool:
        return is_thinking(self.reasoning_effort)

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tools rendered into the prompt and used to parse calls (None: no tool calls parsed)."""
        if self.tool_choice == "none" or not self.tools:
            return None
        if self.tool_choice == "function":
            return [t for t in self.tools if t["function"]["name"] == self.tool_choice_name]
        return self.tools


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    grammar: str | None = None  # response_format json_object / json_schema


# --- bodies --------------------------------------------------------------------------------------


def check_model(name: str, served_names: Sequence[str]) -> None:
    if name not in served_names:
        raise model_not_found(name)


def parse_chat_request(body: dict, *, max_n: int = DEFAULT_MAX_N, max_messages: int = DEFAULT_MAX_MESSAGES,
                       max_output_tokens: int | None = None,
                       image_policy: ImagePolicy = ImagePolicy()) -> ChatCompletionRequest:
    """max_output_tokens: the most max_tokens / max_completion_tokens may ask for (None: the context window);
    image_policy: the image_url parts' limits and URL allow-list (serve_app/image_parts.py)."""
    f = _Fields(body)
    tools = _tools(f)
    choice, choice_name = _tool_choice(f, tools)
    f.check_neutral()
    reasoning_effort = _reasoning_effort(f)
    grammar = output_grammar(response_schema(f.get("response_format")), tools, choice, choice_name,
                             thinking=is_thinking(reasoning_effort))
    max_tokens = f.integer("max_tokens", lo=1, hi=max_output_tokens)
    max_completion_tokens = f.integer("max_completion_tokens", lo=1, hi=max_output_tokens)
    logprobs = f.boolean("logprobs", False)
    top_logprobs = f.integer("top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    stream, include_usage = f.stream()
    model, messages = f.model(), _messages(f, max_messages)
    return ChatCompletionRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        tool_choice_name=choice_name,
        reasoning_effort=reasoning_effort,
        max_tokens=max_tokens if max_completion_tokens is None else max_completion_tokens,
        n=f.integer("n", lo=1, hi=max_n) or 1,
        stop=f.stop(),
        stop_token_ids=f.token_ids("stop_token_ids", MAX_STOP_TOKEN_IDS),
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        stream=stream,
        include_usage=include_usage,
        user=f.string("user"),
        grammar=grammar,
        images=chat_images(messages, image_policy),
        **f.detokenize(),
        **f.sampling(),
    )


def parse_completion_request(body: dict, *, max_n: int = DEFAULT_MAX_N,
                             max_output_tokens: int | None = None) -> CompletionRequest:
    f = _Fields(body)
    f.check_neutral()
    grammar = output_grammar(response_schema(f.get("response_format")), None, "none", None, thinking=False)
    if f.boolean("echo", False):
        raise bad_request("echo: not supported (only false)", "echo")
    if f.get("suffix") is not None:
        raise bad_request("suffix: not supported", "suffix")
    if f.get("best_of") not in (None, 1) or isinstance(f.get("best_of"), bool):
        raise bad_request(f"best_of: not supported (only 1), got {_show(f.get('best_of'))}", "best_of")
    stream, include_usage = f.stream()
    max_tokens = f.integer("max_tokens", lo=1, hi=max_output_tokens)
    default_max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max_output_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
    return CompletionRequest(
        model=f.model(),
        prompt=_prompt(f),
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        n=f.integer("n", lo=1, hi=max_n) or 1,
        stop=f.stop(),
        stop_token_ids=f.token_ids("stop_token_ids", MAX_STOP_TOKEN_IDS),
        logprobs=f.integer("logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS),
        stream=stream,
        include_usage=include_usage,
        user=f.string("user"),
        grammar=grammar,
        **f.detokenize(),
        **f.sampling(),
    )


# --- prompts and sampling ------------------------------------------------------------------------


def chat_prompt(req: ChatCompletionRequest) -> str:
    """The V4.1 prompt text (BOS included; encode it without adding another)."""
    return "".join(p.text for p in chat_prompt_parts(req))


def chat_prompt_parts(req: ChatCompletionRequest) -> list[PromptPart]:
    """The V4.1 prompt as the template's parts and the request's text (literal parts)."""
    try:
        return render_chat_parts(req.messages, tools=req.prompt_tools, reasoning_effort=req.reasoning_effort)
    except ChatFormatError as e:
        message = str(e)
        raise bad_request(message, message.split(":", 1)[0] if ":" in message else "messages") from None


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer: Any, *, max_chars: int) -> list[int]:
    """The rendered prompt's token ids; a prompt text above max_chars is a 400 before tokenising. Special
    tokens come only from the template: the messages' text is encoded as plain text whatever it spells
    (`<｜end▁of▁sentence｜>` in a message is 12 ordinary tokens), so it cannot end a turn or write a call."""
    parts = chat_prompt_parts(req)
    num_chars = sum(len(p.text) for p in parts)
    if num_chars > max_chars:
        raise _too_many_chars("messages", num_chars, max_chars)
    return tokenizer.encode_parts(parts)


def completion_prompt_ids(req: CompletionRequest, tokenizer: Any, *, max_chars: int) -> list[int]:
    """The prompt's token ids: the text encoded (no BOS added; above max_chars a 400 before tokenising),
    or the given ids checked against the vocabulary."""
    if isinstance(req.prompt, str):
        return encode_prompt(tokenizer, req.prompt, max_chars=max_chars, param="prompt")
    for i, token_id in enumerate(req.prompt):
        if token_id >= tokenizer.vocab_size:
            raise bad_request(f"prompt[{i}]: token id {token_id} is not below the vocabulary size "
                              f"{tokenizer.vocab_size}", "prompt")
    return list(req.prompt)


def encode_prompt(tokenizer: Any, text: str, *, max_chars: int, param: str) -> list[int]:
    """text's token ids (no BOS added), bounded first: more than max_chars characters is a 400
    (context_length_exceeded) without tokenising. Through `encode_batch`, which releases the GIL while
    it runs (HF tokenizers' `encode` holds it), so a caller on a worker thread leaves the event loop free."""
    if len(text) > max_chars:
        raise _too_many_chars(param, len(text), max_chars)
    return tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids


def _too_many_chars(param: str, num_chars: int, max_chars: int) -> APIError:
    return bad_request(f"{param}: the prompt has {num_chars} characters, above this server's limit of "
                       f"{max_chars}", param, "context_length_exceeded")


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, *, num_prompt_tokens: int, max_model_len: int,
    max_output_tokens: int | None = None, num_image_tokens: int = 0,
) -> SamplingParams:
    """The engine's parameters. max_tokens None becomes the rest of the context window (at most
    max_output_tokens); a prompt that leaves no room, or prompt + max_tokens beyond the window, is a 400
    (OpenAI's context_length_exceeded). num_prompt_tokens counts image spans expanded, num_image_tokens of them. Chat logprobs map to top_logprobs alternatives, legacy ones to `logprobs`.
    A grammar constrains the output from its first token (in thinking mode its reasoning too)."""
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    room = max_model_len - num_prompt_tokens
    max_tokens = min(room, max_output_tokens or room) if req.max_tokens is None else req.max_tokens
    if room < 1 or max_tokens > room:
        raise bad_request(
            f"{prompt_param}: this model's maximum context length is {max_model_len} tokens; the request "
            f"has {num_prompt_tokens} prompt tokens"
            + (f" ({num_image_tokens} of them its images' spans)" if num_image_tokens else "")
            + f" and asks for up to {max_tokens} more",
            prompt_param, "context_length_exceeded")
    is_chat = isinstance(req, ChatCompletionRequest)
    logprobs = (req.top_logprobs if req.logprobs else None) if is_chat else req.logprobs
    grammar = GrammarSpec(req.grammar) if req.grammar is not None else None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, stop_token_ids=req.stop_token_ids, logprobs=logprobs, n=req.n,
        grammar=grammar)
    try:
        return params.validate()
    except SamplingError as e:  # the checks above make this unreachable; kept as the edge's guard
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


# --- responses -----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: list[dict] | None = None) -> dict:
    """One choice of a non-streaming response; `logprobs` is a list of `chat_logprobs` entries."""
    return {"index": index, "message": message, "logprobs": _chat_logprobs_field(logprobs),
            "finish_reason": finish_reason}


def chat_stream_choice(
    index: int, delta: dict, finish_reason: str | None = None, logprobs: list[dict] | None = None
) -> dict:
    return {"index": index, "delta": delta, "logprobs": _chat_logprobs_field(logprobs),
            "finish_reason": finish_reason}


def chat_completion_response(request_id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return _envelope("chat.completion", request_id, created, model, choices, usage)


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    """A `chat.completion.chunk`; the usage chunk of stream_options.include_usage has choices=[]."""
    return _envelope("chat.completion.chunk", request_id, created, model, choices, usage)


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One choice of a (streamed or not) text completion; `logprobs` from `CompletionLogprobs.add`."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(request_id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return _envelope("text_completion", request_id, created, model, choices, usage)


def completion_chunk(request_id: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    """Streamed completions use object "text_completion" too, finish_reason null until the last chunk."""
    return _envelope("text_completion", request_id, created, model, choices, usage)


def _envelope(kind: str, request_id: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
    body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices,
            "system_fingerprint": None}
    if usage is not None:  # chunks carry usage only when asked for (the last, choice-less one)
        body["usage"] = usage
    return body


def models_response(names: Sequence[str], created: int, owned_by: str = "dsv41-serve") -> dict:
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": owned_by} for n in names]}


def chat_logprobs(strings: TokenStrings, entries: Sequence[TokenLogprob | None]) -> list[dict]:
    """Engine logprobs -> OpenAI chat `logprobs.content` entries (None entries are skipped)."""
    def one(token_id: int, logprob: float) -> dict:
        return {"token": strings.text(token_id), "logprob": _finite(logprob),
                "bytes": list(strings.bytes(token_id))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries if e is not None]


class CompletionLogprobs:
    """Legacy /v1/completions logprobs for one choice: `add` returns the block for the tokens given,
    `text_offset` counting on from the previous call (offsets are sums of the tokens' texts)."""

    def __init__(self, strings: TokenStrings) -> None:
        self._strings = strings
        self._offset = 0

    def add(self, entries: Sequence[TokenLogprob | None]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            if e is None:
                continue
            text = self._strings.text(e.token_id)
            top = {self._strings.text(t): _finite(lp) for t, lp in e.top}
            top.setdefault(text, _finite(e.logprob))  # the sampled token is always listed
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out


def _chat_logprobs_field(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


# --- field validation ----------------------------------------------------------------------------


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Fields:
    """Typed reads of a request body's top-level fields; every failure is a 400 naming the field."""

    def __init__(self, body: dict) -> None:
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {json_kind(body)}")
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def fail(self, name: str, what: str) -> APIError:
        return bad_request(f"{name}: must be {what}, got {_show(self.body.get(name))}", name)

    def model(self) -> str:
        model = self.get("model")
        if not isinstance(model, str) or not model:
            raise self.fail("model", "a non-empty string")
        return model

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(name, "a boolean")
        return value

    def string(self, name: str) -> str | None:
        value = self.get(name)
        if value is not None and not isinstance(value, str):
            raise self.fail(name, "a string")
        return value

    def integer(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.get(name)
        if value is None:
            return None
        if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = (f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}") if lo is not None else ""
            raise self.fail(name, f"an integer{bounds}")
        return value

    def number(self, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        value = self.get(name)
        if value is None:
            return default
        if not _is_number(value) or not (lo < value if lo_open else lo <= value) or value > hi:
            raise self.fail(name, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
        return float(value)

    def detokenize(self) -> dict[str, bool]:
        return {"skip_special_tokens": self.boolean("skip_special_tokens", True),
                "spaces_between_special_tokens": self.boolean("spaces_between_special_tokens", True)}

    def sampling(self) -> dict[str, Any]:
        top_k = self.integer("top_k", lo=-1)
        return {
            "temperature": self.number("temperature", 1.0, 0.0, 2.0),
            "top_p": self.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
            "top_k": 0 if top_k is None or top_k == -1 else top_k,
            "min_p": self.number("min_p", 0.0, 0.0, 1.0),
            "seed": self.integer("seed", lo=0, hi=2**63 - 1),
        }

    def stop(self) -> tuple[str, ...]:
        value = self.get("stop")
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if (not isinstance(items, list) or len(items) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items)):
            raise self.fail("stop", f"a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to "
                            f"{MAX_STOP_CHARS} characters")
        return tuple(items)

    def token_ids(self, name: str, max_len: int) -> tuple[int, ...]:
        value = self.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or len(value) > max_len or not all(_is_int(t) and t >= 0 for t in value):
            raise self.fail(name, f"a list of at most {max_len} non-negative integer token ids")
        return tuple(value)

    def stream(self) -> tuple[bool, bool]:
        """(stream, stream_options.include_usage); stream_options needs stream, as in OpenAI."""
        stream = self.boolean("stream", False)
        options = self.get("stream_options")
        if options is None:
            return stream, False
        if not stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise self.fail("stream_options", "an object")
        include_usage = options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise bad_request(f"stream_options.include_usage: must be a boolean, got {_show(include_usage)}",
                              "stream_options.include_usage")
        return stream, bool(include_usage)

    def check_neutral(self) -> None:
        """Reject known fields whose non-neutral values this server cannot honour."""
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            value = self.get(name)
            if value is not None and not _is_number(value):
                raise self.fail(name, "a number")
            if value is not None and value != neutral:
                raise bad_request(f"{name}: not supported by this server (only {neutral}), got {_show(value)}", name)
        if self.get("logit_bias") not in (None, {}):
            raise bad_request("logit_bias: not supported by this server (only an empty object)", "logit_bias")


def _messages(f: _Fields, max_messages: int) -> list[dict]:
    """Shape checks only (a list of 1 to max_messages objects with known roles); render_chat checks the rest."""
    messages = f.get("messages")
    if messages is None:
        raise bad_request("messages: required", "messages")
    if not isinstance(messages, list):
        raise f.fail("messages", "a list of messages")
    if not messages:
        raise bad_request("messages: must contain at least one message", "messages")
    if len(messages) > max_messages:
        raise bad_request(f"messages: at most {max_messages} messages, got {len(messages)}", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad_request(f"messages[{i}]: must be an object, got {json_kind(msg)}", f"messages[{i}]")
        role = msg.get("role")
        if role is None:
            raise bad_request(f"messages[{i}].role: required", f"messages[{i}].role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role: unknown role {_show(role)} (expected one of "
                              f"{', '.join(CHAT_ROLES)})", f"messages[{i}].role")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise bad_request(f"messages[{i}].name: must be a string", f"messages[{i}].name")
    return messages


def _tools(f: _Fields) -> list[dict] | None:
    tools = f.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise f.fail("tools", "a list of tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type: must be \"function\"", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function: must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad_request(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {_show(name)}",
                              f"{where}.function.name")
        if name in names:
            raise bad_request(f"{where}.function.name: duplicate tool name {name!r}", f"{where}.function.name")
        names.add(name)
        for key, kind, ok in (("description", "a string", str), ("parameters", "an object (a JSON schema)", dict)):
            if function.get(key) is not None and not isinstance(function[key], ok):
                raise bad_request(f"{where}.function.{key}: must be {kind}", f"{where}.function.{key}")
    check_strict(tools)
    return tools


def _tool_choice(f: _Fields, tools: list[dict] | None) -> tuple[ToolChoice, str | None]:
    value = f.get("tool_choice")
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise bad_request(f"tool_choice: {value!r} requires tools", "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise f.fail("tool_choice", '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if not any(t["function"]["name"] == name for t in tools or []):
        raise bad_request(f"tool_choice.function.name: no tool named {name!r} in tools", "tool_choice.function.name")
    return "function", name


def _reasoning_effort(f: _Fields) -> str | int | None:
    value = f.get("reasoning_effort")
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if value is None or value in REASONING_EFFORTS or (_is_int(value) and 1 <= value <= 100):
        return value
    raise f.fail("reasoning_effort", f"one of {', '.join(REASONING_EFFORTS)}, or an integer 1-100 (also as a "
                 "decimal string)")


def _prompt(f: _Fields) -> str | list[int]:
    prompt = f.get("prompt")
    if prompt is None:
        raise bad_request("prompt: required", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt: batched prompts are not supported (send one prompt per request)", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) and t >= 0 for t in prompt)):
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        return prompt
    raise f.fail("prompt", "a string or a list of non-negative token ids")
