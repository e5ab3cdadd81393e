"""engine/vision/image_processing.py: decoding with its refusals, the reference's pixel normalisation, letterboxing
and patch layout (checked against direct indexing of the image), on the released vision config."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from engine.config import ModelConfig
from engine.presets import tiny_config
from engine.vision import ImageError
from engine.vision.image_processing import ImageLimits, decode_image, image_to_patches, normalize, process_image
from engine.vision.layout import plan_image_grid

CFG = ModelConfig()
P = 14


def encode(pixels: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **kw)
    return buf.getvalue()


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def exact_bf16(v: np.ndarray) -> torch.Tensor:
    """(v / 255 - 1/2) * 2 in float64, rounded once to bf16."""
    return torch.from_numpy((v.astype(np.float64) / 255 - 0.5) * 2).to(torch.bfloat16)


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("WEBP", {"lossless": True})])
def test_lossless_formats_decode_exactly(fmt, kw):
    pixels = noise(30, 50)
    img = decode_image(encode(pixels, fmt, **kw))
    assert img.mode == "RGB" and img.size == (50, 30)
    assert np.array_equal(np.asarray(img), pixels)


def test_jpeg_and_other_modes_decode_to_rgb():
    img = decode_image(encode(noise(30, 50), "JPEG", quality=95))
    assert img.mode == "RGB" and img.size == (50, 30)
    rgba = np.concatenate([noise(8, 8), np.full((8, 8, 1), 9, np.uint8)], axis=-1)
    img = decode_image(encode(rgba, "PNG"))  # alpha dropped, not composited (the reference's convert("RGB"))
    assert img.mode == "RGB" and np.array_equal(np.asarray(img), rgba[..., :3])
    gray = decode_image(encode(noise(8, 8)[..., 0], "PNG"))
    assert gray.mode == "RGB" and np.array_equal(np.asarray(gray)[..., 1], noise(8, 8)[..., 0])


@pytest.mark.parametrize("data,reason,message", [
    (b"", "corrupt", "empty"),
    (b"GIF89a" + b"\0" * 40, "format", "not a PNG, JPEG or WebP"),
    (b"hello, world" * 10, "format", "not a PNG, JPEG or WebP"),
    (encode(noise(40, 40), "PNG")[:30], "corrupt", "PNG image cannot be decoded"),
    (encode(noise(40, 40), "PNG")[:-500], "corrupt", "PNG image cannot be decoded: image file is truncated"),
    (encode(noise(40, 40), "JPEG")[:400], "corrupt", "JPEG image cannot be decoded"),
    (encode(noise(40, 40), "WEBP")[:100], "corrupt", "WebP image cannot be decoded"),
], ids=["empty", "gif", "junk", "png-header", "png-truncated", "jpeg-truncated", "webp-truncated"])
def test_bad_data_is_a_typed_error(data, reason, message):
    with pytest.raises(ImageError, match=message) as e:
        decode_image(data)
    assert e.value.reason == reason and isinstance(e.value, ValueError)


def test_other_formats_are_refused():
    for fmt in ("GIF", "BMP", "TIFF"):
        with pytest.raises(ImageError, match="not a PNG, JPEG or WebP") as e:
            decode_image(encode(noise(8, 8), fmt))
        assert e.value.reason == "format"


def test_limits_on_bytes_and_pixels():
    data = encode(noise(60, 80), "PNG")
    with pytest.raises(ImageError, match=f"{len(data)} bytes, more than the limit of 1000") as e:
        decode_image(data, ImageLimits(max_bytes=1000))
    assert e.value.reason == "too_large"
    with pytest.raises(ImageError, match="80 x 60 = 4800 pixels, more than the limit of 4799") as e:
        decode_image(data, ImageLimits(max_pixels=4799))
    assert e.value.reason == "too_large"
    decode_image(data, ImageLimits(max_bytes=len(data), max_pixels=4800))
    # a 20000 x 20000 PNG of one colour is ~1 MB: refused from its header, never decoded (400 M pixels)
    big = encode(np.zeros((20000, 20000), np.uint8), "PNG", compress_level=1)
    with pytest.raises(ImageError, match="too many pixels|more than the limit") as e:
        decode_image(big)
    assert e.value.reason == "too_large"


def test_normalization_is_exact_for_every_byte():
    v = np.arange(256, dtype=np.uint8).reshape(1, 256, 1).repeat(3, axis=2)
    got = normalize(v)  # [3, 1, 256]
    assert got.dtype == torch.bfloat16 and got.shape == (3, 1, 256)
    assert torch.equal(got[0, 0].view(torch.int16), exact_bf16(np.arange(256)).view(torch.int16))
    assert got[0, 0, 0] == -1 and got[0, 0, 255] == 1


def test_patches_follow_the_image_without_resizing():
    pixels = noise(560, 588)  # 40 x 42 patches: already a multiple of 14 and >= 544^2, so no resampling
    out = image_to_patches(decode_image(encode(pixels, "PNG")), CFG)
    g = out.grid
    assert (g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w) == (40, 42, 14, 14)
    assert out.patches.dtype == torch.bfloat16 and out.patches.shape == (40 * 42, 3 * P * P)
    ref = exact_bf16(pixels)  # [H, W, 3]
    for i, j in [(0, 0), (0, 41), (17, 5), (39, 0), (39, 41)]:
        block = ref[i * P:(i + 1) * P, j * P:(j + 1) * P, :]  # [y, x, c]
        want = block.permute(2, 0, 1).reshape(-1)  # channel-major (c, y, x)
        assert torch.equal(out.patches[i * 42 + j].view(torch.int16), want.view(torch.int16)), (i, j)


def test_small_image_is_upscaled_and_letterboxed_in_grey():
    pixels = np.full((50, 100, 3), 255, np.uint8)  # white 100 x 50 -> 770 x 392 px (test_layout)
    out = image_to_patches(Image.fromarray(pixels), CFG)
    assert out.grid == plan_image_grid(100, 50, CFG)
    assert out.patches.shape == (28 * 55, 3 * P * P)
    grey = exact_bf16(np.array([127]))[0]
    x = out.patches.view(28, 55, 3, P, P).permute(2, 0, 3, 1, 4).reshape(3, 392, 770)
    # the image scales to fit 770 wide: 770 x 385, centred in 392 rows: Pillow puts round(3.5) = 4 grey rows
    # above and 3 below
    assert (x[:, :4] == grey).all() and (x[:, -3:] == grey).all()
    assert (x[:, 4:-3] == 1).all()


def test_process_image_needs_a_vision_tower():
    data = encode(noise(20, 20), "PNG")
    with pytest.raises(ImageError, match="no vision tower") as e:
        process_image(data, tiny_config())
    assert e.value.reason == "no_vision"
    small = replace(CFG, vision_min_pixels=0, vision_max_n_token=64)
    out = process_image(data, small)  # 28 x 28 px: 2 x 2 patches, one aligner row: 1 * 2 + 2 tokens
    assert out.patches.shape == (4, 3 * P * P) and out.grid.num_tokens == 4
