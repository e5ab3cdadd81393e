"""DeepSeek-V4.1 completion text -> reasoning, content and tool calls, whole or streamed.

Grammar of a completion (what follows the prompt's `<｜Assistant｜><think>` or `…</think>`):

    [reasoning "</think>"]   content   ["\\n\\n" calls-block   content]*   ["<｜end▁of▁sentence｜>"]

- Thinking mode: reasoning runs to the first `</think>`; without one, everything is reasoning.
- A calls block, as the reference encoder writes it (whitespace between tags is free):
      <｜DSML｜ calls>
      <｜DSML｜ invoke name="f">
      <｜DSML｜ parameter name="k" string="true">raw text</｜DSML｜ parameter>
      <｜DSML｜ parameter name="n" string="false">JSON</｜DSML｜ parameter>
      </｜DSML｜ invoke>
      </｜DSML｜ calls>
  Each invoke becomes a ToolCall whose `arguments` is a JSON object text: string="true" values as
  JSON strings, string="false" values decoded as JSON (the raw text as a string if they are not
  valid JSON). The "\\n\\n" before the block is the encoder's separator, not content.
- A block that is malformed (a tag out of place, a duplicate parameter) or never closed is content,
  verbatim. Only a trailing end-of-sentence marker is removed.
- Tool-call ids are `call_<i>_<h>`: i counts the calls of this completion from 0, h is the first 12
  hex digits of sha256(id_salt, i, name, arguments). The same completion always gets the same ids;
  pass a per-request `id_salt` to keep ids of identical calls in different turns apart.

`CompletionParser` consumes text deltas and returns the newly decided reasoning/content text and
completed tool calls. A delta is only emitted once no continuation could change it (a possible
`</think>`, separator or marker prefix is held back; a calls block is held until it closes), so the
concatenated deltas equal `parse_completion` of the whole text for every chunking.
`parse_completion` is the same machine fed once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.chat import syntax as s


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    reasoning_content: str | None  # None in chat mode
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class CompletionDelta:
    """What one `feed`/`finish` call decided; empty strings and no calls when nothing was."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.reasoning_content or self.content or self.tool_calls)


def parse_completion(
    text: str, thinking: bool, tools: list[dict] | None = None, *, id_salt: str = ""
) -> ParsedCompletion:
    """Parse a whole completion. Never raises on model output: malformed DSML stays content.

    tools: the request's OpenAI tool definitions; used to undo an {"arguments": {...}} or
    {"input": {...}} wrapper around a call's real arguments when the tool declares no such parameter."""
    parser = CompletionParser(thinking, tools, id_salt=id_salt)
    parser.feed(text)
    parser.finish()
    return parser.result()


_State = Literal["reasoning", "content", "calls"]


