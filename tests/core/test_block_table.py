"""BlockTableMirror (engine/core/block_table.py): applying each step's updates to a table keeps it equal to a table
filled from scratch with the step's block lists (-1 past each), over random appends, truncations, replacements,
rows that move and batches that shrink and grow; a request that only appends stages only its new blocks."""

from __future__ import annotations

import random

import numpy as np

from engine.core.block_table import BlockTableMirror

ROWS, WIDTH = 6, 12


def fresh(tables: list[list[int]]) -> np.ndarray:
    want = np.full((ROWS, WIDTH), -1, dtype=np.int64)
    for b, t in enumerate(tables):
        want[b, :len(t)] = t
    return want


def apply(device: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
    assert idx.dtype == vals.dtype == np.int64 and idx.shape == vals.shape
    assert len(set(idx.tolist())) == idx.size, "an entry written twice in one step"
    device.reshape(-1)[idx] = vals


def test_appends_stage_only_the_new_blocks():
    mirror, device = BlockTableMirror(ROWS, WIDTH), np.full((ROWS, WIDTH), -1, dtype=np.int64)
    idx, vals = mirror.updates([[7, 3], [9]], 2)
    apply(device, idx, vals)
    assert idx.tolist() == [0, 1, WIDTH] and vals.tolist() == [7, 3, 9]
    idx, vals = mirror.updates([[7, 3], [9]], 2)
    assert idx.size == 0  # nothing changed: nothing staged
    idx, vals = mirror.updates([[7, 3, 11], [9]], 2)
    assert idx.tolist() == [2] and vals.tolist() == [11]
    apply(device, idx, vals)
    idx, vals = mirror.updates([[7]], 2)  # row 0 truncated, row 1 now padding
    apply(device, idx, vals)
    assert sorted(idx.tolist()) == [1, 2, WIDTH]
    assert (device == fresh([[7]])).all()


def test_random_steps_keep_the_device_table_equal_to_a_fresh_one():
    rng = random.Random(0)
    mirror, device = BlockTableMirror(ROWS, WIDTH), np.full((ROWS, WIDTH), -1, dtype=np.int64)
    requests = [[rng.randrange(100) for _ in range(rng.randrange(WIDTH))] for _ in range(9)]
    for step in range(400):
        op = rng.random()
        r = rng.randrange(len(requests))
        if op < 0.5 and len(requests[r]) < WIDTH:
            requests[r].append(rng.randrange(100))  # a new block
        elif op < 0.6:
            del requests[r][rng.randrange(len(requests[r]) + 1):]  # rollback / preemption
        elif op < 0.7:
            requests[r] = [rng.randrange(100) for _ in range(rng.randrange(WIDTH))]  # a prefix hit, a restore
        elif op < 0.8:
            rng.shuffle(requests)  # rows move
        num_rows = rng.randrange(1, ROWS + 1)
        batch = [list(t) for t in requests[:rng.randrange(num_rows + 1)]]
        apply(device, *mirror.updates(batch, num_rows))
        want = fresh(batch)
        assert (device[:num_rows] == want[:num_rows]).all(), f"step {step}: {device} != {want}"
