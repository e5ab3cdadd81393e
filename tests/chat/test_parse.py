"""parse_completion / CompletionParser against vLLM's DeepSeek V4.1 parser, and streaming.

`VLLM_SAMPLES` are model outputs with what vLLM's parser returns for them, written out by hand from its code
(`vllm/parser/deepseek_v41.py`, `deepseek_v4.py`, `parser/engine/{streaming_parser_engine,parser_engine}.py`,
`tool_parsers/utils.py`): reasoning with its trailing whitespace stripped, content verbatim (the "\\n\\n" before a
calls block kept, whitespace-only content dropped when calls are made), text between tags dropped, arguments from
the parameter regex with JSON decoding, wrapper unwrapping and coercion to the tool's schema types. vLLM's message
fields are `reasoning` / `content` / `tool_calls`, null when empty; ours are the same with "" for no content.
Streaming: every split point of every sample gives the same result, and no delta ever holds tag text.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from engine.chat import CompletionParser, ParsedCompletion, ToolCall, parse_completion, syntax

EOS = syntax.EOS
ID_RE = re.compile(r"^call_\d+_[0-9a-f]{12}$")
TAG_TEXT = ("｜DSML｜", "<think>", "</think>", EOS)


def call(name: str, *params: tuple[str, str, str], close: bool = True) -> str:
    body = "\n".join(f'<｜DSML｜ parameter name="{k}" string="{flag}">{v}</｜DSML｜ parameter>' for k, flag, v in params)
    return f'<｜DSML｜ invoke name="{name}">\n{body}\n' + ("</｜DSML｜ invoke>" if close else "")


def block(*invokes: str) -> str:
    return "<｜DSML｜ calls>\n" + "\n".join(invokes) + "\n</｜DSML｜ calls>"


def tool(name: str, **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


WEATHER = tool("get_weather", city={"type": "string"}, days={"type": "integer"})
TYPED = tool("typed", n={"type": "integer"}, x={"type": "number"}, on={"type": "boolean"}, unit={"type": "string"},
             tags={"type": "array", "items": {"type": "integer"}}, opt={"type": ["null", "string"]},
             mode={"enum": [1, 2, "auto"]}, free={})
TOOLS = [WEATHER, tool("get_time", tz={"type": "string"}), TYPED]
BOTH = block(call("get_weather", ("city", "true", "Paris"), ("days", "false", "2")), call("get_time", ("tz", "true", "UTC")))

# (name, thinking, model output, vLLM's (reasoning, content, [(name, arguments JSON text)]))
VLLM_SAMPLES = [
    ("issue_24_content_keeps_its_blank_line", True,
     "The user asks for two cities.\n\n</think>Let me check both.\n\n" + BOTH + EOS,
     ("The user asks for two cities.", "Let me check both.\n\n",
      [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"tz": "UTC"}')])),
    ("reference_fixture_whitespace_only_content_dropped", True,
     "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
     + block(call("get_weather", ("location", "true", "Beijing"), ("unit", "true", "celsius"))) + EOS,
     ("The user wants to know the weather in Beijing. I should use the get_weather tool.", None,
      [("get_weather", '{"location": "Beijing", "unit": "celsius"}')])),
    ("chat_mode_content_verbatim", False, "  Hello!\n\nBye.\n", (None, "  Hello!\n\nBye.\n", [])),
    ("no_think_end_is_all_reasoning", True, "Still thinking about it \n\n", ("Still thinking about it", None, [])),
    ("reasoning_keeps_inner_whitespace", True, "a\n\nb \n</think>\n\nAnswer.", ("a\n\nb", "\n\nAnswer.", [])),
    ("calls_block_ends_reasoning", True, "Need the weather." + BOTH,
     ("Need the weather.", None, [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"tz": "UTC"}')])),
    ("think_tags_out_of_place", False, "A</think>B<think>C \n</think>D", ("C", "ABD", [])),
    ("second_think_in_reasoning_is_dropped", True, "x<think>y</think>z", ("xy", "z", [])),
    ("text_between_tags_dropped_and_name_stripped", False,
     'Go.<｜DSML｜ calls> junk <｜DSML｜ invoke name=" get_time ">'
     '<｜DSML｜ parameter name="tz" string="true">CET</｜DSML｜ parameter> also junk </｜DSML｜ invoke>between'
     "</｜DSML｜ calls>", (None, "Go.", [("get_time", '{"tz": "CET"}')])),
    ("coercion_to_schema_types", False,
     block(call("typed", ("n", "true", "7"), ("x", "true", "2.50"), ("on", "true", "1"), ("unit", "false", "5"),
                ("tags", "false", '["1", 2]'), ("opt", "true", "null"), ("mode", "true", "2"),
                ("free", "true", "{\"a\": 1}"), ("undeclared", "true", "8"))),
     (None, None, [("typed", '{"n": 7, "x": 2.5, "on": true, "unit": "5", "tags": [1, 2], "opt": null, '
                             '"mode": 2, "free": "{\\"a\\": 1}", "undeclared": "8"}')])),
    ("string_false_json_with_raw_fallback", False,
     block(call("f", ("a", "false", '{"k": [1, 2.5, null]}'), ("b", "false", "not json"))),
     (None, None, [("f", '{"a": {"k": [1, 2.5, null]}, "b": "not json"}')])),
    ("wrapper_unwrapped_against_the_schema", False,
     block(call("get_weather", ("arguments", "false", '{"city": "Rome", "days": "3"}'))),
     (None, None, [("get_weather", '{"city": "Rome", "days": 3}')])),
    ("wrapper_kept_when_not_all_keys_declared", False,
     block(call("get_weather", ("input", "true", '{"city": "Rome", "when": "now"}'))),
     (None, None, [("get_weather", '{"input": "{\\"city\\": \\"Rome\\", \\"when\\": \\"now\\"}"}')])),
    ("parameter_ended_by_the_next_one", False,
     block('<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">1\n'
           '<｜DSML｜ parameter name="b" string="true">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>'),
     (None, None, [("f", '{"a": "1\\n", "b": "2"}')])),
    ("truncated_inside_a_parameter", False,
     "Checking.\n\n<｜DSML｜ calls>\n" + call("get_weather", ("city", "true", "Oslo"), close=False)
     + '<｜DSML｜ parameter name="days" string="false">1',
     (None, "Checking.\n\n", [("get_weather", '{"city": "Oslo"}')])),
    ("truncated_inside_a_name", False, 'x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_wea',
     (None, "x\n\n", [("get_wea", "{}")])),
    ("empty_name_dropped", False, block(call("", ("a", "true", "1")), call("g")), (None, None, [("g", "{}")])),
    ("unknown_tool_no_coercion", False, block(call("nope", ("n", "true", "7"))), (None, None, [("nope", '{"n": "7"}')])),
    ("two_blocks_back_to_back", False, "One.\n\n" + block(call("get_time")) + block(call("get_time")),
     (None, "One.\n\n", [("get_time", "{}"), ("get_time", "{}")])),
    ("unicode_values", False, block(call("get_weather", ("city", "true", "東京 🌧\n")), ), (None, None,
     [("get_weather", '{"city": "東京 🌧\\n"}')])),
]
# Where this parser differs from vLLM on purpose (module docstring of engine/chat/parse.py):
OUR_SAMPLES = [
    ("content_after_calls_is_content", False, "Before.\n\n" + block(call("get_time")) + "\nAfter.",
     (None, "Before.\n\n\nAfter.", [("get_time", "{}")])),  # vLLM's streaming keeps it; its whole-text parse drops it
    ("empty_calls_block_returns_to_content", False, "a<｜DSML｜ calls></｜DSML｜ calls>b", (None, "ab", [])),
    ("non_finite_json_is_text", False, block(call("f", ("c", "false", "NaN"))),
     (None, None, [("f", '{"c": "NaN"}')])),  # vLLM's json.loads takes NaN and writes the invalid JSON `NaN`
    ("repeated_parameter_keeps_the_first", False, block(call("f", ("a", "true", "1"), ("a", "true", "2"))),
     (None, None, [("f", '{"a": "1"}')])),
]
SAMPLES = VLLM_SAMPLES + OUR_SAMPLES
# Tag text inside argument values. The encoder writes a string value raw (string="true") and any other value as
# json.dumps: neither escapes tag text, so DSML cannot carry a value holding a tag that ends it. The parser reads
# such output as vLLM's regexes do: inside a value the tags that end it count (a parameter's close, the next
# parameter's start, the invoke's or the block's close, the end-of-sentence marker); start tags and the think tags
# stay in the value. The grammars (engine/chat/constraints.py) write no value the parser would cut.
IN_VALUE = 'see <｜DSML｜ calls>, <｜DSML｜ invoke name="x">, <think> and </think>'
TAGS_IN_VALUES = [
    ("start_tags_in_a_raw_value", False, block(call("get_time", ("tz", "true", IN_VALUE))),
     (None, None, [("get_time", json.dumps({"tz": IN_VALUE}, ensure_ascii=False))])),
    ("start_tags_in_a_json_string", True,
     "r</think>" + block(call("get_time", ("tz", "false", json.dumps(IN_VALUE, ensure_ascii=False)))),
     ("r", None, [("get_time", json.dumps({"tz": IN_VALUE}, ensure_ascii=False))])),
    ("a_parameter_close_ends_the_value", False, block(call("get_time", ("tz", "true", "a</｜DSML｜ parameter>b"))),
     (None, None, [("get_time", '{"tz": "a"}')])),
    ("the_next_parameter_ends_the_value", False,
     block(call("get_time", ("tz", "false", '"a<｜DSML｜ parameter name="b" string="true">c"'))),
     (None, None, [("get_time", '{"tz": "\\"a", "b": "c\\""}')])),
    ("an_invoke_close_ends_the_call", False, block(call("get_time", ("tz", "true", "a</｜DSML｜ invoke>b"))),
     (None, None, [("get_time", "{}")])),  # its parameter was still open: dropped
    ("a_calls_close_ends_the_block", False, block(call("get_time", ("tz", "true", "a</｜DSML｜ calls>b"))),
     (None, "b</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>", [("get_time", "{}")])),
    ("the_end_of_sentence_marker_is_dropped", False, block(call("get_time", ("tz", "true", "a" + EOS + "b"))),
     (None, None, [("get_time", '{"tz": "ab"}')])),
]


def as_vllm(parsed: ParsedCompletion) -> tuple:
    return (parsed.reasoning_content or None, parsed.content or None,
            [(c.name, c.arguments) for c in parsed.tool_calls])


@pytest.mark.parametrize(("name", "thinking", "text", "expected"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_samples_parse_as_vllm_does(name, thinking, text, expected):
    parsed = parse_completion(text, thinking, TOOLS)
    assert as_vllm(parsed) == expected
    assert all(ID_RE.match(c.id) for c in parsed.tool_calls)
    assert (parsed.reasoning_content is None) == (not thinking and expected[0] is None)


def stream(thinking: bool, chunks: list[str]) -> tuple[ParsedCompletion, ParsedCompletion, list]:
    """(the parser's result, the same assembled from the deltas, the deltas)."""
    parser = CompletionParser(thinking, TOOLS, id_salt="s")
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(calls) and c.arguments == "", c
                calls[c.index] = [c.id, c.name, ""]
            else:
                calls[c.index][2] += c.arguments
    result = parser.result()
    assembled = ParsedCompletion("".join(d.reasoning_content for d in deltas)
                                 if result.reasoning_content is not None else None,
                                 "".join(d.content for d in deltas), [ToolCall(*calls[i]) for i in sorted(calls)])
    return result, assembled, deltas


def assert_no_tag_text(deltas: list, where: str) -> None:
    for d in deltas:
        pieces = [d.reasoning_content, d.content] + [c.arguments + (c.name or "") for c in d.tool_calls]
        assert not any(tag in piece for piece in pieces for tag in TAG_TEXT), f"{where}: {d}"


@pytest.mark.parametrize(("name", "thinking", "text", "expected"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_every_split_point_streams_the_same_and_never_shows_a_tag(name, thinking, text, expected):
    whole = parse_completion(text, thinking, TOOLS, id_salt="s")
    for cut in range(len(text) + 1):
        result, assembled, deltas = stream(thinking, [text[:cut], text[cut:]])
        where = f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
        assert result == whole and assembled == whole, where
        assert_no_tag_text(deltas, where)
    result, assembled, deltas = stream(thinking, list(text))
    assert result == assembled == whole
    assert_no_tag_text(deltas, "one character at a time")
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 12))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        result, assembled, deltas = stream(thinking, chunks)
        assert result == assembled == whole, chunks
        assert_no_tag_text(deltas, str(chunks))


@pytest.mark.parametrize(("name", "thinking", "text", "expected"), TAGS_IN_VALUES, ids=[s[0] for s in TAGS_IN_VALUES])
def test_tag_text_inside_values_parses_by_the_tags_every_split_alike(name, thinking, text, expected):
    whole = parse_completion(text, thinking, TOOLS, id_salt="s")
    assert as_vllm(whole) == expected
    for cut in range(len(text) + 1):
        result, assembled, _ = stream(thinking, [text[:cut], text[cut:]])
        assert result == whole and assembled == whole, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    result, assembled, _ = stream(thinking, list(text))
    assert result == assembled == whole


def test_a_call_streams_name_first_then_each_parameter_as_it_completes():
    parser = CompletionParser(False, TOOLS, id_salt="s")
    assert parser.feed("Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_wea").content == "Let me check.\n\n"
    [first] = parser.feed('ther">\n<｜DSML｜ parameter name="city" string="true">Par').tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "") and ID_RE.match(first.id)
    assert parser.feed("is</｜DSML｜ param").is_empty
    assert [c.arguments for c in parser.feed('eter>\n<｜DSML｜ parameter name="days" string="false">').tool_calls] == [
        '{"city": "Paris"']
    assert [c.arguments for c in parser.feed("2</｜DSML｜ parameter>\n</｜DSML｜ invoke>").tool_calls] == [', "days": 2', "}"]
    [second] = parser.feed('\n<｜DSML｜ invoke name="get_time">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>').tool_calls[:1]
    assert (second.index, second.name) == (1, "get_time")
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.result().tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]


