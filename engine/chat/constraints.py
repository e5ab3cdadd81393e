"""Grammars that constrain a V4.1 completion (llguidance's grammar text; `engine/core/grammar.py` enforces them).

- `json_grammar(schema, thinking)`: the completion is one JSON value valid against `schema` (response_format
  json_schema; json_object is the schema {"type": "object"}). With `thinking` the reasoning comes first, as in
  `tool_calls_grammar`'s (free text that opens no calls block and never spells `</think>`, then the `</think>` token),
  then the value: the content is exactly the JSON, and the end-of-sentence token cannot come before the value is
  complete. A grammar that started at the `</think>` token would leave the reasoning free to end the output, to
  spell `</think>` in plain tokens (where the parser starts the content) or to open a calls block.
- `tool_calls_grammar(tools, name, thinking)`: the completion is the encoder's "\\n\\n" and one DSML calls block, its
  invokes calling `name` only (tool_choice naming a function: exactly one call) or any of `tools` (tool_choice
  "required": one or more). Each invoke writes its tool's declared parameters in schema order, the required ones
  always, each value as JSON valid against the parameter's schema (string="false"; a plain string parameter,
  one with no constraint beyond its type, may also be raw text without "<", and a string enum one of its values
  raw, string="true", as the model usually writes strings). A tool without declared properties takes no
  parameters. With `thinking` (the prompt ended with `<think>`) the reasoning comes first: free text that cannot open
  a calls block and never spells `</think>` (`<think>` tokens allowed, as the parser drops them), then the
  `</think>` token, then the block as above. The grammar spans the reasoning because the parser (parse.py) opens a
  calls block at the tag in reasoning as in content: a grammar that started after `</think>` would leave a block
  written inside the reasoning unconstrained, and the parser would return it as the call.
- `auto_tools_grammar(tools)`: tool_choice "auto" with strict tools. The completion is any text (the reasoning,
  `<think>` and `</think>` included) that never spells the calls tag, then optionally one calls block and nothing
  after it: a strict tool's invokes as above, another tool's invokes with any parameter text. It spans the whole
  completion, reasoning included, because the parser (parse.py) opens a calls block at the tag in reasoning as in
  content: every call the parser can read is inside the block the grammar constrains.

Free text is a lexeme whose regex spells out "no TAG in it" (`text_without`), and the text before a calls block is
one lexeme with the tag at its end (`TEXT_THEN_CALLS`): llguidance's lexer ends a lexeme only when the next byte
cannot extend it and never goes back, so a text lexeme followed by a separate tag literal would swallow the tag's
first 14 characters and then fail at its ">". The free text is exactly what the parser reads as text, with one
restriction: it holds no token llguidance counts as special (it has no bytes a regex can match) but `<think>` and
`</think>`, which the grammar writes between text lexemes. Special tokens are not in the text the parser reads
(skip_special_tokens), so letting one split two text lexemes would let "<｜DSML｜ ca" + special + "lls>" spell the tag
unconstrained. `<think>` and `</think>` are text to the parser, but no tag can overlap one: the tag contains
neither, begins with no proper suffix and ends with no proper prefix of either.
The thinking-mode `REASONING` (of `tool_calls_grammar` and `json_grammar`) is free text of the same kind that also
never spells `</think>` in plain tokens (the parser would end the reasoning there, and the text up to the `</think>`
token would be content).

JSON is compact (", " and ": " separators, no other whitespace, as OpenAI's strict mode writes it), so that a
constrained completion always ends: the grammar leaves no unbounded run of whitespace. And it is `tag_free`: no
free-form string in it, object keys included, holds "<｜", "</｜", "<think>" or "</think>" (STRING_TAGS). DSML has no
escape (the encoder writes a string value raw, any other as json.dumps), and the parser reads tags inside a value as
tags, as vLLM's parser does: a `</｜DSML｜ parameter>` in a value would end it, a `</｜DSML｜ calls>` the whole block
(the rest of the call becoming content), a `</think>` in a JSON answer would be dropped from the content. So the
grammar keeps them out, and what it accepts parses back to the JSON it wrote. `check(grammar)` compiles a grammar
without a tokenizer and raises GrammarError with llguidance's message, which names the keyword it cannot enforce
(e.g. `Unimplemented keys: ["uniqueItems"]`).
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


def json_grammar(schema: dict[str, Any], thinking: bool = False) -> str:
    """thinking: the completion opens with the reasoning, which must end with `</think>`; the JSON value is the
    content after it."""
    try:
        if not thinking:
            return llguidance.LLMatcher.grammar_from_json_schema(tag_free(schema), defaults=JSON_OPTIONS)
        answer = f"%json{json.dumps({**tag_free(schema), 'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}"
        return llguidance.LLMatcher.grammar_from_lark("\n".join(["start: reasoning " + answer, *_reasoning_rules()])
                                                      + "\n")
    except ValueError as e:  # e.g. "Value is not JSON serializable: <an integer past 64 bits>"
        raise GrammarError(str(e).strip().splitlines()[0]) from None


# The texts the parser reads as tags where a constrained JSON value can be: every DSML tag ("<｜DSML｜ ..." and
# "</｜DSML｜ ..."; in an argument value the close tags and the next parameter's start end the value) and the
# end-of-sentence marker's spelling (dropped anywhere) start with "<｜" or "</｜"; "<think>" and "</think>" are tags
# in content, where a response_format answer is.
STRING_TAGS = ("<｜", "</｜", s.THINK_START, s.THINK_END)
_TAG_FREE_ANY = "tag_free_any"  # the $defs entry tag_free adds: any JSON value whose strings (keys too) are tag-free
_COMBINED = {"$ref", "anyOf", "oneOf", "allOf", "not"}  # an untyped schema narrowed by others (narrowed themselves)
_SHAPED = {"pattern", "format", "minLength", "maxLength"}  # a string's own shape, left as the schema gives it


def tag_free(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (a root: its $defs / definitions included) narrowed so that no string of a valid value, object keys
    included, holds one of STRING_TAGS: the encoder escapes no tag text inside a value (strings are written raw or
    as json.dumps writes them), so the parser would read one there as a tag, cutting the value or the call short.

    A free-form string schema gets a `pattern`; an object whose keys are not all declared also takes only tag-free
    keys besides its declared ones (keys matched by its own patternProperties too); a value the schema leaves free
    (`true`, an untyped schema, absent `items` / `additionalProperties`) is `$defs/tag_free_any`. A string with its
    own pattern, format or length bounds keeps exactly those: llguidance would lex it as the intersection of two
    regexes, which takes no token slice (each mask inside such a string walks the vocabulary, ~8x the cost) and,
    with a long bound (minLength 100, a pattern `^[a-z]{5000}$`), exhausts the fuel of its emptiness check, a schema
    that no longer compiles. Such strings are the gap: one may hold a tag (benchmarks/RESULTS.md)."""
    pattern = f"^({text_without(*STRING_TAGS)})$"
    free = {"$ref": f"#/$defs/{_TAG_FREE_ANY}"}

    def narrowed(node: Any) -> Any:
        if node is True:
            return free
        if not isinstance(node, dict):
            return node  # false, or not a schema (llguidance reports it)
        out = dict(node)
        for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(out.get(key), dict):
                out[key] = {k: narrowed(v) for k, v in out[key].items()}
        for key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
            if isinstance(out.get(key), list):
                out[key] = [narrowed(v) for v in out[key]]
        for key in ("additionalProperties", "items", "contains", "not", "if", "then", "else"):
            if key in out and not isinstance(out[key], list):
                out[key] = narrowed(out[key])
        if "$ref" in out:
            return out  # its target is narrowed where it is defined
        kind = out.get("type")
        kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
        is_any = kinds is None and not set(out) & (_COMBINED | {"enum", "const"})
        may_be_string = "string" in kinds if kinds is not None else not set(out) & _COMBINED
        if may_be_string and not set(out) & _SHAPED:
            out["pattern"] = pattern  # (an enum's values it refuses are left out)
        if is_any or (kinds and "object" in kinds):
            out.setdefault("additionalProperties", free)
            if out["additionalProperties"] is not False or out.get("patternProperties"):
                declared = {k: True for k in out.get("properties") or {}}
                out["allOf"] = [*out.get("allOf", []), {"properties": declared, "patternProperties": {pattern: True},
                                                        "additionalProperties": False}]
        if is_any or (kinds and "array" in kinds):
            out.setdefault("items", free)
        return out

    root = narrowed(schema)
    any_value = {"pattern": pattern, "patternProperties": {pattern: free}, "additionalProperties": False, "items": free}
    return {**root, "$defs": {**root.get("$defs", {}), _TAG_FREE_ANY: any_value}}


