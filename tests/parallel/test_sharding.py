"""The model-parallel layout without processes: the refusals naming the dimension, a rank's tensors against
slices of the whole checkpoint (read with get_slice), load errors naming the tensor and the rank, bytes per
rank, and the parallel linears' numerics (partial products summed by hand stand in for the all-reduce)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.layout import expected_tensors, parameter_report
from engine.checkpoint.loader import CheckpointError, load_checkpoint
from engine.checkpoint.sharding import bytes_per_rank, check_shardable
from engine.load import load_model
from engine.model.layers import ColumnParallelLinear, Linear, RowParallelLinear
from engine.parallel import ShardingError, ShardSpec
from engine.presets import full_config, tiny_config
from engine.quant import quant_fp8_weight, round_product

N = 2


@pytest.fixture(scope="module")
def whole(tiny_checkpoint, tiny_cfg) -> dict[str, torch.Tensor]:
    return load_checkpoint(tiny_checkpoint, tiny_cfg, progress=False)


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tiny_cfg) -> list[dict[str, torch.Tensor]]:
    return [load_checkpoint(tiny_checkpoint, tiny_cfg, progress=False, shard=ShardSpec(r, N)) for r in range(N)]


@pytest.mark.parametrize("num_shards, needle", [
    (4, "o_groups=2 is not divisible by 4 shards"),
    (3, "n_heads=4 is not divisible by 3 shards"),
    (8, "n_heads=4 is not divisible by 8 shards"),
    (0, "must be >= 1"),
])
def test_tiny_config_refuses_shard_counts_naming_the_dimension(tiny_cfg, num_shards, needle):
    with pytest.raises(ShardingError, match=needle):
        check_shardable(tiny_cfg, num_shards)


def test_refusals_for_experts_dspark_experts_and_fp8_blocks(tiny_cfg):
    check_shardable(tiny_cfg, 2, include_mtp=True)
    with pytest.raises(ShardingError, match="n_routed_experts=6 is not divisible by 4"):
        check_shardable(replace(tiny_cfg, n_heads=8, o_groups=4, n_routed_experts=6), 4)
    odd_dspark = replace(tiny_cfg, dspark_n_routed_experts=3)
    check_shardable(odd_dspark, 2)  # the engine loads no DSpark stages
    with pytest.raises(ShardingError, match="dspark_n_routed_experts=3 is not divisible by 2"):
        check_shardable(odd_dspark, 2, include_mtp=True)
    with pytest.raises(ShardingError, match="moe_inter_dim=96 over 2 shards gives 48"):
        check_shardable(replace(tiny_cfg, moe_inter_dim=96), 2)


def test_released_config_splits_over_4_and_8_not_16():
    cfg = full_config()
    for n in (1, 2, 4, 8):
        check_shardable(cfg, n, include_mtp=True)
    with pytest.raises(ShardingError, match="o_groups=8 is not divisible by 16"):
        check_shardable(cfg, 16)


def test_load_model_refuses_before_reading(tiny_checkpoint):
    with pytest.raises(ShardingError, match="o_groups"):
        load_model(tiny_checkpoint, progress=False, with_mtp=False, shard=ShardSpec(1, 4))


def test_rank_tensors_are_slices_of_the_whole(tiny_cfg, whole, ranks):
    c = tiny_cfg
    heads, groups, inter, vocab = c.n_heads // N, c.o_groups // N, c.moe_inter_dim // N, c.vocab_size // N
    for r, part in enumerate(ranks):
        # the layout written out by hand (independent of engine/checkpoint/sharding.py's table)
        q_rows = slice(r * heads * c.head_dim, (r + 1) * heads * c.head_dim)
        want = {
            "layers.2.attn.wq_b.weight": whole["layers.2.attn.wq_b.weight"][q_rows],
            "layers.2.attn.wq_b.scale": whole["layers.2.attn.wq_b.scale"][q_rows.start // 32:q_rows.stop // 32],
            "layers.2.attn.attn_sink": whole["layers.2.attn.attn_sink"][r * heads:(r + 1) * heads],
            "layers.5.attn.wo_a.weight": whole["layers.5.attn.wo_a.weight"][r * groups * c.o_lora_rank:
                                                                           (r + 1) * groups * c.o_lora_rank],
            "layers.5.attn.wo_b.weight": whole["layers.5.attn.wo_b.weight"][:, r * groups * c.o_lora_rank:
                                                                              (r + 1) * groups * c.o_lora_rank],
            "layers.5.attn.wo_b.scale": whole["layers.5.attn.wo_b.scale"][:, r * groups * c.o_lora_rank // 32:
                                                                            (r + 1) * groups * c.o_lora_rank // 32],
            "layers.7.ffn.shared_experts.w1.weight": whole["layers.7.ffn.shared_experts.w1.weight"][r * inter:(r + 1) * inter],
            "layers.7.ffn.shared_experts.w2.weight": whole["layers.7.ffn.shared_experts.w2.weight"][:, r * inter:(r + 1) * inter],
            "head.weight": whole["head.weight"][r * vocab:(r + 1) * vocab],
            "mtp.1.markov_head.head.weight": whole["mtp.1.markov_head.head.weight"][r * vocab:(r + 1) * vocab],
        }
        for name, t in want.items():
            assert torch.equal(part[name].view(torch.uint8), t.contiguous().view(torch.uint8)), f"rank {r}: {name}"
        for name in ("embed.weight", "layers.6.attn.wkv.weight", "layers.6.attn.indexer.wq_b.weight",
                     "layers.2.attn.compressor.wgate.weight", "layers.4.engram.embed.weight", "layers.3.ffn.gate.weight"):
            assert torch.equal(part[name].view(torch.uint8), whole[name].view(torch.uint8)), f"rank {r}: {name} whole"
        # every tensor a rank holds is its whole tensor or a contiguous 1/N of it at the rank's offset
        for name, t in part.items():
            full = whole[name]
            # compact: a column slice that kept its whole rows' storage would hold the whole tensor on every rank
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size(), \
                f"rank {r}: {name} {tuple(t.shape)} strides {t.stride()} over {t.untyped_storage().nbytes()} B"
            if t.shape == full.shape:
                assert torch.equal(t.view(torch.uint8), full.view(torch.uint8)), f"rank {r}: {name}"
                continue
            (dim,) = [d for d in range(t.dim()) if t.shape[d] != full.shape[d]]
            assert full.shape[dim] == N * t.shape[dim], f"rank {r}: {name} {tuple(t.shape)} of {tuple(full.shape)}"
            ref = full.narrow(dim, r * t.shape[dim], t.shape[dim]).contiguous()
            assert torch.equal(t.view(torch.uint8), ref.view(torch.uint8)), f"rank {r}: {name}"


def test_routed_experts_partition_over_ranks(tiny_cfg, whole, ranks):
    def experts(tensors: dict, layer: str) -> set[int]:
        prefix = f"{layer}.ffn.experts."
        return {int(n[len(prefix):].split(".")[0]) for n in tensors if n.startswith(prefix)}

    for layer, n in (("layers.0", tiny_cfg.n_routed_experts), ("mtp.0", tiny_cfg.dspark_n_routed_experts)):
        held = [experts(p, layer) for p in ranks]
        assert held == [set(range(r * n // N, (r + 1) * n // N)) for r in range(N)], layer
    assert set(whole) == set().union(*ranks)  # nothing is lost: the union of the ranks is the checkpoint


def copy_checkpoint_with(src: Path, dst: Path, victim: str, replacement: torch.Tensor | None) -> Path:
    """A copy of the checkpoint with one tensor dropped (replacement None) or replaced, index updated."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    fname = index["weight_map"][victim]
    tensors = load_file(dst / fname)
    if replacement is None:
        del tensors[victim]
        del index["weight_map"][victim]
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[victim] = replacement
    save_file(tensors, dst / fname, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("victim, replace_with, needles", [
    ("layers.3.attn.wo_b.weight", None, ["missing tensor layers.3.attn.wo_b.weight"]),
    ("layers.0.ffn.experts.6.w2.scale", None, ["missing tensor layers.0.ffn.experts.6.w2.scale"]),
    ("layers.1.attn.attn_sink", torch.zeros(6), ["tensor layers.1.attn.attn_sink has shape [6], expected [4]"]),
])
def test_load_errors_name_the_tensor_and_the_rank(tiny_checkpoint, tiny_cfg, tmp_path, victim, replace_with, needles):
    broken = copy_checkpoint_with(tiny_checkpoint, tmp_path / "broken", victim, replace_with)
    for r in range(N):
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(broken, tiny_cfg, progress=False, shard=ShardSpec(r, N))
        for needle in [f"rank {r} of {N}", *needles]:
            assert needle in str(err.value), str(err.value)


def test_bytes_per_rank_of_the_released_config():
    cfg = full_config()
    whole = {row.component: row.num_bytes for row in parameter_report(cfg, include_vision=False)}
    specs = expected_tensors(cfg)
    head = specs["head.weight"].nbytes
    for n in (4, 8):
        per_rank = bytes_per_rank(cfg, n)
        assert per_rank["routed experts"] * n == whole["routed experts"]
        assert per_rank["shared experts"] * n == whole["shared experts"]
        assert per_rank["embed + head"] == whole["embed + head"] - head + head // n
        for replicated in ("gates, mHC, norms", "Engram tables", "Engram dense"):
            assert per_rank[replicated] == whole[replicated], replicated
        assert whole["attention"] / n < per_rank["attention"] < whole["attention"]
    assert bytes_per_rank(cfg, 1) == {k: v for k, v in whole.items() if k != "total" and v}


def _fp8_linear(cls, in_f: int, out_f: int, shard: ShardSpec, w: torch.Tensor) -> Linear:
    """A Linear of `cls` for `shard` holding its part of the FP8-quantised w (sliced as the loader slices)."""
    q, s = quant_fp8_weight(w)
    lin = cls(in_f, out_f, "fp8") if cls is Linear else cls(in_f, out_f, "fp8", shard)
    if cls is ColumnParallelLinear:
        k = out_f // shard.world_size
        q, s = q[shard.rank * k:(shard.rank + 1) * k], s[shard.rank * k // 32:(shard.rank + 1) * k // 32]
    elif cls is RowParallelLinear:
        k = in_f // shard.world_size
        q, s = q[:, shard.rank * k:(shard.rank + 1) * k], s[:, shard.rank * k // 32:(shard.rank + 1) * k // 32]
    lin.weight, lin.scale = q.contiguous(), s.contiguous()
    return lin


def test_parallel_linears_compute_the_whole_linear():
    """Column-parallel outputs concatenate to the whole product bit for bit; row-parallel float64 partials
    summed before the one rounding give it up to float64 summation order (here: every bit)."""
    g = torch.Generator().manual_seed(3)
    in_f, out_f, n = 256, 384, 4
    w = torch.randn(out_f, in_f, generator=g) * in_f ** -0.5
    x = torch.randn(37, in_f, generator=g).bfloat16()  # odd row count
    want = _fp8_linear(Linear, in_f, out_f, ShardSpec(), w)(x)
    cols = [_fp8_linear(ColumnParallelLinear, in_f, out_f, ShardSpec(r, n), w) for r in range(n)]
    assert torch.equal(torch.cat([c(x) for c in cols], dim=-1), want)
    k = in_f // n
    rows = [_fp8_linear(RowParallelLinear, in_f, out_f, ShardSpec(r, n), w) for r in range(n)]
    total = sum(rw.partial(x[:, r * k:(r + 1) * k]) for r, rw in enumerate(rows))
    got = round_product(total, rows[0].weight)
    diff = (got.float() - want.float()).abs()
    assert torch.equal(got, want), f"max |diff| {diff.max():.3g} at {divmod(int(diff.argmax()), out_f)}"


def test_make_checkpoint_prints_bytes_per_rank(capsys):
    from engine.tools.make_checkpoint import main

    assert main(["--preset", "full", "--num-shards", "8"]) == 0
    out = capsys.readouterr().out
    assert "per rank at --num-shards 8" in out
    routed = next(line for line in out.splitlines() if line.startswith("routed experts") and line.count("GB") == 2)
    whole, per_rank = (float(v) for v in routed.split()[2:6:2])
    assert abs(whole / 8 - per_rank) < 0.01, routed
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "full", "--num-shards", "16"])
    assert exit_info.value.code == 2 and "o_groups=8 is not divisible by 16" in capsys.readouterr().err
