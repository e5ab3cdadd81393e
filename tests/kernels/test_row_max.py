"""row_max (engine/kernels/row_max.py) against torch's reductions: the max and its first id for rows without NaN,
the NaN / +inf flag and the drawable flag for every row, at every split count; ties at the maximum across tiles and
splits go to the lowest id; a row of -inf gives (-inf, 0)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.row_max import BLOCK, row_max, row_max_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rows(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, vocab, generator=g) * 3
    x[0, [5, BLOCK + 3, vocab - 1]] = 50.0  # the max three times: id 5
    x[1, [vocab - 1, BLOCK - 1]] = 60.0  # across a tile boundary: BLOCK - 1
    x[2, :] = float("-inf")
    x[3, 17] = float("nan")
    x[4, vocab // 2] = float("inf")
    x[5, :vocab - 1] = float("-inf")  # only the last id is drawable
    x[6] = torch.round(x[6])  # many ties
    x[7, :] = -0.0
    x[7, 9] = 0.0  # -0.0 == 0.0: the first zero, id 0
    x[8, :] = float("-inf")
    x[8, 3] = float("nan")  # NaN and no drawable token
    return x


def check(x: torch.Tensor, got) -> None:
    top, at, bad, drawable = row_max_ref(x)
    g_top, g_at, g_bad, g_drawable = (t.cpu() for t in got)
    assert g_bad.tolist() == bad.tolist() and g_drawable.tolist() == drawable.tolist()
    clean = ~x.isnan().any(dim=-1)  # a row with a NaN: (max, id) unspecified
    assert g_at[clean].tolist() == at[clean].tolist()
    assert torch.equal(g_top[clean], top[clean])


@pytest.mark.parametrize("vocab", [1, 7, BLOCK, 3 * BLOCK + 5])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5])
def test_kernel_is_the_torch_reductions(vocab: int, num_splits):
    if vocab >= BLOCK + 5:  # the planted ids exist
        x = rows(vocab, seed=vocab)
    else:
        x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(1))
        x[2, :] = float("-inf")
        x[3, 0] = float("nan")
        x[4, -1] = float("inf")
    check(x, row_max(x, num_splits))
    top, at, bad, drawable = row_max_ref(x)
    assert bad[3] and bad[4] and not drawable[2] and at[2] == 0


def test_planted_ties_and_flags():
    x = rows(3 * BLOCK + 5, seed=3)
    top, at, bad, drawable = row_max(x, num_splits=3)
    assert at[:2].tolist() == [5, BLOCK - 1] and at[2] == 0 and top[2] == float("-inf")
    assert at[5] == x.size(1) - 1 and at[7] == 0
    assert bad.tolist() == [False, False, False, True, True, False, False, False, True]
    assert drawable.tolist() == [True] * 2 + [False] + [True] * 5 + [False]


def test_empty_and_contract():
    assert all(t.shape == (0,) for t in row_max(torch.zeros(0, 10)))
    with pytest.raises(AssertionError):
        row_max(torch.zeros(2, 10, dtype=torch.float64))
    with pytest.raises(AssertionError):
        row_max(torch.zeros(10, 2).t())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 16, 64])
def test_gpu_served_vocab(num_rows: int):
    x = torch.randn(num_rows, 129_280, generator=torch.Generator().manual_seed(num_rows)) * 4
    x[0, [100, 70_000]] = 99.0
    if num_rows > 1:
        x[1, 5] = float("nan")
        x[-1, :] = float("-inf")
    for splits in (None, 1, 7):
        check(x, row_max(x.cuda(), splits))
