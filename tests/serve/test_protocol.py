"""serve_app.protocol / serve_app.errors: request validation (every rejection is a 4xx naming the
field), defaults, prompt building, sampling-parameter mapping, and response bodies checked against
the `openai` package's own types."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.chat.constraints import auto_tools_grammar, json_grammar, tool_calls_grammar
from engine.core.request import TokenLogprob
from engine.core.sampling_params import GrammarSpec, SamplingParams
from serve_app import json_body, protocol as p
from serve_app.errors import APIError, bad_request, overloaded, rate_limited
from serve_app.streaming import ChatChoiceStream, TokenStrings

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
UNIQUE = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
    "tags": {"type": "array", "uniqueItems": True}}}}}  # llguidance cannot enforce uniqueItems
UNIQUE_JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                      "uniqueItems": True}}}
# an integer past 64 bits: llguidance's JSON-schema entry cannot read it (found by tests/reliability/test_fuzz_openapi
# as a 500); in thinking mode (chat's default) the schema goes through a lark grammar, which takes it as a number
HUGE = 10638638380251029063375781888
HUGE_JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "maximum": HUGE}}}
HUGE_TOOL = {"type": "function", "function": {"name": "big", "strict": True, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": -HUGE}}}}}


def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def chat(**fields) -> dict:
    return {"model": "m", "messages": USER, **fields}


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def rejected(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# --- errors and bodies ---------------------------------------------------------------------------


def test_api_error_body_is_openai_shaped():
    err = bad_request("temperature: must be a number", "temperature")
    assert err.status == 400
    assert err.body() == {"error": {"message": "temperature: must be a number", "type": "invalid_request_error",
                                    "param": "temperature", "code": None}}
    assert overloaded("queue full", retry_after_s=3).headers == {"Retry-After": "3"}
    assert overloaded("queue full").status == 503
    assert rate_limited("slow down", 1).status == 429


def test_parse_json_body():
    assert json_body.parse_json_body(b'{"a": 1}', 100) == {"a": 1}
    assert rejected(json_body.parse_json_body, b'{"a": 1}', 5).status == 413
    for raw in (b'{"a": ', b'{"a": NaN}', b"\xff\xfe", b""):
        err = rejected(json_body.parse_json_body, raw, 100)
        assert (err.status, err.message.startswith("invalid JSON")) == (400, True), raw
    err = rejected(json_body.parse_json_body, b"[1, 2]", 100)
    assert err.status == 400 and "JSON object" in err.message


def nested(depth: int, inner: bytes = b"1") -> bytes:
    """An object holding arrays nested so that the whole body is `depth` levels deep."""
    return b'{"a": ' + b"[" * (depth - 1) + inner + b"]" * (depth - 1) + b"}"


def test_parse_json_body_bounds_nesting_depth():
    limit = json_body.MAX_JSON_DEPTH
    assert json_body.parse_json_body(nested(limit), 10**6)["a"] == json.loads(nested(limit))["a"]
    for depth in (limit + 1, 3000, 100_000):
        err = rejected(json_body.parse_json_body, nested(depth), 10**6)
        assert (err.status, err.param) == (400, None) and f"more than {limit} levels" in err.message, depth
    with pytest.raises(RecursionError):
        json.loads(nested(3000))  # what the scan keeps json.loads from seeing
    brackets_in_text = b'{"a": "' + b"[{" * 3000 + b'\\\\", "b": "\\\\\\"]]"}'  # escapes, brackets in strings
    assert json_body.parse_json_body(brackets_in_text, 10**6) == {"a": "[{" * 3000 + "\\", "b": '\\"]]'}
    many_shallow = b'{"a": [' + b",".join([b"[{}]"] * 5000) + b"]}"  # 10,000 openers, 4 levels
    assert len(json_body.parse_json_body(many_shallow, 10**6)["a"]) == 5000
    for broken in (b'{"a": "[[[[' + b"[" * 100, b"[" * 100 + b'"', b'"\\' + b"{" * 100):  # not JSON: still 400
        assert rejected(json_body.parse_json_body, broken, 10**6).status == 400


@pytest.mark.parametrize(("raw", "where"), [
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    (b'{"stop": ["ok", "\\uDC00"]}', "stop[1]"),
    (b'{"prompt": "\\ud83d"}', "prompt"),  # a high surrogate with no low one after it
    (b'{"tools": [{"x\\ud800": 1}]}', "tools[0].x\\ud800"),  # a key: the path escapes it
])
def test_a_lone_surrogate_is_400_naming_where(raw, where):
    err = rejected(json_body.parse_json_body, raw, 1000)
    assert (err.status, err.param) == (400, where) and err.message.startswith(where + ": contains a lone"), err
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # the answer is writable as UTF-8


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert json_body.parse_json_body(b'{"a": "\\ud83d\\ude00"}', 100) == {"a": "\U0001f600"}
    assert json_body.parse_json_body(b'{"a": "\\\\ud800"}', 100) == {"a": "\\ud800"}  # a backslash, then text


def test_api_errors_that_quote_a_surrogate_are_writable_as_utf8():
    """A message or param quoting user text with a lone surrogate (had it got past the body check) is
    escaped when the error is made, so OpenAI's error body always encodes."""
    for err in (p.model_not_found("m\ud800"), bad_request("stop: must be ..., got \"\udfff\"", "stop\ud800")):
        encoded = json.dumps(err.body(), ensure_ascii=False).encode("utf-8")
        assert b"\\ud800" in encoded or b"\\udfff" in encoded, encoded
    assert p.model_not_found("m\ud800").message == "The model `m\\ud800` does not exist."


