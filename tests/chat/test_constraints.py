"""engine/chat/constraints.py: which completions its grammars accept (llguidance over the real tokenizer), judged
against the DSML the encoder writes (syntax.render_tool_calls) and JSON as json.dumps writes it. The auto-tools
grammar is also judged by what the parser (parse_completion) reads from what it accepts: every call of a strict
tool has arguments valid against the tool's parameters (jsonschema)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import pytest

from engine.chat import parse_completion, syntax
from engine.chat.constraints import (STRING_TAGS, GrammarError, auto_tools_grammar, check, json_grammar,
                                     text_without, tool_calls_grammar)

BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "meal": {"enum": ["veg", "fish"]}, "note": {"type": "string"}},
    "required": ["seats", "meal"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
STRICT_BOOK = {"type": "function", "function": {**BOOK["function"], "strict": True}}
# not strict, and named so that the strict tool's name is a prefix of it
BOOKMARK = {"type": "function", "function": {"name": "bookmark", "strict": False, "parameters": {
    "type": "object", "properties": {"page": {"type": "integer"}}, "required": ["page"]}}}


@pytest.fixture(scope="module")
def accepts(tok):
    """accepts(grammar, text or token ids): the grammar takes every token and may end there."""
    llg_tok = llguidance.LLTokenizer(tok.path.read_text(encoding="utf-8"), eos_token=tok.eos_id)

    def run(grammar: str, text: str | list[int]) -> bool:
        matcher = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
        ids = tok.encode(text) if isinstance(text, str) else text
        return matcher.consume_tokens(ids) and matcher.is_accepting()
    return run


def calls(*pairs) -> str:
    return syntax.render_tool_calls(list(pairs))


def test_json_is_compact_and_follows_the_schema(accepts):
    g = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
                      "required": ["a"], "additionalProperties": False})
    assert accepts(g, json.dumps({"a": 1, "b": [1, "x"]}))
    for text in ('{"a":1}', '{"a": 1,  "b": []}', '{ "a": 1}', '{"a": "1"}', '{"c": 1}', '{"a": 1}\n'):
        assert not accepts(g, text), text


def test_named_and_required_tool_calls(accepts):
    named, required = tool_calls_grammar([BOOK, NOW], "book"), tool_calls_grammar([BOOK, NOW])
    good = calls(("book", {"seats": 2, "meal": "veg", "note": "aisle"}))  # strings raw, as the encoder writes them
    assert accepts(named, good) and accepts(required, good)
    json_values = good.replace('"meal" string="true">veg', '"meal" string="false">"veg"')
    assert json_values != good and accepts(named, json_values)
    two = calls(("now", {}), ("book", {"seats": 9, "meal": "fish"}))
    assert accepts(required, two) and not accepts(named, two)
    for bad in (calls(("book", {"seats": 10, "meal": "veg"})), calls(("book", {"seats": 2})),
                calls(("book", {"seats": 2, "meal": "beef"})), calls(("book", {"meal": "veg", "seats": 2})),
                calls(("book", {"seats": 2, "meal": "veg", "extra": 1})), "Sure." + good, good + "\n"):
        assert not accepts(named, bad), bad


@pytest.mark.parametrize("tags", [(syntax.CALLS_OPEN,), (syntax.CALLS_OPEN, syntax.THINK_END),
                                  (syntax.INVOKE_CLOSE, syntax.CALLS_CLOSE), ("<｜", "</｜", "<think>", "</think>")])
def test_text_without_matches_exactly_the_texts_without_the_tags(tags):
    """Random texts built from the tags, their prefixes and other characters (newlines, a lone "<") against the
    definition: the regex (Python's re reads it as llguidance does) takes a text iff no tag occurs in it."""
    any_text, nonempty = (re.compile(text_without(*tags, nonempty=n)) for n in (False, True))
    pieces = [*tags, *(t[:k] for t in tags for k in range(1, len(t))), "x", "\n", "<", "/", "｜", " "]
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 7)))
        free = not any(tag in text for tag in tags)
        assert bool(any_text.fullmatch(text)) == free, text
        assert bool(nonempty.fullmatch(text)) == (free and text != ""), text


# Text the parser reads as a tag where a JSON value can be (engine/chat/constraints.py: STRING_TAGS), and text that
# merely looks like one.
TAGGED = [syntax.PARAM_CLOSE, syntax.INVOKE_CLOSE, syntax.CALLS_CLOSE, syntax.CALLS_OPEN, syntax.EOS,
          syntax.PARAM_OPEN + ' name="k" string="true">', syntax.THINK_START, syntax.THINK_END]