def test_a_possible_wrapper_is_held_until_the_invoke_ends():
    parser = CompletionParser(False, TOOLS)
    parser.feed('<｜DSML｜ calls><｜DSML｜ invoke name="get_weather"><｜DSML｜ parameter name="arguments" '
                'string="false">{"city": "Rome"}</｜DSML｜ parameter>x')
    assert [c.arguments for c in parser.feed("").tool_calls] == []
    assert [c.arguments for c in parser.feed("</｜DSML｜ invoke>").tool_calls] == ['{"city": "Rome"}']


def test_tool_call_ids_are_deterministic_salted_and_known_with_the_name():
    text = block(call("get_time"), call("get_time"))
    a, b = parse_completion(text, False, id_salt="req-1"), parse_completion(text, False, id_salt="req-2")
    assert a == parse_completion(text, False, id_salt="req-1")
    assert len({c.id for c in a.tool_calls + b.tool_calls}) == 4
    assert [c.id[:7] for c in a.tool_calls] == ["call_0_", "call_1_"]


def test_tool_choice_none_leaves_dsml_in_the_content():
    text = "r</think>Hi.\n\n" + BOTH
    parsed = parse_completion(text, True, TOOLS, parse_tool_calls=False)
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == ("r", "Hi.\n\n" + BOTH, [])


def test_parser_misuse_raises():
    parser = CompletionParser(thinking=False)
    with pytest.raises(RuntimeError):
        parser.result()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.finish()


def test_arguments_are_json_objects():
    for _, thinking, text, _ in SAMPLES + TAGS_IN_VALUES:
        for c in parse_completion(text, thinking, TOOLS).tool_calls:
            assert isinstance(json.loads(c.arguments), dict)