def test_check_model_unknown_is_404_model_not_found():
    p.check_model("dsv41", ["dsv41"])
    err = rejected(p.check_model, "gpt-9", ["dsv41"])
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "gpt-9" in err.body()["error"]["message"]


# --- chat request validation ---------------------------------------------------------------------

CHAT_REJECTIONS = [
    ({"model": None}, "model"),
    ({"model": 3}, "model"),
    ({"model": ""}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["Hi"]}, "messages[0]"),
    ({"messages": [{"content": "Hi"}]}, "messages[0].role"),
    ({"messages": [*USER, {"role": "robot", "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),  # above the default cap of 8
    ({"n": 2.0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_completion_tokens": 5, "max_tokens": "5"}, "max_tokens"),  # both are checked
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 5}, "top_logprobs"),  # needs logprobs
    ({"stream": "true"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream
    ({"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": True}, "stream_options"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"frequency_penalty": "0"}, "frequency_penalty"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "x": 1}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": UNIQUE_JSON_SCHEMA}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "response_format"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": 1}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, strict(UNIQUE)]}, "tools[1].function.parameters.properties.tags"),  # auto, strict
    ({"tools": [WEATHER, HUGE_TOOL]}, "tools[1].function.parameters.properties.n"),  # auto, strict
    ({"tools": [HUGE_TOOL], "tool_choice": "required"}, "tools[0].function.parameters.properties.n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "d": {"type": "string", "format": "bogus"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.d"),
    ({"tools": WEATHER}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 'x">'}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
     "tools[0].function.description"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"reasoning_effort": "Medium"}, "reasoning_effort"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": 0}, "reasoning_effort"),
    ({"reasoning_effort": 101}, "reasoning_effort"),
    ({"reasoning_effort": "101"}, "reasoning_effort"),
    ({"reasoning_effort": True}, "reasoning_effort"),
    ({"user": 5}, "user"),
    ({"skip_special_tokens": "false"}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_REJECTIONS, ids=[c[1] + ":" + json.dumps(c[0])[:40]
                                                                     for c in CHAT_REJECTIONS])
def test_chat_request_rejections_name_the_field(fields, param):
    body = {k: v for k, v in chat(**fields).items() if v is not None}
    err = rejected(p.parse_chat_request, body)
    assert err.status == 400, err
    assert err.param == param, err
    assert err.message.startswith(param + ":"), err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_chat_n_cap_is_configurable():
    assert p.parse_chat_request(chat(n=4), max_n=4).n == 4
    err = rejected(p.parse_chat_request, chat(n=5), max_n=4)
    assert (err.param, "[1, 4]" in err.message) == ("n", True)


