"""Same-node reads of another process's host store (serve_app/kv_local.py): the owner's buffer is a memfd that a
reader maps through /proc/<pid>/fd; block copies equal the owner's blocks in any order; an owner that exited, a
handle of another node or a reused fd maps nothing (the caller reads over NIXL); a PeerBlockReader picks the path."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.core.kv_blocks import ExportedPrefix
from serve_app import kv_local
from serve_app.kv_local import PeerStores, SharedStoreHandle, block_runs, copy_blocks
from serve_app.kv_store import HostKVStore

BLOCK = 4096 + 1024
OWNER = f"""
import json, sys
import numpy as np
from engine.core.kv_blocks import ExportedPrefix
from serve_app.kv_store import HostKVStore
store = HostKVStore(b"f" * 32, {BLOCK}, 16 * {BLOCK})
data = np.random.default_rng(7).integers(0, 256, (12, {BLOCK}), dtype=np.uint8)
hashes = [bytes([i]) * 32 for i in range(12)]
store.put(ExportedPrefix(b"f" * 32, hashes, data))
refs = store.get_descriptors(hashes)
print(json.dumps({{"handle": store.shared_handle().doc(), "addresses": [r.address for r in refs]}}), flush=True)
sys.stdin.readline()
"""


def owner_data() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (12, BLOCK), dtype=np.uint8)


@pytest.fixture
def owner():
    """Another process holding a store of 12 blocks: (its handle, the blocks' addresses, the process)."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        doc = json.loads(proc.stdout.readline())
        yield SharedStoreHandle.from_doc(doc["handle"]), doc["addresses"], proc
    finally:
        proc.kill()
        proc.wait()


def test_a_reader_maps_another_processs_store_and_copies_its_blocks(owner, monkeypatch):
    handle, addresses, proc = owner
    assert handle.pid == proc.pid and handle.node == kv_local.this_node()
    stores = PeerStores()
    mapped = stores.map(handle)
    assert mapped is not None and mapped.array.nbytes == handle.nbytes and not mapped.array.flags.writeable
    assert mapped.page_locked is None, "read-only unless page-locked for a device"
    assert stores.map(handle) is mapped, "one mapping per owner store"
    data = owner_data()
    rows = [4, 5, 6, 0, 11, 3]  # runs 4-6, 0, 11, 3
    dst = np.zeros((len(rows), BLOCK), np.uint8)
    monkeypatch.setattr(kv_local, "MIN_PIECE_BYTES", 1000)  # several pieces per run, on several threads
    copy_blocks(mapped.array, handle.base, [addresses[i] for i in rows], dst)
    assert np.array_equal(dst, data[rows])
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(30)
    assert stores.map(handle) is None, "an owner that exited is not mapped (the caller reads over NIXL)"


def test_only_a_live_handle_of_this_node_maps(owner):
    handle, _, _ = owner
    stores = PeerStores()
    assert stores.map(dataclasses.replace(handle, node="another-boot/123")) is None
    assert stores.map(dataclasses.replace(handle, inode=handle.inode + 1)) is None, "a reused fd number"
    assert stores.map(dataclasses.replace(handle, fd=0)) is None, "its stdin, not its store"
    assert stores.map(handle) is not None


def test_handles_round_trip_through_their_record_and_mappings_are_bounded(monkeypatch):
    stores = [HostKVStore(b"f" * 32, BLOCK, 2 * BLOCK) for _ in range(3)]
    handles = [s.shared_handle() for s in stores]
    assert all(SharedStoreHandle.from_doc(json.loads(json.dumps(h.doc()))) == h for h in handles)
    monkeypatch.setattr(kv_local, "MAX_MAPPINGS", 2)
    peers = PeerStores()
    for h in handles:
        assert peers.map(h) is not None  # this process's own stores map too
    assert list(peers._maps) == handles[1:], "the least recently used mapping is dropped"
    assert peers.map(handles[2], page_locked=True).array.flags.writeable == torch.cuda.is_available()


def test_block_runs_and_bad_copies():
    assert block_runs([50, 60, 70, 10, 20, 90], 10) == [(0, 3), (3, 2), (5, 1)]
    assert block_runs([], 10) == []
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros((2, 10), np.uint8)
    copy_blocks(src, 1000, [1090, 1000], dst)
    assert dst[0].tolist() == list(range(90, 100)) and dst[1].tolist() == list(range(10))
    with pytest.raises(AssertionError, match="outside the store"):
        copy_blocks(src, 1000, [1095, 1000], dst)


def test_a_peer_reader_copies_from_shared_memory_on_this_node_else_reads_over_nixl():
    pytest.importorskip("nixl_cu13")
    from serve_app.kv_transfer import PeerBlockReader, TransferAgent

    store = HostKVStore(b"f" * 32, BLOCK, 8 * BLOCK)
    data = owner_data()[:5]
    hashes = [bytes([i]) * 32 for i in range(5)]
    store.put(ExportedPrefix(b"f" * 32, hashes, data))
    refs = store.get_descriptors(hashes)
    owner, agent = TransferAgent("local-owner", store), TransferAgent("local-reader", None, 0)
    try:
        for handle, path in [(store.shared_handle(), "shared memory"), (None, "NIXL"),
                             (dataclasses.replace(store.shared_handle(), node="elsewhere"), "NIXL")]:
            reader = PeerBlockReader(owner.metadata, refs, 5.0, handle, agent=agent).select([3, 1, 2])
            staging = np.zeros((3, BLOCK), np.uint8)
            reader.open(staging)
            assert reader.path == path and reader.pinned_rows(0, 1) is None  # no CUDA here
            reader.read(0, staging[:2])
            reader.read(2, staging[2:])
            assert np.array_equal(staging, data[[3, 1, 2]]), path
            assert np.array_equal(reader.expected_checksums, [int.from_bytes(r.checksum, "big", signed=True)
                                                               for r in (refs[3], refs[1], refs[2])])
    finally:
        owner.close()
        agent.close()
