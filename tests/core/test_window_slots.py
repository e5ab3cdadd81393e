"""Window slots of a prefill chunk's queries (kernel_layers.window_slots, made on the device from the held blocks'
table) and of its rows (paged.swa_slots), against a position-by-position reference from the block map."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.kernel_layers import window_slots
from engine.kernels import paged


def _slot(blocks: dict[int, int], p: int, size: int) -> int:
    return blocks[p // size] * size + p % size


def _blocks(first: int, end: int, seed: int) -> dict[int, int]:
    """Window blocks first..end-1 held at distinct random pool blocks."""
    rng = random.Random(seed)
    ids = rng.sample(range(10 * (end - first) + 10), end - first)
    return dict(zip(range(first, end), ids))


@pytest.mark.parametrize("start,end,window,floor,size", [(0, 1, 8, 0, 4), (0, 37, 8, 0, 4), (100, 164, 16, 0, 8),
                                                         (100, 164, 16, 120, 8), (30, 31, 128, 0, 64),
                                                         (250, 300, 32, 299, 16), (5, 9, 4, 9, 2)])
def test_window_slots_are_each_querys_window(start, end, window, floor, size):
    held = _blocks(max(start - window + 1, floor, 0) // size, (end - 1) // size + 1, seed=start + end)
    got = window_slots(held, start, end, window, floor, size, torch.device("cpu"))
    want = torch.tensor([[_slot(held, q, size) if q >= max(floor, 0) else -1 for q in range(p - window + 1, p + 1)]
                         for p in range(start, end)], dtype=torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_window_slots_refuse_a_missing_block():
    held = _blocks(0, 5, seed=1)
    del held[2]
    with pytest.raises(AssertionError, match="window block 2"):
        window_slots(held, 16, 20, 8, 0, 4, torch.device("cpu"))


def test_no_query_of_the_chunk_reads_a_position():
    got = window_slots({}, 10, 12, 4, 12, 4, torch.device("cpu"))  # every window position is below the floor
    assert torch.equal(got, torch.full((2, 4), -1, dtype=torch.int32))


def test_swa_slots_are_each_rows_slot():
    held = _blocks(3, 11, seed=2)
    assert paged.swa_slots(held, 13, 43, 4).tolist() == [_slot(held, p, 4) for p in range(13, 43)]
    assert paged.swa_slots(held, 20, 20, 4).numel() == 0
    with pytest.raises(AssertionError, match="window block 11"):
        paged.swa_slots(held, 40, 45, 4)