class CompletionParser:
    """Incremental parser: `feed(delta)` any number of times, then `finish()`, then `result()`."""

    def __init__(self, thinking: bool, tools: list[dict] | None = None, *, id_salt: str = "") -> None:
        self._thinking = thinking
        self._properties = _tool_properties(tools)
        self._id_salt = id_salt
        self._state: _State = "reasoning" if thinking else "content"
        self._eos_tail = ""  # a possible trailing end-of-sentence marker, not yet passed on
        self._buf = ""  # text passed on but not yet decided
        self._separator = ""  # the "\n\n" taken off before the open calls block
        self._scanner = _CallsScanner()  # the open calls block's scan so far
        self._finished = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> CompletionDelta:
        if self._finished:
            raise RuntimeError("CompletionParser.feed after finish")
        pending = self._eos_tail + text
        keep = _held_len(pending, (s.EOS,), whole=True)
        self._eos_tail = pending[len(pending) - keep :]
        return self._advance(pending[: len(pending) - keep], final=False)

    def finish(self) -> CompletionDelta:
        """Decide everything left: an unclosed calls block becomes content."""
        if self._finished:
            raise RuntimeError("CompletionParser.finish called twice")
        self._finished = True
        tail = self._eos_tail.removesuffix(s.EOS)
        return self._advance(tail, final=True)

    def result(self) -> ParsedCompletion:
        if not self._finished:
            raise RuntimeError("CompletionParser.result before finish")
        return ParsedCompletion(
            reasoning_content="".join(self._reasoning) if self._thinking else None,
            content="".join(self._content),
            tool_calls=list(self._calls),
        )

    def _advance(self, text: str, final: bool) -> CompletionDelta:
        self._buf += text
        marks = (len(self._reasoning), len(self._content), len(self._calls))
        while True:
            buf = self._buf
            if self._state == "reasoning":
                end = buf.find(s.THINK_END)
                if end < 0:
                    cut = len(buf) - (0 if final else _held_len(buf, (s.THINK_END,)))
                    self._reasoning.append(buf[:cut])
                    self._buf = buf[cut:]
                    break
                self._reasoning.append(buf[:end])
                self._buf = buf[end + len(s.THINK_END) :]
                self._state = "content"
            elif self._state == "content":
                start = buf.find(s.CALLS_OPEN)
                if start < 0:
                    markers = (s.CALLS_SEPARATOR + s.CALLS_OPEN, s.CALLS_OPEN)
                    cut = len(buf) - (0 if final else _held_len(buf, markers))
                    self._content.append(buf[:cut])
                    self._buf = buf[cut:]
                    break
                before = buf[:start]
                self._separator = s.CALLS_SEPARATOR if before.endswith(s.CALLS_SEPARATOR) else ""
                self._content.append(before[: len(before) - len(self._separator)])
                self._buf = buf[start:]
                self._scanner = _CallsScanner()
                self._state = "calls"
            else:
                status = self._scanner.scan(buf)
                if status == "open" and not final:
                    break
                if status == "closed":
                    for name, args in self._scanner.invokes:
                        self._calls.append(self._tool_call(len(self._calls), name, args))
                    self._buf = buf[self._scanner.pos :]
                else:  # malformed, or still open at the end: the text is content after all
                    self._content.append(self._separator + s.CALLS_OPEN)
                    self._buf = buf[len(s.CALLS_OPEN) :]
                self._state = "content"
        return CompletionDelta(
            "".join(self._reasoning[marks[0] :]),
            "".join(self._content[marks[1] :]),
            tuple(self._calls[marks[2] :]),
        )

    def _tool_call(self, index: int, name: str, args: dict[str, Any]) -> ToolCall:
        arguments = json.dumps(_unwrap_arguments(args, self._properties.get(name)), ensure_ascii=False)
        digest = hashlib.sha256(f"{self._id_salt}\0{index}\0{name}\0{arguments}".encode()).hexdigest()
        return ToolCall(id=f"call_{index}_{digest[:12]}", name=name, arguments=arguments)


