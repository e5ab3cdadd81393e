"""NIXL (UCX) pulls from another agent's host KV store: two agents in one process, and an owner in a
second process over loopback. Verified blocks arrive bit for bit; a corrupted block, an address the
owner never registered, garbage metadata, a dead owner and a deadline all raise TransferFailed."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from engine.core.kv_blocks import ExportedPrefix
from serve_app.kv_store import BlockRef, HostKVStore
from serve_app.kv_transfer import TransferAgent, TransferFailed

FP = b"f" * 32
BLOCK = 56960  # one real-config block: 64 tokens x 890 B


def blocks(n: int, seed: int = 0) -> ExportedPrefix:
    hashes = [hashlib.sha256(b"%d/%d" % (seed, i)).digest() for i in range(n)]
    return ExportedPrefix(FP, hashes, np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8))


@pytest.fixture(scope="module")
def pair():
    """An owner agent over a store holding 8 blocks, and a reader agent."""
    store = HostKVStore(FP, BLOCK, 16 * BLOCK)
    owner = TransferAgent(f"owner-{os.getpid()}", store, staging_bytes=BLOCK)
    reader = TransferAgent(f"reader-{os.getpid()}", staging_bytes=BLOCK)
    yield store, owner, reader
    reader.close()
    owner.close()


def test_pull_delivers_verified_blocks_and_grows_its_staging(pair):
    store, owner, reader = pair
    data = blocks(8)
    store.put(data)
    refs = store.get_descriptors(data.hashes)
    got = reader.pull(owner.metadata, refs)  # 8 blocks: the one-block staging buffer grows
    assert got.shape == (8, BLOCK) and np.array_equal(got, data.data)
    dst = np.zeros((3, BLOCK), np.uint8)
    reader.register(dst)
    assert np.array_equal(reader.pull(owner.metadata, refs[2:5], dst=dst), data.data[2:5]) and dst.any()
    scattered = [refs[5], refs[1], refs[2], refs[7]]  # three descriptors
    assert np.array_equal(reader.pull(owner.metadata, scattered), data.data[[5, 1, 2, 7]])
    assert reader.num_pulls == 3 and reader.num_bytes_pulled == 15 * BLOCK


def test_a_corrupted_or_unregistered_block_is_a_transfer_failure(pair):
    store, owner, reader = pair
    data = blocks(2, seed=1)
    store.put(data)
    refs = store.get_descriptors(data.hashes)
    slot = (refs[1].address - store.address) // BLOCK
    store.buffer[slot, 1234] ^= 0x01
    with pytest.raises(TransferFailed, match="block 1 .* checksum mismatch"):
        reader.pull(owner.metadata, refs)
    store.buffer[slot, 1234] ^= 0x01
    assert np.array_equal(reader.pull(owner.metadata, refs), data.data)
    outside = BlockRef(refs[0].block_hash, store.address + store.nbytes + 4096, BLOCK, refs[0].checksum)
    with pytest.raises(TransferFailed):
        reader.pull(owner.metadata, [outside])
    with pytest.raises(TransferFailed, match="cannot connect"):
        reader.pull(b"not nixl metadata", refs)


def test_a_pull_past_its_deadline_fails_and_retires_the_buffer(pair, monkeypatch):
    store, owner, reader = pair
    data = blocks(2, seed=2)
    store.put(data)
    refs = store.get_descriptors(data.hashes)
    real_transfer = reader._agent.transfer
    # loopback in one process finishes at the post: make the READ look in flight past the deadline
    monkeypatch.setattr(reader._agent, "transfer", lambda handle: real_transfer(handle) and "PROC")
    monkeypatch.setattr(reader._agent, "check_xfer_state", lambda handle: "PROC")
    staging = reader._staging
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="timed out after 0.050 s"):
        reader.pull(owner.metadata, refs, timeout_s=0.05)
    assert 0.05 <= time.monotonic() - t0 < 1.0
    assert reader._staging is not staging  # a late READ may still land in the old one: never reused
    monkeypatch.undo()
    assert np.array_equal(reader.pull(owner.metadata, refs), data.data)


def _owner_process(conn, n: int) -> None:
    store = HostKVStore(FP, BLOCK, n * BLOCK)
    agent = TransferAgent(f"owner-proc-{os.getpid()}", store, staging_bytes=BLOCK)
    data = blocks(n, seed=3)
    store.put(data)
    conn.send((agent.metadata, store.get_descriptors(data.hashes)))
    conn.recv()  # until told (or killed)


def test_pull_from_an_owner_process_then_the_owner_dies():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner_process, args=(child, 64), daemon=True)
    proc.start()
    reader = TransferAgent(f"reader-x-{os.getpid()}", staging_bytes=64 * BLOCK)
    try:
        assert parent.poll(120), "the owner process did not start"  # a spawn that imports NIXL: >30 s seen at load 5-9
        metadata, refs = parent.recv()
        want = blocks(64, seed=3).data
        assert np.array_equal(reader.pull(metadata, refs), want)
        assert np.array_equal(reader.pull(metadata, refs[10:20]), want[10:20])
        proc.kill()
        proc.join(10)
        with pytest.raises(TransferFailed):
            reader.pull(metadata, refs, timeout_s=2.0)
        assert reader._peers == {}  # the dead peer is forgotten
    finally:
        reader.close()
        if proc.is_alive():
            proc.kill()


def test_adjacent_slots_coalesce_into_one_descriptor():
    from serve_app.kv_transfer import coalesce_reads

    local, remote = coalesce_reads(1000, [50, 60, 70, 10, 20, 90], 10)
    assert remote == [(50, 30, 0), (10, 20, 0), (90, 10, 0)]
    assert local == [(1000, 30, 0), (1030, 20, 0), (1050, 10, 0)]


def test_a_block_reader_reads_chunks_into_a_buffer_it_registers_once_and_travels_without_its_agent(pair, capfd):
    import pickle

    from serve_app.kv_transfer import PeerBlockReader

    store, owner, reader = pair
    prefix = blocks(5, seed=7)
    store.put(prefix)
    refs = store.get_descriptors(prefix.hashes)
    staging = np.zeros((2, 2, BLOCK), np.uint8)  # an importer's two slots of two blocks
    nixl = PeerBlockReader(owner.metadata, refs, 5.0, agent=reader).select([4, 0, 2])
    registered = len(reader._registered)
    for _ in range(2):
        nixl.open(staging.reshape(-1))
    assert len(reader._registered) == registered + 1
    nixl.read(0, staging[0, :2])
    nixl.read(2, staging[1, :1])
    assert np.array_equal(staging[0], prefix.data[[4, 0]]) and np.array_equal(staging[1, 0], prefix.data[2])
    travelled = pickle.loads(pickle.dumps(nixl))
    assert travelled.agent is None and travelled.blocks == nixl.blocks and travelled.num_blocks == 3
    capfd.readouterr()
    TransferAgent(f"logged-{os.getpid()}").close()
    line = f"NIXL agent logged-{os.getpid()}: UCX backend, UCX_TLS={os.environ.get('UCX_TLS', 'unset (all found)')}"
    assert line in capfd.readouterr().err
