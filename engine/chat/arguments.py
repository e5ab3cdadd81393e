"""A DSML invoke's parameters -> its arguments JSON, incrementally, as vLLM's DeepSeek V4.1 parser builds them.

vLLM (`parser/deepseek_v4.py`: `_dsml_arg_converter`, `_unwrap_wrapper_args`; `parser/engine/parser_engine.py`:
`_fix_arg_types`; `tool_parsers/utils.py`: `coerce_to_schema_type`) reads an invoke's raw text with one regex:
a parameter is `<｜DSML｜ parameter name="k" string="true|false">value` ended by its close tag or by the next
parameter's start; anything between parameters is ignored. A string="true" value is the raw text; a string="false"
value is decoded JSON, or the raw text when it is not JSON. Then a lone {"arguments": X} or {"input": X} whose key
the tool does not declare is unwrapped to X (an object of declared keys), and every top-level value whose key the
tool's schema declares is coerced to the schema's types (integer, number, boolean, null, object, array, in that
order of preference; string keeps the text). The arguments are `json.dumps(args, ensure_ascii=False)`.

Streaming (`InvokeArguments.feed`) gives the same JSON in fragments, each final: `{"k": v` when the first parameter
is complete, `, "k": v` for each later one, `}` when the invoke ends; the fragments join to `arguments()`. Two
choices make every fragment final, where vLLM may stream a prefix it later contradicts:
- A parameter is emitted once complete (its close tag, or the next parameter's start, has arrived); a parameter
  still open when the output ends is dropped, as vLLM's final conversion drops it.
- A repeated key keeps its first value (vLLM's dict keeps the last; the reference encoder rejects the repeat).
- A possible wrapper (a first key "arguments"/"input" the tool does not declare) is held until the invoke ends.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from engine.chat import syntax as s

_PARAM_RE = re.compile(
    re.escape(s.PARAM_OPEN) + r'\s+name="([^"]+)"\s+string="(true|false)">(.*?)'
    r"(?:" + re.escape(s.PARAM_CLOSE) + r"|(?=" + re.escape(s.PARAM_OPEN) + r"\s+name=))",
    re.DOTALL,
)
_WRAPPERS = ("arguments", "input")
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string", "int": "integer",
    "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer", "uint64": "integer",
    "long": "integer", "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
    "float64": "number", "double": "number", "bool": "boolean", "dict": "object", "arr": "array", "list": "array",
    "sequence": "array",
}
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def tool_properties(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters' `properties` (only tools whose schema lists some)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(props, dict) and props:
            out[function["name"]] = props
    return out


class InvokeArguments:
    """One invoke's arguments, built from its raw text (everything between `name="f">` and its end) as it grows.
    properties: the tool's declared properties (None: an unknown tool, or one that declares none)."""

    def __init__(self, properties: dict[str, Any] | None) -> None:
        self._properties = properties
        self._raw = ""
        self._scanned = 0  # raw text before this is decided (complete parameters, or text between them)
        self._args: dict[str, Any] = {}
        self._num_emitted = 0  # parameters already streamed
        self._json: list[str] = []  # the fragments streamed so far
        self._keeps_wrapper = False  # the invoke ended with one wrapper key that does not unwrap

    def feed(self, text: str) -> str:
        """More of the invoke's raw text; returns the arguments JSON fragment now final ("" if none)."""
        self._raw += text
        for m in _PARAM_RE.finditer(self._raw, self._scanned):
            key, is_string, value = m.group(1), m.group(2) == "true", m.group(3)
            if key not in self._args:  # a repeated key keeps its first value
                self._args[key] = value if is_string else _json_or_raw(value)
            self._scanned = m.end()
        if self._may_unwrap():
            return ""
        keys = list(self._args)[self._num_emitted:]
        self._num_emitted += len(keys)
        parts = [(", " if self._json or i else "{") + _pair(k, self._coerced(k, self._args[k]))
                 for i, k in enumerate(keys)]
        return self._emit("".join(parts))

    def finish(self) -> str:
        """The invoke ended (its close tag, or the output's end): the rest of the JSON."""
        if self._may_unwrap():
            inner = _unwrapped(self._args, self._properties)
            if inner is not None:
                args = {k: _coerce(v, self._properties.get(k)) for k, v in inner.items()}
                return self._emit(json.dumps(args, ensure_ascii=False))
            self._keeps_wrapper = True
        rest = self.feed("")  # the held wrapper that did not unwrap (nothing otherwise)
        return rest + self._emit("}" if self._json else "{}")

    def arguments(self) -> str:
        return "".join(self._json)

    def _emit(self, fragment: str) -> str:
        if fragment:
            self._json.append(fragment)
        return fragment

    def _may_unwrap(self) -> bool:
        """The arguments so far are one undeclared wrapper key, still undecided (held, not streamed)."""
        if self._keeps_wrapper or self._num_emitted or len(self._args) != 1 or self._properties is None:
            return False
        key = next(iter(self._args))
        return key in _WRAPPERS and key not in self._properties

    def _coerced(self, key: str, value: Any) -> Any:
        return value if self._properties is None else _coerce(value, self._properties.get(key))


def _pair(key: str, value: Any) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_or_raw(value: str) -> Any:
    """A string="false" value: decoded JSON, or the raw text if it is not valid (strict) JSON."""
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError:
        return value


def _unwrapped(args: dict[str, Any], properties: dict[str, Any]) -> dict[str, Any] | None:
    """{"arguments": X} or {"input": X} -> X when X (or the JSON text it holds) is an object of declared keys."""
    ((_, inner),) = args.items()
    if isinstance(inner, str):
        try:
            inner = json.loads(inner, parse_constant=_reject_constant)
        except ValueError:
            return None
    return inner if isinstance(inner, dict) and set(inner) <= set(properties) else None


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a property schema allows: its type(s), its enum values' types, anyOf/oneOf/allOf's; else string."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    types.update([kind] if isinstance(kind, str) else [t for t in kind if isinstance(t, str)] if isinstance(kind, list)
                 else [])
    for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        types.add("null" if value is None else "boolean" if isinstance(value, bool) else "integer"
                  if isinstance(value, int) else "number" if isinstance(value, float) else "string"
                  if isinstance(value, str) else "array" if isinstance(value, list) else "object")
    for choice in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choice), list):
            for sub in schema[choice]:
                types |= _schema_types(sub)
    return types or {"string"}


def _is_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_is_finite(v) for v in value.values())
    return True


def _coerce_text(text: str, types: set[str]) -> Any:
    """vLLM's coerce_to_schema_type: the first of _TYPE_ORDER that the schema allows and the text parses as."""
    allowed = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in (k for k in _TYPE_ORDER if k in allowed):
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "string":
            return text
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        if kind == "boolean" and text.lower().strip() in ("true", "1", "false", "0"):
            return text.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if _is_finite(parsed):
                return parsed
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if _is_finite(parsed) else text


def _coerce(value: Any, schema: Any) -> Any:
    """A value coerced to its property schema (None: undeclared, kept). Objects and arrays are coerced member by
    member where the schema declares properties / items; any other non-text value goes through its JSON text."""
    if schema is None:
        return value
    if isinstance(value, str):
        return _coerce_text(value, _schema_types(schema))
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema, dict) else None
        return {k: _coerce(v, props.get(k)) for k, v in value.items()} if isinstance(props, dict) else value
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema, dict) else None
        return [_coerce(v, items) for v in value] if isinstance(items, dict) else value
    coerced = _coerce_text(json.dumps(value), _schema_types(schema))
    return coerced if type(coerced) is not type(value) or coerced != value else value