UNTAGGED = ["a < b", "a </b> c", "<thin>", "｜DSML｜ calls>", "<｜"[::-1], "<\n｜", "</ ｜"]
VALUES = {"type": "object", "properties": {"s": {"type": "string"}, "o": {"type": "object"}, "a": {"type": "array"},
                                           "e": {"enum": ["x", "y" + syntax.PARAM_CLOSE]}, "any": {}}}


def test_json_values_hold_no_tag_text_in_strings_or_keys(accepts, tok):
    """A string anywhere in a constrained JSON value, object keys and free values included, never holds a tag's text
    (spelled in any tokens: the whole text's, or one character at a time, which also keeps `<think>` out of special
    tokens, which JSON refuses anyway); text that only resembles a tag passes."""
    assert all(any(tag in text for tag in STRING_TAGS) for text in TAGGED)
    grammar = json_grammar(VALUES)

    def values(text: str) -> list[dict]:
        return [{"s": f"1{text}2"}, {"o": {"k": text}}, {"o": {text: 1}}, {"o": {"k": [{"j": text}]}}, {"a": [text]},
                {"e": text}, {"any": text}, {"any": {"k": [text]}}, {"any": {text: None}}]

    def spellings(value: dict) -> list[list[int]]:
        text = json.dumps(value, ensure_ascii=False)
        return [tok.encode(text), [i for ch in text for i in tok.encode(ch)]]

    for text in TAGGED:
        for value in values(text):
            assert not any(accepts(grammar, ids) for ids in spellings(value)), value
    for text in UNTAGGED:
        for value in values(text)[:5] + values(text)[6:]:
            assert all(accepts(grammar, ids) for ids in spellings(value)), value
    assert accepts(grammar, json.dumps({"e": "x"}))
    assert not accepts(grammar, json.dumps({"e": "y" + syntax.PARAM_CLOSE}, ensure_ascii=False))


def test_strings_with_their_own_shape_keep_it(accepts, tok):
    """A string with a pattern, format or length bounds gets no tag-free pattern (constraints.tag_free says why: the
    intersection would cost ~8x per mask and, with long bounds, not compile): these schemas compile as they did."""
    shaped = [{"type": "string", "minLength": 100, "maxLength": 200}, {"type": "string", "pattern": "^[a-z]{5000}$"},
              {"type": "string", "minLength": 3000},
              {"anyOf": [{"type": "string", "minLength": 100}, {"type": "null"}]},
              {"type": "object", "additionalProperties": {"type": "string", "minLength": 100}}]
    for schema in shaped:
        check(json_grammar(schema))
        check(tool_calls_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"p": schema}}}}], "f"))
    bounded = json_grammar({"type": "string", "maxLength": 40})
    assert accepts(bounded, json.dumps("a" + syntax.PARAM_CLOSE, ensure_ascii=False))  # the gap


def test_tool_call_values_hold_no_tag_text_and_parse_back(accepts, tok):
    """The same in a forced call's JSON values (a raw value holds no "<" at all): what the grammar takes, the parser
    reads back as written, streamed or not; a value cut by a tag the grammar refuses."""
    tool = {"type": "function", "function": {"name": "w", "parameters": VALUES}}
    grammar = tool_calls_grammar([tool], "w")

    def written(value: dict) -> str:  # every value as JSON (string="false"), which the grammar always allows
        text = calls(("w", {k: 0 for k in value}))
        for k, v in value.items():
            text = text.replace(f'"{k}" string="false">0', f'"{k}" string="false">' + json.dumps(v, ensure_ascii=False))
        return text

    for text in UNTAGGED:
        value = {"s": text, "o": {text: [text]}, "any": text}
        assert accepts(grammar, written(value)), value
        [call] = parse_completion(written(value), False, [tool]).tool_calls
        assert json.loads(call.arguments) == value
    for text in TAGGED:
        for value in ({"s": text}, {"o": {"k": text}}, {"o": {text: 1}}, {"any": [text]}):
            assert not accepts(grammar, written(value)), value
            assert not accepts(grammar, [i for ch in written(value) for i in tok.encode(ch)]), value


