"""The block checksum (engine/core/block_checksum.py): the sum of fixed odd weights times the record's int32 words,
mod 2^64, checked against Python's integers; host and device agree (gpu marker); any single changed word changes it,
and so does a torn record."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.block_checksum import (block_checksums, block_weights, checksum_bytes, checksum_value,
                                        host_block_checksums)


def python_checksum(record: np.ndarray) -> int:
    words = record.view("<i4").tolist()
    weights = block_weights(len(words)).tolist()
    return sum(w * x for w, x in zip(weights, words)) % 2**64


def records(n: int, nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, nbytes), dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [4, 36, 4096 + 12])
def test_the_checksum_is_the_weighted_word_sum_mod_2_64(nbytes):
    data = records(5, nbytes)
    data[0] = 0xFF  # every word -1
    got = host_block_checksums(data)
    assert got.dtype == np.int64 and got.shape == (5,)
    for i in range(5):
        assert int(got[i]) % 2**64 == python_checksum(data[i]), f"row {i} of {nbytes} B"
    assert torch.equal(block_checksums(torch.from_numpy(data)), torch.from_numpy(got))
    assert (block_weights(nbytes // 4) & 1 == 1).all(), "weights are odd"


def test_slices_give_the_same_sums(monkeypatch):
    import engine.core.block_checksum as bc

    data = records(9, 64, seed=1)
    whole = host_block_checksums(data)
    monkeypatch.setattr(bc, "SLICE_WORDS", 32)  # two rows a slice: five slices
    assert np.array_equal(host_block_checksums(data), whole)


def test_any_single_changed_word_and_a_torn_record_change_the_checksum():
    data = records(1, 256, seed=2)[0]
    base = int(host_block_checksums(data[None])[0])
    for word in range(64):
        for delta in (1, -1, 1 << 31, 7 << 20):
            changed = data.copy()
            w = changed.view("<i4")
            w[word] = np.int32((int(w[word]) + delta + 2**31) % 2**32 - 2**31)
            assert int(host_block_checksums(changed[None])[0]) != base, f"word {word} + {delta}"
    torn = data.copy()
    torn[128:] = records(1, 256, seed=3)[0, 128:]
    assert int(host_block_checksums(torn[None])[0]) != base


def test_the_eight_bytes_records_carry_round_trip():
    for v in (0, 1, -1, 2**63 - 1, -2**63):
        b = checksum_bytes(v)
        assert len(b) == 8 and checksum_value(b) == v
    assert checksum_bytes(-1) == b"\xff" * 8


def test_bad_rows_are_refused():
    with pytest.raises(AssertionError, match="multiple of 4|4k"):
        host_block_checksums(np.zeros((2, 6), np.uint8))
    with pytest.raises(AssertionError, match="uint8"):
        block_checksums(torch.zeros((2, 8), dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_device_checksum_equals_the_host_one():
    data = records(300, 34176, seed=4)  # a real-width 8-layer block
    want = host_block_checksums(data)
    got = block_checksums(torch.from_numpy(data).cuda())
    assert got.device.type == "cuda" and np.array_equal(got.cpu().numpy(), want)
