"""load_checkpoint on the tiny checkpoint: every tensor round-trips, and each kind of damage is reported
as a CheckpointError that names the tensor or file. Damaged copies symlink the untouched shards."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import CheckpointError, expected_tensors, load_checkpoint
from engine.config import load_config
from engine.quant import act_quant, dequant_fp4_weight, dequant_fp8_weight, quant_fp4_weight, quant_fp8_weight
from engine.tools.make_checkpoint import unquantized_weight

INDEX = "model.safetensors.index.json"
VICTIM = "layers.5.attn.wq_a.weight"  # lives in the small middle shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint, tiny_cfg):
    return load_checkpoint(tiny_checkpoint, tiny_cfg)


def _weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX).read_text())["weight_map"]


def _copy(src: Path, dst: Path) -> Path:
    """dst: JSON files copied (editable), everything else symlinked to src."""
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".json" and path.name != "tokenizer.json":
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    return dst


def _edit_shard(src: Path, dst: Path, shard: str, edit) -> None:
    tensors = load_file(src / shard)
    edit(tensors)
    (dst / shard).unlink()
    save_file(tensors, dst / shard, metadata={"format": "pt"})


def _edit_index(dst: Path, edit) -> None:
    index = json.loads((dst / INDEX).read_text())
    edit(index["weight_map"])
    (dst / INDEX).write_text(json.dumps(index))


def _load_error(ckpt: Path, cfg) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, cfg, progress=False)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def _expand_fp8_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    s = scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    return s[: shape[0], : shape[1]]


def test_loads_every_tensor_in_storage_dtypes(loaded, tiny_cfg):
    specs = expected_tensors(tiny_cfg)
    assert set(loaded) == set(specs)
    want = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.uint8,
            "BF16": torch.bfloat16, "F32": torch.float32}
    for name, spec in specs.items():
        t = loaded[name]
        assert (t.dtype, tuple(t.shape)) == (want[spec.dtype], spec.shape), name
    # the model dequantises wo_a itself
    assert loaded["layers.0.attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    assert loaded["layers.0.attn.wo_a.scale"].dtype == torch.float8_e8m0fnu


def test_every_tensor_round_trips(loaded, tiny_cfg, tiny_seed):
    """Stored bits == quantising the regenerated weight; dequantised values within the format's bound."""
    for name, spec in expected_tensors(tiny_cfg).items():
        if name.endswith(".scale"):
            continue
        w = unquantized_weight(spec, tiny_seed)  # fp32, logical shape
        t = loaded[name]
        scale = loaded.get(name.removesuffix(".weight") + ".scale")
        if name.endswith("engram.embed.weight"):
            q, s = act_quant(w.to(torch.bfloat16))
            assert torch.equal(t.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(scale.float(), s), name
            s_elem = scale.float().repeat_interleave(32, 1)
            deq = t.float() * s_elem
            bound = torch.maximum(w.abs() * 2**-4, s_elem * 2**-10)  # e4m3: half ULP (normal / subnormal)
        elif spec.dtype == "F8_E4M3":
            q, s = quant_fp8_weight(w)
            assert torch.equal(t.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(scale.view(torch.uint8), s.view(torch.uint8)), name
            deq = dequant_fp8_weight(t, scale)
            bound = torch.maximum(w.abs() * 2**-4, _expand_fp8_scale(scale, w.shape) * 2**-10)
        elif spec.dtype == "I8":
            q, s = quant_fp4_weight(w)
            assert torch.equal(t, q), name
            assert torch.equal(scale.view(torch.uint8), s.view(torch.uint8)), name
            deq = dequant_fp4_weight(t, scale)
            # e2m1 grid 0, .5, 1, 1.5, 2, 3, 4, 6: half a gap is <= max(0.25, |v| / 4) scale units
            bound = torch.maximum(scale.float().repeat_interleave(32, 1) * 0.25, w.abs() / 4)
        else:
            assert torch.equal(t, w.to(t.dtype)), name
            continue
        err = (deq - w).abs()
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (
            f"{name}: |dequant - original| {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} "
            f"at flat index {worst} (original {w.flatten()[worst]:.4g})")


def test_include_mtp_false_skips_dspark(tiny_checkpoint, tiny_cfg, tmp_path):
    loaded = load_checkpoint(tiny_checkpoint, tiny_cfg, include_mtp=False, progress=False)
    assert loaded and not any(n.startswith("mtp.") for n in loaded)
    # and a checkpoint without mtp.* still loads that way
    dst = _copy(tiny_checkpoint, tmp_path / "no_mtp")
    wm = _weight_map(dst)
    for shard in sorted({s for n, s in wm.items() if n.startswith("mtp.")}):
        _edit_shard(tiny_checkpoint, dst, shard, lambda t: [t.pop(n) for n in list(t) if n.startswith("mtp.")])
    _edit_index(dst, lambda m: [m.pop(n) for n in list(m) if n.startswith("mtp.")])
    assert set(load_checkpoint(dst, tiny_cfg, include_mtp=False, progress=False)) == set(loaded)
    msg = _load_error(dst, tiny_cfg)
    assert "config.json says n_mtp_layers=2 but the checkpoint has no mtp.0..1" in msg
    assert "missing tensor mtp.0.attn.attn_sink" in msg


def test_single_file_checkpoint(loaded, tiny_checkpoint, tiny_cfg, tmp_path):
    shutil.copyfile(tiny_checkpoint / "config.json", tmp_path / "config.json")
    tensors = {n: (t.view(torch.int8) if t.dtype == torch.uint8 else t) for n, t in loaded.items()}
    save_file(tensors, tmp_path / "model.safetensors")
    again = load_checkpoint(tmp_path, load_config(tmp_path), progress=False)
    assert set(again) == set(loaded)
    assert all(torch.equal(again[n].view(torch.uint8), loaded[n].view(torch.uint8))
               for n in ("layers.3.ffn.experts.2.w2.weight", "layers.3.ffn.experts.2.w2.scale", "embed.weight"))
    del tensors[VICTIM]
    save_file(tensors, tmp_path / "model.safetensors")
    msg = _load_error(tmp_path, tiny_cfg)
    assert f"missing tensor {VICTIM}" in msg and "model.safetensors does not contain it" in msg


def test_packed_fp4_accepts_u8_and_f4_labels(tiny_checkpoint, tiny_cfg, loaded, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "labels")
    u8, f4 = "layers.5.ffn.experts.0.w1.weight", "layers.5.ffn.experts.1.w2.weight"

    def relabel(t):
        t[u8] = t[u8].view(torch.uint8)
        t[f4] = t[f4].view(torch.float4_e2m1fn_x2)

    _edit_shard(tiny_checkpoint, dst, _weight_map(dst)[u8], relabel)
    again = load_checkpoint(dst, tiny_cfg, progress=False)
    for name in (u8, f4):
        assert again[name].dtype == torch.uint8 and torch.equal(again[name], loaded[name])


def test_missing_tensor_names_its_shard(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "missing")
    shard = _weight_map(dst)[VICTIM]
    _edit_shard(tiny_checkpoint, dst, shard, lambda t: t.pop(VICTIM))
    _edit_index(dst, lambda m: m.pop(VICTIM))
    msg = _load_error(dst, tiny_cfg)
    assert f"missing tensor {VICTIM}" in msg and f"expected in {shard}" in msg


def test_tensor_in_index_but_not_in_shard(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "not_in_shard")
    shard = _weight_map(dst)[VICTIM]
    _edit_shard(tiny_checkpoint, dst, shard, lambda t: t.pop(VICTIM))
    msg = _load_error(dst, tiny_cfg)
    assert f"missing tensor {VICTIM}" in msg and f"maps it to {shard}, which does not contain it" in msg


def test_wrong_shape(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "shape")

    def reshape(t):
        t[VICTIM] = t[VICTIM][:32].contiguous()

    _edit_shard(tiny_checkpoint, dst, _weight_map(dst)[VICTIM], reshape)
    msg = _load_error(dst, tiny_cfg)
    assert f"tensor {VICTIM} has shape [32, 256], expected [64, 256]" in msg


def test_wrong_dtype(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "dtype")
    name = "layers.5.attn_norm.weight"

    def to_f32(t):
        t[name] = t[name].float()

    _edit_shard(tiny_checkpoint, dst, _weight_map(dst)[name], to_f32)
    msg = _load_error(dst, tiny_cfg)
    assert f"tensor {name} has dtype F32, expected BF16" in msg


def test_unexpected_tensor(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "unexpected")
    extra = "layers.5.attn.wq_c.weight"
    shard = _weight_map(dst)[VICTIM]
    _edit_shard(tiny_checkpoint, dst, shard, lambda t: t.update({extra: torch.zeros(4, 4)}))
    _edit_index(dst, lambda m: m.update({extra: shard}))
    msg = _load_error(dst, tiny_cfg)
    assert f"unexpected tensor {extra}" in msg
    # vision-only tensors are skipped, not unexpected
    _edit_shard(tiny_checkpoint, dst, shard, lambda t: t.update({"aligner.w1.bias": torch.zeros(4)}))
    _edit_index(dst, lambda m: (m.pop(extra), m.update({"aligner.w1.bias": shard})))
    assert "aligner.w1.bias" not in load_checkpoint(dst, tiny_cfg, progress=False)


def test_shard_tensor_not_listed_in_index(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "unlisted")
    _edit_index(dst, lambda m: m.pop(VICTIM))
    msg = _load_error(dst, tiny_cfg)
    assert f"tensor {VICTIM} is in shard" in msg and "does not list it" in msg


def test_index_lists_tensor_no_shard_holds(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "ghost")
    shard = _weight_map(dst)[VICTIM]
    _edit_index(dst, lambda m: m.update({"layers.5.attn.ghost.weight": shard}))
    msg = _load_error(dst, tiny_cfg)
    assert f"maps tensor layers.5.attn.ghost.weight to {shard}, which does not contain it" in msg


def test_truncated_shard(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "truncated")
    shard = _weight_map(dst)[VICTIM]
    data = (tiny_checkpoint / shard).read_bytes()
    (dst / shard).unlink()
    (dst / shard).write_bytes(data[: len(data) - 1000])
    msg = _load_error(dst, tiny_cfg)
    assert f"shard {shard} is truncated or corrupt" in msg and "ends at byte" in msg


def test_corrupt_header(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "header")
    shard = _weight_map(dst)[VICTIM]
    data = bytearray((tiny_checkpoint / shard).read_bytes())
    data[8:16] = b"\x00garbage"
    (dst / shard).unlink()
    (dst / shard).write_bytes(bytes(data))
    msg = _load_error(dst, tiny_cfg)
    assert f"shard {shard} is truncated or corrupt: header is not valid JSON" in msg


def test_index_names_missing_shard(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "no_shard")
    _edit_index(dst, lambda m: m.update({VICTIM: "model-00009-of-00004.safetensors"}))
    msg = _load_error(dst, tiny_cfg)
    assert "model-00009-of-00004.safetensors, which does not exist" in msg and VICTIM in msg


def test_bad_index_and_empty_dir(tiny_checkpoint, tiny_cfg, tmp_path):
    assert "neither" in _load_error(tmp_path, tiny_cfg)
    dst = _copy(tiny_checkpoint, tmp_path / "bad_index")
    (dst / INDEX).write_text('{"metadata": {}}')
    assert "weight_map" in _load_error(dst, tiny_cfg)
    (dst / INDEX).write_text("{not json")
    assert "not valid JSON" in _load_error(dst, tiny_cfg)


def test_config_that_does_not_match_the_weights(tiny_checkpoint, tiny_cfg, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path / "dim")
    hf = json.loads((dst / "config.json").read_text())
    hf["text_config"]["hidden_size"] = 512
    (dst / "config.json").write_text(json.dumps(hf))
    cfg = load_config(dst)
    assert cfg.dim == 512
    msg = _load_error(dst, cfg)
    assert "config.json says dim=512 but embed.weight is [129280, 256]" in msg
    msg = _load_error(tiny_checkpoint, replace(tiny_cfg, n_routed_experts=16))
    assert "config.json says n_routed_experts=16 but layers.0.ffn.gate.weight is [8, 256]" in msg
    assert "missing tensor layers.0.ffn.experts.8.w1.weight" in msg


def test_no_progress_bar_without_tty(tiny_checkpoint, tiny_cfg, capfd):
    load_checkpoint(tiny_checkpoint, tiny_cfg, include_mtp=False)
    assert capfd.readouterr().err == ""