def test_chat_defaults_and_nulls():
    req = p.parse_chat_request(chat())
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.seed, req.n) == (1.0, 1.0, 0, 0.0, None, 1)
    assert (req.max_tokens, req.stop, req.stop_token_ids, req.logprobs, req.top_logprobs) == (None, (), (), False, 0)
    assert (req.stream, req.include_usage, req.tools, req.tool_choice, req.reasoning_effort) == (
        False, False, None, "none", None)
    assert req.thinking  # None means "high"
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "max_tokens",
                               "max_completion_tokens", "logprobs", "top_logprobs", "stream", "stream_options",
                               "tools", "tool_choice", "reasoning_effort", "user", "presence_penalty",
                               "logit_bias", "response_format")}
    assert p.parse_chat_request(chat(**nulls)) == req


def test_unknown_fields_are_ignored_and_neutral_values_accepted():
    req = p.parse_chat_request(chat(metadata={"a": 1}, store=False, parallel_tool_calls=True, some_vendor_knob=3,
                                    presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                    response_format={"type": "text"}, repetition_penalty=1.0))
    assert req == p.parse_chat_request(chat())


def test_max_completion_tokens_wins_over_max_tokens():
    assert p.parse_chat_request(chat(max_tokens=10)).max_tokens == 10
    assert p.parse_chat_request(chat(max_completion_tokens=20)).max_tokens == 20
    assert p.parse_chat_request(chat(max_tokens=10, max_completion_tokens=20)).max_tokens == 20
    assert p.parse_chat_request(chat(max_tokens=10, max_completion_tokens=None)).max_tokens == 10


def test_chat_field_values():
    req = p.parse_chat_request(chat(temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=7, n=3, stop="END",
                                    stop_token_ids=[5, 6], logprobs=True, top_logprobs=3, stream=True,
                                    stream_options={"include_usage": True}, user="u1"))
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.seed, req.n) == (0.0, 0.5, 0, 0.1, 7, 3)
    assert (req.stop, req.stop_token_ids, req.logprobs, req.top_logprobs) == (("END",), (5, 6), True, 3)
    assert (req.stream, req.include_usage, req.user) == (True, True, "u1")
    assert p.parse_chat_request(chat(top_k=40, stop=["a", "b"])).top_k == 40
    assert p.parse_chat_request(chat(stream=True, stream_options={})).include_usage is False


def test_detokenization_flags_default_true():
    for parse, body in ((p.parse_chat_request, chat), (p.parse_completion_request, completion)):
        assert (parse(body()).skip_special_tokens, parse(body()).spaces_between_special_tokens) == (True, True)
        req = parse(body(skip_special_tokens=False, spaces_between_special_tokens=False))
        assert (req.skip_special_tokens, req.spaces_between_special_tokens) == (False, False)


def test_a_bad_reasoning_effort_lists_what_is_accepted():
    e = rejected(p.parse_chat_request, chat(reasoning_effort="extreme"))
    assert (e.status, e.param) == (400, "reasoning_effort")
    assert e.message == ('reasoning_effort: must be one of none, minimal, low, medium, high, xhigh, max, or an integer '
                         '1-100 (also as a decimal string), got "extreme"')


@pytest.mark.parametrize(("effort", "stored", "thinking", "line"), [
    (None, None, True, "Reasoning Effort: 75 "),
    ("none", "none", False, None),
    ("minimal", "minimal", True, "Reasoning Effort: 50 "),
    ("low", "low", True, "Reasoning Effort: 50 "),
    ("medium", "medium", True, "Reasoning Effort: 75 "),
    ("high", "high", True, "Reasoning Effort: 75 "),
    ("xhigh", "xhigh", True, "Reasoning Effort: 75 "),
    ("max", "max", True, "Reasoning Effort: 100 "),
    (30, 30, True, "Reasoning Effort: 30 "),
    ("30", 30, True, "Reasoning Effort: 30 "),
    (1, 1, True, "Reasoning Effort: 1 "),
    (100, 100, True, "Reasoning Effort: 100 "),
])
def test_reasoning_effort_mirrors_render_chat(effort, stored, thinking, line):
    req = p.parse_chat_request(chat(reasoning_effort=effort))
    assert (req.reasoning_effort, req.thinking) == (stored, thinking)
    prompt = p.chat_prompt(req)
    assert prompt.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    assert (line in prompt) if line else ("Reasoning Effort" not in prompt)


