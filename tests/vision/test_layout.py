"""engine/vision/layout.py: the resize plan of an image and its span in the prompt (spec 4.10, the reference's
image_processor.py), on the released config (patch 14, downsample 3, <= 1024 tokens, >= 544^2 pixels).

Every expected size below was worked out by hand from the reference's rules (the arithmetic is in the comments),
not by calling the code under test."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.chat.syntax import IMAGE
from engine.config import ModelConfig
from engine.vision import ImageError
from engine.vision.layout import (ImageGrid, TokenType, expand_image_placeholders, image_token_id, plan_image_grid,
                                  span_types)

CFG = ModelConfig()  # the released vision config
IMG = 129264

# (width, height) -> (best_height, best_width, n_vit_h, n_vit_w, n_llm_h, n_llm_w, tokens)
HAND = {
    # 544 x 544 = 295936 = min_pixels: no upscale. ceil(544/14) = 39 -> 546 px, 39 patches, ceil(39/3) = 13.
    # 13 * 14 + 2 = 184 tokens.
    (544, 544): (546, 546, 39, 39, 13, 13, 184),
    # 560 = 40 * 14: no resize; ceil(40/3) = 14; 14 * 15 + 2 = 212.
    (560, 560): (560, 560, 40, 40, 14, 14, 212),
    # 1344 = 96 * 14 -> 32 x 32 rows, 32 * 33 + 2 = 1058 > 1024: shrink. aspect 1: max_w = sqrt(1022 + 1/4) - 1/2
    # = 31.47 -> 31 rows of 42 px: scale 1302/1344 -> 1302 px = 93 patches = 31 rows; 31 * 32 + 2 = 994.
    (1344, 1344): (1302, 1302, 93, 93, 31, 31, 994),
    # 100 x 50 = 5000 < 295936: up by sqrt(59.1872) = 7.6933 -> int(769.33) = 769 x int(384.67) = 384;
    # ceil(769/14) = 55 -> 770, ceil(384/14) = 28 -> 392; rows ceil(28/3) = 10, cols ceil(55/3) = 19; 10 * 20 + 2 = 202.
    (100, 50): (392, 770, 28, 55, 10, 19, 202),
    # 1920 x 1080: 138 x 78 patches -> 26 x 46 rows, 1224 tokens: shrink. a = 0.5625: max_w = sqrt(1022/a + 1/4) - 1/2
    # = 42.13, max_h = 23.70 -> scale min(42 * 42/1920, 23 * 42/1080) = 966/1080; 1080 -> 966 = 69 patches,
    # 1920 * 966/1080 = 1717.3 -> 122 patches = 1708 px; rows 23, cols ceil(122/3) = 41; 23 * 42 + 2 = 968.
    (1920, 1080): (966, 1708, 69, 122, 23, 41, 968),
    # 3000 x 2000: a = 2/3, max_w = sqrt(1533.25) - 1/2 = 38.66, max_h = 25.77 -> scale min(38 * 42/3000,
    # 25 * 42/2000) = 0.525: 1050 px = 75 patches, 1575 px -> 112 patches = 1568; 25 x 38 rows; 25 * 39 + 2 = 977.
    (3000, 2000): (1050, 1568, 75, 112, 25, 38, 977),
    # 20 x 4000 = 80000: up by sqrt(3.6992) = 1.9233 -> 38 x 7693 -> 42 x 7700 px, 3 x 550 patches, 1 x 184 rows,
    # 184 * 2 + 2 = 370: fits.
    (20, 4000): (7700, 42, 550, 3, 184, 1, 370),
    # 10 x 40000: 14 x 40012 px, 1 x 2858 patches -> 953 x 1 rows, 1908 tokens: shrink. max_w = sqrt(1022/4000 +
    # 1/4) - 1/2 = 0.21 < 1: one column of (1024 - 2) // 2 = 511 rows: 42 x 21462 px; 511 * 2 + 2 = 1024.
    (10, 40000): (21462, 42, 1533, 3, 511, 1, 1024),
    # 40000 x 10: 40012 x 14 px, 2858 x 1 patches -> 1 row of ceil(2858/3) = 953: 954 + 2 = 956 tokens, fits.
    (40000, 10): (14, 40012, 1, 2858, 1, 953, 956),
}


@pytest.mark.parametrize("size", list(HAND), ids=[f"{w}x{h}" for w, h in HAND])
def test_plan_matches_hand_arithmetic(size):
    *grid, tokens = HAND[size]
    got = plan_image_grid(*size, CFG)
    assert got == ImageGrid(*grid), f"{size}: {got}"
    assert got.num_tokens == tokens
    assert got.num_tokens <= CFG.vision_max_n_token
    assert got.best_width * got.best_height >= CFG.vision_min_pixels


def test_wh_ratio_clamps_the_planned_width():
    # ratio 2: a 3000 x 500 image is planned as 1000 x 500 (500000 >= min pixels): 1008 x 504 px,
    # 72 x 36 patches, 12 x 24 rows; 12 * 25 + 2 = 302.
    cfg = replace(CFG, vision_max_wh_ratio=2.0)
    assert plan_image_grid(3000, 500, cfg) == ImageGrid(504, 1008, 36, 72, 12, 24)


def test_every_plan_fits_the_budget():
    for w in (1, 7, 14, 41, 300, 999, 2048, 5000):
        for h in (1, 13, 42, 500, 1344, 3333):
            g = plan_image_grid(w, h, CFG)
            assert 4 <= g.num_tokens <= 1024 and g.n_llm_h >= 1 and g.n_llm_w >= 1, (w, h, g)
            assert g.best_height % 14 == 0 and g.best_width % 14 == 0, (w, h, g)


def test_span_types():
    t = span_types(ImageGrid(28, 42, 2, 3, 1, 1))
    assert t == [TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEW_LINE, TokenType.IMAGE_END]
    S, I, N, E = TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEW_LINE, TokenType.IMAGE_END
    assert span_types(ImageGrid(0, 0, 0, 0, 2, 3)) == [S, I, I, I, N, I, I, I, N, E]


def test_one_image_prompt():
    grid = ImageGrid(0, 0, 0, 0, 2, 3)  # 2 rows of 3: 2 * 4 + 2 = 10 positions
    p = expand_image_placeholders([0, 5, IMG, 7], [grid], IMG)
    S, I, N, E, T = (TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEW_LINE, TokenType.IMAGE_END,
                     TokenType.TEXT)
    assert p.ids == [0, 5] + [IMG] * 10 + [7]
    assert p.types == [T, T, S, I, I, I, N, I, I, I, N, E, T]
    assert [(s.start, s.end) for s in p.spans] == [(2, 12)]
    assert p.image_mask == [False, False] + [True] * 10 + [False]


def test_two_images_of_different_sizes():
    a = ImageGrid(0, 0, 0, 0, 1, 2)  # [S I I N E]: 5
    b = ImageGrid(0, 0, 0, 0, 3, 1)  # [S I N I N I N E]: 8
    p = expand_image_placeholders([9, IMG, IMG, 8, 8], [a, b], IMG)
    S, I, N, E, T = (TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEW_LINE, TokenType.IMAGE_END,
                     TokenType.TEXT)
    assert p.ids == [9] + [IMG] * 13 + [8, 8]
    assert p.types == [T, S, I, I, N, E, S, I, N, I, N, I, N, E, T, T]
    assert [(s.start, s.end, s.grid) for s in p.spans] == [(1, 6, a), (6, 14, b)]


def test_placeholder_count_must_match():
    g = ImageGrid(0, 0, 0, 0, 1, 1)
    with pytest.raises(ImageError, match="2 image placeholders but 1 images") as e:
        expand_image_placeholders([IMG, IMG], [g], IMG)
    assert e.value.reason == "count"
    with pytest.raises(ImageError, match="0 image placeholders but 1"):
        expand_image_placeholders([1, 2], [g], IMG)
    assert expand_image_placeholders([1, 2], [], IMG).types == [TokenType.TEXT] * 2


def test_image_token_id_from_the_tokenizer(tok):
    assert image_token_id(tok, CFG) == IMG == tok.token_to_id(IMAGE)
    assert tok.encode(f"a{IMAGE}b").count(IMG) == 1
    with pytest.raises(ValueError, match="image_token_id is 5"):
        image_token_id(tok, replace(CFG, image_token_id=5))
