"""Request bytes -> a JSON object, or an `APIError` that says why not (no Ray, no HTTP framework).

Bounded before anything deep happens to the bytes:
- size: above max_bytes is 413;
- nesting: arrays and objects deeper than MAX_JSON_DEPTH levels are 400, found by a scan of the raw
  bytes before parsing (Python's json recurses per level: 3,000 levels of `[` raise RecursionError);
- text: a string (value or key) holding a lone UTF-16 surrogate (`"\\ud800"` is valid JSON but no
  Unicode text) is 400 naming where it is; the tokenizer and every UTF-8 writer would fail on it.
  Only bodies that spell a surrogate escape are walked: raw UTF-8 cannot carry one (strict decoding
  refuses it), and escaped pairs (`"\\ud83d\\ude00"`) decode to one character.
"""

from __future__ import annotations

import json
import re
from typing import Any

from serve_app.errors import bad_request, payload_too_large

MAX_JSON_DEPTH = 64  # arrays/objects inside one another; tool schemas, the deepest legitimate part, use ~10

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENERS = frozenset(b"[{")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_body(raw: bytes, max_bytes: int) -> dict:
    """Request bytes -> a JSON object. 413 above max_bytes; 400 for nesting deeper than MAX_JSON_DEPTH,
    bad UTF-8/JSON, a lone surrogate in a string, or a non-object."""
    if len(raw) > max_bytes:
        raise payload_too_large(f"request body is {len(raw)} bytes, the limit is {max_bytes}")
    if nests_deeper(raw, MAX_JSON_DEPTH):
        raise bad_request(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
                          f"(the limit is {MAX_JSON_DEPTH})")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"invalid JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_kind(body)}")
    if _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate_at(body)
        if where is not None:
            raise bad_request(f"{where}: contains a lone UTF-16 surrogate, which is not Unicode text (send the "
                              "character as UTF-8 or as a surrogate pair)", where)
    return body


def nests_deeper(raw: bytes, limit: int) -> bool:
    """Whether raw's arrays and objects nest more than `limit` levels deep. Brackets inside strings do
    not count; raw need not be valid JSON (wherever json.loads would get, the scan agrees with it on
    what is a string). O(len(raw)); bodies with at most `limit` brackets return at once."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for b in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET):
        depth += 1 if b in _OPENERS else -1
        if depth > limit:
            return True
    return False


def lone_surrogate_at(value: Any, where: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string or key holding a lone surrogate, else None.
    A key at fault is written with its surrogates escaped, so the path itself is valid text."""
    if isinstance(value, str):
        return (where or "the request body") if _SURROGATE.search(value) else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_at(item, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            if _SURROGATE.search(key):
                return path.encode("utf-8", "backslashreplace").decode("utf-8")
            found = lone_surrogate_at(item, path)
            if found is not None:
                return found
    return None


def json_kind(value: object) -> str:
    """'an object', 'an array', ... for error messages."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
