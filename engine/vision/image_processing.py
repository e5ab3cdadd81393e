"""Image bytes to ViT patches, as DeepSeek's reference `image_processor.py` does (spec 4.10). The only
module that imports Pillow.

decode_image: PNG, JPEG or WebP bytes -> an RGB Pillow image (the first frame of an animated one; no
EXIF rotation and no alpha compositing, as the reference), refused with an `ImageError` when the bytes
or the pixels exceed `ImageLimits` (checked from the header, before the pixels are decoded) or the data
is not a complete image of those formats.
image_to_patches: the reference's pixels: letterboxed into best_width x best_height on grey (127, 127,
127) with Pillow's bicubic resize (`ImageOps.pad`), scaled to [-1, 1] in float32 as (v / 255 - 0.5) / 0.5,
rounded to bf16, cut into p x p patches in reading order, each flattened channel-major (c, y, x).
prepare_image_prompt: a prompt's ids with one placeholder per image, and the images' bytes -> the ids with
each placeholder expanded to its span and the `ImageInput`s the engine carries.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.config import ModelConfig
from engine.vision import ImageError
from engine.vision.inputs import ImageInput, image_key
from engine.vision.layout import ImageGrid, expand_image_placeholders, plan_image_grid

FORMATS = ("PNG", "JPEG", "WEBP")
PAD_COLOR = (127, 127, 127)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Per-image limits, checked before decoding. The defaults: OpenAI's 20 MB per image, and 8K UHD."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 7680 * 4320

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0:
            raise ValueError(f"image limits must be positive, got {self.max_bytes} bytes, {self.max_pixels} pixels")


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image ready for the tower: patches bf16 [n_vit_h * n_vit_w, 3 * p * p] and its grid."""

    patches: torch.Tensor
    grid: ImageGrid


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Encoded bytes -> RGB image; ImageError("too_large" | "format" | "corrupt") otherwise."""
    if len(data) > limits.max_bytes:
        raise ImageError("too_large", f"the image is {len(data)} bytes, more than the limit of {limits.max_bytes}")
    if not data:
        raise ImageError("corrupt", "the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow warns (DecompressionBombWarning) between its own limits; ours is checked below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            source = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError("too_large", f"the image has too many pixels ({e})") from None
    except UnidentifiedImageError:
        if _sniff(data) != "unknown":  # the right magic, then too little of a header
            raise ImageError("corrupt", f"the {_sniff(data)} image cannot be decoded (damaged header)") from None
        raise ImageError("format", "the data is not a PNG, JPEG or WebP image") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError("corrupt", f"the {_sniff(data)} image cannot be decoded: {e}") from None
    with source:
        width, height = source.size
        if width * height > limits.max_pixels:
            raise ImageError("too_large", f"the image is {width} x {height} = {width * height} pixels, more than "
                             f"the limit of {limits.max_pixels}")
        try:
            source.load()
            return source.convert("RGB")
        except (OSError, SyntaxError, ValueError) as e:  # truncated or damaged pixel data
            raise ImageError("corrupt", f"the {source.format} image cannot be decoded: {e}") from None


def _sniff(data: bytes) -> str:
    for magic, name in ((b"\x89PNG", "PNG"), (b"\xff\xd8", "JPEG"), (b"RIFF", "WebP")):
        if data.startswith(magic):
            return name
    return "unknown"


def normalize(pixels: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] -> bf16 [3, H, W] in [-1, 1]: the reference's float32 (v / 255 - 0.5) / 0.5."""
    x = torch.from_numpy(np.asarray(pixels, dtype=np.float32)).permute(2, 0, 1) / 255
    return ((x - 0.5) / 0.5).to(torch.bfloat16)


def to_patches(x: torch.Tensor, p: int) -> torch.Tensor:
    """[3, n_h * p, n_w * p] -> [n_h * n_w, 3 * p * p]: patches in reading order, each (c, y, x) flattened."""
    c, height, width = x.shape
    n_h, n_w = height // p, width // p
    return x.reshape(c, n_h, p, n_w, p).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, c * p * p)


def image_to_patches(image: Image.Image, cfg: ModelConfig) -> ProcessedImage:
    """An RGB image -> its patches and grid (`plan_image_grid` decides the size)."""
    grid = plan_image_grid(image.width, image.height, cfg)
    size = (grid.best_width, grid.best_height)
    if cfg.vision_max_wh_ratio is not None and image.width >= cfg.vision_max_wh_ratio * image.height:
        image = image.resize(size)  # planned at the ratio's width: stretched, not padded
    else:
        image = ImageOps.pad(image, size, color=PAD_COLOR)
    return ProcessedImage(to_patches(normalize(np.asarray(image)), cfg.vision_patch_size), grid)


def process_image(data: bytes, cfg: ModelConfig, limits: ImageLimits = ImageLimits()) -> ProcessedImage:
    """Encoded image bytes -> patches and grid for a config with a vision tower."""
    if not cfg.has_vision:
        raise ImageError("no_vision", "this model has no vision tower: it takes text only")
    return image_to_patches(decode_image(data, limits), cfg)


def prepare_image_prompt(ids: Sequence[int], images: Sequence[bytes], cfg: ModelConfig,
                         limits: ImageLimits = ImageLimits()) -> tuple[list[int], list[ImageInput]]:
    """ids holding one `cfg.image_token_id` placeholder per image, in order, and the encoded images -> the
    expanded ids and one ImageInput per image. Raises ImageError (no_vision, too_large, format, corrupt, count)."""
    processed = []
    for k, data in enumerate(images):
        try:
            processed.append(process_image(data, cfg, limits))
        except ImageError as e:
            raise ImageError(e.reason, f"image {k}: {e}") from None
    prompt = expand_image_placeholders(ids, [p.grid for p in processed], cfg.image_token_id)
    inputs = [ImageInput(span.start, span.grid, p.patches.contiguous().view(torch.int16).numpy().tobytes(),
                         image_key(data)) for span, p, data in zip(prompt.spans, processed, images)]
    return prompt.ids, inputs
