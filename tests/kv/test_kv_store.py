"""The host KV store: blocks by chain hash in one page-aligned buffer, LRU by bytes with a chain's tail
evicted before its head, checksums, and the eviction callback that runs before a slot is reused."""

from __future__ import annotations

import hashlib
import mmap

import numpy as np
import pytest

from engine.core.block_checksum import checksum_bytes, host_block_checksums
from engine.core.kv_blocks import ExportedPrefix
from serve_app.kv_store import BlockRef, HostKVStore, block_checksum, block_checksums

FP = b"f" * 32
BLOCK = 1000


def prefix(name: str, n: int, fingerprint: bytes = FP, block: int = BLOCK) -> ExportedPrefix:
    hashes = [hashlib.sha256(f"{name}{i}".encode()).digest() for i in range(n)]
    data = np.random.default_rng(len(name) * 100 + n).integers(0, 256, (n, block), dtype=np.uint8)
    return ExportedPrefix(fingerprint, hashes, data)


def test_put_get_read_and_integrity():
    store = HostKVStore(FP, BLOCK, 4 * BLOCK + 999)
    assert store.num_slots == 4 and store.address % mmap.PAGESIZE == 0
    a = prefix("a", 3)
    assert store.put(a) == a.hashes
    refs = store.get_descriptors(a.hashes + [b"missing"])
    assert [r.block_hash for r in refs] == a.hashes
    for i, r in enumerate(refs):
        assert r.nbytes == BLOCK and r.checksum == block_checksum(a.data[i])
        slot = (r.address - store.address) // BLOCK
        assert np.array_equal(store.buffer[slot], a.data[i])
    back = store.read(a.hashes)
    assert back.hashes == a.hashes and np.array_equal(back.data, a.data)
    assert store.longest_prefix([a.hashes[0], b"x", a.hashes[2]]) == 1
    assert store.put(a) == a.hashes and store.num_blocks == 3  # already held: refreshed only
    store.check_integrity(verify_checksums=True)


def test_a_prefix_partly_held_stores_its_new_blocks_with_their_own_checksums():
    """put() stores only the blocks it lacks (rows gathered from the prefix) and records their checksums, as it does
    for an all-new prefix (its rows taken whole)."""
    store = HostKVStore(FP, BLOCK, 6 * BLOCK)
    a, tail = prefix("a", 2), prefix("t", 4)
    store.put(a)
    longer = ExportedPrefix(FP, a.hashes + tail.hashes[2:], np.concatenate([a.data, tail.data[2:]]))
    assert store.put(longer) == longer.hashes and store.num_blocks == 4
    for i, r in enumerate(store.get_descriptors(longer.hashes)):
        assert r.checksum == block_checksum(longer.data[i])
        assert np.array_equal(store.buffer[(r.address - store.address) // BLOCK], longer.data[i])
    store.check_integrity(verify_checksums=True)


def test_an_exporters_checksums_are_what_the_store_records():
    """put() records the checksums an exporter sent (summed on its device) instead of summing the rows again; they are
    the rows' own, and a wrong one is what check_integrity's verification finds."""
    store = HostKVStore(FP, BLOCK, 4 * BLOCK)
    a = prefix("a", 3)
    sums = host_block_checksums(a.data)
    store.put(ExportedPrefix(FP, a.hashes, a.data, sums))
    assert [r.checksum for r in store.get_descriptors(a.hashes)] == [checksum_bytes(int(v)) for v in sums]
    store.check_integrity(verify_checksums=True)
    b = prefix("b", 1)
    store.put(ExportedPrefix(FP, b.hashes, b.data, sums[:1]))  # another block's sum
    with pytest.raises(AssertionError, match="corrupted"):
        store.check_integrity(verify_checksums=True)


def test_lru_eviction_takes_the_tail_first_and_calls_back_before_reuse():
    evicted: list[list[bytes]] = []
    store = HostKVStore(FP, BLOCK, 4 * BLOCK, on_evict=lambda hs: evicted.append(list(hs)))
    a, b = prefix("a", 3), prefix("b", 2)
    store.put(a)
    store.put(b)  # one slot short: a's tail goes
    assert evicted == [[a.hashes[2]]]
    assert store.longest_prefix(a.hashes) == 2 and store.longest_prefix(b.hashes) == 2
    store.get_descriptors(a.hashes)  # a is now the most recently used
    store.put(prefix("c", 2))
    assert evicted[1] == [b.hashes[1], b.hashes[0]]
    big = prefix("d", 6)
    assert store.put(big) == big.hashes[:4]  # larger than the store: its head
    assert store.num_evicted == 1 + 2 + 4
    assert store.drop([big.hashes[3], b"absent"]) == [big.hashes[3]] and evicted[-1] == [big.hashes[3]]
    store.check_integrity(verify_checksums=True)


def test_a_corrupted_slot_is_detected_and_foreign_prefixes_are_refused():
    store = HostKVStore(FP, BLOCK, 2 * BLOCK)
    a = prefix("a", 2)
    store.put(a)
    store.buffer[1, 17] ^= 0xFF
    with pytest.raises(AssertionError, match="corrupted"):
        store.check_integrity(verify_checksums=True)
    with pytest.raises(ValueError, match="fingerprint"):
        store.put(prefix("x", 1, fingerprint=b"g" * 32))
    with pytest.raises(ValueError, match="bytes"):
        store.put(prefix("x", 1, block=BLOCK + 1))
    with pytest.raises(ValueError):
        HostKVStore(FP, BLOCK, BLOCK - 1)
    assert isinstance(store.get_descriptors(a.hashes)[0], BlockRef)


@pytest.mark.parametrize("num_blocks", [1, 5, 37])
def test_a_batch_of_checksums_is_the_engines_row_by_row(num_blocks):
    """block_checksums gives each row's engine checksum (engine/core/block_checksum.py, what the importer checks on
    the device) as 8 big-endian bytes, in row order; one changed byte changes only its row's."""
    records = np.random.default_rng(num_blocks).integers(0, 256, (num_blocks, 1028), dtype=np.uint8)
    want = [checksum_bytes(int(v)) for v in host_block_checksums(records)]
    assert block_checksums(records) == want and all(len(c) == 8 for c in want)
    assert [block_checksum(r) for r in records] == want
    records[num_blocks // 2, 3] ^= 1
    got = block_checksums(records)
    assert [i for i in range(num_blocks) if got[i] != want[i]] == [num_blocks // 2]
