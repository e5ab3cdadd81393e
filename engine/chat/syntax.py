"""The literal strings of the DeepSeek-V4.1 chat format: special tokens, DSML tool-call tags, the
reasoning-effort line and the tool-description system prompt, plus the rendering of an assistant
turn's tool calls. Shared by `render.py` (writes them) and `parse.py` (reads them back).

V4.1 spells its DSML tag names with a leading space (`<｜DSML｜ calls>`, `<｜DSML｜ invoke …>`,
`<｜DSML｜ parameter …>`); V4 wrote `<｜DSML｜tool_calls>` / `invoke` / `parameter` without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"

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
    return _TOOLS_PROMPT_HEAD + "\n".join(to_json(f) for f in functions) + _TOOLS_PROMPT_TAIL


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """`[(name, arguments)]` -> the separator plus the DSML calls block that ends an assistant turn.

    String values are written verbatim with `string="true"`; every other value as JSON with
    `string="false"`."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(
            f'{PARAM_OPEN} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else to_json(value)}{PARAM_CLOSE}"
            for key, value in arguments.items()
        )
        invokes.append(f'{INVOKE_OPEN} name="{name}">\n{params}\n{INVOKE_CLOSE}')
    return f"{CALLS_SEPARATOR}{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"
