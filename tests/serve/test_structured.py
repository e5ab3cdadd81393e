"""Structured output through the real app (tiny random-weight checkpoint, CPU) with the official openai client:
response_format json_schema (strict and not) and json_object, on chat and legacy completions (and in thinking mode,
where the grammar spans the reasoning), tool_choice "required"
and a named function, and a strict tool under tool_choice "auto". The random model writes noise, so output that
parses and validates is the grammar's doing. Streamed tool-call argument deltas join to the non-streamed arguments
(same seed), and a schema that cannot be enforced is a 400 naming the keyword."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import openai
import pytest

from engine.chat import syntax
from serve_app.settings import ServeSettings
from tests.serve.api_fixtures import API_KEY, api  # noqa: F401

MODEL = "deepseek-v4.1-flash"
USER = [{"role": "user", "content": "Describe a thing."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "unit": {"enum": ["cm", "in"]}},
                 "required": ["w", "unit"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["ok", "color", "size", "tags"],
    "additionalProperties": False,
}
BOOK = {"type": "function", "function": {"name": "book", "description": "Book seats.", "parameters": {
    "type": "object", "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "meal": {"enum": ["veg", "fish"]}, "window": {"type": "boolean"}},
    "required": ["seats", "meal"], "additionalProperties": False}}}
CANCEL = {"type": "function", "function": {"name": "cancel", "parameters": {
    "type": "object", "properties": {"ref": {"enum": ["A1", "B2"]}}, "required": ["ref"]}}}


@pytest.fixture(scope="module")
def api_settings(tiny_checkpoint) -> ServeSettings:
    """As test_api's, with room for a tools prompt (~300 tokens) and a constrained answer. No prefix cache: a hit
    replays the last window (bounded replay), which moves the logits, and the tests repeat a seeded request streamed
    to compare it with the unstreamed one."""
    return ServeSettings(checkpoint=str(tiny_checkpoint), device="cpu", cache_memory_bytes=16 << 20, max_num_seqs=8,
                         enable_prefix_caching=False,
                         max_num_batched_tokens=512, max_model_len=1024, api_key=API_KEY, max_n=4,
                         replica_num_cpus=1, health_check_period_s=60, graceful_shutdown_timeout_s=1)


@pytest.fixture(scope="module")
def oai(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(oai, **kw):
    return oai.chat.completions.create(**{"model": MODEL, "messages": USER, "reasoning_effort": "none",
                                          "max_tokens": 200, "temperature": 1.0, **kw})


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_outputs_parse_and_validate(oai, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": strict}}
    r = chat(oai, response_format=fmt, seed=3 if strict else 4, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = chat(oai, response_format=fmt, seed=3 if strict else 4, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content  # the same seed: the same constrained draw


def test_json_object_is_one_object(oai):
    r = chat(oai, response_format={"type": "json_object"}, seed=5, max_tokens=300)
    if r.choices[0].finish_reason == "stop":  # an unbounded object may also run out of tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_json_in_thinking_mode_ends_cleanly_inside_the_reasoning(oai):
    """response_format JSON in thinking mode: the grammar spans the reasoning, so the output cannot end before its
    answer, and the random model hardly ever closes its reasoning (tests/core/test_grammar.py forces `</think>`):
    max_tokens ends it there, finish_reason "length" with the reasoning so far and no content, streamed alike."""
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    kw = dict(response_format=fmt, reasoning_effort="high", seed=12, max_tokens=24)
    r = chat(oai, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 24, choice
    assert choice.message.reasoning_content and not choice.message.content and not choice.message.tool_calls
    parts = [c.choices[0] for c in chat(oai, stream=True, **kw) if c.choices]
    assert "".join(getattr(p.delta, "reasoning_content", None) or "" for p in parts) == choice.message.reasoning_content
    assert not "".join(p.delta.content or "" for p in parts) and parts[-1].finish_reason == "length"


def arguments_of(stream) -> list[tuple[str, str]]:
    """(name, joined arguments) per call of a streamed response: the id and name first, then argument fragments."""
    calls: list[list[str]] = []
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.id is not None:
                assert d.index == len(calls) and d.function.arguments == ""
                calls.append([d.function.name, ""])
            else:
                calls[d.index][1] += d.function.arguments
    return [tuple(c) for c in calls]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_have_valid_arguments_streamed_or_not(oai, choice):
    tool_choice = {"type": "function", "function": {"name": "book"}} if choice == "named" else "required"
    kw = dict(tools=[BOOK, CANCEL], tool_choice=tool_choice, seed=7, max_tokens=400)
    r = chat(oai, **kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls, r
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (BOOK, CANCEL)}
    for call in message.tool_calls:
        assert call.function.name in (("book",) if choice == "named" else ("book", "cancel"))
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if choice == "named":
        assert len(message.tool_calls) == 1
    streamed = arguments_of(chat(oai, **kw, stream=True))
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_the_keyword(oai):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema.schema" and "uniqueItems" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, response_format={"type": "json_object"}, tools=[BOOK], tool_choice="required")
    assert e.value.body["param"] == "response_format"


def test_a_strict_tool_under_auto_constrains_the_whole_output(oai, tok):
    """tool_choice auto with a strict tool, in thinking mode: the grammar spans the reasoning too. The random model
    hardly ever opens a calls block by itself (tests/core/test_grammar.py forces one), so the grammar shows here in
    the free text: the same seeded request without `strict` draws special tokens (placeholders, template markers),
    with it none (its free text holds no special token but the think pair, so none can splice the calls tag).
    Any call made validates; streamed text equals unstreamed."""
    llg = llguidance.LLTokenizer(tok.path.read_text(encoding="utf-8"), eos_token=tok.eos_id)
    special = {tok.decode([i]) for i in range(tok.vocab_size) if llg.is_special_token(i)}
    special -= {syntax.THINK_START, syntax.THINK_END, "\ufffd"}  # U+FFFD: the lone byte 0xFF, llguidance's marker
    strict_book = {"type": "function", "function": {**BOOK["function"], "strict": True}}
    kw = dict(reasoning_effort="high", seed=11, max_tokens=120, logprobs=True)
    free = chat(oai, tools=[BOOK, CANCEL], **kw)
    assert special & {e.token for e in free.choices[0].logprobs.content}, "the seed draws a special token unconstrained"
    r = chat(oai, tools=[strict_book, CANCEL], **kw)
    drawn = [e.token for e in r.choices[0].logprobs.content]
    assert len(drawn) == r.usage.completion_tokens and not special & set(drawn), special & set(drawn)
    message = r.choices[0].message
    for call in message.tool_calls or []:
        if call.function.name == "book":
            jsonschema.validate(json.loads(call.function.arguments), BOOK["function"]["parameters"])
    streamed = list(chat(oai, tools=[strict_book, CANCEL], stream=True, **kw))
    parts = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.content or "" for d in parts) == (message.content or "")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in parts) == message.reasoning_content


def test_completions_take_response_format(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    kw = dict(model=MODEL, prompt="A thing, as JSON:", max_tokens=200, temperature=1.0, seed=6)
    r = oai.completions.create(**kw, n=2, extra_body={"response_format": fmt})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    streamed = oai.completions.create(**kw, stream=True, extra_body={"response_format": fmt})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    r = oai.completions.create(**kw, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")  # an unbounded object may run out of tokens
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    for bad, param in (({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                        "uniqueItems": True}}},
                        "response_format.json_schema.schema")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(**kw, extra_body={"response_format": bad})
        assert e.value.body["param"] == param, e.value.body
