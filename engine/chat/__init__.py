"""DeepSeek-V4.1 chat format: prompt rendering (`render_chat`, and `render_chat_parts` to tokenize) and completion parsing
(`parse_completion`, streaming `CompletionParser`)."""

from engine.chat.parse import CompletionDelta, CompletionParser, ParsedCompletion, ToolCall, parse_completion
from engine.chat.render import EFFORT_NAMES, EFFORT_PRESETS, ChatFormatError, is_thinking, render_chat, render_chat_parts
from engine.chat.syntax import PromptPart

__all__ = [
    "EFFORT_NAMES",
    "EFFORT_PRESETS",
    "ChatFormatError",
    "CompletionDelta",
    "CompletionParser",
    "ParsedCompletion",
    "PromptPart",
    "ToolCall",
    "is_thinking",
    "parse_completion",
    "render_chat",
    "render_chat_parts",
]
