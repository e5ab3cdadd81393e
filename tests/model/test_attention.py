"""CSA2 attention pieces against independent expectations (spec 3, 4.4): sparse_attn against a naive
per-query softmax loop, window / candidate-block / top-k index rules on hand cases, and the ratio-2
compressor against a hand-computed pooled group and against itself called in pieces (pending state).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.attention import Compressor, select_candidate_blocks, sparse_attn, stable_topk, window_indices
from engine.model.cache import ModelCache
from engine.presets import tiny_config

NEG_INF = float("-inf")


# ---- sparse_attn --------------------------------------------------------------------------------

def naive_sparse_attn(q, kv, sink, idx, scale) -> torch.Tensor:
    """float64 per-query loop: softmax over the listed rows (each occurrence counts; -1 skipped) with
    exp(sink[h]) (not scaled) in the denominator; a query with no valid row gives 0."""
    B, M, H, D = q.shape
    out = torch.zeros(B, M, H, D, dtype=torch.float64)
    for b in range(B):
        for m in range(M):
            rows = [int(j) for j in idx[b, m].tolist() if j >= 0]
            if not rows:
                continue
            keys = kv[b, rows].double()  # [K', D]
            for h in range(H):
                logits = (keys @ q[b, m, h].double()) * scale  # [K']
                mx = logits.max()
                p = torch.exp(logits - mx)
                denom = p.sum() + math.exp(sink[h].item() - mx.item())
                out[b, m, h] = (p.unsqueeze(-1) * keys).sum(0) / denom
    return out


def _assert_attn_close(got: torch.Tensor, ref: torch.Tensor, kv: torch.Tensor, what: str) -> None:
    """bf16 output: one rounding of the output (<= 2^-8 relative) plus the bf16 rounding of the
    probabilities before the PV product (<= 2^-8 of max |kv|); allowed: twice that."""
    assert got.dtype == torch.bfloat16
    assert not torch.isnan(got).any(), f"{what}: NaN in the output"
    tol = 2 * (2.0**-8 * ref.abs() + 2.0**-8 * kv.abs().max().double())
    diff = (got.double() - ref).abs()
    bad = diff > tol
    if bad.any():
        i = int((diff - tol).argmax())
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), diff.shape))
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of tolerance; worst at {idx}: "
                             f"got {got.double().flatten()[i].item()}, expected {ref.flatten()[i].item()}, "
                             f"tol {tol.flatten()[i].item()}")


@pytest.mark.parametrize("B,M,H,D,N,K", [(2, 5, 3, 40, 13, 7), (1, 3, 2, 64, 1, 1), (1, 259, 2, 24, 300, 11)],
                         ids=["odd", "single-row", "over-256-queries"])
def test_sparse_attn_matches_naive_loop(B, M, H, D, N, K):
    gen = torch.Generator().manual_seed(B * 1000 + M)
    q = torch.randn(B, M, H, D, generator=gen).bfloat16()
    kv = torch.randn(B, N, D, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen) * 2
    idx = torch.randint(-1, N, (B, M, K), generator=gen, dtype=torch.int32)  # -1 padding mixed in, duplicates likely
    idx[0, 0] = -1  # an empty row
    if K > 1:
        idx[0, -1, :2] = idx[0, -1, 0].clamp_min(0)  # an explicit duplicate
    scale = D**-0.5
    got = sparse_attn(q, kv, sink, idx, scale)
    assert got.shape == (B, M, H, D)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0])), "an all -1 row must give exactly 0"
    _assert_attn_close(got, naive_sparse_attn(q, kv, sink, idx, scale), kv, f"B={B} M={M} H={H} D={D} N={N} K={K}")


def test_sparse_attn_sink_and_duplicates_hand_case():
    # one key row of all ones: logit = q.k * scale; with q = c * ones, logit = c * D * scale
    D = 32
    kv = torch.ones(1, 2, D, dtype=torch.bfloat16)
    kv[0, 1] = 2.0
    q = torch.full((1, 1, 2, D), 0.0, dtype=torch.bfloat16)  # logits 0 for every row
    sink = torch.tensor([0.0, math.log(3.0)])
    idx = torch.tensor([[[0, 1, 1, -1]]])  # row 1 twice
    got = sparse_attn(q, kv, sink, idx, scale=0.125)
    # head 0: weights 1,1,1 and sink e^0 = 1 -> (1 + 2 + 2) / 4; head 1: sink e^{ln 3} = 3 (not scaled) -> 5 / 6
    assert got[0, 0, 0].float().tolist() == pytest.approx([5 / 4] * D, rel=2.0**-8)
    assert got[0, 0, 1].float().tolist() == pytest.approx([5 / 6] * D, rel=2.0**-8)


def test_sparse_attn_empty_rows_are_zero_not_nan():
    q = torch.randn(1, 3, 2, 16).bfloat16()
    kv = torch.randn(1, 4, 16).bfloat16()
    sink = torch.tensor([50.0, -50.0])
    all_invalid = torch.full((1, 3, 5), -1)
    out = sparse_attn(q, kv, sink, all_invalid, 0.25)
    assert torch.equal(out, torch.zeros_like(out))
    none = sparse_attn(q, kv, sink, torch.empty(1, 3, 0, dtype=torch.long), 0.25)
    assert torch.equal(none, torch.zeros_like(none))


# ---- index rules --------------------------------------------------------------------------------

def _valid_sets(idx: torch.Tensor) -> list[list[int]]:
    return [sorted(v for v in row if v >= 0) for row in idx.tolist()]


def test_window_indices_hand_cases():
    got = window_indices(torch.tensor([0, 1, 5, 9]), 4, 0)
    assert got.shape == (4, 4)
    assert _valid_sets(got) == [[0], [0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    # bounded replay: nothing below the floor, even when the window would reach further back
    got = window_indices(torch.tensor([45, 46, 50, 60, 61]), 16, 45)
    assert _valid_sets(got) == [[45], [45, 46], list(range(45, 51)), list(range(45, 61)), list(range(46, 62))]
    # a chunk starting mid-sequence (start 17) with the floor at 0 sees the full window
    got = window_indices(torch.arange(17, 20), 16, 0)
    assert _valid_sets(got) == [list(range(2, 18)), list(range(3, 19)), list(range(4, 20))]
    assert got.dtype in (torch.int32, torch.int64)


def test_select_candidate_blocks_hand_cases():
    # T = 10 entries in blocks of 4: [0..3], [4..7], [8, 9 + 2 padding]
    s = torch.tensor([
        [5.0, 0, 0, 0, 1.0, 1.0, 0, 0, 0.5, 0.25],  # visible 10: newest block 2 (low scores) is forced in
        [5.0, 0, 0, 0, 1.0, 1.0, 7.0, NEG_INF, NEG_INF, NEG_INF],  # visible 7: block 2 all -inf
        [NEG_INF] * 10,  # visible 0: nothing
        [0.0, 0, 0, 0, 0, 0, 0, 0, 3.0, NEG_INF],  # visible 9: last block partly padding
    ]).unsqueeze(0)
    visible = torch.tensor([10, 7, 0, 9])
    keep = select_candidate_blocks(s, visible, 2, 4)
    assert keep.shape == (1, 4, 10) and keep.dtype == torch.bool
    blocks = lambda *b: [any(i // 4 == k for k in b) for i in range(10)]  # noqa: E731
    assert keep[0, 0].tolist() == blocks(0, 2)  # best block 0 + forced newest 2 (beats block 1's 1.0)
    assert keep[0, 1].tolist() == blocks(0, 1)  # forced 1 (newest = 6 // 4) + block 0; block 2 is -inf
    assert keep[0, 2].tolist() == blocks()
    assert keep[0, 3].tolist() == blocks(0, 2)  # forced 2; tie between blocks 0 and 1 goes to the lower
    # more blocks asked than reachable: the -inf block is dropped, not kept by padding the top-k
    keep3 = select_candidate_blocks(s, visible, 3, 4)
    assert keep3[0, 1].tolist() == blocks(0, 1)
    assert keep3[0, 0].tolist() == blocks(0, 1, 2)


def test_stable_topk_ties_go_to_the_lower_index():
    values, indices = stable_topk(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), 2)
    assert values.tolist() == [3.0, 3.0] and indices.tolist() == [1, 2]
    # long rows of equal bf16 scores (where torch.topk's tie choice depends on the length)
    for n in (7, 64, 1000, 4097):
        x = torch.zeros(2, n, dtype=torch.bfloat16)
        x[1, n // 2:] = 1.0
        _, idx = stable_topk(x, 5)
        assert idx[0].tolist() == [0, 1, 2, 3, 4], n
        assert idx[1].tolist() == (list(range(n // 2, n)) + list(range(n // 2)))[:5], n
    x = torch.tensor([[NEG_INF, NEG_INF, 0.5, NEG_INF]])
    values, indices = stable_topk(x, 3)
    assert indices.tolist() == [[2, 0, 1]] and values[0, 1:].tolist() == [NEG_INF, NEG_INF]


# ---- compressor ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ratio2():
    """A ratio-2 compressor of the tiny preset with random bf16 weights, and a cache factory."""
    cfg = tiny_config()
    comp = Compressor(cfg, 2)
    gen = torch.Generator().manual_seed(7)
    comp.wkv.weight.copy_((torch.randn(comp.wkv.weight.shape, generator=gen) * cfg.dim**-0.5).bfloat16())
    comp.wgate.weight.copy_((torch.randn(comp.wgate.weight.shape, generator=gen) * 2 * cfg.dim**-0.5).bfloat16())
    comp.norm.weight.copy_((0.6 + 0.06 * torch.randn(cfg.head_dim, generator=gen)).bfloat16())

    def new_source(batch: int):
        return ModelCache.allocate(cfg, batch, 64, "cpu").sources[cfg.kv_source_layers[0]]

    return cfg, comp, new_source


def test_compressor_ratio2_pools_a_group_with_a_per_channel_softmax(ratio2):
    cfg, comp, new_source = ratio2
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 2, cfg.dim, generator=gen).bfloat16()  # two requests, one complete group each
    with torch.inference_mode():
        got = comp(x, 0, new_source(2))
    assert got is not None and got.shape == (2, 1, cfg.head_dim) and got.dtype == torch.bfloat16

    Wkv, Wg = comp.wkv.weight.double(), comp.wgate.weight.double()
    w_norm = comp.norm.weight.double()
    for b in range(2):
        kv = [x[b, t].double() @ Wkv.T for t in range(2)]  # [hd] per token
        sc = [x[b, t].double() @ Wg.T for t in range(2)]
        entry = torch.empty(cfg.head_dim, dtype=torch.float64)
        for c in range(cfg.head_dim):
            e0, e1 = math.exp(sc[0][c].item()), math.exp(sc[1][c].item())
            entry[c] = (e0 * kv[0][c].item() + e1 * kv[1][c].item()) / (e0 + e1)
        entry = entry.bfloat16().double()  # the reference casts the pooled entry to bf16 before its norm
        expected = w_norm * entry / math.sqrt(entry.square().mean().item() + cfg.norm_eps)
        # bf16 output: the entry's bf16 rounding may flip (changing the rms slightly) plus one final
        # rounding; allowed: 2 bf16 ulps relative to the element, or 2^-8 of the largest element
        torch.testing.assert_close(got[b, 0].double(), expected, rtol=2.0**-7,
                                   atol=2.0**-8 * expected.abs().max().item())


@pytest.mark.parametrize("pieces", [[1] * 11, [3, 1, 4, 1, 2], [2, 2, 7], [1, 2, 8]], ids=str)
def test_compressor_in_pieces_equals_one_call(ratio2, pieces):
    cfg, comp, new_source = ratio2
    S = sum(pieces)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, S, cfg.dim, generator=gen).bfloat16()
    with torch.inference_mode():
        whole_src = new_source(2)
        whole = comp(x, 0, whole_src)
        assert whole is not None and whole.shape == (2, S // 2, cfg.head_dim)
        src = new_source(2)
        parts, start = [], 0
        for n in pieces:
            latent = comp(x[:, start:start + n], start, src)
            expected_groups = (start + n) // 2 - start // 2  # groups completed by this piece
            if expected_groups == 0:
                assert latent is None, f"piece at {start} (+{n}) completes no group but returned {latent.shape}"
            else:
                assert latent is not None and latent.size(1) == expected_groups, (start, n)
                parts.append(latent)
            start += n
    pieced = torch.cat(parts, dim=1)
    assert torch.equal(pieced, whole), (
        f"pieces {pieces}: max |diff| {(pieced.float() - whole.float()).abs().max().item()}")
    if S % 2:  # the trailing odd token waits in the pending state, identically
        assert torch.equal(src.pending_kv[:, 0], whole_src.pending_kv[:, 0])
        assert torch.equal(src.pending_score[:, 0], whole_src.pending_score[:, 0])
