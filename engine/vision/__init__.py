"""Image input (spec 4.10): decoding and sizing images (`image_processing`), their spans in the prompt
(`layout`). The tower itself is `engine/model/vision.py`."""

from __future__ import annotations

from typing import Literal

ImageErrorReason = Literal["corrupt", "format", "too_large", "count", "no_vision"]


class ImageError(ValueError):
    """An image the server refuses, with a message for the client (the API answers it with a 400).

    reason: "corrupt" (cannot be decoded), "format" (not PNG, JPEG or WebP), "too_large" (bytes or
    pixels over the limits), "count" (images and placeholders disagree), "no_vision" (a text-only model)."""

    def __init__(self, reason: ImageErrorReason, message: str):
        super().__init__(message)
        self.reason = reason
