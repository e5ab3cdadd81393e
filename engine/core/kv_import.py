"""Pulled global blocks into the paged pools, in chunks, through one host staging buffer the pools' owner keeps.

    reader thread:  read chunk 0 -> slot 0 | read chunk 1 -> slot 1 | read chunk 2 -> slot 0 (after chunk 0's copy) ...
    this thread:                           | import chunk 0 (slot 0)  | import chunk 1 (slot 1)                      ...

A reader whose blocks are already in page-locked host memory the device can copy from (a same-node owner's store
registered with CUDA: serve_app/kv_local.py) offers them as pinned_rows instead, chunk by chunk: those chunks skip
the reader thread and the staging buffer, and go to the device straight from the owner's memory.

The buffer is uint8 [2, chunk_blocks, block_bytes]: two slots, so at most two chunks are in flight (one being
read, one being imported). It is allocated once per pools' owner (a shard actor, an in-process executor) and page-
locked on CUDA, so a one-sided read (NIXL) can land in it and the host-to-device copy runs asynchronously on the
importer's own stream; on the CPU it is plain memory and the import is a synchronous copy. A slot is handed back to
the reader only once the copy out of it has finished (a CUDA event per slot).

Where it runs: beside the steps (the AsyncEngine's pull thread in-process, a shard actor's "pull" group), into
blocks the engine holds for the pull and has not published (LLMEngine.begin_import), so no step reads, reuses or
hits them while they are written; the engine publishes them between two steps once this returns (end_import).
The pools' other blocks are read and written by steps meanwhile: on CUDA the copies run on this importer's stream
(after the work the steps had queued when the import started), and `import_blocks` returns only once they ended.

Verification: a reader with expected checksums (a peer's blocks) has every block's checksum computed where it
landed (on the importer's stream, from the device copy: no host pass over the bytes) and compared once, after the
last chunk; a mismatch raises BlockChecksumMismatch, with the blocks written but unpublished, as below.

Failure: a read that raises stops the pipeline; `import_blocks` waits for the read in flight, then raises. Chunks
before it may already be in the pools: the caller must not use any of the blocks (LLMEngine.end_import frees them
unpublished, so the request recomputes). After a failed read the buffer is retired and a fresh one allocated,
since a one-sided read that timed out may still land in it later (the reader keeps the old one alive).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from engine.core.block_checksum import block_checksums
from engine.core.kv_blocks import block_bytes, write_rows
from engine.core.kv_cache import PagedKVCache

DEFAULT_CHUNK_BLOCKS = 1024  # 58 MB of the real config's records per chunk; two slots: 117 MB of pinned memory. On an
# H100 (kv_turn2.py's parts, 2026-12-07) the shared-memory pipeline took 0.76 / 2.27 ms for 17.5 / 70 MB against 0.90 /
# 2.90 ms at 256 blocks (19.4 -> 23 GB/s at 32K tokens; 24 -> 31 at 128K); 256 had been 2.9x faster than 64


class BlockReader(Protocol):
    """A source of flat block records (engine/core/kv_blocks.py), read on the importer's reader thread."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def expected_checksums(self) -> np.ndarray | None:
        """int64 [num_blocks]: each block's checksum (engine/core/block_checksum.py) as its owner recorded it, which
        the importer verifies where the bytes land; None for a source trusted as it is (this replica's own memory)."""
        ...

    def select(self, rows: list[int]) -> "BlockReader":
        """The same source restricted to these rows, in this order."""
        ...

    def open(self, buffer: np.ndarray) -> None:
        """Once per import, before the first read, on the reader thread: buffer is the whole staging buffer
        (uint8, C-contiguous), e.g. to register it for one-sided reads."""
        ...

    def read(self, first: int, dst: np.ndarray) -> None:
        """Fills dst (uint8 [n, block_bytes], a view of the staging buffer) with blocks first .. first + n - 1,
        or raises (nothing in dst may be used then)."""
        ...

    def pinned_rows(self, first: int, count: int) -> torch.Tensor | None:
        """After open(): blocks first .. first + count - 1 as page-locked host rows (uint8 [count, block_bytes]) that
        a CUDA device copies from directly, instead of read() into the staging buffer; None where they are not one
        adjacent run of such memory (asked only when the pools are on CUDA)."""
        ...


@dataclass(frozen=True, slots=True)
class ArrayReader:
    """Blocks already in host memory (an ExportedPrefix's data, the replica's own host store)."""

    data: np.ndarray  # uint8 [n, block_bytes]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def expected_checksums(self) -> None:
        return None

    def select(self, rows: list[int]) -> "ArrayReader":
        return ArrayReader(self.data[rows])

    def open(self, buffer: np.ndarray) -> None:
        pass

    def read(self, first: int, dst: np.ndarray) -> None:
        dst[:] = self.data[first:first + dst.shape[0]]

    def pinned_rows(self, first: int, count: int) -> None:
        return None


# writes chunk rows (uint8 [n, block_bytes] on the host, a staging-buffer view) into those blocks of every rank's
# pools; the default writes this process's pools, a shard group's leader broadcasts them (shard_lead.write_blocks)
BlockSink = Callable[[list[int], torch.Tensor], None]


class BlockChecksumMismatch(RuntimeError):
    """A pulled block's bytes, as they landed, do not have the checksum its owner recorded (a slot reused or torn
    during the read, or corrupted): none of the import's blocks may be used."""