def test_json_in_thinking_mode_spans_the_reasoning(accepts, tok):
    """response_format JSON in thinking mode: reasoning (free text, `<think>` tokens), the `</think>` token, then the
    JSON value, which the parser reads as the whole content. Refused: a `</think>` spelled in plain tokens (the
    parser's content would start there), a calls block in the reasoning (the parser would read it as a call), any
    other special token (the end-of-sentence one included: the output cannot end before its answer), text between
    `</think>` and the JSON, and JSON without the reasoning's end."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar, answer = json_grammar(schema, thinking=True), json.dumps({"n": 3})
    think_start, think_end = tok.token_to_id(syntax.THINK_START), tok.token_to_id(syntax.THINK_END)
    spelled_end = tok.encode("</") + tok.encode("think>")
    for reasoning in ([], tok.encode("Let me think. <b>bold</b> 🦜 {\"n\": 1} a partial tag: <｜DSML｜ call"),
                      tok.encode("one") + [think_start] + tok.encode("two")):
        ids = reasoning + [think_end] + tok.encode(answer)
        assert accepts(grammar, ids), tok.decode(ids)
        parsed = parse_completion(tok.decode(ids), True)
        assert json.loads(parsed.content) == {"n": 3} and not parsed.tool_calls
    for ids in (tok.encode("x") + spelled_end + tok.encode("y") + [think_end] + tok.encode(answer),
                tok.encode("x" + calls(("f", {}))) + [think_end] + tok.encode(answer),
                tok.encode("x") + [tok.token_to_id("<｜place▁holder▁no▁7｜>"), think_end] + tok.encode(answer),
                tok.encode("x") + [tok.eos_id], tok.encode("x") + [think_end] + tok.encode(" " + answer),
                tok.encode(answer), tok.encode("x") + [think_end] + tok.encode(json.dumps({"n": "3"}))):
        assert not accepts(grammar, ids), tok.decode(ids)
    assert json_grammar(schema) == json_grammar(schema, thinking=False) and accepts(json_grammar(schema), answer)


def test_check_names_the_keyword():
    with pytest.raises(GrammarError, match="uniqueItems"):
        check(json_grammar({"type": "array", "uniqueItems": True}))
    assert check(json_grammar({"type": "object"}))


def invoke(name: str, body: str) -> str:
    """A calls block with one invoke whose parameter text is `body`, as written (not necessarily DSML)."""
    return (f"{syntax.CALLS_SEPARATOR}{syntax.CALLS_OPEN}\n{syntax.INVOKE_OPEN} name=\"{name}\">\n{body}"
            f"{syntax.INVOKE_CLOSE}\n{syntax.CALLS_CLOSE}")


def test_auto_tools_free_text_and_reasoning(accepts, tok):
    g = auto_tools_grammar([STRICT_BOOK, BOOKMARK])
    think = "Let me think. <b>bold</b> 🦜" + syntax.THINK_END + "Sure, here you go."
    assert tok.token_to_id(syntax.THINK_END) in tok.encode(think)  # the reasoning's end is its special token
    outside = "an invoke tag outside a block: " + syntax.INVOKE_OPEN + ' name="x">'
    for text in ("", "Hello", think, syntax.THINK_START + "again" + syntax.THINK_END, "a partial tag: <｜DSML｜ call",
                 outside, "\n\n   \n"):
        assert accepts(g, text), text
    user = tok.token_to_id("<｜User｜>")
    assert not accepts(g, tok.encode("Hi") + [user])  # special tokens are not text (see the next test)
    # a special token skipped when detokenising must not splice "<｜DSML｜ ca" + "lls>" into the calls tag
    placeholder = tok.token_to_id("<｜place▁holder▁no▁7｜>")
    call = invoke("book", '<｜DSML｜ parameter name="seats" string="false">99</｜DSML｜ parameter>\n')
    head, tail = call.split(" calls>", 1)
    spliced = tok.encode(head + " ca") + [placeholder] + tok.encode("lls>" + tail)
    assert tok.decode(spliced, skip_special_tokens=True) == call
    assert not accepts(g, spliced)


AUTO_ACCEPTED = [
    calls(("book", {"seats": 2, "meal": "veg"})),
    "Booking now." + calls(("book", {"seats": 9, "meal": "fish", "note": "aisle, please"})),
    invoke("book", '<｜DSML｜ parameter name="seats" string="false">3</｜DSML｜ parameter>\n'
                   '<｜DSML｜ parameter name="meal" string="true">veg</｜DSML｜ parameter>\n'
                   '<｜DSML｜ parameter name="note" string="false">"a <b> tag"</｜DSML｜ parameter>\n'),
    "thinking" + syntax.THINK_END + "Done." + calls(("bookmark", {"page": 3}), ("book", {"seats": 1, "meal": "veg"})),
    "a call straight from the reasoning" + calls(("book", {"seats": 4, "meal": "fish"})),
    calls(("book", {"seats": 2, "meal": "veg"})).replace('"meal" string="true">veg', '"meal" string="false">"veg"'),
    invoke("bookmark", "anything at all, <｜DSML｜ calls> or {not json"),  # a free tool's parameters are free
    invoke("bookmark", '<｜DSML｜ parameter name="page" string="false">"x"</｜DSML｜ parameter>\n'
                       '<｜DSML｜ parameter name="other" string="true">y</｜DSML｜ parameter>\n'),
]
AUTO_REFUSED = [
    calls(("book", {"seats": 10, "meal": "veg"})),  # out of range
    calls(("book", {"seats": 2})),  # a required parameter missing
    calls(("book", {"seats": 2, "meal": "beef"})),  # not in the enum
    calls(("book", {"meal": "veg", "seats": 2})),  # out of schema order
    calls(("book", {"seats": 2, "meal": "veg", "extra": 1})),  # undeclared
    calls(("bookmark", {"page": 1}), ("book", {"seats": 0, "meal": "veg"})),  # the strict call of two
    calls(("lookup", {})),  # not a tool
    invoke(" book", '<｜DSML｜ parameter name="seats" string="false">99</｜DSML｜ parameter>\n'),  # parsed as book
    calls(("book", {"seats": 2, "meal": "veg"})) + "more text",  # nothing after the block
    calls(("bookmark", {"page": 1})) + calls(("book", {"seats": 2, "meal": "veg"})),  # one block
    invoke("bookmark", "x" + syntax.CALLS_CLOSE + "y"),  # would end the block inside the free call
]


@pytest.mark.parametrize("text", AUTO_ACCEPTED)
def test_auto_tools_accepted_calls_parse_to_valid_strict_arguments(accepts, text):
    tools = [STRICT_BOOK, BOOKMARK]
    assert accepts(auto_tools_grammar(tools), text), text
    for thinking in (False, True):
        parsed = parse_completion(text, thinking, tools)
        assert parsed.tool_calls, (thinking, text)
        for call in parsed.tool_calls:
            assert call.name in ("book", "bookmark")
            if call.name == "book":
                jsonschema.validate(json.loads(call.arguments), BOOK["function"]["parameters"])


@pytest.mark.parametrize("text", AUTO_REFUSED)
def test_auto_tools_refuses_invalid_strict_calls(accepts, text):
    assert not accepts(auto_tools_grammar([STRICT_BOOK, BOOKMARK]), text), text


def test_auto_tools_refusals_are_the_strict_tools_doing(accepts):
    """With no tool strict the same grammar takes the invalid book calls: the constraint is `strict`'s."""
    free = auto_tools_grammar([BOOK, BOOKMARK])
    for text in AUTO_REFUSED[:6]:
        assert accepts(free, text), text


