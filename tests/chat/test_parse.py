"""parse_completion / CompletionParser: reasoning split, DSML tool calls, malformed output, ids,
render -> parse round trips, and streaming == whole-text parsing for every chunking."""

from __future__ import annotations

import json
import random
import re

import pytest

from engine.chat import CompletionParser, ParsedCompletion, ToolCall, parse_completion, render_chat

EOS = "<｜end▁of▁sentence｜>"
ID_RE = re.compile(r"^call_\d+_[0-9a-f]{12}$")

# The assistant turn of the reference fixture deepseek_v41/test_output_1.txt (after "<think>").
FIXTURE_CALL = (
    "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="location" string="true">Beijing</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="unit" string="true">celsius</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>" + EOS
)


def block(*invokes: str) -> str:
    return "<｜DSML｜ calls>\n" + "\n".join(invokes) + "\n</｜DSML｜ calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "\n".join(
        f'<｜DSML｜ parameter name="{k}" string="{flag}">{v}</｜DSML｜ parameter>' for k, flag, v in params
    )
    return f'<｜DSML｜ invoke name="{name}">\n{body}\n</｜DSML｜ invoke>'


def without_ids(parsed: ParsedCompletion) -> tuple:
    return parsed.reasoning_content, parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# --- reasoning / content -------------------------------------------------------------------------


def test_thinking_splits_at_think_end_and_strips_eos():
    parsed = parse_completion("Let me see.</think>Paris." + EOS, thinking=True)
    assert parsed == ParsedCompletion("Let me see.", "Paris.", [])


def test_thinking_without_think_end_is_all_reasoning():
    text = 'still thinking\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">'
    assert parse_completion(text, thinking=True) == ParsedCompletion(text, "", [])
    assert parse_completion("abc" + EOS, thinking=True) == ParsedCompletion("abc", "", [])


def test_chat_mode_is_all_content():
    parsed = parse_completion("Paris.</think> is the <think>answer" + EOS, thinking=False)
    assert parsed == ParsedCompletion(None, "Paris.</think> is the <think>answer", [])


def test_only_the_trailing_eos_is_removed():
    assert parse_completion("a" + EOS + "b", thinking=False).content == "a" + EOS + "b"
    assert parse_completion("a" + EOS + EOS, thinking=False).content == "a" + EOS
    assert parse_completion("a" + EOS[:5], thinking=False).content == "a" + EOS[:5]
    assert parse_completion("", thinking=True) == ParsedCompletion("", "", [])


def test_empty_reasoning_and_second_think_end_is_content():
    assert parse_completion("</think>x</think>y", thinking=True) == ParsedCompletion("", "x</think>y", [])


# --- tool calls ----------------------------------------------------------------------------------


def test_reference_fixture_tool_call():
    parsed = parse_completion(FIXTURE_CALL, thinking=True)
    assert parsed.reasoning_content == (
        "The user wants to know the weather in Beijing. I should use the get_weather tool."
    )
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"location": "Beijing", "unit": "celsius"}')
    ]


def test_string_false_values_are_json_with_raw_fallback():
    text = "\n\n" + block(
        invoke(
            "f",
            ("n", "false", "3"),
            ("x", "false", " 2.5 "),
            ("b", "false", "true"),
            ("l", "false", '[1, "é"]'),
            ("o", "false", '{"a": null}'),
            ("bad", "false", "not json{"),
            ("nan", "false", "NaN"),
            ("s", "true", "42"),
            ("raw", "true", ' keep  "quotes" & <b>tags</b>\n'),
        )
    )
    (c,) = parse_completion(text, thinking=False).tool_calls
    assert json.loads(c.arguments) == {
        "n": 3,
        "x": 2.5,
        "b": True,
        "l": [1, "é"],
        "o": {"a": None},
        "bad": "not json{",
        "nan": "NaN",
        "s": "42",
        "raw": ' keep  "quotes" & <b>tags</b>\n',
    }
    assert '"l": [1, "é"]' in c.arguments  # non-ASCII kept, reference spacing


def test_content_before_and_after_calls_and_several_blocks():
    text = (
        "Checking both.\n\n" + block(invoke("f", ("a", "true", "1")), invoke("g"))
        + "middle\n\n" + block(invoke("h", ("z", "false", "[]"))) + " tail" + EOS
    )
    parsed = parse_completion(text, thinking=False)
    assert parsed.content == "Checking both.middle tail"
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("f", '{"a": "1"}'), ("g", "{}"), ("h", '{"z": []}')
    ]


