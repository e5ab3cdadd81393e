"""An encoded image's width and height from its header bytes alone: no Pillow, no torch, so the HTTP ingress can
check pixel limits and count an image's span tokens (`layout.plan_image_grid`) before the replica decodes it.

The sizes are the ones Pillow reports for the same bytes (`tests/vision/test_image_size.py` compares them):
PNG: the IHDR chunk (the canvas of an animated PNG). JPEG: the first start-of-frame segment (SOF0-SOF15 but
DHT, JPG and DAC), reached by walking the segments from SOI; no EXIF rotation (the reference applies none).
WebP: the VP8X canvas, else the VP8 key frame's or the VP8L header's size.
"""

from __future__ import annotations

from engine.vision import ImageError

_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC share the range
_STANDALONE_MARKERS = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM carry no length


def read_image_size(data: bytes) -> tuple[int, int]:
    """PNG, JPEG or WebP bytes -> (width, height) from the header. Raises ImageError("format") for other data
    and ImageError("corrupt") for a header cut short or damaged (a zero side included)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        width, height = _png_size(data)
        kind = "PNG"
    elif data.startswith(b"\xff\xd8"):
        width, height = _jpeg_size(data)
        kind = "JPEG"
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        width, height = _webp_size(data)
        kind = "WebP"
    else:
        raise ImageError("format", "the data is not a PNG, JPEG or WebP image")
    if width <= 0 or height <= 0:
        raise ImageError("corrupt", f"the {kind} image's header is damaged (its size reads {width} x {height})")
    return width, height


def _corrupt(kind: str) -> ImageError:
    return ImageError("corrupt", f"the {kind} image's header is cut short or damaged: its size cannot be read")


def _png_size(data: bytes) -> tuple[int, int]:
    # signature (8), IHDR's length (4) and type (4), then width and height as big-endian uint32
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise _corrupt("PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    i = 2  # after SOI
    while True:
        while i < len(data) and data[i] == 0xFF:  # a marker's 0xFF, and any fill bytes before it
            i += 1
        if i >= len(data) or data[i - 1] != 0xFF:
            raise _corrupt("JPEG")
        marker = data[i]
        i += 1
        if marker in _STANDALONE_MARKERS:
            continue
        if marker in (0xD9, 0xDA) or i + 2 > len(data):  # EOI or start of scan before any frame header
            raise _corrupt("JPEG")
        length = int.from_bytes(data[i:i + 2], "big")  # counts its own two bytes
        if marker in _SOF_MARKERS:
            if length < 7 or i + 7 > len(data):
                raise _corrupt("JPEG")
            # length (2), sample precision (1), height (2), width (2)
            return int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 3:i + 5], "big")
        if length < 2:
            raise _corrupt("JPEG")
        i += length


def _webp_size(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    body = data[20:]
    if chunk == b"VP8X" and len(body) >= 10:  # flags (4), canvas width - 1 and height - 1 as 24-bit LE
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if chunk == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        # frame tag (3), start code (3), then 14-bit width and height (2 scale bits above each)
        return int.from_bytes(body[6:8], "little") & 0x3FFF, int.from_bytes(body[8:10], "little") & 0x3FFF
    if chunk == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:  # signature, then width - 1, height - 1 (14 bits)
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    raise _corrupt("WebP")