def test_forced_calls_in_thinking_mode_span_the_reasoning(accepts, tok):
    """tool_choice "required" / named in thinking mode: reasoning (free text, `<think>` tokens), `</think>`, then the
    call(s). A calls block inside the reasoning, which the parser would return as the call, is refused, valid or not;
    so is a `</think>` spelled in plain tokens (the parser's reasoning would end there) and any other special token."""
    tools = [BOOK, NOW]
    think_start, think_end = tok.token_to_id(syntax.THINK_START), tok.token_to_id(syntax.THINK_END)
    good, bad = calls(("book", {"seats": 2, "meal": "veg"})), calls(("book", {"seats": 10, "meal": "veg"}))
    spelled_end = tok.encode("</") + tok.encode("think>")
    assert tok.decode(spelled_end) == syntax.THINK_END and think_end not in spelled_end
    placeholder = tok.token_to_id("<｜place▁holder▁no▁7｜>")
    for grammar in (tool_calls_grammar(tools, "book", thinking=True), tool_calls_grammar(tools, thinking=True)):
        for reasoning in ([], tok.encode("Let me think. <b>bold</b> 🦜 a partial tag: <｜DSML｜ call"),
                          tok.encode("one") + [think_start] + tok.encode("two"), tok.encode(syntax.INVOKE_OPEN)):
            ids = reasoning + [think_end] + tok.encode(good)
            assert accepts(grammar, ids), tok.decode(ids)
            parsed = parse_completion(tok.decode(ids), True, tools)
            assert parsed.content == "" and [c.name for c in parsed.tool_calls] == ["book"], parsed
            jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), BOOK["function"]["parameters"])
        inside = [tok.encode("Plan." + good), tok.encode("Plan." + bad), tok.encode("Plan." + good) + [think_end]
                  + tok.encode(good), tok.encode(good)]
        for ids in inside:
            assert parse_completion(tok.decode(ids), True, tools).tool_calls  # the parser takes it as a call
            assert not accepts(grammar, ids), tok.decode(ids)
        for ids in (tok.encode("x") + spelled_end + tok.encode("y") + [think_end] + tok.encode(good),
                    tok.encode("x") + [placeholder] + [think_end] + tok.encode(good),
                    tok.encode("x") + [think_end] + tok.encode("Sure." + good),  # no content, as in chat mode
                    tok.encode("x") + [think_end] + tok.encode(bad), tok.encode("x") + [think_end]):
            assert not accepts(grammar, ids), tok.decode(ids)
    chat_mode = tool_calls_grammar(tools)
    assert chat_mode == tool_calls_grammar(tools, thinking=False) and accepts(chat_mode, good)
    assert not accepts(chat_mode, tok.encode("x") + [think_end] + tok.encode(good))
