"""The tiny-vision preset's checkpoint (engine/tools/make_checkpoint.py) and its loading (engine/checkpoint/loader.py,
engine/load.py): the tower, the aligner, image_* and every gate's bias_vl are written, read when the config has a
tower and checked like every other tensor, and skipped for a text-only load."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from engine.checkpoint.layout import expected_tensors, is_text_only_skippable
from engine.checkpoint.loader import CheckpointError, load_checkpoint
from engine.load import load_model
from engine.model.vision import encode_image
from engine.presets import tiny_config, tiny_vision_config
from engine.tools.make_checkpoint import INDEX_FILE
from engine.vision.image_processing import process_image

CFG = tiny_vision_config()


@pytest.fixture(scope="module")
def vision_ckpt(tiny_vision_checkpoint) -> Path:
    return tiny_vision_checkpoint  # tests/conftest.py: the tiny-vision preset (CFG), seed 0


@pytest.fixture(scope="module")
def loaded(vision_ckpt):
    return load_model(vision_ckpt, progress=False)


def stored(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        out.update(load_file(str(f)))
    return out


def vision_names(cfg) -> list[str]:
    return [n for n in expected_tensors(cfg, include_vision=True) if is_text_only_skippable(n)]


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (150, 200, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_checkpoint_holds_the_tower(vision_ckpt):
    names = vision_names(CFG)
    # 2 blocks x 8 (norm1, wqkv + bias, wo + bias, norm2, w1, w2) + patch embed 2 + norm + aligner 4 + image_* 3
    # + bias_vl on 10 layers and 2 DSpark stages
    assert len(names) == 2 * 8 + 2 + 1 + 4 + 3 + 12
    weight_map = json.loads((vision_ckpt / INDEX_FILE).read_text())["weight_map"]
    assert set(names) <= set(weight_map)
    config = json.loads((vision_ckpt / "config.json").read_text())["vision_config"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["max_image_tokens"]) == (2, 64, 64)


def test_load_reads_every_vision_tensor(vision_ckpt, loaded):
    state = loaded.model.state_dict()
    on_disk = stored(vision_ckpt)
    for name in vision_names(CFG):
        assert state[name].dtype == on_disk[name].dtype and torch.equal(state[name], on_disk[name]), name
    assert loaded.cfg.has_vision and loaded.model.layers[3].ffn.gate.bias_vl.shape == (CFG.n_routed_experts,)
    assert loaded.model.mtp[1].ffn.gate.bias_vl.shape == (CFG.dspark_n_routed_experts,)


def test_loaded_tower_encodes_images(loaded):
    rows = []
    for seed in (0, 1):
        image = process_image(png(seed), loaded.cfg)  # 200 x 150: 210 x 154 px, 11 x 15 patches, 4 x 5 rows
        g = image.grid
        assert (g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w, g.num_tokens) == (11, 15, 4, 5, 26)
        rows.append(encode_image(loaded.model.vision, loaded.model.aligner, image.patches, g.n_vit_h, g.n_vit_w))
    assert rows[0].shape == (20, CFG.dim) and rows[0].dtype == torch.bfloat16
    assert torch.isfinite(rows[0].float()).all() and not torch.equal(rows[0], rows[1])


def test_text_only_load_skips_the_tower(vision_ckpt):
    text = load_model(vision_ckpt, progress=False, with_vision=False)
    assert not text.cfg.has_vision and not hasattr(text.model, "vision")
    assert not any(is_text_only_skippable(n) for n in text.model.state_dict())
    weights = load_checkpoint(vision_ckpt, tiny_config(), progress=False)  # a text-only config, same text layout
    assert not any(is_text_only_skippable(n) for n in weights)


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of src whose shards' tensors are edited by edit(dict) (the index follows the shards)."""
    shutil.copytree(src, dst)
    weight_map = {}
    for f in sorted(dst.glob("model-*.safetensors")):
        tensors = load_file(str(f))
        if f.name == sorted(p.name for p in dst.glob("model-*.safetensors"))[-1]:
            edit(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f.name))
    index = json.loads((dst / INDEX_FILE).read_text())
    index["weight_map"] = weight_map
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return dst


def test_a_missing_vision_tensor_is_named(vision_ckpt, tmp_path):
    victim = "vision.blocks.1.mlp.w2.weight"
    dst = edited_copy(vision_ckpt, tmp_path / "missing", lambda t: t.pop(victim))
    with pytest.raises(CheckpointError, match=f"missing tensor {victim} \\(BF16 \\[64, 128\\]\\)"):
        load_checkpoint(dst, CFG, progress=False)
    load_checkpoint(dst, tiny_config(), progress=False)  # text-only: not needed


def test_an_extra_vision_block_is_unexpected(vision_ckpt, tmp_path):
    extra = "vision.blocks.2.norm1.weight"
    dst = edited_copy(vision_ckpt, tmp_path / "extra", lambda t: t.update({extra: torch.ones(64).bfloat16()}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor {extra}"):
        load_checkpoint(dst, CFG, progress=False)
