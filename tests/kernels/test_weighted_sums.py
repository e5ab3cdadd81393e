"""weighted_row_sums (engine/kernels/weighted_sums.py), the GPU's block checksum, against Python's integers mod 2^64
and numpy's host checksum (engine/core/block_checksum.py): words at the int32 extremes, a last tile cut short, every
split count (the partial sums wrap mod 2^64 alike), and the GPU's block_checksums equal to the host's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.block_checksum import block_checksums, block_weights, host_block_checksums
from engine.kernels.weighted_sums import BLOCK, weighted_row_sums, weighted_row_sums_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def words(n: int, num_words: int, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    w = g.integers(-2**31, 2**31, (n, num_words), dtype=np.int64).astype(np.int32)
    w[0, :] = -1  # every word -1: sign extension
    w[1, ::2] = 2**31 - 1
    w[1, 1::2] = -2**31
    return torch.from_numpy(w)


def python_sums(x: torch.Tensor, weights: torch.Tensor) -> list[int]:
    wl = weights.tolist()
    return [sum(a * b for a, b in zip(row, wl)) % 2**64 for row in x.tolist()]


@pytest.mark.parametrize("num_words,num_splits", [(BLOCK * 2 + 37, None), (BLOCK * 2 + 37, 1), (BLOCK * 3, 2),
                                                   (5, None)])
def test_sums_are_the_weighted_word_sums_mod_2_64(num_words, num_splits):
    x, w = words(4, num_words, seed=num_words), block_weights(num_words)
    got = weighted_row_sums(x, w, num_splits)
    assert got.dtype == torch.int64 and got.shape == (4,)
    assert [v % 2**64 for v in got.tolist()] == python_sums(x, w)
    assert torch.equal(got, weighted_row_sums_ref(x, w))


def test_block_checksums_through_the_kernel_equal_the_hosts():
    data = np.random.default_rng(3).integers(0, 256, (6, 4 * (BLOCK + 11)), dtype=np.uint8)
    rows = torch.from_numpy(data)
    via_kernel = weighted_row_sums(rows.view(torch.int32), block_weights(data.shape[1] // 4))
    assert np.array_equal(via_kernel.numpy(), host_block_checksums(data))


def test_no_rows_and_a_strided_view():
    assert weighted_row_sums(torch.empty(0, 8, dtype=torch.int32), block_weights(8)).shape == (0,)
    x = words(5, 3 * BLOCK, seed=9)
    part = x[1:4, :BLOCK + 3]  # rows of a larger tensor: stride 3 * BLOCK
    w = block_weights(BLOCK + 3)
    assert torch.equal(weighted_row_sums(part, w), weighted_row_sums_ref(part, w))


@needs_cuda
@pytest.mark.gpu
def test_on_the_gpu_equal_the_host():
    data = np.random.default_rng(4).integers(0, 256, (300, 56960), dtype=np.uint8)  # the real config's block
    got = block_checksums(torch.from_numpy(data).cuda())
    assert np.array_equal(got.cpu().numpy(), host_block_checksums(data))