def tool_calls_grammar(tools: Sequence[dict], name: str | None = None, thinking: bool = False) -> str:
    """tools: the request's OpenAI tool definitions; name: the one to call (None: any, one or more calls);
    thinking: the completion opens with the reasoning (thinking mode), which must end with `</think>`."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    calls = "invoke" if name is not None else "invoke next_invoke*"
    block = f"{_lit(s.CALLS_SEPARATOR + s.CALLS_OPEN + chr(10))} {calls} {_lit(chr(10) + s.CALLS_CLOSE)}"
    rules = [f"start: {'reasoning ' if thinking else ''}{block}", *(_reasoning_rules() if thinking else []),
             *_alternatives([f"invoke_{i}" for i in range(len(functions))]), "RAW: /[^<]*/"]
    for i, function in enumerate(functions):
        rules += _invoke_rules(f"invoke_{i}", function)
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def auto_tools_grammar(tools: Sequence[dict]) -> str:
    """tools: the request's OpenAI tool definitions, some with `strict: true` (their arguments constrained)."""
    functions = [t["function"] for t in tools]
    strict = [i for i, f in enumerate(functions) if f.get("strict") is True]
    rules = [f"start: (TEXT? think)* (TEXT? | TEXT_THEN_CALLS invoke next_invoke* {_lit(chr(10) + s.CALLS_CLOSE)})",
             f"think: {s.THINK_START} | {s.THINK_END}",  # special tokens (llguidance's <name> syntax)
             f"TEXT: {_regex(text_without(s.CALLS_OPEN, nonempty=True))}",
             f"TEXT_THEN_CALLS: {_regex(text_without(s.CALLS_OPEN))} {_lit(s.CALLS_OPEN + chr(10))}",
             f"FREE_ARGS: {_regex(text_without(s.INVOKE_CLOSE, s.CALLS_CLOSE))} {_lit(s.INVOKE_CLOSE)}",
             *_alternatives([f"invoke_{i}" for i in range(len(functions))]), "RAW: /[^<]*/"]
    for i, function in enumerate(functions):
        if i in strict:
            rules += _invoke_rules(f"invoke_{i}", function)
        else:  # the parser reads a call's parameters up to the invoke's close tag, or the block's
            head = f'{s.INVOKE_OPEN} name="{function["name"]}">\n'
            rules += [f"invoke_{i}: {_lit(head)} FREE_ARGS", f"next_invoke_{i}: {_lit(chr(10) + head)} FREE_ARGS"]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def _reasoning_rules() -> list[str]:
    """`reasoning`: free text that opens no calls block and never spells `</think>` (`<think>` tokens between its
    lexemes), then the `</think>` token: the reasoning's text ends where the parser's does and holds no call."""
    return [f"reasoning: (REASONING? {s.THINK_START})* REASONING? {s.THINK_END}",
            f"REASONING: {_regex(text_without(s.CALLS_OPEN, s.THINK_END, nonempty=True))}"]


