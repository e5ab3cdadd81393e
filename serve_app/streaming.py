"""Generated token ids -> the text and OpenAI deltas of one choice, incrementally (no Ray, no HTTP).

Pipeline per choice: token ids -> `IncrementalDetokenizer` (whole UTF-8 characters only) ->
`StopChecker` (holds back a possible stop-string start, cuts at a hit) -> for chat,
`engine.chat.CompletionParser` (reasoning / content / DSML tool calls) -> delta dicts.

Choices made here:
- skip_special_tokens (default true, as vLLM): tokens the tokenizer flags special (`<｜place▁holder▁no▁N｜>`, BOS,
  `<｜System｜>`) are not text. V4.1's chat tags (`<think>`, `</think>`, `｜DSML｜`, `<｜User｜>`) are added tokens
  but not special, so the parser always reads them. spaces_between_special_tokens (default true) is accepted as
  vLLM accepts it: its fast detokenizer (tokenizers' DecodeStream) writes no space between added tokens of this
  byte-level tokenizer either way, and neither does this one. The end-of-sentence token and the request's
  stop_token_ids are not text whatever is asked: they end the output, are counted as generated tokens, and are
  never shown (vLLM's default).
- Stop strings apply to the raw completion text, reasoning and DSML included (as vLLM does). The
  text is cut before the earliest hit; tokens after the hitting one are not consumed, and the caller
  should abort the engine request once `is_stopped`.
- Reasoning tokens (usage.completion_tokens_details.reasoning_tokens): in thinking mode, the tokens
  consumed up to and including the one whose text completes the first `</think>` (all of them when
  it never comes); 0 in chat mode.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from engine.chat import CompletionDelta, CompletionParser
from engine.chat import syntax

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _byte_of_char() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2's bytes_to_unicode): token char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()


class TokenStrings:
    """A token's text (`decode([id])`; a partial UTF-8 character shows as U+FFFD) and its exact bytes,
    for logprobs. Cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
        self._text: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self._tokenizer.decode([token_id])
        return self._text[token_id]

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            if token_id in self._added:
                raw = self._added[token_id].encode("utf-8")
            else:
                piece = self._tokenizer.id_to_token(token_id) or ""
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
            self._bytes[token_id] = raw
        return self._bytes[token_id]


class IncrementalDetokenizer:
    """Token ids in, text out, never a partial character: the concatenated outputs of `add` and
    `finish` equal `tokenizer.decode(all ids)` exactly.

    Invariant: `_pending` starts at a character boundary and `_num_emitted` characters of its decode
    have been returned. A decode that ends in U+FFFD may end in an incomplete character, so that run is
    held back; once a decode ends in a whole character the pending ids are dropped, and since lossy
    UTF-8 decoding restarts cleanly after a whole character, later text decodes as it would in full."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._pending: list[int] = []
        self._num_emitted = 0

    def add(self, token_ids: Iterable[int]) -> str:
        self._pending.extend(token_ids)
        if not self._pending:
            return ""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip)
        safe = text.rstrip("\ufffd")
        out = safe[self._num_emitted :]
        if len(safe) == len(text):
            self._pending.clear()
            self._num_emitted = 0
        else:
            self._num_emitted = len(safe)
        return out

    def finish(self) -> str:
        """The held-back text (U+FFFD for a character that never completed)."""
        text = self._tokenizer.decode(self._pending, self._skip)[self._num_emitted :] if self._pending else ""
        self._pending.clear()
        self._num_emitted = 0
        return text


def _held_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class StopChecker:
    """Cuts streamed text before the first stop string to be completed: the occurrence that ends
    earliest (of two ending together, the longer), which is what any chunking of the text sees first.

    `feed` returns the text that is safe to emit: everything except a suffix that could still grow into
    a stop string. After a hit it returns the text before the stop string, `is_hit` becomes True and
    later calls return "". `finish` releases the held suffix when no hit came."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.is_hit = False

    def feed(self, text: str) -> str:
        if self.is_hit:
            return ""
        buf = self._held + text
        hits = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self._stop) if i >= 0]
        if hits:
            self.is_hit, self._held = True, ""
            return buf[: min(hits)[1]]
        keep = _held_len(buf, self._stop)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        out, self._held = self._held, ""
        return out


