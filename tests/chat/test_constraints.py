"""engine/chat/constraints.py: which completions its grammars accept (llguidance over the real tokenizer), judged
against the DSML the encoder writes (syntax.render_tool_calls) and JSON as json.dumps writes it."""

from __future__ import annotations

import json

import llguidance
import pytest

from engine.chat import syntax
from engine.chat.constraints import GrammarError, check, json_grammar, tool_calls_grammar

BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "meal": {"enum": ["veg", "fish"]}, "note": {"type": "string"}},
    "required": ["seats", "meal"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def accepts(tok):
    llg_tok = llguidance.LLTokenizer(tok.path.read_text(encoding="utf-8"), eos_token=tok.eos_id)

    def run(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
        return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()
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


def test_check_names_the_keyword():
    with pytest.raises(GrammarError, match="uniqueItems"):
        check(json_grammar({"type": "array", "uniqueItems": True}))
    assert check(json_grammar({"type": "object"}))
