"""Pulled blocks enter the pools in chunks through the importer's staging buffer (engine/core/kv_import.py).

- for chunk sizes 1, 3 (a last partial chunk) and all blocks, the pools equal write_blocks' bit for bit;
- the read of chunk i + 1 runs (on the reader thread) while chunk i is imported, never more than two in flight;
- a read that fails part-way raises, retires the buffer, and through LLMEngine.import_blocks leaves none of
  the blocks registered: the prompt recomputes (no hit), and the pool's self-check holds;
- a reader's expected checksums are checked on what landed: a block whose bytes differ from its owner's record
  raises BlockChecksumMismatch naming it, after the last chunk; through LLMEngine.import_blocks none of the blocks
  is registered and the prompt recomputes;
- on CUDA (gpu marker) the buffer is pinned, the pools equal the CPU import's bit for bit, and the checks run on
  the device.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from engine.core.block_checksum import host_block_checksums
from engine.core.kv_blocks import block_bytes, read_blocks, write_blocks
from engine.core.kv_cache import PagedKVCache
from engine.core.kv_import import ArrayReader, BlockChecksumMismatch, BlockImporter
from tests.core.conftest import random_prompt
from tests.kv.test_kv_blocks import make_engine, small_layout, turn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_BLOCKS = 7
TARGETS = [9, 2, 14, 0, 5, 11, 3]  # out of order, with gaps


def random_records(cfg, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes(cfg, 64)), dtype=np.uint8)


def pools(kv: PagedKVCache) -> dict[str, torch.Tensor]:
    return {f"{name}[{s}]": t for name in ("main_kv", "index_k") for s, t in getattr(kv, name).items()}


def assert_pools_equal(got: PagedKVCache, want: PagedKVCache, what: str) -> None:
    for name, t in pools(want).items():
        g = pools(got)[name].cpu()
        bad = (g != t.cpu()).nonzero()
        assert bad.numel() == 0, f"{what}: {name} differs at {bad.shape[0]} bytes, first at {bad[0].tolist()}"


class RecordingReader:
    """A BlockReader over host records that logs when each read starts and ends, and can fail at one chunk;
    expected: the checksums it claims (None: unchecked)."""

    def __init__(self, data: np.ndarray, log: list, fail_at: int | None = None, expected: np.ndarray | None = None):
        self.data, self.log, self.fail_at, self.expected = data, log, fail_at, expected

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def expected_checksums(self) -> np.ndarray | None:
        return self.expected

    def pinned_rows(self, first: int, count: int) -> None:
        return None

    def select(self, rows: list[int]) -> "RecordingReader":
        return RecordingReader(self.data[rows], self.log, self.fail_at,
                               None if self.expected is None else self.expected[rows])

    def open(self, buffer: np.ndarray) -> None:
        self.log.append(("open", buffer.nbytes, threading.current_thread().name))

    def read(self, first: int, dst: np.ndarray) -> None:
        self.log.append(("read", first, threading.current_thread().name))
        if first == self.fail_at:
            raise ConnectionError(f"chunk at block {first}: the owner went away")
        dst[:] = self.data[first:first + dst.shape[0]]
        self.log.append(("read done", first, threading.current_thread().name))


@pytest.mark.parametrize("chunk_blocks", [1, 3, NUM_BLOCKS])
def test_chunked_import_equals_write_blocks_bit_for_bit(tiny_cfg, chunk_blocks):
    layout = small_layout(num_global=16)
    want, got = PagedKVCache(tiny_cfg, layout, "cpu"), PagedKVCache(tiny_cfg, layout, "cpu")
    data = random_records(tiny_cfg, NUM_BLOCKS)
    write_blocks(want, TARGETS, data)
    importer = BlockImporter(got, chunk_blocks)
    assert importer.host.shape == (2, chunk_blocks, block_bytes(tiny_cfg, 64)) and not importer.host.is_pinned()
    importer.import_blocks(TARGETS, ArrayReader(data))
    assert_pools_equal(got, want, f"chunk_blocks={chunk_blocks}")
    assert np.array_equal(read_blocks(got, TARGETS), data)
    buffer = importer.host
    importer.import_blocks(TARGETS[:2], ArrayReader(data[:2]))  # the one buffer, reused
    assert importer.host is buffer and importer.num_retired == 0
    importer.import_blocks([], ArrayReader(data[:0]))
    importer.close()


def test_the_next_read_overlaps_the_import_and_at_most_two_chunks_are_in_flight(tiny_cfg):
    kv = PagedKVCache(tiny_cfg, small_layout(num_global=16), "cpu")
    log: list = []
    importer = BlockImporter(kv, chunk_blocks=2)
    writes: list[tuple[list[int], int]] = []

    def sink(ids: list[int], rows: torch.Tensor) -> None:
        writes.append((ids, rows.data_ptr()))
        log.append(("import", ids[0], threading.current_thread().name))
        time.sleep(0.05)  # a slow import: the next read has time to start
        write_blocks(kv, ids, rows.numpy())
        log.append(("import done", ids[0], threading.current_thread().name))

    data = random_records(tiny_cfg, NUM_BLOCKS, seed=1)
    importer.import_blocks(TARGETS, RecordingReader(data, log), sink)
    assert np.array_equal(read_blocks(kv, TARGETS), data)
    assert [w[0] for w in writes] == [TARGETS[0:2], TARGETS[2:4], TARGETS[4:6], TARGETS[6:7]]
    slots = [w[1] for w in writes]
    assert slots[0] == slots[2] != slots[1] == slots[3], "chunks alternate between the two slots"
    assert log[0][:2] == ("open", importer.host.numel())
    log = log[1:]
    readers = {t for kind, _, t in log if kind.startswith("read")}
    assert len(readers) == 1 and threading.current_thread().name not in readers
    # block ids -> chunk index: chunk i's first block is TARGETS[2 i], read at first = 2 i
    events = [(kind, first if kind.startswith("read") else TARGETS.index(first)) for kind, first, _ in log]
    for i in range(3):
        assert events.index(("read", 2 * i + 2)) < events.index(("import done", 2 * i)), \
            f"the read of chunk {i + 1} did not start during chunk {i}'s import: {events}"
        if i >= 1:  # chunk i + 1 reuses chunk i - 1's slot: never read before that chunk's import ended
            assert events.index(("read", 2 * i + 2)) > events.index(("import done", 2 * i - 2)), events


def test_a_read_that_fails_mid_pipeline_raises_and_retires_the_buffer(tiny_cfg):
    kv = PagedKVCache(tiny_cfg, small_layout(num_global=16), "cpu")
    importer = BlockImporter(kv, chunk_blocks=2)
    buffer, log = importer.host, []
    with pytest.raises(ConnectionError, match="block 4"):
        importer.import_blocks(TARGETS, RecordingReader(random_records(tiny_cfg, NUM_BLOCKS), log, fail_at=4))
    assert [e[:2] for e in log if e[0] == "read"] == [("read", 0), ("read", 2), ("read", 4)], \
        "no read starts after a failed one"
    assert importer.host is not buffer and importer.num_retired == 1
    data = random_records(tiny_cfg, NUM_BLOCKS, seed=2)
    importer.import_blocks(TARGETS, ArrayReader(data))  # the importer works on after a failure
    assert np.array_equal(read_blocks(kv, TARGETS), data)


def test_every_block_is_checked_against_its_owners_checksum_where_it_landed(tiny_cfg):
    kv = PagedKVCache(tiny_cfg, small_layout(num_global=16), "cpu")
    importer = BlockImporter(kv, chunk_blocks=3)
    data = random_records(tiny_cfg, NUM_BLOCKS, seed=4)
    expected = host_block_checksums(data)
    importer.import_blocks(TARGETS, RecordingReader(data, [], expected=expected))
    assert np.array_equal(read_blocks(kv, TARGETS), data)
    torn = data.copy()
    torn[5, 1000:] = random_records(tiny_cfg, 1, seed=5)[0, 1000:]  # block 5 read half old, half new
    log: list = []
    with pytest.raises(BlockChecksumMismatch, match=r"1 of 7 pulled blocks \(first: block 5\)"):
        importer.import_blocks(TARGETS, RecordingReader(torn, log, expected=expected))
    assert [e[1] for e in log if e[0] == "read done"] == [0, 3, 6], "checked once, after every chunk was read"
    assert importer.num_retired == 0, "no read failed: the buffer is kept"
    importer.import_blocks(TARGETS[:2], RecordingReader(data, [], expected=expected).select([1, 0]))
    assert np.array_equal(read_blocks(kv, TARGETS[:2]), data[[1, 0]])


def test_a_failed_pull_leaves_no_block_registered_and_the_prompt_recomputes(tiny_model):
    """Engine a computes a turn; engine b imports a's blocks through a reader that fails at the second of
    three chunks: nothing is registered, b's pool checks out, its next request recomputes the whole prompt
    (and equals a reference); then a reader that works imports them and the same prompt hits."""
    model = tiny_model.model
    a, b = make_engine(model), make_engine(model)
    b.executor.importer = BlockImporter(b.executor.kv, chunk_blocks=1)
    prompt = random_prompt(200, seed=51)
    out_a, _, _ = turn(a, "a1", prompt)
    exported = a.export_prefix(prompt + out_a)
    assert exported.num_blocks == 3
    free = b.cache.global_pool.num_free
    with pytest.raises(ConnectionError):
        b.import_blocks(exported.fingerprint, exported.hashes, RecordingReader(exported.data, [], fail_at=1))
    wrong = host_block_checksums(exported.data)
    wrong[2] ^= 1
    with pytest.raises(BlockChecksumMismatch):
        b.import_blocks(exported.fingerprint, exported.hashes, RecordingReader(exported.data, [], expected=wrong))
    assert b.cache.cached_prefix(prompt + out_a)[0] == 0 and b.cache.global_pool.num_cached == 0
    assert b.cache.global_pool.num_free == free and b.stats.num_imported_tokens == 0
    b.cache.global_pool.check_integrity()
    out_b, _, stats_b = turn(b, "b1", prompt)
    assert stats_b.num_cached_tokens == 0 and stats_b.num_computed_prompt_tokens == len(prompt)

    c = make_engine(model)
    c.executor.importer = BlockImporter(c.executor.kv, chunk_blocks=2)
    assert c.import_blocks(exported.fingerprint, exported.hashes, ArrayReader(exported.data)) == 192
    assert np.array_equal(c.export_prefix(prompt + out_a).data, exported.data)
    assert c.import_blocks(exported.fingerprint, exported.hashes, ArrayReader(exported.data)) == 192  # held: no read
    assert c.stats.num_imported_tokens == 192


class PinnedReader(RecordingReader):
    """Offers the blocks of every other chunk as page-locked rows (as a same-node owner's registered store does),
    the rest through read(): one import mixes both paths."""

    def __init__(self, data: np.ndarray, expected: np.ndarray, chunk_blocks: int):
        super().__init__(data, [], expected=expected)
        self.pinned = torch.from_numpy(data).pin_memory()
        self.chunk_blocks = chunk_blocks

    def pinned_rows(self, first: int, count: int) -> torch.Tensor | None:
        if (first // self.chunk_blocks) % 2:
            return None
        self.log.append(("pinned", first))
        return self.pinned[first:first + count]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_blocks", [1, 3, NUM_BLOCKS])
def test_cuda_import_through_pinned_memory_equals_the_cpu_import(tiny_cfg, chunk_blocks):
    layout = small_layout(num_global=16)
    want, got = PagedKVCache(tiny_cfg, layout, "cpu"), PagedKVCache(tiny_cfg, layout, "cuda")
    data = random_records(tiny_cfg, NUM_BLOCKS, seed=3)
    write_blocks(want, TARGETS, data)
    importer = BlockImporter(got, chunk_blocks)
    assert importer.host.is_pinned() and importer.stream is not None
    importer.import_blocks(TARGETS, ArrayReader(data))
    assert_pools_equal(got, want, f"cuda, chunk_blocks={chunk_blocks}")
    expected = host_block_checksums(data)
    importer.import_blocks(TARGETS, RecordingReader(data, [], expected=expected))  # checked on the device
    expected[NUM_BLOCKS - 1] += 1
    with pytest.raises(BlockChecksumMismatch, match=f"first: block {NUM_BLOCKS - 1}"):
        importer.import_blocks(TARGETS, RecordingReader(data, [], expected=expected))
    mixed = random_records(tiny_cfg, NUM_BLOCKS, seed=6)
    reader = PinnedReader(mixed, host_block_checksums(mixed), chunk_blocks)
    importer.import_blocks(TARGETS, reader)  # even chunks straight from pinned rows, odd ones staged
    assert np.array_equal(read_blocks(got, TARGETS), mixed)
    pinned = [e[1] for e in reader.log if e[0] == "pinned"]
    staged = [e[1] for e in reader.log if e[0] == "read"]
    assert pinned == list(range(0, NUM_BLOCKS, 2 * chunk_blocks))
    assert staged == list(range(chunk_blocks, NUM_BLOCKS, 2 * chunk_blocks))
    with pytest.raises(ConnectionError):
        importer.import_blocks(TARGETS, RecordingReader(data, [], fail_at=chunk_blocks % NUM_BLOCKS))
    assert importer.host.is_pinned() and importer.num_retired == 1

