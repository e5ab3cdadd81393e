"""DeepSeek-V4.1 completion text -> reasoning, content and tool calls, whole or streamed, as vLLM's DeepSeek V4.1
parser reads it (`vllm/parser/deepseek_v41.py` over `deepseek_v4.py`'s state machine and `parser/engine`).

A state machine over the text; the tags move it, the text between tags belongs to the state:

    reasoning --</think>--> content            reasoning --<｜DSML｜ calls>--> preamble (reasoning ends)
    content   --<think>-->  reasoning          content   --<｜DSML｜ calls>--> preamble
    preamble / between --<｜DSML｜ invoke name="--> name --">--> arguments
    arguments --</｜DSML｜ invoke>--> between   arguments / between --</｜DSML｜ calls>--> content

- Thinking mode starts in reasoning, chat mode in content. `<think>` inside reasoning and `</think>` inside content
  are dropped; the end-of-sentence marker is dropped anywhere. Text in preamble and between is dropped (the
  whitespace between tags). A tool name is the text up to `">`, stripped; a call whose name is empty is dropped.
- Reasoning loses its trailing whitespace (vLLM's strip_trailing_reasoning_whitespace). Content keeps its
  whitespace (the encoder's "\\n\\n" before a calls block included), but content that is only whitespace is
  dropped when the completion made calls (vLLM's drop_whitespace_only_content_before_tools).
- Arguments: `engine.chat.arguments` (vLLM's regex, JSON decoding, unwrapping and schema coercion).
- A completion that ends inside a calls block ends it there: the open call keeps its complete parameters.
Deliberate differences from vLLM: content after a calls block is content here as in vLLM's streaming (its
non-streaming parse has dropped it); an empty calls block returns to content (vLLM would drop the rest of the
output); a repeated parameter keeps its first value (see arguments.py).

Streaming: `feed(text)` returns what became final (`CompletionDelta`): reasoning and content text, and tool-call
deltas in OpenAI's order, a call's index, id and name first (once `">` closes its name), then argument fragments
as its parameters complete. Text that could still be the start of a tag is held back, so no tag text ever reaches
a delta however the text is split, and the deltas of any split join to `parse_completion` of the whole text.
Tool-call ids are `call_<i>_<h>`: i counts this completion's calls from 0, h is the first 12 hex digits of
sha256(id_salt, i, name); pass a per-request `id_salt`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from engine.chat import syntax as s
from engine.chat.arguments import InvokeArguments, tool_properties

INVOKE_PREFIX = s.INVOKE_OPEN + ' name="'
NAME_END = '">'


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    reasoning_content: str | None  # None in chat mode when the model wrote no reasoning
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call `index`: its first delta carries id and name (arguments ""), later ones argument fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionDelta:
    """What one `feed`/`finish` call decided; empty strings and no calls when nothing was."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.reasoning_content or self.content or self.tool_calls)


def parse_completion(
    text: str, thinking: bool, tools: list[dict] | None = None, *, id_salt: str = "", parse_tool_calls: bool = True
) -> ParsedCompletion:
    """Parse a whole completion; never raises on model output. tools: the request's OpenAI tool definitions (their
    parameter schemas coerce argument types). parse_tool_calls=False leaves DSML in the content (tool_choice "none")."""
    parser = CompletionParser(thinking, tools, id_salt=id_salt, parse_tool_calls=parse_tool_calls)
    parser.feed(text)
    parser.finish()
    return parser.result()


_State = Literal["reasoning", "content", "preamble", "name", "arguments", "between"]


@dataclass(slots=True)
class _Call:
    name: str = ""
    args: InvokeArguments | None = None  # None until the name is known
    index: int = -1  # -1: dropped (empty name)
    id: str = ""


@dataclass(slots=True)
class _Out:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)


