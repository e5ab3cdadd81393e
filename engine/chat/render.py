"""OpenAI chat-completions messages -> DeepSeek-V4.1 prompt text.

Follows the V4.1 reference encoder (DeepSeek's `encoding/encoding.py`, as adapted in vLLM's
`tokenizers/deepseek_v41_encoding.py` with the request handling of `tokenizers/deepseek_v41.py`):

1. Validate and normalise: text parts of a list `content` are joined with "\\n\\n"; `reasoning` is
   accepted as an alias of `reasoning_content`. A user message's `image_url` parts become the image
   placeholder `<｜deepseek_image｜>` where they stand (joined with "\\n\\n" like text parts; the engine
   expands each to its image's span, engine/vision/layout.py); other roles take text only.
2. `tools` go into the first system message (an empty one is inserted at index 0 if there is none).
3. Tool messages become `<tool_result>…</tool_result>` blocks of a user turn; consecutive user and
   tool messages form one turn, its blocks joined with "\\n\\n"; a turn's tool results are put in the
   order of the calls of the assistant message before it.
4. Thinking mode with `drop_thinking` (forced off when tools are present): before the last user turn,
   assistant reasoning is dropped and developer messages are dropped entirely (as the reference does).
5. Render turn by turn. The reasoning-effort line opens the prompt (thinking mode only). An assistant
   header `<｜Assistant｜>` + `<think>` / `</think>` follows every user / developer / mid-conversation
   system turn that an assistant or latest_reminder turn follows, and the last turn when it is a user,
   developer, system or assistant turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.chat import syntax as s

# The released encoder (and the spec) map low/high/max to 50/75/100; "xhigh" is kept as an alias of
# high, as vLLM does. (vLLM's vendored pre-release table, 25/50/75/100, is stale.) OpenAI's "minimal" and
# "medium" have no V4.1 preset: each takes the released preset it sits on (minimal -> low's 50, medium ->
# high's 75), as DeepSeek's API treats its in-between names. "none" is chat mode (no reasoning).
EFFORT_PRESETS: dict[str, int] = {"minimal": 50, "low": 50, "medium": 75, "high": 75, "xhigh": 75, "max": 100}
# Every accepted name, in the order OpenAI ranks them, then V4.1's own "max".
EFFORT_NAMES: tuple[str, ...] = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# reasoning_effort=None does what the reference does without one: thinking mode with preset "high".
DEFAULT_EFFORT = "high"
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

TurnRole = Literal["system", "developer", "user", "assistant", "latest_reminder"]


class ChatFormatError(ValueError):
    """A request the V4.1 chat format cannot express. The message starts with the offending field
    (`messages[2].role: …`); the API layer turns it into a 400."""


@dataclass(slots=True)
class _Block:
    """One part of a user turn: plain text, or a tool result (`tool_call_id` set); a user message with images
    holds its parts in order (`parts`, text as literals and image placeholders as template parts)."""

    text: str
    tool_call_id: str | None = None
    parts: list[s.PromptPart] | None = None


@dataclass(slots=True)
class _Turn:
    role: TurnRole
    text: str = ""  # system / developer / latest_reminder / assistant content
    blocks: list[_Block] = field(default_factory=list)  # user turns only
    reasoning: str = ""  # assistant only
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (id, name, arguments)
    tools: list[dict[str, Any]] | None = None  # function schemas; the first system turn only


def is_thinking(reasoning_effort: str | int | None) -> bool:
    """Whether `render_chat` opens the assistant turn with `<think>` for this effort."""
    return _effort_budget(reasoning_effort) is not None


def render_chat_parts(
    messages: list[dict],
    tools: list[dict] | None = None,
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
) -> list[s.PromptPart]:
    """`render_chat`'s prompt as parts: the template's text, and the request's text (every message
    content, reasoning, tool schema, call name and argument) as literal parts, which the tokenizer
    encodes as plain text (`Tokenizer.encode_parts`): a message spelling `<｜end▁of▁sentence｜>`,
    `<｜User｜>` or a DSML tag can neither end its turn nor write a tool call."""
    budget = _effort_budget(reasoning_effort)
    functions = _validate_tools(tools)
    if not isinstance(messages, list):
        raise ChatFormatError(f"messages: must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatFormatError("messages: must not be empty")

    turns = _merge_tool_results(_normalize(messages))
    if functions:
        system = next((t for t in turns if t.role == "system"), None)
        if system is None:
            system = _Turn("system")
            turns.insert(0, system)
        system.tools = functions
    drop = drop_thinking and not functions
    if budget is not None and drop:
        turns = _drop_developer_turns(turns)
    return _render_turns(turns, budget, drop)


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
) -> str:
    """The full prompt text: BOS, the turns, and the assistant header that generation continues from
    (none after a final latest_reminder message: the reference writes the reminder after the header).

    reasoning_effort: "none" -> chat mode (`<｜Assistant｜></think>`); "minimal"/"low"/"medium"/"high"/"xhigh"/
    "max" (50/50/75/75/75/100) or an int 1-100 -> thinking mode (`<｜Assistant｜><think>`) with the effort line
    "Reasoning Effort: N (…)" at the start; None -> "high". Raises ChatFormatError on invalid input.
    To tokenize a prompt, render its parts (`render_chat_parts`) instead: the text alone cannot tell the
    template's special tokens from the same spellings inside a message."""
    return s.joined(render_chat_parts(messages, tools, reasoning_effort, drop_thinking))