class BlockImporter:
    """The staging buffer and the pipeline. One import at a time (the engine's pull thread, or a shard actor's
    "pull" group); the reader thread is this importer's own."""

    def __init__(self, kv: PagedKVCache, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS):
        assert chunk_blocks >= 1, f"chunk_blocks {chunk_blocks}"
        self.kv, self.chunk_blocks = kv, chunk_blocks
        self.block_bytes = block_bytes(kv.cfg, kv.layout.global_block_size)
        self.device = next(iter(kv.main_kv.values())).device
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # host-to-device copies run on their own stream, so chunk i + 1's copy overlaps chunk i's checks and scatter
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.host = self._new_buffer()  # [2, chunk_blocks, block_bytes] uint8
        self.num_retired = 0  # buffers given up after a failed read
        self.last_direct_chunks = self.last_staged_chunks = 0  # the last import's chunks by path (benchmarks report it)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-import-read")
        self._lock = threading.Lock()

    @property
    def buffer(self) -> np.ndarray:
        """The staging buffer's host memory as numpy (what a reader registers)."""
        return self.host.numpy()

    @torch.inference_mode()
    def import_blocks(self, block_ids: list[int], reader: BlockReader, sink: BlockSink | None = None) -> None:
        """Reads reader's blocks (as many as block_ids) chunk by chunk and writes block i into block_ids[i] of
        every global pool; returns once all are in the pools. Raises what a read raised, or BlockChecksumMismatch
        (see the module doc)."""
        assert reader.num_blocks == len(block_ids), f"{reader.num_blocks} blocks read for {len(block_ids)} targets"
        if not block_ids:
            return
        with self._lock:
            self._run(block_ids, reader, sink)

    def close(self) -> None:
        self._reader.shutdown(wait=True)

    # ---- internals ----------------------------------------------------------------------------------
    def _run(self, block_ids: list[int], reader: BlockReader, sink: BlockSink | None) -> None:
        C, host = self.chunk_blocks, self.host
        chunks = [(first, min(first + C, len(block_ids))) for first in range(0, len(block_ids), C)]
        copied: list[torch.cuda.Event | None] = [None, None]  # per slot: its last copy to the device has ended
        expected = reader.expected_checksums
        sums = torch.empty(len(block_ids), dtype=torch.int64, device=self.device) if expected is not None else None
        staged: list[int] = []  # the chunks read into the staging buffer (the others: the reader's pinned rows)

        def read(k: int) -> None:  # on the reader thread: staged chunk k into slot k % 2
            if copied[k % 2] is not None:
                copied[k % 2].synchronize()  # the slot's previous chunk has left it
            first, end = chunks[staged[k]]
            reader.read(first, host[k % 2, :end - first].numpy())

        if self.is_cuda:  # work queued before the pull (a launched step that may still write a block freed since)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # goes before this stream's copies
            self.copy_stream.wait_stream(self.stream)
        pending: Future | None = None
        try:
            self._reader.submit(reader.open, host.numpy()).result()
            direct = [reader.pinned_rows(f, e - f) if self.is_cuda else None for f, e in chunks]
            staged = [i for i, rows in enumerate(direct) if rows is None]
            self.last_direct_chunks, self.last_staged_chunks = len(chunks) - len(staged), len(staged)
            staged_index = {i: k for k, i in enumerate(staged)}
            pending = self._reader.submit(read, 0) if staged else None
            for i, (first, end) in enumerate(chunks):
                k = staged_index.get(i)
                if k is not None:
                    pending.result()  # chunk i is in slot k % 2 (or its read raised)
                    if k + 1 < len(staged):
                        pending = self._reader.submit(read, k + 1)  # overlaps the import below
                rows = host[k % 2, :end - first] if k is not None else direct[i]  # [n, block_bytes]
                landed = rows
                if self.is_cuda and (sink is None or sums is not None):
                    with torch.cuda.stream(self.copy_stream):
                        landed = rows.to(self.device, non_blocking=True)
                    if k is not None:  # the slot is free once its bytes are on the device
                        copied[k % 2] = torch.cuda.Event()
                        copied[k % 2].record(self.copy_stream)
                    self.stream.wait_stream(self.copy_stream)
                    landed.record_stream(self.stream)  # the allocator keeps it until the checks and scatter ran
                with torch.cuda.stream(self.stream) if self.is_cuda else nullcontext():
                    if sums is not None:
                        sums[first:end] = block_checksums(landed)
                    if sink is None:
                        write_rows(self.kv, block_ids[first:end], landed)
                if sink is not None:
                    sink(block_ids[first:end], rows)  # synchronous on the host: the slot is free after it
            if self.is_cuda:
                self.stream.synchronize()  # the pools are complete before the engine's next step reads them
        except BaseException:
            if pending is not None and not pending.done():
                pending.exception()  # wait: the reader must not write the buffer while someone else uses it
            if self.is_cuda:
                self.copy_stream.synchronize()
                self.stream.synchronize()
            self.host = self._new_buffer()
            self.num_retired += 1
            raise
        if sums is not None:
            bad = np.flatnonzero(sums.cpu().numpy() != expected)
            if bad.size:
                raise BlockChecksumMismatch(f"{bad.size} of {len(block_ids)} pulled blocks (first: block {bad[0]}) "
                                            "arrived with another checksum than their owner's: checksum mismatch")

    def _new_buffer(self) -> torch.Tensor:
        return torch.empty((2, self.chunk_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=self.is_cuda)