class CompletionParser:
    """Incremental parser: `feed(delta)` any number of times, then `finish()`, then `result()`."""

    def __init__(self, thinking: bool, tools: list[dict] | None = None, *, id_salt: str = "",
                 parse_tool_calls: bool = True) -> None:
        self._thinking = thinking
        self._properties = tool_properties(tools)
        self._id_salt = id_salt
        self._parse_calls = parse_tool_calls
        self._state: _State = "reasoning" if thinking else "content"
        self._buf = ""  # text of the current state not yet decided (a possible tag start)
        self._reasoning_ws = ""  # trailing whitespace of the reasoning, emitted only if more reasoning follows
        self._content_ws = ""  # whitespace-only content while no other content came: dropped if calls are made
        self._has_content = False
        self._call: _Call | None = None
        self._finished = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._call_args: list[list[str]] = []  # per accepted call, its argument fragments

    def feed(self, text: str) -> CompletionDelta:
        if self._finished:
            raise RuntimeError("CompletionParser.feed after finish")
        out = _Out()
        self._buf += text
        self._advance(out, final=False)
        return self._delta(out)

    def finish(self) -> CompletionDelta:
        """Decide everything left: held text is the state's text, an open calls block ends here."""
        if self._finished:
            raise RuntimeError("CompletionParser.finish called twice")
        self._finished = True
        out = _Out()
        self._advance(out, final=True)
        if self._state in ("name", "arguments"):
            self._end_call(out)
        self._reasoning_ws = ""
        if self._content_ws and not self._calls:
            self._add_content(out, self._content_ws)
        return self._delta(out)

    def result(self) -> ParsedCompletion:
        if not self._finished:
            raise RuntimeError("CompletionParser.result before finish")
        reasoning = "".join(self._reasoning)
        calls = [ToolCall(c.id, c.name, "".join(a)) for c, a in zip(self._calls, self._call_args)]
        return ParsedCompletion(reasoning if self._thinking or reasoning else None, "".join(self._content), calls)

    # ---- the machine --------------------------------------------------------------------------------
    def _tags(self) -> tuple[str, ...]:
        calls = (s.CALLS_OPEN,) if self._parse_calls else ()
        return {
            "reasoning": (s.THINK_END, s.THINK_START, *calls),
            "content": (s.THINK_START, s.THINK_END, *calls),
            "preamble": (INVOKE_PREFIX, s.CALLS_CLOSE),
            "between": (INVOKE_PREFIX, s.CALLS_CLOSE),
            "name": (NAME_END,),
            "arguments": (s.INVOKE_CLOSE, s.CALLS_CLOSE),
        }[self._state] + (s.EOS,)

    def _advance(self, out: _Out, final: bool) -> None:
        while True:
            tags = self._tags()
            start, tag = _first(self._buf, tags)
            if tag is None:
                cut = len(self._buf) - (0 if final else _held_len(self._buf, tags))
                self._text(out, self._buf[:cut], final)
                self._buf = self._buf[cut:]
                return
            self._text(out, self._buf[:start], True)
            self._buf = self._buf[start + len(tag):]
            self._move(out, tag)

    def _move(self, out: _Out, tag: str) -> None:
        state = self._state
        if tag == s.EOS or (state == "reasoning" and tag == s.THINK_START) or (state == "content" and tag == s.THINK_END):
            return  # dropped
        if tag == s.THINK_END:
            self._reasoning_ws, self._state = "", "content"
        elif tag == s.THINK_START:
            self._state = "reasoning"
        elif tag == s.CALLS_OPEN:
            self._reasoning_ws, self._state = "", "preamble"
        elif tag == INVOKE_PREFIX:
            self._call, self._state = _Call(), "name"
        elif tag == NAME_END:
            self._start_call(out)
            self._state = "arguments"
        elif tag == s.INVOKE_CLOSE:
            self._end_call(out)
            self._state = "between"
        else:  # CALLS_CLOSE
            if state == "arguments":
                self._end_call(out)
            self._state = "content"

    def _text(self, out: _Out, text: str, final: bool) -> None:
        """Text of the current state (final: no tag can start inside it)."""
        if not text:
            return
        if self._state == "reasoning":
            text = self._reasoning_ws + text
            body = text.rstrip()
            self._reasoning_ws = text[len(body):]
            if body:
                out.reasoning.append(body)
                self._reasoning.append(body)
        elif self._state == "content":
            if not self._has_content and not text.strip():
                self._content_ws += text
                return
            self._add_content(out, self._content_ws + text)
        elif self._state == "name":
            self._call.name += text
        elif self._state == "arguments" and self._call.args is not None:
            self._call_fragment(out, self._call.args.feed(text))

    def _add_content(self, out: _Out, text: str) -> None:
        self._content_ws, self._has_content = "", True
        out.content.append(text)
        self._content.append(text)

    def _start_call(self, out: _Out) -> None:
        call = self._call
        call.name = call.name.strip()
        if not call.name:
            return  # dropped: its arguments are read and ignored
        call.index = len(self._calls)
        digest = hashlib.sha256(f"{self._id_salt}\0{call.index}\0{call.name}".encode()).hexdigest()
        call.id = f"call_{call.index}_{digest[:12]}"
        call.args = InvokeArguments(self._properties.get(call.name))
        self._calls.append(ToolCall(call.id, call.name, ""))
        self._call_args.append([])
        out.calls.append(ToolCallDelta(call.index, "", call.id, call.name))

    def _end_call(self, out: _Out) -> None:
        if self._state == "name":  # the output ended inside the name: the call takes what there is (as vLLM)
            self._start_call(out)
        if self._call is not None and self._call.args is not None:
            self._call_fragment(out, self._call.args.finish())
        self._call = None

    def _call_fragment(self, out: _Out, fragment: str) -> None:
        if fragment:
            self._call_args[self._call.index].append(fragment)
            out.calls.append(ToolCallDelta(self._call.index, fragment))

    @staticmethod
    def _delta(out: _Out) -> CompletionDelta:
        return CompletionDelta("".join(out.reasoning), "".join(out.content), tuple(out.calls))


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest tag in text (of two at one place, the longer): (position, tag), or (-1, None)."""
    best, found = -1, None
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (found is None or i < best or (i == best and len(tag) > len(found))):
            best, found = i, tag
    return best, found


def _held_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text a later delta
    could turn into that tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