def _effort_budget(effort: object) -> int | None:
    """None for chat mode, else the 1-100 budget written into the prompt."""
    if effort is None:
        effort = DEFAULT_EFFORT
    if isinstance(effort, str):
        if effort == "none":
            return None
        if effort in EFFORT_PRESETS:
            return EFFORT_PRESETS[effort]
    elif type(effort) is int and 1 <= effort <= 100:  # not bool
        return effort
    raise ChatFormatError(
        f"reasoning_effort: must be {'/'.join(EFFORT_NAMES)} or an integer 1-100, got {effort!r}"
    )


def _validate_tools(tools: object) -> list[dict[str, Any]]:
    """OpenAI tool definitions -> their `function` objects (an empty list for None)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError(f"tools: must be a list, got {type(tools).__name__}")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ChatFormatError(f"{where}: must be an object")
        if tool.get("type", "function") != "function":
            raise ChatFormatError(f"{where}.type: unsupported tool type {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ChatFormatError(f"{where}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"{where}.function.name: must be a non-empty string")
        try:
            s.to_json(function)
        except (TypeError, ValueError) as e:
            raise ChatFormatError(f"{where}.function: not JSON-serialisable ({e})") from None
        functions.append(function)
    return functions


def _text(content: object, where: str, *, allow_none: bool = False) -> str:
    """A message `content` (string, or list of text parts) -> one string."""
    if isinstance(content, str):
        return content
    if content is None and allow_none:
        return ""
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatFormatError(f"{where}[{j}]: must be an object")
        if part.get("type") == "image_url":
            raise ChatFormatError(f"{where}[{j}].type: image_url parts are accepted in user messages only")
        if part.get("type") != "text":
            raise ChatFormatError(f"{where}[{j}].type: unsupported content part type {part.get('type')!r}")
        if not isinstance(part.get("text"), str):
            raise ChatFormatError(f"{where}[{j}].text: must be a string")
        texts.append(part["text"])
    return "\n\n".join(texts)


def _user_block(content: object, where: str) -> _Block:
    """A user message's content; with image_url parts (their URLs are the API layer's business), its parts."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return _Block(_text(content, where))
    parts: list[s.PromptPart] = []
    for j, part in enumerate(content):
        if parts:
            parts.append(s.template("\n\n"))
        if isinstance(part, dict) and part.get("type") == "image_url":
            parts.append(s.template(s.IMAGE))
        else:
            parts.append(s.literal(_text([part], where)))
    return _Block("", parts=parts)


def _call_arguments(arguments: object, where: str) -> dict[str, Any]:
    """Tool-call arguments (JSON text or object) -> a dict. As in the reference, JSON text is decoded
    up to twice (double-encoded arguments) and anything that is not an object ends up wrapped as
    {"arguments": <the original value>}."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise ChatFormatError(f"{where}: must be a JSON string or an object")
    value: object = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def _normalize(messages: list[object]) -> list[_Turn | _Block]:
    """Validated messages -> turns, with each tool message as a bare tool-result `_Block`."""
    out: list[_Turn | _Block] = []
    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatFormatError(f"{where}: must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role: unknown role {role!r}")
        content = msg.get("content")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ChatFormatError(f"{where}.tool_call_id: must be a string")
            if call_id not in call_ids:
                raise ChatFormatError(f"{where}.tool_call_id: {call_id!r} matches no earlier tool call")
            out.append(_Block(_text(content, f"{where}.content"), call_id))
        elif role == "user":
            out.append(_Turn("user", blocks=[_user_block(content, f"{where}.content")]))
        elif role == "assistant":
            out.append(_assistant_turn(msg, where, call_ids))
        else:
            text = _text(content, f"{where}.content")
            if role == "developer" and not text:
                raise ChatFormatError(f"{where}.content: a developer message must not be empty")
            out.append(_Turn(role, text=text))
    return out


def _assistant_turn(msg: dict, where: str, call_ids: set[str]) -> _Turn:
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"{where}.reasoning_content: must be a string")
    tool_calls = msg.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise ChatFormatError(f"{where}.tool_calls: must be a list")
    calls = []
    for j, call in enumerate(tool_calls):
        cw = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ChatFormatError(f"{cw}: must be an object")
        if call.get("type", "function") != "function":
            raise ChatFormatError(f"{cw}.type: unsupported tool call type {call.get('type')!r}")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise ChatFormatError(f"{cw}.id: must be a string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatFormatError(f"{cw}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"{cw}.function.name: must be a non-empty string")
        calls.append((call_id, name, _call_arguments(function.get("arguments"), f"{cw}.function.arguments")))
        if call_id:
            call_ids.add(call_id)
    text = _text(msg.get("content"), f"{where}.content", allow_none=True)
    return _Turn("assistant", text=text, reasoning=reasoning or "", calls=calls)


def _merge_tool_results(items: list[_Turn | _Block]) -> list[_Turn]:
    """Fold tool results, and the user messages next to them, into user turns; then put each user
    turn's tool results in the call order of the latest assistant turn with calls before it."""
    turns: list[_Turn] = []
    for item in items:
        if isinstance(item, _Turn) and item.role != "user":
            turns.append(item)
            continue
        blocks = [item] if isinstance(item, _Block) else item.blocks
        if turns and turns[-1].role == "user":
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn("user", blocks=list(blocks)))
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.calls:
            call_order = {call_id: k for k, (call_id, _, _) in enumerate(turn.calls) if call_id}
        elif turn.role == "user":
            _sort_tool_results(turn, call_order)
    return turns


