"""serve_app/schemas.py against serve_app/protocol.py: the OpenAPI document's request-body schemas list the
fields protocol.py (and render_chat) read, and a body is valid under the schema exactly when protocol.py
accepts it, for a table of values at and past every bound. The expectations come from protocol.py itself:
which keys it reads (a dict that records its reads) and what it accepts (calling it)."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from serve_app import protocol as p
from serve_app.errors import APIError
from serve_app.ingress import app
from serve_app.schemas import openapi_document

MAX_N = 4
MODEL = "m"
USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def doc() -> dict:
    return openapi_document(app, max_n=MAX_N, model_names=[MODEL])


def validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


class Reads(dict):
    """A dict that records the keys read from it (get, [], in)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def accepts_chat(body: dict) -> bool:
    try:
        req = p.parse_chat_request(body, max_n=MAX_N)
        p.check_model(req.model, [MODEL])
        p.chat_prompt(req)
    except APIError:
        return False
    return True


def accepts_completion(body: dict) -> bool:
    try:
        p.check_model(p.parse_completion_request(body, max_n=MAX_N).model, [MODEL])
    except APIError:
        return False
    return True


def properties(doc: dict, name: str) -> set[str]:
    return set(doc["components"]["schemas"][name]["properties"])


def test_the_routes_reference_the_body_schemas(doc):
    for path, name in (("/v1/chat/completions", "ChatCompletionBody"), ("/v1/completions", "CompletionBody")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"}
        n = doc["components"]["schemas"][name]["properties"]["n"]["anyOf"][0]
        assert (n["minimum"], n["maximum"]) == (1, MAX_N), "n is capped at the deployment's max_n"
        assert doc["components"]["schemas"][name]["properties"]["model"]["enum"] == [MODEL]
    assert "/openapi.json" not in doc["paths"]
    jsonschema.Draft202012Validator.check_schema({"components": doc["components"]})


def test_the_schemas_list_the_fields_protocol_reads(doc):
    chat = Reads(model=MODEL, messages=[USER])
    assert accepts_chat(chat)
    assert properties(doc, "ChatCompletionBody") == chat.read
    completion = Reads(model=MODEL, prompt="hi")
    assert accepts_completion(completion)
    assert properties(doc, "CompletionBody") == completion.read

    function = Reads(name="f", arguments={})
    call = Reads(id="c1", function=function)
    part = Reads(type="text", text="x")
    messages = {"system": Reads(role="system", content="s"), "developer": Reads(role="developer", content="d"),
                "user": Reads(role="user", content=[part]), "assistant": Reads(role="assistant", tool_calls=[call]),
                "tool": Reads(role="tool", tool_call_id="c1", content="r"),
                "latest_reminder": Reads(role="latest_reminder", content="l")}
    tool_function = Reads(TOOL["function"])
    tool = Reads(type="function", function=tool_function)
    choice = Reads(type="function", function=Reads(name="get_weather"))
    options = Reads(include_usage=True)
    assert accepts_chat({"model": MODEL, "messages": list(messages.values()), "tools": [tool], "tool_choice": choice,
                         "stream": True, "stream_options": options})
    by_role = {"system": "SystemMessage", "latest_reminder": "SystemMessage", "developer": "DeveloperMessage",
               "user": "UserMessage", "assistant": "AssistantMessage", "tool": "ToolMessage"}
    for role, msg in messages.items():
        assert properties(doc, by_role[role]) == msg.read, role
    for name, reads in (("ToolCall", call), ("ToolCallFunction", function), ("TextPart", part), ("Tool", tool),
                        ("FunctionDefinition", tool_function), ("NamedToolChoice", choice),
                        ("ToolChoiceFunction", choice["function"]), ("StreamOptions", options)):
        assert properties(doc, name) == reads.read, name
    assert properties(doc, "ResponseFormat") == {"type"}  # protocol compares the whole object with {"type": "text"}


# (fields over a valid body, or a function of the body) -> both must accept, or both refuse
CHAT_CASES = [
    {}, {"unknown_field": [1, {"x": None}]}, {"temperature": 0}, {"temperature": 2}, {"temperature": 2.0001},
    {"temperature": -0.1}, {"temperature": "1"}, {"temperature": True}, {"temperature": None}, {"top_p": 0},
    {"top_p": 1e-9}, {"top_p": 1}, {"top_p": 1.5}, {"top_k": -1}, {"top_k": -2}, {"top_k": 40}, {"top_k": 1.5},
    {"min_p": 0}, {"min_p": 1}, {"min_p": 1.1}, {"seed": 0}, {"seed": 2**63 - 1}, {"seed": 2**63}, {"seed": -1},
    {"n": 0}, {"n": 1}, {"n": MAX_N}, {"n": MAX_N + 1}, {"n": False}, {"stop": "x"}, {"stop": ""}, {"stop": []},
    {"stop": ["a"] * 4}, {"stop": ["a"] * 5}, {"stop": [""]}, {"stop": 3}, {"stop_token_ids": [0, 7]},
    {"stop": "s" * p.MAX_STOP_CHARS}, {"stop": "s" * (p.MAX_STOP_CHARS + 1)}, {"stop": ["a", "s" * (p.MAX_STOP_CHARS + 1)]},
    {"stop_token_ids": [3] * p.MAX_STOP_TOKEN_IDS}, {"stop_token_ids": [3] * (p.MAX_STOP_TOKEN_IDS + 1)},
    {"messages": [USER] * p.DEFAULT_MAX_MESSAGES}, {"messages": [USER] * (p.DEFAULT_MAX_MESSAGES + 1)},
    {"stop_token_ids": [-1]}, {"stop_token_ids": "7"}, {"max_tokens": 1}, {"max_tokens": 0}, {"max_tokens": "8"},
    {"max_completion_tokens": 5}, {"max_completion_tokens": 0}, {"logprobs": True, "top_logprobs": 20},
    {"logprobs": True, "top_logprobs": 21}, {"logprobs": "yes"}, {"stream": True},
    {"stream": True, "stream_options": {"include_usage": True}}, {"stream": True, "stream_options": {"include_usage": 1}},
    {"stream": True, "stream_options": []}, {"stream": "yes"}, {"user": "u"}, {"user": 5},
    {"presence_penalty": 0}, {"presence_penalty": 0.0}, {"presence_penalty": 0.5}, {"frequency_penalty": -1},
    {"repetition_penalty": 1}, {"repetition_penalty": 1.2}, {"logit_bias": {}}, {"logit_bias": {"5": 1}},
    {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "text", "x": 1}}, {"reasoning_effort": "none"}, {"reasoning_effort": "max"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "description": "d"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "other": 1}}},
    {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "json_object", "x": 1}},
    {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]},
    {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": "yes"}}]},
    {"reasoning_effort": 1}, {"reasoning_effort": 100}, {"reasoning_effort": 0}, {"reasoning_effort": 101},
    {"reasoning_effort": "30"}, {"reasoning_effort": "0100"}, {"reasoning_effort": "101"}, {"reasoning_effort": "0"},
    {"reasoning_effort": "extreme"}, {"reasoning_effort": True}, {"reasoning_effort": "minimal"},
    {"reasoning_effort": "medium"}, {"reasoning_effort": "xhigh"}, {"reasoning_effort": "Medium"},
    {"skip_special_tokens": False}, {"skip_special_tokens": "no"}, {"spaces_between_special_tokens": False},
    {"spaces_between_special_tokens": 1}, {"model": ""}, {"model": 7}, {"model": "other"},
    {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "required"}, {"tools": []}, {"tools": TOOL},
    {"tools": [{**TOOL, "type": "other"}]}, {"tools": [{"type": "function", "function": {"name": "a b"}}]},
    {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [TOOL], "tool_choice": "sometimes"}, {"tool_choice": "none"},
    {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"content": "hi"}]}, {"messages": [{"role": "user"}]}, {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
    {"messages": [{"role": "user", "content": "hi", "name": 5}]},
    {"messages": [{"role": "developer", "content": ""}]}, {"messages": [{"role": "developer", "content": "d"}]},
    {"messages": [{"role": "system", "content": ""}, USER]}, {"messages": [USER, {"role": "latest_reminder", "content": "r"}]},
    {"messages": [USER, {"role": "assistant", "content": None}]},
    {"messages": [USER, {"role": "assistant", "content": "a", "reasoning_content": "r"}]},
    {"messages": [USER, {"role": "assistant", "content": "a", "reasoning_content": 5}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f"}}]}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}]}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "other"}]}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": 5}]}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": CALL}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": 1, "content": "r"}]},
    {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1"}]},
]
COMPLETION_CASES = [
    {}, {"model": "other"}, {"prompt": ""}, {"prompt": "x"}, {"prompt": []}, {"prompt": [0, 5]}, {"prompt": [-1]}, {"prompt": [[1]]},
    {"prompt": ["a"]}, {"prompt": {"text": "hi"}}, {"prompt": 5}, {"echo": False}, {"echo": True}, {"suffix": None},
    {"suffix": "x"}, {"best_of": 1}, {"best_of": 2}, {"best_of": True}, {"logprobs": 0}, {"logprobs": 5},
    {"logprobs": 6}, {"logprobs": True}, {"max_tokens": 1}, {"max_tokens": 0}, {"n": MAX_N}, {"n": MAX_N + 1},
    {"temperature": 2.5}, {"stop": ["a"] * 5}, {"presence_penalty": 0.5}, {"logit_bias": {"1": 1}},
    {"stream": False, "stream_options": None}, {"unknown_field": "x"}, {"skip_special_tokens": False},
    {"response_format": {"type": "json_object"}}, {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": False}}},
    {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_object", "x": 1}}, {"skip_special_tokens": 0},
]


@pytest.mark.parametrize("fields", CHAT_CASES, ids=[str(c)[:70] for c in CHAT_CASES])
def test_chat_schema_agrees_with_protocol(doc, fields):
    body = {"model": MODEL, "messages": [USER], **copy.deepcopy(fields)}
    valid = validator(doc, "ChatCompletionBody").is_valid(body)
    assert valid == accepts_chat(body), f"schema {'accepts' if valid else 'refuses'} what protocol does not: {body}"


@pytest.mark.parametrize("fields", COMPLETION_CASES, ids=[str(c)[:70] for c in COMPLETION_CASES])
def test_completion_schema_agrees_with_protocol(doc, fields):
    body = {"model": MODEL, "prompt": "Hello", **copy.deepcopy(fields)}
    valid = validator(doc, "CompletionBody").is_valid(body)
    assert valid == accepts_completion(body), f"schema {'accepts' if valid else 'refuses'} what protocol does not: {body}"


def test_a_full_chat_body_validates(doc):
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, USER,
                                         {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [CALL]},
                                         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "22C"}]}],
            "tools": [TOOL], "tool_choice": "auto", "reasoning_effort": "30", "max_completion_tokens": 64,
            "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "seed": 11, "n": 2, "stop": ["\n\n"],
            "stop_token_ids": [1], "logprobs": True, "top_logprobs": 3, "stream": True,
            "stream_options": {"include_usage": True}, "user": "u-1", "presence_penalty": 0, "frequency_penalty": 0,
            "repetition_penalty": 1, "logit_bias": {}, "response_format": {"type": "text"}}
    validator(doc, "ChatCompletionBody").validate(body)
    assert accepts_chat(body)


@pytest.mark.parametrize("fields", [{}, {"max_tokens": 100}, {"max_tokens": 101}, {"max_completion_tokens": 100},
                                    {"max_completion_tokens": 101}, {"messages": [USER] * 3}, {"messages": [USER] * 4}])
def test_the_deployments_limits_agree_with_protocol(fields):
    """A deployment's --max-messages 3 and --max-output-tokens 100: in its schemas and in protocol.py."""
    doc = openapi_document(app, max_n=MAX_N, model_names=[MODEL], max_messages=3, max_output_tokens=100)
    limits = {"max_n": MAX_N, "max_output_tokens": 100}

    def accepts(body: dict, parse) -> bool:
        try:
            parse(body)
        except APIError:
            return False
        return True

    chat = {"model": MODEL, "messages": [USER], **fields}
    assert validator(doc, "ChatCompletionBody").is_valid(chat) == accepts(
        chat, lambda b: p.parse_chat_request(b, max_messages=3, **limits)), chat
    if "messages" not in fields and "max_completion_tokens" not in fields:
        completion = {"model": MODEL, "prompt": "hi", **fields}
        assert validator(doc, "CompletionBody").is_valid(completion) == accepts(
            completion, lambda b: p.parse_completion_request(b, **limits)), completion
