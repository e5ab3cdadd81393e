"""The tiny-checkpoint generator writes the released format, deterministically, with sane statistics;
`--preset full` prints the spec's accounting."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint import expected_tensors, load_checkpoint
from engine.config import ModelConfig, load_config
from engine.engram_tables import TOKEN_MAP_CACHE_PREFIX
from engine.quant import dequant_fp4_weight, dequant_fp8_weight
from engine.tokenizer import load_tokenizer
from engine.tools.make_checkpoint import main, make_checkpoint, split_shards, unquantized_weight

REPO = Path(__file__).resolve().parents[2]
SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hashes(ckpt: Path) -> dict[str, str]:
    """The checkpoint's files by hash, without the Engram token-map cache a model load may have added since
    (engine/engram_tables.py writes it beside the tokenizer: the session's checkpoint gains it once loaded)."""
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*")) if p.is_file() and not p.name.startswith(TOKEN_MAP_CACHE_PREFIX)}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint, tiny_cfg):
    return load_checkpoint(tiny_checkpoint, tiny_cfg, progress=False)


def test_released_file_layout(tiny_checkpoint, tiny_cfg):
    shards = sorted(p.name for p in tiny_checkpoint.glob("*.safetensors"))
    matches = [SHARD_RE.fullmatch(s) for s in shards]
    assert all(matches) and len(shards) >= 2
    n = len(shards)
    assert [(int(m[1]), int(m[2])) for m in matches] == [(k, n) for k in range(1, n + 1)]
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    headers = {s: _header(tiny_checkpoint / s) for s in shards}
    assert index["weight_map"] == {name: s for s, h in headers.items() for name in h}
    assert index["metadata"]["total_size"] == sum(
        e - b for h in headers.values() for b, e in (v["data_offsets"] for v in h.values()))
    assert set(index["weight_map"]) == set(expected_tensors(tiny_cfg))
    dtypes = {name: v["dtype"] for h in headers.values() for name, v in h.items()}
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == "I8"
    assert dtypes["layers.0.attn.wo_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wo_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.engram.embed.weight"] == "F8_E4M3" and dtypes["layers.1.engram.embed.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.gate.bias"] == "F32" and dtypes["embed.weight"] == "BF16"


def test_configs_and_tokenizer(tiny_checkpoint, tiny_cfg):
    hf = json.loads((tiny_checkpoint / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV41ForCausalLM"] and hf["text_config"]["hidden_size"] == 256
    assert load_config(tiny_checkpoint) == tiny_cfg
    ref = json.loads((tiny_checkpoint / "inference" / "config.json").read_text())
    assert ref["dim"] == 256 and ModelConfig.from_reference(ref) == tiny_cfg
    tok = load_tokenizer(tiny_checkpoint)
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_deterministic_across_runs_and_processes(tiny_checkpoint, tiny_cfg, tiny_seed, tmp_path):
    want = _hashes(tiny_checkpoint)
    assert _hashes(make_checkpoint(tmp_path / "again", tiny_cfg, tiny_seed)) == want
    out = tmp_path / "subprocess"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    subprocess.run([sys.executable, "-m", "engine.tools.make_checkpoint", str(out), "--preset", "tiny",
                    "--seed", str(tiny_seed)], cwd=REPO, env=env, check=True, capture_output=True)
    assert _hashes(out) == want


def test_seed_changes_weights(tiny_cfg):
    spec = expected_tensors(tiny_cfg)["layers.2.attn.wq_b.weight"]
    assert not torch.equal(unquantized_weight(spec, 0), unquantized_weight(spec, 1))
    assert torch.equal(unquantized_weight(spec, 7), unquantized_weight(spec, 7))


def _rms(t: torch.Tensor) -> float:
    return t.float().square().mean().sqrt().item()


def test_statistics_follow_the_release(loaded, tiny_cfg):
    """testing.py's recipe: embed RMS 0.12, per-owner norm means, projections gain / sqrt(fan_in)."""
    assert _rms(loaded["embed.weight"]) == pytest.approx(0.12, rel=0.01)
    means = {"attn_norm": 0.025, "ffn_norm": 0.2, "attn.q_norm": 0.97, "attn.kv_norm": 0.4,
             "attn.compressor.norm": 0.6, "attn.indexer.k_norm": 0.5}
    for owner, mean in means.items():
        w = loaded[f"layers.2.{owner}.weight"].float()
        assert w.mean().item() == pytest.approx(mean, rel=0.03), owner
        assert (w.std() / w.mean()).item() == pytest.approx(0.1, rel=0.3), owner
    assert loaded["norm.weight"].float().mean().item() == pytest.approx(1.0, rel=0.03)
    fan_in = tiny_cfg.dim
    for name, gain in (("attn.wq_a", 1.6), ("attn.wkv", 1.8), ("ffn.shared_experts.w1", 1.5)):
        w = dequant_fp8_weight(loaded[f"layers.3.{name}.weight"], loaded[f"layers.3.{name}.scale"])
        assert _rms(w) == pytest.approx(gain / fan_in**0.5, rel=0.06), name
    experts = torch.cat([dequant_fp4_weight(loaded[f"layers.3.ffn.experts.{e}.w1.weight"],
                                            loaded[f"layers.3.ffn.experts.{e}.w1.scale"]) for e in range(8)])
    assert _rms(experts) == pytest.approx(1.5 / fan_in**0.5, rel=0.06)
    assert _rms(loaded["layers.3.ffn.gate.weight"]) == pytest.approx(2.9 / fan_in**0.5, rel=0.1)
    assert _rms(loaded["layers.3.hc_attn_fn"]) == pytest.approx((4 * fan_in) ** -0.5, rel=0.03)
    assert abs(loaded["layers.3.attn.attn_sink"].float()).max().item() < 3.0
    # router biases stay well below the spread of the router scores, so routing depends on the token
    assert loaded["layers.3.ffn.gate.bias"].std().item() == pytest.approx(0.05, rel=0.5)


def test_full_preset_prints_the_accounting(capsys, tmp_path):
    assert main(["--preset", "full"]) == 0
    out = capsys.readouterr().out
    for figure in ("763.2", "890", "2,703,360", "202,752", "543.58", "196.61", "14.23", "552.37"):
        assert figure in out, figure
    assert not list(tmp_path.iterdir())


def test_cli_needs_out_for_tiny(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--preset", "tiny"])
    assert info.value.code == 2
    assert "OUT is required" in capsys.readouterr().err


def test_split_shards():
    sizes = {"a": 10, "b": 10, "c": 25, "d": 1}
    assert split_shards(list(sizes), sizes, 20) == [["a", "b"], ["c"], ["d"]]
    assert split_shards(list(sizes), sizes, 10**9) == [["a", "b"], ["c", "d"]]  # always at least two
