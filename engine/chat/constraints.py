"""Grammars that constrain a V4.1 completion (llguidance's grammar text; `engine/core/grammar.py` enforces them).

- `json_grammar(schema)`: the completion is one JSON value valid against `schema` (response_format json_schema;
  json_object is the schema {"type": "object"}).
- `tool_calls_grammar(tools, name)`: the completion is the encoder's "\\n\\n" and one DSML calls block, its
  invokes calling `name` only (tool_choice naming a function: exactly one call) or any of `tools` (tool_choice
  "required": one or more). Each invoke writes its tool's declared parameters in schema order, the required ones
  always, each value as JSON valid against the parameter's schema (string="false"; a plain string parameter,
  one with no constraint beyond its type, may also be raw text without "<", string="true"). A tool without
  declared properties takes no parameters.
- `auto_tools_grammar(tools)`: tool_choice "auto" with strict tools: free content text, optionally followed by
  a calls block in which the strict tools' invokes are constrained as above and the others take any parameters.

JSON is compact (", " and ": " separators, no other whitespace, as OpenAI's strict mode writes it), so that a
constrained completion always ends: the grammar leaves no unbounded run of whitespace. `check(grammar)` compiles
a grammar without a tokenizer and raises GrammarError with llguidance's message, which names the keyword it
cannot enforce (e.g. `Unimplemented keys: ["uniqueItems"]`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance

from engine.chat import syntax as s

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_PLAIN_STRING_KEYS = {"type", "description", "title"}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message is llguidance's (it names the offending keyword)."""


def check(grammar: str) -> str:
    """The grammar, after llguidance compiled it (without a tokenizer); raises GrammarError."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip().splitlines()[0])
    return grammar


def json_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def tool_calls_grammar(tools: Sequence[dict], name: str | None = None) -> str:
    """tools: the request's OpenAI tool definitions; name: the one to call (None: any, one or more calls)."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    calls = "invoke" if name is not None else "invoke next_invoke*"
    rules = [f"start: {_lit(s.CALLS_SEPARATOR + s.CALLS_OPEN + chr(10))} {calls} {_lit(chr(10) + s.CALLS_CLOSE)}",
             *_alternatives(len(functions), False), "RAW: /[^<]*/"]
    for i, function in enumerate(functions):
        rules += _invoke_rules(f"invoke_{i}", function)
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def auto_tools_grammar(tools: Sequence[dict]) -> str:
    """Free content, then optionally the calls block; strict tools' invokes constrained, the others' free."""
    strict = [t["function"] for t in tools if t["function"].get("strict") is True]
    free = [t["function"]["name"] for t in tools if t["function"].get("strict") is not True]
    rules = [f"start: CONTENT ({_lit(s.CALLS_OPEN + chr(10))} invoke next_invoke* {_lit(chr(10) + s.CALLS_CLOSE)})?",
             f"CONTENT: /(.|\\n)*/ & ~/(.|\\n)*{_regex_escape(s.CALLS_OPEN)}(.|\\n)*/",
             *_alternatives(len(strict), bool(free)), "RAW: /[^<]*/"]
    for i, function in enumerate(strict):
        rules += _invoke_rules(f"invoke_{i}", function)
    if free:
        names = " | ".join(_lit(n) for n in free)
        for rule, head in (("free_invoke", s.INVOKE_OPEN), ("next_free_invoke", chr(10) + s.INVOKE_OPEN)):
            rules.append(f"{rule}: {_lit(head + ' name=' + chr(34))} ({names}) {_lit(chr(34) + '>' + chr(10))} free_body")
        rules += [f"free_body: free_param* {_lit(chr(10))}? {_lit(s.INVOKE_CLOSE)}",
                  f"free_param: {_lit(s.PARAM_OPEN + ' name=' + chr(34))} /[A-Za-z0-9_.-]+/ "
                  f"({_lit(chr(34) + ' string=' + chr(34) + 'true' + chr(34) + '>')} RAW | "
                  f"{_lit(chr(34) + ' string=' + chr(34) + 'false' + chr(34) + '>')} %json{{}}) "
                  f"{_lit(s.PARAM_CLOSE + chr(10))}"]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def _alternatives(num_constrained: int, free: bool) -> list[str]:
    """`invoke` (the first of a block) and `next_invoke` (a later one: its newline is part of its first literal, so
    that no literal is a prefix of another where both may come next: llguidance's lexer does not go back)."""
    first = [f"invoke_{i}" for i in range(num_constrained)] + (["free_invoke"] if free else [])
    later = [f"next_invoke_{i}" for i in range(num_constrained)] + (["next_free_invoke"] if free else [])
    return [f"invoke: {' | '.join(first)}", f"next_invoke: {' | '.join(later)}"]


def _invoke_rules(rule: str, function: dict) -> list[str]:
    """An invoke of `function` whose parameters are its declared properties, in order, the required ones always."""
    params = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    properties = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # what a property's $ref may name
    body, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        name = f"{rule}_p{j}"
        value = f"{_lit(_param_head(key, False))} %json{json.dumps({**schema, **defs, 'x-guidance': JSON_OPTIONS})}"
        if isinstance(schema, dict) and schema.get("type") == "string" and set(schema) <= _PLAIN_STRING_KEYS:
            value = f"{_lit(_param_head(key, True))} RAW | {value}"
        rules.append(f"{name}: ({value}) {_lit(s.PARAM_CLOSE + chr(10))}")
        body.append(name if key in required else f"{name}?")
    head = f'{s.INVOKE_OPEN} name="{function["name"]}">\n'
    # the encoder ends each parameter with a newline, and writes an empty line for an invoke without parameters
    return [f"{rule}: {_lit(head)} {rule}_body", f"next_{rule}: {_lit(chr(10) + head)} {rule}_body",
            f"{rule}_body: {' '.join(body)} {_lit(chr(10))}? {_lit(s.INVOKE_CLOSE)}", *rules]


def _param_head(key: str, is_string: bool) -> str:
    return f'{s.PARAM_OPEN} name="{key}" string="{"true" if is_string else "false"}">'


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}/" else c for c in text)