def _alternatives(invokes: list[str]) -> list[str]:
    """`invoke` (the first of a block) and `next_invoke` (a later one: its newline is part of its first literal, so
    that no literal is a prefix of another where both may come next: llguidance's lexer does not go back). Each
    alternative's first literal holds the whole `<｜DSML｜ invoke name="f">`, for the same reason."""
    return [f"invoke: {' | '.join(invokes)}", f"next_invoke: {' | '.join('next_' + i for i in invokes)}"]


def _invoke_rules(rule: str, function: dict) -> list[str]:
    """An invoke of `function` whose parameters are its declared properties, in order, the required ones always."""
    params = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    properties = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # what a property's $ref may name
    body, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        name = f"{rule}_p{j}"
        value_schema = tag_free({**schema, **defs} if isinstance(schema, dict) else {"allOf": [schema], **defs})
        value = f"{_lit(_param_head(key, False))} %json{json.dumps({**value_schema, 'x-guidance': JSON_OPTIONS})}"
        if isinstance(schema, dict) and schema.get("type") == "string" and set(schema) <= _PLAIN_STRING_KEYS:
            value = f"{_lit(_param_head(key, True))} RAW | {value}"
        elif isinstance(schema, dict) and _raw_choices(schema):
            choices = " | ".join(_lit(v) for v in _raw_choices(schema))
            value = f"{_lit(_param_head(key, True))} ({choices}) | {value}"
        rules.append(f"{name}: ({value}) {_lit(s.PARAM_CLOSE + chr(10))}")
        body.append(name if key in required else f"{name}?")
    head = f'{s.INVOKE_OPEN} name="{function["name"]}">\n'
    # the encoder ends each parameter with a newline, and writes an empty line for an invoke without parameters
    return [f"{rule}: {_lit(head)} {rule}_body", f"next_{rule}: {_lit(chr(10) + head)} {rule}_body",
            f"{rule}_body: {' '.join(body)} {_lit(chr(10))}? {_lit(s.INVOKE_CLOSE)}", *rules]