# --- prompts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
     "messages[0].content[0].type"),  # image_url parts: tests/serve/test_image_parts.py
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([*USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"}], "messages[1].tool_call_id"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"type": "function", "function": {"name": ""}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "developer", "content": ""}], "messages[0].content"),
])
def test_chat_prompt_format_errors_are_400_naming_the_message_field(messages, param):
    req = p.parse_chat_request(chat(messages=messages))
    err = rejected(p.chat_prompt, req)
    assert (err.status, err.param) == (400, param), err
    assert err.message.startswith(param + ":")


def test_chat_prompt_accepts_the_openai_message_forms():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    prompt = p.chat_prompt(p.parse_chat_request(chat(messages=messages, tools=[WEATHER])))
    assert "Be brief." in prompt and "<tool_result>18C</tool_result>" in prompt
    assert '<｜DSML｜ invoke name="get_weather">' in prompt and "Use the tool.</think>" in prompt


def test_tool_choice_controls_the_rendered_tools():
    both = [WEATHER, TIME]
    auto = p.parse_chat_request(chat(tools=both))
    assert (auto.tool_choice, auto.prompt_tools) == ("auto", both)
    assert '"get_weather"' in p.chat_prompt(auto) and '"get_time"' in p.chat_prompt(auto)
    required = p.parse_chat_request(chat(tools=both, tool_choice="required"))
    assert required.prompt_tools == both
    none = p.parse_chat_request(chat(tools=both, tool_choice="none"))
    assert none.prompt_tools is None and "## Tools" not in p.chat_prompt(none)
    named = p.parse_chat_request(chat(tools=both, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (named.tool_choice, named.tool_choice_name, named.prompt_tools) == ("function", "get_time", [TIME])
    prompt = p.chat_prompt(named)
    assert '"get_time"' in prompt and '"get_weather"' not in prompt


def test_which_requests_get_a_grammar():
    """Every grammar constrains from the first token; in thinking mode (reasoning_effort null) JSON's and the forced
    calls' (required, named) span the reasoning (the parser reads calls in the reasoning too, and starts the content
    at a spelled </think>), as the strict tools' grammar of tool_choice auto does; completions' JSON has no
    reasoning. Auto without a strict tool has no grammar (no mask per token)."""

    def spec(req) -> GrammarSpec | None:
        return p.to_sampling_params(req, num_prompt_tokens=1, max_model_len=100).grammar

    for body in (chat(), chat(tools=[WEATHER, UNIQUE]), chat(tools=[strict(WEATHER)], tool_choice="none"),
                 chat(response_format={"type": "text"})):
        assert spec(p.parse_chat_request(body)) is None, body
    tools = [UNIQUE, strict(WEATHER), TIME]  # UNIQUE is not strict: its parameters are free, never compiled
    auto = p.parse_chat_request(chat(tools=tools))
    assert spec(auto) == GrammarSpec(auto_tools_grammar(tools)) and auto.tool_choice == "auto"
    required = p.parse_chat_request(chat(tools=[WEATHER], tool_choice="required"))
    assert spec(required) == GrammarSpec(tool_calls_grammar([WEATHER], thinking=True))
    named = p.parse_chat_request(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_time"}}, reasoning_effort=30))
    assert spec(named) == GrammarSpec(tool_calls_grammar([WEATHER, TIME], "get_time", thinking=True))
    chat_mode = p.parse_chat_request(chat(tools=[WEATHER], tool_choice="required", reasoning_effort="none"))
    assert spec(chat_mode) == GrammarSpec(tool_calls_grammar([WEATHER]))
    assert spec(p.parse_chat_request(chat(response_format={"type": "json_object"}))) == GrammarSpec(
        json_grammar({"type": "object"}, thinking=True))
    assert spec(p.parse_chat_request(chat(response_format={"type": "json_object"}, reasoning_effort="none"))) == \
        GrammarSpec(json_grammar({"type": "object"}))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    assert spec(p.parse_completion_request(completion(response_format=fmt))) == GrammarSpec(json_grammar(schema))
    assert spec(p.parse_completion_request(completion(response_format={"type": "json_object"}))) == GrammarSpec(
        json_grammar({"type": "object"}))
    assert spec(p.parse_completion_request(completion(response_format={"type": "text"}))) is None


# --- completion request validation ---------------------------------------------------------------

COMPLETION_REJECTIONS = [
    ({"prompt": None}, "prompt", "required"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
    ({"prompt": ["a"]}, "prompt", "batched prompts are not supported"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "batched prompts are not supported"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": [1, -2]}, "prompt", "must be"),
    ({"prompt": [1, "a"]}, "prompt", "must be"),
    ({"prompt": 7}, "prompt", "must be"),
    ({"echo": True}, "echo", "not supported"),
    ({"echo": "no"}, "echo", "boolean"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"logprobs": 6}, "logprobs", "[0, 5]"),
    ({"logprobs": True}, "logprobs", "integer"),
    ({"max_tokens": 0}, "max_tokens", "integer"),
    ({"n": 9}, "n", "[1, 8]"),
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"stop": ["a"] * 5}, "stop", "at most 4"),
    ({"model": None}, "model", "non-empty string"),
    ({"presence_penalty": 1}, "presence_penalty", "not supported"),
    ({"response_format": {"type": "xml"}}, "response_format", '{"type": "json_object"}'),
    ({"response_format": "json_object"}, "response_format", "must be"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name and schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema", "an object"),
    ({"response_format": UNIQUE_JSON_SCHEMA}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": HUGE_JSON_SCHEMA}, "response_format.json_schema.schema", "not JSON serializable"),
]


@pytest.mark.parametrize(("fields", "param", "fragment"), COMPLETION_REJECTIONS,
                         ids=[c[1] + ":" + json.dumps(c[0])[:40] for c in COMPLETION_REJECTIONS])
def test_completion_request_rejections_name_the_field(fields, param, fragment):
    body = {k: v for k, v in completion(**fields).items() if v is not None}
    err = rejected(p.parse_completion_request, body)
    assert (err.status, err.param) == (400, param), err
    assert err.message.startswith(param + ":") and fragment in err.message, err.message


def test_completion_defaults_and_prompt_ids(tok):
    req = p.parse_completion_request(completion())
    assert (req.max_tokens, req.temperature, req.top_p, req.logprobs, req.n, req.stream) == (16, 1.0, 1.0, None, 1, False)
    assert p.completion_prompt_ids(req, tok, max_chars=5) == tok.encode("Hello")
    assert p.parse_completion_request(completion(max_tokens=None, echo=False, best_of=1, logprobs=0)).max_tokens == 16
    ids = p.parse_completion_request(completion(prompt=[0, 5, 129279]))
    assert p.completion_prompt_ids(ids, tok, max_chars=1) == [0, 5, 129279]  # the bound is on text
    err = rejected(p.completion_prompt_ids, p.parse_completion_request(completion(prompt=[5, 129280])), tok,
                   max_chars=100)
    assert (err.status, err.param) == (400, "prompt") and err.message.startswith("prompt[1]:")
    err = rejected(p.completion_prompt_ids, req, tok, max_chars=4)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert "5 characters" in err.message and "limit of 4" in err.message


def test_chat_prompt_ids_bound_the_rendered_text(tok):
    req = p.parse_chat_request(chat())
    text = p.chat_prompt(req)
    assert p.chat_prompt_ids(req, tok, max_chars=len(text)) == tok.encode(text)
    err = rejected(p.chat_prompt_ids, req, tok, max_chars=len(text) - 1)
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded"), err


def test_encode_prompt_equals_encode_and_lets_other_threads_run(tok):
    """encode_prompt goes through encode_batch so that the ingress's event loop keeps running while a worker
    thread tokenizes: a thread that ticks every millisecond is never held up for long. HF's plain encode
    holds the GIL for the whole text (measured the same way: one gap as long as the encode)."""
    text = "Some prose with numbers 12345, emoji 🦜 and <｜end▁of▁sentence｜> spelt out. " * 6000  # ~450K chars
    assert p.encode_prompt(tok, text, max_chars=len(text), param="prompt") == tok.encode(text)

    def longest_gap(fn) -> tuple[float, float]:
        gaps, done = [], threading.Event()

        def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = threading.Thread(target=tick)
        ticker.start()
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        done.set()
        ticker.join()
        return max(gaps), took

    gap, took = longest_gap(lambda: p.encode_prompt(tok, text, max_chars=len(text), param="prompt"))
    held, took_plain = longest_gap(lambda: tok.encode(text))
    assert held > took_plain / 2, "the comparison needs an encode that holds the GIL"
    assert gap < took / 4, (gap, took)


# --- sampling parameters -------------------------------------------------------------------------


def test_to_sampling_params_maps_every_field():
    req = p.parse_chat_request(chat(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=11, n=2, stop=["x"],
                                    stop_token_ids=[7], logprobs=True, top_logprobs=4, max_completion_tokens=32))
    params = p.to_sampling_params(req, num_prompt_tokens=100, max_model_len=1000)
    assert params == SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=11,
                                    stop_token_ids=(7,), logprobs=4, n=2)
    assert p.to_sampling_params(p.parse_chat_request(chat(logprobs=True)), num_prompt_tokens=1,
                                max_model_len=10).logprobs == 0
    assert p.to_sampling_params(p.parse_chat_request(chat(top_k=-1)), num_prompt_tokens=1,
                                max_model_len=10).top_k == 0
    legacy = p.parse_completion_request(completion(logprobs=3, temperature=0))
    params = p.to_sampling_params(legacy, num_prompt_tokens=5, max_model_len=100)
    assert (params.logprobs, params.max_tokens, params.is_greedy) == (3, 16, True)


def test_max_tokens_default_and_context_window():
    req = p.parse_chat_request(chat())
    assert p.to_sampling_params(req, num_prompt_tokens=90, max_model_len=100).max_tokens == 10
    for num_prompt in (100, 150):
        err = rejected(p.to_sampling_params, req, num_prompt_tokens=num_prompt, max_model_len=100)
        assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    err = rejected(p.to_sampling_params, p.parse_chat_request(chat(max_tokens=11)), num_prompt_tokens=90,
                   max_model_len=100)
    assert (err.param, err.code) == ("messages", "context_length_exceeded")
    assert "100" in err.message and "90" in err.message and "11" in err.message
    err = rejected(p.to_sampling_params, p.parse_completion_request(completion()), num_prompt_tokens=90,
                   max_model_len=100)
    assert err.param == "prompt"


# --- responses -----------------------------------------------------------------------------------


def test_usage_shape():
    u = p.usage(10, 5, cached_tokens=4, reasoning_tokens=2)
    assert u == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                 "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}}


def _logprob(tok, text: str, lp: float, alternatives: list[tuple[str, float]]) -> TokenLogprob:
    (token_id,) = tok.encode(text)
    return TokenLogprob(token_id, lp, [(tok.encode(t)[0], v) for t, v in alternatives])


def test_chat_completion_response_validates_as_openai(tok):
    strings = TokenStrings(tok)
    stream = ChatChoiceStream(tok, thinking=True, tools=[WEATHER], id_salt="req-1/0")
    text = 'Check.</think>On it.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n' \
           '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    stream.feed(tok.encode(text) + [tok.eos_id])
    stream.finish("stop")
    entries = [_logprob(tok, "Check", -0.1, [("Check", -0.1), ("Hello", -2.5)]), None,
               _logprob(tok, ".", -math.inf, [])]
    choice = p.chat_choice(0, stream.message(), stream.finish_reason, p.chat_logprobs(strings, entries))
    resp = p.chat_completion_response("chatcmpl-1", 1700000000, "dsv41", [choice],
                                      p.usage(20, stream.num_tokens, 16, stream.num_reasoning_tokens))
    parsed = ChatCompletion.model_validate(resp)
    assert json.loads(json.dumps(resp)) == resp  # plain JSON
    msg = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "tool_calls"
    assert msg.content == "On it.\n\n" and msg.reasoning_content == "Check."  # vLLM keeps the blank line
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    content = parsed.choices[0].logprobs.content
    assert [c.token for c in content] == ["Check", "."]
    assert content[0].bytes == list(b"Check") and content[0].logprob == -0.1
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Check", -0.1), ("Hello", -2.5)]
    assert content[1].logprob == p.MIN_LOGPROB  # -inf is not JSON
    assert parsed.usage.prompt_tokens_details.cached_tokens == 16
    assert parsed.usage.completion_tokens_details.reasoning_tokens == stream.num_reasoning_tokens > 0
    assert parsed.usage.total_tokens == 20 + stream.num_tokens


def test_chat_chunks_validate_as_openai(tok):
    strings = TokenStrings(tok)
    lp = p.chat_logprobs(strings, [_logprob(tok, "Hi", -0.5, [("Hi", -0.5)])])
    chunks = [
        p.chat_chunk("c", 1, "m", [p.chat_stream_choice(0, {"role": "assistant", "content": ""})]),
        p.chat_chunk("c", 1, "m", [p.chat_stream_choice(0, {"reasoning_content": "hm"})]),
        p.chat_chunk("c", 1, "m", [p.chat_stream_choice(0, {"content": "Hi"}, logprobs=lp)]),
        p.chat_chunk("c", 1, "m", [p.chat_stream_choice(1, {"tool_calls": [
            {"index": 0, "id": "call_0_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})]),
        p.chat_chunk("c", 1, "m", [p.chat_stream_choice(0, {}, "stop")]),
        p.chat_chunk("c", 1, "m", [], usage=p.usage(3, 4)),
    ]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[2].choices[0].logprobs.content[0].token == "Hi"
    assert parsed[3].choices[0].delta.tool_calls[0].function.name == "f"
    assert parsed[4].choices[0].finish_reason == "stop"
    assert parsed[5].usage.total_tokens == 7 and "usage" not in chunks[0]


def test_completion_bodies_validate_as_openai(tok):
    logprobs = p.CompletionLogprobs(TokenStrings(tok))
    first = logprobs.add([_logprob(tok, "Hello", -0.2, [("Hi", -1.0)])])
    second = logprobs.add([None, _logprob(tok, " world", -0.3, [(" world", -0.3), (" there", -1.5)])])
    assert first == {"tokens": ["Hello"], "token_logprobs": [-0.2], "top_logprobs": [{"Hi": -1.0, "Hello": -0.2}],
                     "text_offset": [0]}
    assert second["text_offset"] == [5] and second["top_logprobs"] == [{" world": -0.3, " there": -1.5}]
    resp = p.completion_response("cmpl-1", 2, "m", [p.completion_choice(0, "Hello world", "length", first)],
                                 p.usage(1, 2))
    parsed = Completion.model_validate(resp)
    assert parsed.choices[0].text == "Hello world" and parsed.choices[0].logprobs.text_offset == [0]
    # Streamed text_completion chunks carry finish_reason null until the last one, as OpenAI's do; the
    # SDK's Completion type (used for whole responses) declares it non-null, so validate the last one.
    chunk = p.completion_chunk("cmpl-1", 2, "m", [p.completion_choice(0, " world", None, second)])
    assert chunk["choices"][0] == {"index": 0, "text": " world", "logprobs": second, "finish_reason": None}
    last = p.completion_chunk("cmpl-1", 2, "m", [p.completion_choice(0, "", "stop")])
    assert Completion.model_validate(last).object == "text_completion"
    assert Completion.model_validate(p.completion_chunk("cmpl-1", 2, "m", [], usage=p.usage(1, 2))).usage


def test_models_response():
    resp = p.models_response(["dsv41", "dsv41-flash"], created=5)
    assert resp["object"] == "list"
    assert [Model.model_validate(m).id for m in resp["data"]] == ["dsv41", "dsv41-flash"]