class _TokenText:
    """The shared front of both streams: stop ids dropped, detokenized, cut at stop strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], stop_token_ids: Iterable[int],
                 skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = StopChecker(stop)
        self.stop_ids = frozenset(stop_token_ids) | {tokenizer.eos_id}

    def raw(self, token_id: int) -> str:
        return "" if token_id in self.stop_ids else self.detok.add((token_id,))

    def flush(self) -> str:
        """Everything left once generation ended (no stop-string hit is possible after this)."""
        text = self.stop.feed(self.detok.finish())
        return text + self.stop.finish() if not self.stop.is_hit else text


def _finish_reason(stopped: bool, engine_reason: str | None) -> str:
    return "stop" if stopped or engine_reason is None else engine_reason


class ChatChoiceStream:
    """One chat choice: `feed(token_ids)` per engine chunk and `finish(engine_reason)` once return
    OpenAI delta dicts, in order: {"role": "assistant", "content": ""} first, then
    {"reasoning_content": ...}, {"content": ...} (consecutive ones of a kind merged) and tool calls as OpenAI
    streams them: {"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}
    once a call's name is read, then {"tool_calls": [{"index", "function": {"arguments": fragment}}]} as its
    parameters complete (consecutive fragments of a call merged). Deltas of a kind concatenate to the fields of
    `message()`, a call's argument fragments to its arguments.

    tools / parse_tool_calls: what `CompletionParser` is given; parse_tool_calls=False (tool_choice
    "none") leaves DSML in the content. id_salt: per request and choice, so tool-call ids differ
    between turns. finish_reason: "tool_calls" when the choice made calls and stopped normally,
    "stop" on a stop string, else the engine's reason."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        thinking: bool,
        tools: list[dict] | None = None,
        parse_tool_calls: bool = True,
        stop: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        id_salt: str = "",
        skip_special_tokens: bool = True,
    ) -> None:
        self._text = _TokenText(tokenizer, stop, stop_token_ids, skip_special_tokens)
        self._thinking = thinking
        self._parser = CompletionParser(thinking, tools, id_salt=id_salt, parse_tool_calls=parse_tool_calls)
        self._in_reasoning = thinking
        self._think_tail = ""
        self._started = False
        self._num_calls = 0
        self.num_tokens = 0  # tokens consumed (stop ids included, tokens after a stop-string hit not)
        self.num_reasoning_tokens = 0
        self.finish_reason: str | None = None  # set by finish()

    @property
    def is_stopped(self) -> bool:
        """A stop string was hit: feed() ignores further tokens; call finish()."""
        return self._text.stop.is_hit

    def feed(self, token_ids: Iterable[int]) -> list[dict]:
        if self.finish_reason is not None:
            raise RuntimeError("ChatChoiceStream.feed after finish")
        deltas = self._start()
        for token_id in token_ids:
            if self.is_stopped:
                break
            self.num_tokens += 1
            self.num_reasoning_tokens += self._in_reasoning
            raw = self._text.raw(token_id)
            self._track_reasoning(raw)
            self._emit(deltas, self._parser.feed(self._text.stop.feed(raw)))
        return deltas

    def finish(self, engine_reason: str | None) -> list[dict]:
        """The last deltas; sets `finish_reason`. engine_reason: the last chunk's finish_reason (None
        when the stream ended on a stop string and the engine request was aborted)."""
        if self.finish_reason is not None:
            raise RuntimeError("ChatChoiceStream.finish called twice")
        deltas = self._start()
        self._emit(deltas, self._parser.feed(self._text.flush()))
        self._emit(deltas, self._parser.finish())
        reason = _finish_reason(self.is_stopped, engine_reason)
        self.finish_reason = "tool_calls" if self._num_calls and reason == "stop" else reason
        return deltas

    def message(self) -> dict:
        """The non-streaming `message`: content (None when empty and there are tool calls),
        reasoning_content (thinking mode, or when the model opened `<think>`), tool_calls (when any)."""
        if self.finish_reason is None:
            raise RuntimeError("ChatChoiceStream.message before finish")
        parsed = self._parser.result()
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content if parsed.content or not parsed.tool_calls else None,
        }
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
        return message

    def _start(self) -> list[dict]:
        if self._started:
            return []
        self._started = True
        return [{"role": "assistant", "content": ""}]

    def _track_reasoning(self, raw: str) -> None:
        if not self._in_reasoning:
            return
        seen = self._think_tail + raw
        if syntax.THINK_END in seen:
            self._in_reasoning = False
        self._think_tail = seen[-(len(syntax.THINK_END) - 1) :]

    def _emit(self, deltas: list[dict], delta: CompletionDelta) -> None:
        for key, text in (("reasoning_content", delta.reasoning_content), ("content", delta.content)):
            if not text:
                continue
            if deltas and deltas[-1].keys() == {key}:
                deltas[-1][key] += text
            else:
                deltas.append({key: text})
        for call in delta.tool_calls:
            last = deltas[-1]["tool_calls"][0] if deltas and deltas[-1].keys() == {"tool_calls"} else None
            if call.id is not None:
                self._num_calls += 1
                deltas.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": call.arguments}}]})
            elif last is not None and last["index"] == call.index and "id" not in last:
                last["function"]["arguments"] += call.arguments
            else:
                deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})


class CompletionChoiceStream:
    """One /v1/completions choice: plain text. `feed` and `finish` return the new text; `text` is
    all of it; finish_reason "stop" on a stop string, else the engine's."""

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (), stop_token_ids: Iterable[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._text = _TokenText(tokenizer, stop, stop_token_ids, skip_special_tokens)
        self._parts: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self._text.stop.is_hit

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, token_ids: Iterable[int]) -> str:
        if self.finish_reason is not None:
            raise RuntimeError("CompletionChoiceStream.feed after finish")
        out = []
        for token_id in token_ids:
            if self.is_stopped:
                break
            self.num_tokens += 1
            out.append(self._text.stop.feed(self._text.raw(token_id)))
        self._parts.extend(out)
        return "".join(out)

    def finish(self, engine_reason: str | None) -> str:
        if self.finish_reason is not None:
            raise RuntimeError("CompletionChoiceStream.finish called twice")
        out = self._text.flush()
        self._parts.append(out)
        self.finish_reason = _finish_reason(self.is_stopped, engine_reason)
        return out
