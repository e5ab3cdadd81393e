"""Exact top-k and candidate-block selection vs the golden (engine.model.attention stable_topk /
select_candidate_blocks / the end of Indexer.forward), bitwise: the same ids in the same order, the
same -1s, the same masks. Scores include heavy ties (a few bf16 values, -0 and +0, +-inf), all -inf
rows, rows with fewer than k visible entries, k > T, NaN, and several chunks per row.
"""

import pytest
import torch

from engine.kernels.topk import (candidate_block_mask, candidate_blocks, candidate_blocks_ref, entry_slots,
                                 index_topk, index_topk_ref)
from engine.presets import full_config, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # interpreter
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the three ways through index_topk: multi-program radix select, one program per row, int64 keys + torch.topk
PATHS = {"grid": dict(row_max_t=0), "row": dict(row_max_t=1 << 30), "keys": dict(method="keys")}
TIE_VALUES = (float("-inf"), -2.5, -0.0, 0.0, 0.0078125, 1.0, 3.0, float("inf"))


def _scores(m: int, t: int, kind: str, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [m, t] scores with invisible entries -inf, and visible [m] (row 1 sees nothing, row 2 few)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        s = torch.randn(m, t, generator=g).bfloat16()
    elif kind == "ties":
        s = torch.tensor(TIE_VALUES).bfloat16()[torch.randint(0, len(TIE_VALUES), (m, t), generator=g)]
    elif kind == "few":  # 3 finite values: every threshold bin is crowded
        s = torch.tensor([-1.0, 0.5, 2.0]).bfloat16()[torch.randint(0, 3, (m, t), generator=g)]
    else:
        assert kind == "const", kind
        s = torch.zeros(m, t, dtype=torch.bfloat16)
    visible = torch.randint(0, t + 1, (m,), generator=g)
    visible[0] = t
    if m > 1:
        visible[1] = 0
    if m > 2:
        visible[2] = min(t, 5)
    s = s.masked_fill(torch.arange(t) >= visible.unsqueeze(-1), float("-inf"))
    return s.to(device), visible.to(device)


def _check_ids(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.int32 and out.shape == ref.shape, (what, out.dtype, tuple(out.shape), tuple(ref.shape))
    bad = (out != ref).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.size(0)} ids differ, first at {tuple(bad[0].tolist())}: "
                              f"got {out[tuple(bad[0])]} want {ref[tuple(bad[0])]}")


def _check_mask(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.bool and out.shape == ref.shape, (what, out.dtype, tuple(out.shape), tuple(ref.shape))
    bad = (out != ref).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.size(0)} mask entries differ, first at {tuple(bad[0].tolist())}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["random", "ties", "few"])
@pytest.mark.parametrize("t", [37, 100, 257])
def test_index_topk_matches_golden(t, kind, path):
    s, _ = _scores(4, t, kind, seed=t)
    for k in (8, 64, 300):  # 300 > T: min(k, T) columns, the -inf tail picked in position order
        out = index_topk(s, k, chunk=32 if t <= 128 else 64, **PATHS[path])  # 2-5 chunks per row
        _check_ids(out, index_topk_ref(s, k), f"T={t} {kind} k={k} {path}")


def test_index_topk_single_chunk_and_const_rows():
    s, _ = _scores(3, 100, "const", seed=1)
    for chunk in (16, 128, 4096):
        for path in ("grid", "row"):
            out = index_topk(s, 8, chunk=chunk, **PATHS[path])
            _check_ids(out, index_topk_ref(s, 8), f"const chunk={chunk} {path}")
    s, _ = _scores(3, 257, "ties", seed=2)
    _check_ids(index_topk(s, 64), index_topk_ref(s, 64), "ties, default chunk")


def test_signed_zero_nan_and_inf_order():
    """-0 ties with +0 (lower index wins), NaN sorts above +inf and is not attended, +inf is."""
    row = [0.0, -0.0, float("nan"), 1.0, float("inf"), -0.0, float("-inf"), 0.0, -float("nan"), -1.0]
    s = torch.tensor([row, row[::-1]]).bfloat16()
    for k in (1, 2, 3, 5, 8, 10):
        for path, kw in PATHS.items():
            _check_ids(index_topk(s, k, chunk=16, **kw), index_topk_ref(s, k), f"k={k} {path}")


