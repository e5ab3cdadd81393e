"""The literal strings of the DeepSeek-V4.1 chat format: special tokens, DSML tool-call tags, the
reasoning-effort line and the tool-description system prompt, plus the rendering of an assistant
turn's tool calls. Shared by `render.py` (writes them) and `parse.py` (reads them back).

V4.1 spells its DSML tag names with a leading space (`<｜DSML｜ calls>`, `<｜DSML｜ invoke …>`,
`<｜DSML｜ parameter …>`); V4 wrote `<｜DSML｜tool_calls>` / `invoke` / `parameter` without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class PromptPart(NamedTuple):
    """A piece of a rendered prompt. The template's own text (is_literal False) may spell special tokens,
    and they are encoded as such; a request's text (message contents, reasoning, tool schemas, call names
    and arguments: is_literal True) is encoded as plain text, so no spelling in it becomes a special id
    (`engine.tokenizer.Tokenizer.encode_parts`)."""

    text: str
    is_literal: bool


def template(text: str) -> PromptPart:
    return PromptPart(text, False)


def literal(text: str) -> PromptPart:
    return PromptPart(text, True)


def joined(parts: Sequence[PromptPart]) -> str:
    return "".join(p.text for p in parts)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
IMAGE = "<｜deepseek_image｜>"  # an image placeholder; expanded to the image's span (engine/vision/layout.py)

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke"  # followed by ' name="f">'
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_OPEN = f"<{DSML} parameter"  # followed by ' name="k" string="true|false">'
PARAM_CLOSE = f"</{DSML} parameter>"
# The encoder joins an assistant turn's content and its calls block with a blank line, and writes it
# even when the content is empty; the parser removes it again.
CALLS_SEPARATOR = "\n\n"

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"


def reasoning_effort_line(budget: int) -> str:
    return (
        f"Reasoning Effort: {budget} "
        "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    )


_TOOLS_PROMPT_HEAD = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_PROMPT_TAIL = """

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    """JSON as the reference writes it: `json.dumps` defaults (", " and ": "), non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools_prompt(functions: Sequence[Mapping[str, Any]]) -> str:
    """The "## Tools" system-prompt section: fixed instructions, then one JSON schema per line.

    `functions` are the `function` objects of OpenAI tool definitions, serialised as given (key order
    kept)."""
    return joined(tools_prompt_parts(functions))


def tools_prompt_parts(functions: Sequence[Mapping[str, Any]]) -> list[PromptPart]:
    """render_tools_prompt as parts: the schemas are the request's text."""
    return [template(_TOOLS_PROMPT_HEAD), literal("\n".join(to_json(f) for f in functions)),
            template(_TOOLS_PROMPT_TAIL)]


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """`[(name, arguments)]` -> the separator plus the DSML calls block that ends an assistant turn.

    String values are written verbatim with `string="true"`; every other value as JSON with
    `string="false"`."""
    return joined(tool_calls_parts(calls))


def tool_calls_parts(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> list[PromptPart]:
    """render_tool_calls as parts: names, argument keys and values are the request's text."""
    out = [template(f"{CALLS_SEPARATOR}{CALLS_OPEN}\n")]
    for i, (name, arguments) in enumerate(calls):
        out += [template(("\n" if i else "") + f'{INVOKE_OPEN} name="'), literal(name), template('">\n')]
        for j, (key, value) in enumerate(arguments.items()):
            is_string = isinstance(value, str)
            out += [template(("\n" if j else "") + f'{PARAM_OPEN} name="'), literal(key),
                    template(f'" string="{"true" if is_string else "false"}">'),
                    literal(value if is_string else to_json(value)), template(PARAM_CLOSE)]
        out.append(template(f"\n{INVOKE_CLOSE}"))
    out.append(template(f"\n{CALLS_CLOSE}"))
    return out