def _sort_tool_results(turn: _Turn, call_order: dict[str, int]) -> None:
    """Reorder the tool-result blocks of a user turn by call index (unknown ids count as 0; stable),
    leaving text blocks where they are."""
    if not call_order:
        return
    slots = [k for k, b in enumerate(turn.blocks) if b.tool_call_id is not None]
    results = sorted((turn.blocks[k] for k in slots), key=lambda b: call_order.get(b.tool_call_id, 0))
    for k, block in zip(slots, results):
        turn.blocks[k] = block


def _last_user_index(turns: list[_Turn]) -> int:
    """Index of the last user-like turn (user, developer, or a system turn after index 0); -1 if none."""
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in ("user", "developer") or (turns[i].role == "system" and i > 0):
            return i
    return -1


def _drop_developer_turns(turns: list[_Turn]) -> list[_Turn]:
    """Thinking mode with drop_thinking: the reference drops developer messages before the last
    user-like turn (assistant reasoning there is dropped at render time)."""
    last_user = _last_user_index(turns)
    return [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]


def _render_turns(turns: list[_Turn], budget: int | None, drop: bool) -> list[s.PromptPart]:
    thinking = budget is not None
    last_user = _last_user_index(turns)
    T, L = s.template, s.literal
    out = [T(s.BOS)]
    for i, turn in enumerate(turns):
        if i == 0 and (thinking or turn.role == "system"):
            out.append(T(s.SYSTEM))
        if i == 0 and budget is not None:
            out.append(T(s.reasoning_effort_line(budget)))
        if turn.role == "system":
            out += [T(s.SYSTEM if i > 0 else ""), L(turn.text)]
            if turn.tools:
                out += [T("\n\n"), *s.tools_prompt_parts(turn.tools)]
        elif turn.role == "developer":
            out += [T(s.USER), L(turn.text)]
        elif turn.role == "user":
            out.append(T(s.USER))
            for k, block in enumerate(turn.blocks):
                out += [T("\n\n" if k else ""), *_block_parts(block)]
        elif turn.role == "latest_reminder":
            out += [T(s.LATEST_REMINDER), L(turn.text)]
        else:
            if thinking and (not drop or i > last_user):
                out += [L(turn.reasoning), T(s.THINK_END)]
            out.append(L(turn.text))
            if turn.calls:
                out += s.tool_calls_parts([(name, args) for _, name, args in turn.calls])
            out.append(T(s.EOS))
        if _needs_header(turns, i):
            open_think = thinking and (not drop or i >= last_user)
            out.append(T(s.ASSISTANT + (s.THINK_START if open_think else s.THINK_END)))
    return [p for p in out if p.text]


def _block_parts(block: _Block) -> list[s.PromptPart]:
    if block.parts is not None:
        return block.parts
    if block.tool_call_id is None:
        return [s.literal(block.text)]
    return [s.template(s.TOOL_RESULT_OPEN), s.literal(block.text), s.template(s.TOOL_RESULT_CLOSE)]


def _needs_header(turns: list[_Turn], i: int) -> bool:
    """Whether the assistant header follows turn i (the reference's transition rule)."""
    role = turns[i].role
    is_last = i == len(turns) - 1
    if not is_last and turns[i + 1].role not in ("assistant", "latest_reminder"):
        return False
    return role in ("user", "developer") or (role == "system" and i > 0) or (
        is_last and role in ("system", "assistant")
    )