def test_separator_is_only_the_blank_line_before_the_block():
    parsed = parse_completion("a\n\n\n" + block(invoke("f")), thinking=False)
    assert parsed.content == "a\n"
    parsed = parse_completion("a " + block(invoke("f")), thinking=False)
    assert parsed.content == "a "
    assert len(parsed.tool_calls) == 1


def test_whitespace_between_tags_is_free():
    text = (
        '<｜DSML｜ calls><｜DSML｜ invoke name="f">  <｜DSML｜ parameter name="a" string="false">1'
        '</｜DSML｜ parameter>\t\r\n</｜DSML｜ invoke></｜DSML｜ calls>'
    )
    assert [c.arguments for c in parse_completion(text, thinking=False).tool_calls] == ['{"a": 1}']


def test_empty_calls_block_yields_no_calls():
    assert parse_completion("x\n\n" + block(), thinking=False) == ParsedCompletion(None, "x", [])


def test_tool_call_ids_are_deterministic_and_salted():
    text = "\n\n" + block(invoke("f", ("a", "true", "1")), invoke("f", ("a", "true", "1")))
    first = parse_completion(text, thinking=False).tool_calls
    assert first == parse_completion(text, thinking=False).tool_calls
    assert all(ID_RE.match(c.id) for c in first)
    assert [c.id.split("_")[1] for c in first] == ["0", "1"]
    assert first[0].id != first[1].id  # identical calls, different index
    salted = parse_completion(text, thinking=False, id_salt="req-7").tool_calls
    assert [c.id for c in salted] != [c.id for c in first]
    assert [(c.name, c.arguments) for c in salted] == [(c.name, c.arguments) for c in first]


def test_call_index_counts_across_blocks():
    text = block(invoke("f")) + "\n\n" + block(invoke("g"))
    assert [c.id.split("_")[1] for c in parse_completion(text, thinking=False).tool_calls] == ["0", "1"]


def test_wrapped_arguments_are_unwrapped_only_against_the_schema():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}, "b": {}}}}},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {"arguments": {}}}}},
    ]
    wrapped = ("arguments", "true", '{"a": 1}')
    assert parse_completion(block(invoke("f", wrapped)), False, tools).tool_calls[0].arguments == '{"a": 1}'
    as_object = ("input", "false", '{"b": "x"}')
    assert parse_completion(block(invoke("f", as_object)), False, tools).tool_calls[0].arguments == '{"b": "x"}'
    # g declares "arguments"; unknown keys inside; no tools given: all kept as written.
    assert parse_completion(block(invoke("g", wrapped)), False, tools).tool_calls[0].arguments == (
        '{"arguments": "{\\"a\\": 1}"}'
    )
    unknown = ("arguments", "false", '{"c": 1}')
    assert parse_completion(block(invoke("f", unknown)), False, tools).tool_calls[0].arguments == (
        '{"arguments": {"c": 1}}'
    )
    assert parse_completion(block(invoke("f", wrapped)), False).tool_calls[0].arguments == (
        '{"arguments": "{\\"a\\": 1}"}'
    )


# --- malformed DSML stays content ----------------------------------------------------------------

GOOD = "Sure.\n\n" + block(invoke("f", ("a", "true", "x"), ("n", "false", "2")), invoke("g")) + EOS


def test_every_truncation_of_a_calls_block_is_verbatim_content():
    start = GOOD.index("\n\n<｜DSML｜")
    end = GOOD.index(EOS)
    for cut in range(start + 1, end):
        text = GOOD[:cut]
        parsed = parse_completion(text, thinking=False)
        assert parsed == ParsedCompletion(None, text, []), cut


@pytest.mark.parametrize(
    "broken",
    [
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\nhello\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a">1</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="yes">1'
        "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="true">1</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="a" string="true">2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        "<｜DSML｜ calls>\n<｜DSML｜tool_calls>\n</｜DSML｜ calls>",  # V4 spelling inside
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\ntrailing words',
    ],
)
def test_malformed_block_is_verbatim_content_and_parsing_resumes(broken):
    good = "\n\n" + block(invoke("ok", ("k", "false", "1")))
    text = "Before." + "\n\n" + broken + " after." + good + EOS
    parsed = parse_completion(text, thinking=True)
    assert parsed.reasoning_content == "Before.\n\n" + broken + " after." + good
    parsed = parse_completion("r</think>" + text, thinking=True)
    assert parsed.reasoning_content == "r"
    assert parsed.content == "Before.\n\n" + broken + " after."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("ok", '{"k": 1}')]


