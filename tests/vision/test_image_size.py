"""Image sizes from the header bytes (engine/vision/image_size.py) equal Pillow's for every format and variant the
replica decodes; anything else is an ImageError, never an IndexError."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from engine.vision import ImageError
from engine.vision.image_size import read_image_size

SIZES = [(1, 1), (37, 5), (300, 301), (1343, 17), (16383, 3)]
VARIANTS = [
    ("PNG", "RGB", {}), ("PNG", "RGBA", {}), ("PNG", "L", {}), ("PNG", "P", {}), ("PNG", "RGB", {"interlace": 1}),
    ("JPEG", "RGB", {}), ("JPEG", "L", {}), ("JPEG", "RGB", {"progressive": True}),
    ("JPEG", "RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 64, "icc_profile": b"\x00" * 300}),
    ("WEBP", "RGB", {}), ("WEBP", "RGB", {"lossless": True}), ("WEBP", "RGBA", {}),
    ("WEBP", "RGBA", {"lossless": True}), ("WEBP", "RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 16}),
]


def encode(fmt: str, mode: str, size: tuple[int, int], **options) -> bytes:
    pixels = np.random.default_rng(size[0] * 7 + size[1]).integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA").convert(mode)
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, mode, options", VARIANTS, ids=[f"{f}-{m}-{'-'.join(o)}" for f, m, o in VARIANTS])
def test_the_header_size_is_pillows(fmt, mode, options):
    for size in SIZES:
        if fmt == "WEBP" and max(size) > 16383:
            continue
        data = encode(fmt, mode, size, **options)
        with Image.open(io.BytesIO(data)) as im:
            assert read_image_size(data) == im.size == size, (fmt, mode, options, size)


def test_animated_png_and_webp_give_the_canvas():
    frames = [Image.new("RGB", (40, 30), (i * 40, 0, 0)) for i in range(3)]
    for fmt in ("PNG", "WEBP"):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:])
        assert read_image_size(buf.getvalue()) == (40, 30), fmt


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_header_cut_short_is_corrupt_never_an_index_error(fmt):
    data = encode(fmt, "RGB", (37, 5), **({"exif": b"Exif\x00\x00" + b"\x00" * 64} if fmt == "JPEG" else {}))
    readable = 0
    for n in range(len(data)):
        try:
            assert read_image_size(data[:n]) == (37, 5)
            readable += 1
        except ImageError as e:
            assert e.reason in ("format", "corrupt"), (n, e.reason)
    assert readable > 0  # a long enough prefix is read: the size is in the header, not after the pixels


@pytest.mark.parametrize("data, reason", [
    (b"", "format"), (b"GIF89a" + b"\x00" * 20, "format"), (b"hello world", "format"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR" + b"\x00" * 8, "corrupt"),  # 0 x 0
    (b"\xff\xd8\xff\xda\x00\x02", "corrupt"),  # start of scan before any frame header
    (b"\xff\xd8\xff\xe0\x00\x00", "corrupt"),  # a segment length below 2
    (b"RIFF\x00\x00\x00\x00WEBPVP8 " + b"\x00" * 16, "corrupt"),  # no key-frame start code
])
def test_other_data_is_refused(data, reason):
    with pytest.raises(ImageError) as e:
        read_image_size(data)
    assert e.value.reason == reason