def _held_len(text: str, markers: Sequence[str], whole: bool = False) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (or the
    whole marker, with whole=True): text that a later delta could turn into that marker."""
    best = 0
    for marker in markers:
        longest = min(len(text), len(marker) if whole else len(marker) - 1)
        for n in range(longest, best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


_Status = Literal["closed", "open", "malformed"]


class _CallsScanner:
    """Scan of one calls block, resumed where it stopped each time the block's text has grown.

    `scan(text)` takes the block's text so far (starting with `<｜DSML｜ calls>`, each call an
    extension of the previous one). It says "open" only while the text is still a prefix of a
    well-formed block, and "malformed" only at a character that no well-formed block has there, so
    the outcome for a prefix never contradicts the outcome for the whole text. Text before `pos` is
    decided: complete tags and parameters, or (inside a value) text known not to hold its end tag."""

    __slots__ = ("pos", "invokes", "invoke", "value")

    def __init__(self) -> None:
        self.pos = len(s.CALLS_OPEN)
        self.invokes: list[tuple[str, dict[str, Any]]] = []  # complete invokes: (name, arguments)
        self.invoke: tuple[str, dict[str, Any]] | None = None  # the open invoke
        self.value: tuple[str, bool, int] | None = None  # the open parameter: (key, is_string, start)

    def scan(self, text: str) -> _Status:
        while True:
            if self.value is not None:
                key, is_string, start = self.value
                close = text.find(s.PARAM_CLOSE, self.pos)
                if close < 0:
                    self.pos = max(start, len(text) - len(s.PARAM_CLOSE) + 1)
                    return "open"
                raw = text[start:close]
                self.invoke[1][key] = raw if is_string else _json_or_raw(raw)
                self.value = None
                self.pos = close + len(s.PARAM_CLOSE)
            elif self.invoke is not None:
                pos = _skip_space(text, self.pos)
                end = _literal(text, pos, s.INVOKE_CLOSE)
                if end >= 0:
                    self.invokes.append(self.invoke)
                    self.invoke = None
                    self.pos = end
                    continue
                pos = _literal(text, pos, s.PARAM_OPEN + ' name="')
                if pos < 0:
                    return _stuck(end, pos)
                pos, key = _name(text, pos, '" string="')
                if pos < 0 or key in self.invoke[1]:  # the reference rejects a repeated parameter
                    return _stuck(pos)
                is_string, is_json = _literal(text, pos, 'true">'), _literal(text, pos, 'false">')
                if is_string < 0 and is_json < 0:
                    return _stuck(is_string, is_json)
                self.pos = max(is_string, is_json)
                self.value = (key, is_string >= 0, self.pos)
            else:
                pos = _skip_space(text, self.pos)
                end = _literal(text, pos, s.CALLS_CLOSE)
                if end >= 0:
                    self.pos = end
                    return "closed"
                pos = _literal(text, pos, s.INVOKE_OPEN + ' name="')
                if pos < 0:
                    return _stuck(end, pos)
                pos, name = _name(text, pos, '">')
                if pos < 0:
                    return _stuck(pos)
                self.invoke = (name, {})
                self.pos = pos


# Scanner positions below 0 are outcomes, not positions.
_OPEN = -1  # the text ended where a well-formed block could still continue
_BAD = -2  # the text cannot be part of a well-formed block


def _stuck(*codes: int) -> _Status:
    """The outcome when no alternative matched: open if any of them could still match."""
    return "open" if _OPEN in codes else "malformed"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _literal(text: str, pos: int, literal: str) -> int:
    """The position after `literal` at `pos`; _OPEN if the text ends inside it; _BAD otherwise."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    return _OPEN if literal.startswith(text[pos:]) else _BAD


def _name(text: str, pos: int, terminator: str) -> tuple[int, str]:
    """A tool or parameter name (non-empty; no quote, <, > or newline) followed by `terminator`,
    which starts with the closing quote. Returns (position after the terminator, name)."""
    end = pos
    while end < len(text) and text[end] not in '"<>\n':
        end += 1
    if end == len(text):
        return _OPEN, ""
    if end == pos:
        return _BAD, ""
    return _literal(text, end, terminator), text[pos:end]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_or_raw(value: str) -> Any:
    """A string="false" value: decoded JSON, or the raw text if it is not valid (strict) JSON."""
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError:
        return value


def _tool_properties(tools: list[dict] | None) -> dict[str, set[str]]:
    """Tool name -> its declared parameter names (only tools whose schema lists properties)."""
    out: dict[str, set[str]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(props, dict):
            out[function["name"]] = set(props)
    return out


def _unwrap_arguments(args: dict[str, Any], properties: set[str] | None) -> dict[str, Any]:
    """{"arguments": X} or {"input": X} -> X, when the tool declares no such parameter and X (or the
    JSON it holds) is an object with only declared keys. The encoder writes non-object arguments
    of a history turn that way, so a model may imitate it."""
    if not properties or len(args) != 1:
        return args
    (key, inner), = args.items()
    if key not in ("arguments", "input") or key in properties:
        return args
    if isinstance(inner, str):
        try:
            inner = json.loads(inner)
        except ValueError:
            return args
    if isinstance(inner, dict) and set(inner) <= properties:
        return inner
    return args
