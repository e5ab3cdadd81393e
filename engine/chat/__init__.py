"""DeepSeek-V4.1 chat format: prompt rendering (`render_chat`) and completion parsing
(`parse_completion`, streaming `CompletionParser`)."""

from engine.chat.parse import CompletionDelta, CompletionParser, ParsedCompletion, ToolCall, parse_completion
from engine.chat.render import ChatFormatError, is_thinking, render_chat

__all__ = [
    "ChatFormatError",
    "CompletionDelta",
    "CompletionParser",
    "ParsedCompletion",
    "ToolCall",
    "is_thinking",
    "parse_completion",
    "render_chat",
]
