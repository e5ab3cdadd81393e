"""Requests with images through the engine (golden runner, tiny-vision checkpoint): the runner's logits equal the
golden model's forward with the same span rows, a prefill chunked across a span equals the one-shot prefill bit
for bit, and the prefix cache keys image spans by the image's content: the same image hits (snapshot and full
blocks), a different image at the same positions does not."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.core.engine import EngineConfig, LLMEngine, RequestError
from engine.core.plan import chunk_images
from engine.core.sampling_params import SamplingParams
from engine.vision.image_processing import prepare_image_prompt, process_image
from engine.vision.inputs import ImageInput, image_mask
from engine.vision.layout import ImageGrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_NEW = 3


def png(seed: int, height: int = 150, width: int = 200) -> bytes:
    """Random pixels; 150 x 200 is planned as 154 x 210 (a 4 x 5 aligner grid, a 26-token span), 100 x 110 as
    112 x 126 (3 x 3, 14 tokens: the kernel path's tests, whose Triton interpreter takes seconds a row)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision_model(tiny_vision_checkpoint):
    from engine.load import load_model

    return load_model(tiny_vision_checkpoint, progress=False, with_mtp=False)


def prompt_with(cfg, images: list[bytes], text_after: list[int]):
    ids = [0, 1300, 2201] + [cfg.image_token_id] * len(images) + text_after
    return prepare_image_prompt(ids, images, cfg)


def make(model, **kw) -> LLMEngine:
    kw.setdefault("max_num_batched_tokens", 256)
    return LLMEngine.local(model, EngineConfig(bounded_replay=False, **kw), eos_token_id=-1)


def run(engine, rid, ids, images, keep_logits=False):
    engine.add_request(rid, ids, SamplingParams(max_tokens=NUM_NEW, temperature=0.0), keep_logits=keep_logits,
                       images=images)
    tokens, rows, cached = [], [], None
    while engine.has_unfinished:
        for o in engine.step():
            tokens += o.new_token_ids
            if o.logits is not None:
                rows.append(o.logits)
            if o.finished:
                cached = o.stats.num_cached_tokens
    return tokens, rows, cached


def test_runner_equals_the_golden_forward_and_chunks_agree(vision_model):
    model, cfg = vision_model.model, vision_model.cfg
    ids, images = prompt_with(cfg, [png(0)], [4100, 880])
    assert len(images) == 1 and images[0].start == 3 and images[0].end == 3 + 26
    tokens, rows, _ = run(make(model), "a", ids, images, keep_logits=True)
    first_pos, logits = rows[0]
    assert first_pos == 0 and logits.size(0) == len(ids)
    image = process_image(png(0), cfg)
    mask = torch.tensor([image_mask(0, len(ids), images)])
    golden = model(torch.tensor([ids]), 0, model.new_cache(1, len(ids) + 1), full_logits=True, image_mask=mask,
                   image_rows=model.span_rows(image.patches, image.grid)).logits[0]
    assert torch.equal(logits, golden)
    chunked, chunk_rows, _ = run(make(model, max_chunk_tokens=7), "b", ids, images, keep_logits=True)
    assert chunked == tokens and torch.equal(torch.cat([r for _, r in chunk_rows])[:len(ids)], logits)


def test_decode_right_after_an_image_that_ends_the_prompt(vision_model):
    """The image is the prompt's last span, so the decode steps' chunks carry it only for their Engram look-back
    (no row of theirs is an image row): every row, prompt and decode, equals the golden forward teacher-forced on
    the prompt + the drawn tokens."""
    model, cfg = vision_model.model, vision_model.cfg
    ids, images = prompt_with(cfg, [png(2)], [])
    assert images[0].end == len(ids)
    tokens, rows, _ = run(make(model), "e", ids, images, keep_logits=True)
    assert len(tokens) == NUM_NEW, tokens
    logits = torch.cat([r for _, r in rows])
    seq = ids + tokens[:-1]
    image = process_image(png(2), cfg)
    mask = torch.tensor([image_mask(0, len(seq), images)])
    golden = model(torch.tensor([seq]), 0, model.new_cache(1, len(seq) + 1), full_logits=True, image_mask=mask,
                   image_rows=model.span_rows(image.patches, image.grid)).logits[0]
    assert logits.shape == golden.shape and torch.equal(logits, golden)


def test_chunks_carry_patches_only_where_they_hold_image_rows():
    """chunk_images: an image wholly in a chunk's Engram look-back travels without its patches (the decode steps
    right after it); one the chunk itself overlaps keeps them; one out of reach is not carried."""
    grid = ImageGrid(112, 112, 8, 8, 3, 3)  # 14 span tokens
    im = ImageInput(4, grid, b"\x01" * 64, -7)
    assert im.end == 18
    [inside] = chunk_images((im,), 0, 10, 3)  # a prefill chunk through the span
    assert inside is im
    [behind] = chunk_images((im,), 18, 19, 3)  # the first decode step after it
    assert (behind.start, behind.grid, behind.key, behind.patches) == (4, grid, -7, b"")
    assert chunk_images((im,), 21, 22, 3) == ()  # past the look-back


def test_two_images_give_different_outputs(vision_model):
    model, cfg = vision_model.model, vision_model.cfg
    outs = []
    for seed in (0, 1):
        ids, images = prompt_with(cfg, [png(seed)], [4100, 880])
        outs.append(run(make(model), f"i{seed}", ids, images, keep_logits=True)[1][0][1][-1])
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("snapshots", [8, 0], ids=["snapshot", "blocks"])
def test_prefix_cache_keys_image_spans_by_content(vision_model, snapshots):
    """Two images in a 70-token prompt, so that one full 64-token block covers both spans. The same images in
    the next turn hit (the snapshot, or the full block); the second image swapped for another misses from the
    block that holds it, and its tokens equal a cold engine's."""
    model, cfg = vision_model.model, vision_model.cfg
    engine = make(model, max_snapshots=snapshots)
    ids, images = prompt_with(cfg, [png(0), png(1)], [4100, 880] * 7)
    assert len(ids) >= 65 and images[1].end <= 64
    first, _, cached = run(engine, "t1", ids, images)
    assert cached == 0
    ids2 = ids + first + [91, 92]
    _, _, cached = run(engine, "t2", ids2, images)
    assert cached == (len(ids) + NUM_NEW - 1 if snapshots else 64)
    other_ids, other = prompt_with(cfg, [png(0), png(2)], [4100, 880] * 7)
    assert other_ids == ids and other[1].key != images[1].key
    other_ids2 = other_ids + first + [91, 92]
    tokens, _, cached = run(engine, "t3", other_ids2, other)
    assert cached == 0
    assert tokens == run(make(model), "cold", other_ids2, other)[0]


def test_images_are_refused_where_they_cannot_run(vision_model, tiny_checkpoint):
    from engine.load import load_model

    cfg = vision_model.cfg
    ids, images = prompt_with(cfg, [png(0)], [4100])
    text_only = make(load_model(tiny_checkpoint, progress=False, with_mtp=False).model)
    with pytest.raises(RequestError, match="no vision tower"):
        text_only.add_request("x", ids, SamplingParams(max_tokens=1), images=images)
    engine = make(vision_model.model)
    with pytest.raises(RequestError, match="image 0: its span's ids are not all the image token"):
        engine.add_request("y", [5] * len(ids), SamplingParams(max_tokens=1), images=images)