@pytest.mark.parametrize("block", [1, 4, 8])
def test_index_topk_with_candidates(block):
    t = 100
    s, _ = _scores(3, t, "ties", seed=block)
    g = torch.Generator().manual_seed(block)
    cand = torch.rand(3, -(-t // block), generator=g) < 0.4
    cand[0] = False  # a row with no candidates: every pick is -1
    for k in (8, 64):
        for path, kw in PATHS.items():
            _check_ids(index_topk(s, k, cand, block, chunk=32, **kw), index_topk_ref(s, k, cand, block),
                       f"block={block} k={k} {path}")


@pytest.mark.parametrize("kind", ["random", "ties", "few"])
@pytest.mark.parametrize("t,topk_blocks,block", [(37, 3, 4), (100, 5, 8), (257, 9, 8), (100, 100, 4), (257, 20, 3)])
def test_candidate_blocks_matches_golden(t, topk_blocks, block, kind):
    s, visible = _scores(4, t, kind, seed=t + block)
    ref = candidate_blocks_ref(s, visible, topk_blocks, block)
    what = f"T={t} {kind} topk_blocks={topk_blocks} block={block}"
    _check_mask(candidate_blocks(s, visible, topk_blocks, block, chunk=16, row_max_t=0), ref, what + " grid")
    bm = candidate_block_mask(s, visible, topk_blocks, block, chunk=16, row_max_t=1 << 30)
    assert bm.shape == (4, -(-t // block))
    # the block form feeds index_topk directly: the Reindex layer's masked top-k
    _check_mask(bm.repeat_interleave(block, dim=-1)[:, :t], ref, what + " row")
    _check_ids(index_topk(s, 16, bm, block, chunk=32), index_topk_ref(s, 16, ref), what + " -> index_topk")


def test_tiny_config_pipeline():
    """The tiny preset's numbers: candidate source picks 3 blocks of 4, then top-8 inside them."""
    cfg = tiny_config()
    s, visible = _scores(5, 61, "ties", seed=3)
    ref_cand = candidate_blocks_ref(s, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    bm = candidate_block_mask(s, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size, chunk=16)
    _check_ids(index_topk(s, cfg.index_topk, bm, cfg.candidate_block_size, chunk=16),
               index_topk_ref(s, cfg.index_topk, ref_cand), "tiny pipeline")


def test_empty():
    s = torch.zeros(0, 50, dtype=torch.bfloat16)
    assert index_topk(s, 8).shape == (0, 8)
    assert candidate_blocks(s, torch.zeros(0, dtype=torch.int64), 3, 4).shape == (0, 50)
    s = torch.zeros(2, 0, dtype=torch.bfloat16)
    assert index_topk(s, 8).shape == (2, 0)
    assert candidate_blocks(s, torch.zeros(2, dtype=torch.int64), 3, 4).shape == (2, 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["random", "ties", "few", "const"])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("t", [4096, 65536, 1 << 20])
def test_real_shapes(t, m, kind):
    cfg = full_config()
    s, visible = _scores(m, t, kind, seed=t + m, device="cuda")
    what = f"T={t} M={m} {kind}"
    ref = index_topk_ref(s, cfg.index_topk)
    for path, kw in PATHS.items():
        _check_ids(index_topk(s, cfg.index_topk, **kw), ref, f"{what} {path}")
    kb, blk = cfg.candidate_topk_blocks, cfg.candidate_block_size
    ref_cand = candidate_blocks_ref(s, visible, kb, blk)
    for path in ("grid", "row"):
        _check_mask(candidate_blocks(s, visible, kb, blk, **PATHS[path]), ref_cand, f"{what} candidates {path}")
    bm = candidate_block_mask(s, visible, kb, blk)
    ref = index_topk_ref(s, cfg.index_topk, ref_cand)
    for path, kw in PATHS.items():
        _check_ids(index_topk(s, cfg.index_topk, bm, blk, **kw), ref, f"{what} in candidates {path}")


def check_entry_slots(dtype, device):
    """entry_slots is torch's where(ids >= 0, entries[ids.clamp_min(0)], -1) written into the first K columns of
    each row, with -1 in the rest (the runner's main_idx rows)."""
    g = torch.Generator().manual_seed(3)
    entries = torch.randperm(1 << 20, generator=g)[:4099].to(torch.int32)
    for m, k, w in ((1, 5, 5), (3, 7, 13), (2, 0, 4), (4, 64, 64), (6, 512, 512)):
        ids = torch.randint(-1, entries.numel(), (m, k), generator=g).to(dtype)
        out = torch.full((m, w), 123, dtype=torch.int32)
        want = torch.full((m, w), -1, dtype=torch.int32)
        want[:, :k] = torch.where(ids >= 0, entries[ids.clamp_min(0).long()], -1)
        out, ids_d, entries_d = out.to(device), ids.to(device), entries.to(device)
        entry_slots(ids_d, entries_d, out)
        assert torch.equal(out.cpu(), want), (m, k, w)
        rows = torch.randperm(1 << 20, generator=g)[:m * 4099].view(m, 4099).to(torch.int32)  # [m, E]: per row
        want[:, :k] = torch.where(ids >= 0, rows.gather(1, ids.clamp_min(0).long()), -1)
        entry_slots(ids_d, rows.to(device), out)
        assert torch.equal(out.cpu(), want), ("per-row entries", m, k, w)
    with pytest.raises(AssertionError, match="int32 entries"):
        entry_slots(ids_d, entries_d.long(), out)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_entry_slots_cpu(dtype):
    check_entry_slots(dtype, "cpu")


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_entry_slots_gpu():
    check_entry_slots(torch.int32, "cuda")
