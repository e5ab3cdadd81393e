"""What a request asks its output to be, as a grammar (`engine.chat.constraints`), or a 400 naming the field.

- response_format {"type": "text"} (or none): no grammar. {"type": "json_object"}: one JSON object.
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: one JSON value valid
  against `schema` (strict true or false alike: the schema is enforced either way, as vLLM does; no schema is
  any JSON object). The same on chat and legacy completions.
- tool_choice "required": one or more DSML calls of the tools, each call's arguments valid against its tool's
  parameters; a named function: exactly one call of it. In thinking mode this grammar spans the reasoning too: free
  text that cannot open a calls block, `</think>`, then the call(s) (the parser reads a calls block in the reasoning
  as the call, so one written there must be refused). Under "auto", tools with `strict: true` make a grammar
  of the whole output: free text (the reasoning included), then optionally one calls block in which a strict
  tool's arguments follow its parameters and another tool's are free (`constraints.auto_tools_grammar`). Under
  "auto" without a strict tool there is no grammar (no mask to compute per token).
- response_format json_* in thinking mode spans the reasoning too: free text that cannot open a calls block or
  spell `</think>`, then `</think>`, then the JSON value (the content is exactly the JSON). The end-of-sentence
  token cannot come before the value is complete; only max_tokens can end the output in the reasoning (finish
  reason "length", no content).
- response_format json_* cannot be combined with tool_choice "required" or a named function (a 400).
A grammar llguidance cannot compile is a 400 whose message is llguidance's, naming the keyword (e.g.
`response_format.json_schema.schema: cannot be enforced: Unimplemented keys: ["uniqueItems"]`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from engine.chat import constraints
from serve_app.errors import bad_request

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def response_schema(value: Any) -> dict | None:
    """response_format -> the JSON schema the output must follow (None: text). Raises a 400 naming the field."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in FORMAT_KEYS or set(value) - FORMAT_KEYS[kind]:
        raise bad_request('response_format: must be {"type": "text"}, {"type": "json_object"} or {"type": '
                          f'"json_schema", "json_schema": {{...}}}}, got {_show(value)}', "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict) or set(spec) - JSON_SCHEMA_KEYS:
        raise bad_request(f"{where}: must be an object with name and schema (strict and description optional), got "
                          f"{_show(spec)}", where)
    if not isinstance(spec.get("name"), str) or not _SCHEMA_NAME.match(spec["name"]):
        raise bad_request(f"{where}.name: must be 1-64 letters, digits, '_' or '-', got {_show(spec.get('name'))}",
                          f"{where}.name")
    for key, ok, what in (("schema", dict, "an object (a JSON schema)"), ("strict", bool, "a boolean"),
                          ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], ok):
            raise bad_request(f"{where}.{key}: must be {what}, got {_show(spec[key])}", f"{where}.{key}")
    return spec.get("schema") if spec.get("schema") is not None else {"type": "object"}


def check_strict(tools: list[dict] | None) -> None:
    for i, tool in enumerate(tools or []):
        strict = tool["function"].get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"tools[{i}].function.strict: must be a boolean, got {_show(strict)}",
                              f"tools[{i}].function.strict")


def output_grammar(schema: dict | None, tools: list[dict] | None, tool_choice: str, name: str | None, *,
                   thinking: bool) -> str | None:
    """The llguidance grammar of a request's output, from its first token (None: unconstrained); thinking: the output
    opens with the reasoning (chat in thinking mode). Raises a 400 naming what cannot compile."""
    if schema is not None:
        if tool_choice in ("required", "function"):
            raise bad_request("response_format: a JSON response_format cannot be combined with tool_choice "
                              f"{'required' if tool_choice == 'required' else 'naming a function'}", "response_format")
        return _compiled(lambda: constraints.json_grammar(schema, thinking), "response_format.json_schema.schema")
    if not tools or tool_choice == "none":
        return None
    if tool_choice == "auto":
        strict = [i for i, t in enumerate(tools) if t["function"].get("strict") is True]
        if not strict:
            return None
        # the parser reads a calls block in the reasoning too, so this grammar spans the whole output
        return _tools_compiled(constraints.auto_tools_grammar(tools), tools, strict)
    chosen = [i for i, t in enumerate(tools) if tool_choice == "required" or t["function"]["name"] == name]
    # in thinking mode the grammar covers the reasoning, in which the parser would also read a calls block
    grammar = constraints.tool_calls_grammar(tools, name if tool_choice == "function" else None, thinking)
    return _tools_compiled(grammar, tools, chosen)


def _tools_compiled(grammar: str, tools: list[dict], constrained: list[int]) -> str:
    """grammar, compiled; else a 400 naming the first parameter of a constrained tool that cannot be enforced."""
    try:
        return constraints.check(grammar)
    except constraints.GrammarError as e:
        for i in constrained:
            params = tools[i]["function"].get("parameters") or {}
            for key, prop in (params.get("properties") or {}).items():
                where = f"tools[{i}].function.parameters.properties.{key}"
                _compiled(lambda: constraints.json_grammar(prop if isinstance(prop, dict) else {}), where)
        raise bad_request(f"tools: the tools' parameters cannot be enforced: {e}", "tools") from None


def _compiled(build: Callable[[], str], where: str) -> str:
    """build()'s grammar, compiled; else a 400 naming `where` (a schema llguidance cannot take or compile)."""
    try:
        return constraints.check(build())
    except constraints.GrammarError as e:
        raise bad_request(f"{where}: cannot be enforced: {e}", where) from None
