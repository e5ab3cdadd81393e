"""The golden model's forward with images (spec 4.10, 4.3, 4.5) on the tiny-vision checkpoint: the span rows
overwrite the embedding rows, image tokens route with bias_vl and take no part in Engram (DEAD n-grams, gate
0), and a text-only prompt is unchanged bit for bit. Expectations are built in the test from the spec: the
span laid out by hand from the tower's output and the learned delimiters, top-k routing computed from the
scores and the bias, n-gram hashes of a token whose look-back is blocked."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.engram_tables import hash_ngrams, initial_history
from engine.load import load_model
from engine.model.moe import Gate
from engine.model.vision import encode_image
from engine.presets import tiny_vision_config
from engine.vision.image_processing import process_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT_BEFORE = [0, 1300, 2201, 57]  # BOS and a few ordinary ids
TEXT_AFTER = [4100, 880, 91]


def png(seed: int, size=(200, 150)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def loaded(tiny_vision_checkpoint):
    return load_model(tiny_vision_checkpoint, with_mtp=False, progress=False)


@pytest.fixture(scope="module")
def prompt(loaded):
    """ids [1, S] with one image span, the mask of its positions, its span rows and the image."""
    cfg = loaded.cfg
    image = process_image(png(0), cfg)
    n = image.grid.num_tokens
    ids = torch.tensor([TEXT_BEFORE + [cfg.image_token_id] * n + TEXT_AFTER])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(TEXT_BEFORE):len(TEXT_BEFORE) + n] = True
    return ids, mask, loaded.model.span_rows(image.patches, image.grid), image


def run(model, ids, mask=None, rows=None, **kw):
    cache = model.new_cache(1, ids.size(1) + 1)
    return model(ids, 0, cache, full_logits=True, image_mask=mask, image_rows=rows, **kw).logits


def test_span_rows_are_the_towers_rows_between_the_learned_delimiters(loaded, prompt):
    model, (_, _, rows, image) = loaded.model, prompt
    g = image.grid
    tower = encode_image(model.vision, model.aligner, image.patches, g.n_vit_h, g.n_vit_w)  # [n_llm_h*n_llm_w, D]
    expected = [model.image_start]
    for r in range(g.n_llm_h):
        expected += [tower[r * g.n_llm_w + c] for c in range(g.n_llm_w)] + [model.image_newline]
    expected.append(model.image_end)
    assert rows.shape == (g.num_tokens, loaded.cfg.dim) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, torch.stack(expected))


def test_image_rows_overwrite_the_embedding(loaded, prompt):
    model, (ids, mask, rows, _) = loaded.model, prompt
    seen = {}
    hook = model.layers[0].register_forward_pre_hook(lambda m, args: seen.update(X=args[0].clone()))
    try:
        run(model, ids, mask, rows)
    finally:
        hook.remove()
    X = seen["X"][0]  # [S, hc, D]: the stream entering layer 0, 4 identical copies
    assert torch.equal(X[mask[0]], rows[:, None].expand(-1, loaded.cfg.hc_mult, -1))
    assert torch.equal(X[~mask[0]], model.embed.weight[ids[0][~mask[0]]][:, None].expand(-1, loaded.cfg.hc_mult, -1))


def test_image_tokens_route_with_bias_vl(loaded, prompt):
    model, (ids, mask, rows, _) = loaded.model, prompt
    masks = []
    gate = model.layers[2].ffn.gate
    original = gate.forward
    gate.forward = lambda x, image_mask=None: (masks.append(image_mask), original(x, image_mask))[1]
    try:
        run(model, ids, mask, rows)
    finally:
        del gate.forward
    assert len(masks) == 1 and torch.equal(masks[0], mask.reshape(-1))


def test_gate_selects_with_bias_vl_for_image_rows():
    cfg = tiny_vision_config()
    gate = Gate(cfg, 8, 2).to_empty(device="cpu")
    torch.manual_seed(0)
    gate.weight.copy_(torch.randn(8, cfg.dim).bfloat16() * 0.05)
    gate.bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))  # text rows: experts 0 and 1
    gate.bias_vl.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0]))  # image rows: experts 6 and 7
    x = (torch.randn(5, cfg.dim) * 0.1).bfloat16()
    is_image = torch.tensor([False, True, True, False, True])
    weights, ids = gate(x, is_image)
    scores = torch.nn.functional.softplus(x.double() @ gate.weight.double().T).sqrt()  # sqrt-softplus, temp 1
    for t in range(5):
        want = [6, 7] if is_image[t] else [0, 1]
        assert sorted(ids[t].tolist()) == want, (t, ids[t])
        w = scores[t, ids[t]]
        assert torch.allclose(weights[t], w / w.sum() * cfg.route_scale, rtol=0, atol=1e-15)
    assert torch.equal(gate(x)[1], gate(x, torch.zeros(5, dtype=torch.bool))[1])  # no mask: bias only


def test_engram_excludes_image_tokens(loaded, prompt):
    model, (ids, mask, rows, _) = loaded.model, prompt
    tables = model.engram_tables
    calls = []
    layer = model.layers[model.cfg.engram_layer_ids[0]]
    hooks = [layer.engram.register_forward_hook(lambda m, args, out: calls.append((args, out)))]
    try:
        run(model, ids, mask, rows)
    finally:
        for h in hooks:
            h.remove()
    (x, hash_ids, token_mask), out = calls[0]
    assert torch.equal(token_mask, ~mask)
    assert torch.equal(out[mask], x[mask])  # gate 0: image rows leave Engram unchanged
    assert not torch.equal(out[~mask], x[~mask])
    # the first text token after the span: its look-back hits DEAD at shift 1, so every n-gram is (token, pad, ...),
    # which is what the same token hashes to at position 0, where nothing precedes it
    after = len(TEXT_BEFORE) + int(mask.sum())
    alone = hash_ngrams(tables, ids[:, after:after + 1], initial_history(tables, 1), 0)[0, 0, tables_index(model, layer)]
    assert torch.equal(hash_ids[0, after], alone)
    plain = hash_ngrams(tables, ids, initial_history(tables, 1), 0)[0, after, tables_index(model, layer)]
    assert not torch.equal(hash_ids[0, after], plain)  # without the mask the image id would enter the n-grams


def tables_index(model, layer) -> int:
    return layer.role.engram_index


def test_text_only_prompt_is_unchanged_bit_for_bit(loaded, tiny_vision_checkpoint):
    model = loaded.model
    ids = torch.tensor([TEXT_BEFORE + TEXT_AFTER + [77, 1200]])
    plain = run(model, ids)
    none_masked = run(model, ids, torch.zeros_like(ids, dtype=torch.bool), torch.empty(0, loaded.cfg.dim).bfloat16())
    text_only = load_model(tiny_vision_checkpoint, with_mtp=False, with_vision=False, progress=False).model
    assert torch.equal(plain, none_masked) and torch.equal(plain, run(text_only, ids))


def test_images_change_the_output_and_chunks_agree(loaded, prompt):
    """Two images give different logits at the text after them; a prefill cut inside the span (engram history and
    the stream carried across the cut) equals the one-shot prefill bit for bit."""
    model, (ids, mask, rows, _) = loaded.model, prompt
    other = process_image(png(1), loaded.cfg)
    rows1 = model.span_rows(other.patches, other.grid)
    one = run(model, ids, mask, rows)
    assert not torch.equal(one[0, -1], run(model, ids, mask, rows1)[0, -1])
    cut = len(TEXT_BEFORE) + 10
    cache = model.new_cache(1, ids.size(1) + 1)
    n_first = int(mask[:, :cut].sum())
    a = model(ids[:, :cut], 0, cache, full_logits=True, image_mask=mask[:, :cut], image_rows=rows[:n_first]).logits
    b = model(ids[:, cut:], cut, cache, full_logits=True, image_mask=mask[:, cut:], image_rows=rows[n_first:]).logits
    assert torch.equal(torch.cat([a, b], dim=1), one)