# --- round trip ----------------------------------------------------------------------------------

ROUND_TRIP_CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {
            "name": "search",
            "arguments": json.dumps({"query": "北京 weather\n<b>", "num_results": 3, "filters": {"x": [1, None]}}),
        },
    },
    {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    {"id": "call_c", "type": "function", "function": {"name": "flag", "arguments": '{"on": true, "s": "true"}'}},
]


@pytest.mark.parametrize("effort", ["high", "none"])
@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_rendered_tool_calls_parse_back(effort, content):
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "I need tools.", "content": content, "tool_calls": ROUND_TRIP_CALLS},
    ]
    prompt = render_chat(messages, reasoning_effort=effort, drop_thinking=False)
    header = "<｜User｜>q<｜Assistant｜>" + ("<think>" if effort == "high" else "</think>")
    turn = prompt[prompt.index(header) + len(header) : prompt.index(EOS) + len(EOS)]
    parsed = parse_completion(turn, thinking=effort == "high")
    assert parsed.reasoning_content == ("I need tools." if effort == "high" else None)
    assert parsed.content == content
    assert [c.name for c in parsed.tool_calls] == ["search", "now", "flag"]
    for got, sent in zip(parsed.tool_calls, ROUND_TRIP_CALLS):
        assert got.arguments == json.dumps(json.loads(sent["function"]["arguments"]), ensure_ascii=False)


# --- streaming -----------------------------------------------------------------------------------

STREAM_TEXTS = [
    (True, FIXTURE_CALL),
    (True, "a</think>b" + EOS),
    (True, "x</thi</think>\n\n\n<｜DSML｜ call" + EOS + "s>" + EOS + EOS),
    (False, GOOD),
    (False, "Before.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\nbad</｜DSML｜ invoke>\n\n" + block(invoke("g"))),
    (False, "text\n\n" + block(invoke("f", ("a", "true", "v</｜DSML｜ invoke>" + EOS)))),
    (False, "unterminated\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ param"),
    (True, "think</think>" + GOOD[: GOOD.index("</｜DSML｜ calls>") + 3]),
    (False, "\n\n\n\n<｜DSML｜ calls><｜DSML｜ calls></｜DSML｜ calls>\n\n"),
    (False, "日本語の\n\nテキスト" + EOS[:-1]),
]


def stream(thinking: bool, chunks: list[str]) -> tuple[ParsedCompletion, ParsedCompletion]:
    """(the parser's result, the same assembled from the deltas)."""
    parser = CompletionParser(thinking)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    assembled = ParsedCompletion(
        "".join(d.reasoning_content for d in deltas) if thinking else None,
        "".join(d.content for d in deltas),
        [c for d in deltas for c in d.tool_calls],
    )
    return parser.result(), assembled


@pytest.mark.parametrize(("thinking", "text"), STREAM_TEXTS)
def test_streaming_equals_whole_text_for_every_split(thinking, text):
    expected = parse_completion(text, thinking)
    for cut in range(len(text) + 1):
        result, assembled = stream(thinking, [text[:cut], text[cut:]])
        assert result == expected, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
        assert assembled == expected, f"deltas, split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    assert stream(thinking, list(text)) == (expected, expected)


@pytest.mark.parametrize(("thinking", "text"), STREAM_TEXTS)
def test_streaming_equals_whole_text_for_random_chunkings(thinking, text):
    expected = parse_completion(text, thinking)
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 12))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(thinking, chunks) == (expected, expected), chunks


def test_streaming_emits_text_as_soon_as_it_is_decided():
    parser = CompletionParser(thinking=True)
    assert parser.feed("Let me think").reasoning_content == "Let me think"
    assert parser.feed(" more</thi").reasoning_content == " more"
    delta = parser.feed("nk>The answer\n")
    assert (delta.reasoning_content, delta.content) == ("", "The answer")
    assert parser.feed("\n<｜DSML｜ calls>\n").is_empty
    delta = parser.feed('<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert (delta.content, [c.name for c in delta.tool_calls]) == ("", ["f"])
    assert parser.feed(EOS).is_empty
    assert parser.finish().is_empty
    assert parser.result().content == "The answer"


def test_parser_misuse_raises():
    parser = CompletionParser(thinking=False)
    with pytest.raises(RuntimeError):
        parser.result()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.finish()


def test_tool_call_record_is_frozen():
    call = ToolCall(id="call_0_x", name="f", arguments="{}")
    with pytest.raises(AttributeError):
        call.name = "g"  # type: ignore[misc]
