"""benchmarks/rank_decode.py, the GPU measurement of one rank alone, on the CPU: --help, a rank's random model holds
exactly the layout's bytes, the released config's rank 0 of 8 fits one GPU, and a smoke run of the harness (tiny
preset, rank 0 of 2, solo, the decode step eagerly through the engine) that prints the projection."""

from __future__ import annotations

import pytest

from benchmarks import rank_decode
from benchmarks.random_model import random_model, released_config
from engine.checkpoint.sharding import bytes_per_rank
from engine.parallel import ShardSpec
from engine.presets import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def device_weights(layout: dict[str, int]) -> int:
    return sum(b for c, b in layout.items() if c != "Engram tables")


def test_help_works_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as done:
        rank_decode.main(["--help"])
    assert done.value.code == 0 and "--num-shards" in capsys.readouterr().out


def test_a_solo_rank_builds_only_its_slices():
    cfg = tiny_config()
    model = random_model(cfg, "cpu", shard=ShardSpec(1, 2, solo=True))
    assert rank_decode.device_bytes(model) == device_weights(bytes_per_rank(cfg, 2, include_mtp=False))
    moe, attn = model.layers[3].ffn, model.layers[3].attn
    assert list(moe.local_experts) == [4, 5, 6, 7] and moe.experts[0] is None and moe.experts[4] is not None
    assert (attn.n_local_heads, attn.n_local_groups, attn.attn_sink.numel()) == (2, 1, 2)
    assert model.head.weight.size(0) == cfg.vocab_size // 2


def test_released_rank_0_of_8_fits_one_gpu():
    cfg = released_config(4096)
    assert cfg.n_layers == 40
    weights = device_weights(bytes_per_rank(cfg, 8, include_mtp=False))
    assert 39e9 < weights < 40e9, f"{weights / 1e9:.2f} GB"  # 39.43 GB: an H100's 80 GB holds it, KV and graphs


@pytest.mark.slow
def test_smoke_run_prints_the_projection(capsys):
    rank_decode.main(["--preset", "tiny", "--device", "cpu", "--num-shards", "2", "--rank", "0", "--tokens", "1",
                      "--steps", "1", "--warmup", "0", "--prompt-len", "4", "--cache-mib", "64"])
    out = capsys.readouterr().out
    assert "rank 0 of 2 (tiny, 10 layers, solo)" in out
    assert "+ 20 x 7 us | + 20 x 13 us" in out  # 2 all-reduces a layer, 10 layers
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    step_ms, _, at_7, at_13 = (float(v) if v.strip() != "-" else None for v in row.split("|")[2:6])
    assert step_ms > 0 and at_7 == pytest.approx(step_ms + 0.14, abs=2e-3) and at_13 == pytest.approx(step_ms + 0.26,
                                                                                                        abs=2e-3)