def _raw_choices(schema: dict) -> list[str]:
    """The values of a string enum (or const) that can be written raw (string="true"): none with "<"."""
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else []
    ok = values and all(isinstance(v, str) and "<" not in v for v in values) and schema.get("type") in (None, "string")
    return values if ok and set(schema) <= _PLAIN_STRING_KEYS | {"enum", "const"} else []


def _param_head(key: str, is_string: bool) -> str:
    return f'{s.PARAM_OPEN} name="{key}" string="{"true" if is_string else "false"}">'


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def text_without(*tags: str, nonempty: bool = False) -> str:
    """A regex of the texts in which none of `tags` occurs (nonempty: and not ""). Each tag starts with "<" and holds
    no other "<", so one can only begin at a "<" and end before the next: the text is a run without "<", then any
    number of "<" each followed by a segment without "<" that starts with no tag's rest. Written out, not as
    llguidance's `/(.|\\n)*/ & ~/(.|\\n)*TAG(.|\\n)*/`: llguidance proves that a token slice (engine/core/grammar.py)
    may follow a state only for a regex of this shape, and walks the whole vocabulary otherwise."""
    assert tags and all(t.startswith("<") and "<" not in t[1:] for t in tags), tags

    def segment(rests: list[str]) -> str:  # the texts without "<" that start with none of rests
        firsts = sorted({r[0] for r in rests})
        alternatives = [f"[^<{''.join(_escape(c) for c in firsts)}][^<]*"]
        for c in firsts:
            longer = [r[1:] for r in rests if r[0] == c]
            if "" not in longer:  # c ends no tag: what follows c must not complete one
                alternatives.append(_escape(c) + segment(longer))
        return f"({'|'.join(alternatives)})?"

    tagged = "<" + segment([t[1:] for t in tags])
    return f"[^<]+({tagged})*|({tagged})+" if nonempty else f"[^<]*({tagged})*"


def _escape(c: str) -> str:
    return "\\" + c if c in "\\^$.|?*+()[]{}-" else c


def _regex(regex: str) -> str:
    """A Lark regex literal."""
    return "/" + regex.replace("/", "\\/") + "/"
