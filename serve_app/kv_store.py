"""The replica's host KV store: exported global blocks in one fixed, page-aligned host buffer, keyed by
chain hash, that other replicas read with one-sided transfers (serve_app/kv_transfer.py).

A slot holds one block's flat record (engine/core/kv_blocks.py) and its checksum. Slots are evicted least
recently used first, a chain's tail before its head (as the engine's BlockPool does), and `on_evict`
hears of every evicted hash *before* its slot is overwritten, so the replica withdraws its ownership
records first (if it raises, nothing is evicted and the call raises). A reader that raced an eviction
anyway, or read a stale record, gets a checksum mismatch, never wrong KV.

Invariant (check_integrity): every slot is either free or holds exactly one hash;
len(free) + len(hash -> slot) == num_slots.
"""

from __future__ import annotations

import mmap
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine.core.kv_blocks import ExportedPrefix


CHECKSUM_THREADS = 4  # a batch of blocks is checksummed on this many threads (zlib releases the GIL over 5 KiB)
PARALLEL_MIN_BYTES = 1 << 20  # below this, one thread (a thread hop costs more than it saves)
_checksummer: ThreadPoolExecutor | None = None
_checksummer_lock = threading.Lock()


def block_checksum(record: np.ndarray) -> bytes:
    """CRC-32 of one block's bytes, 4 bytes big-endian. It guards against torn or reused slots, not
    adversaries (the chain hash names the content); zlib's CRC runs at ~6 GB/s a thread, where blake2b
    ran at 1.3 GB/s and dominated a pull's time."""
    return zlib.crc32(np.ascontiguousarray(record)).to_bytes(4, "big")


def block_checksums(records: np.ndarray) -> list[bytes]:
    """block_checksum of every row of records (uint8 [n, block_bytes]), in order; a batch of PARALLEL_MIN_BYTES
    or more is split into CHECKSUM_THREADS slices checksummed at once."""
    n = records.shape[0]
    if records.nbytes < PARALLEL_MIN_BYTES or n < 2:
        return [block_checksum(r) for r in records]
    global _checksummer
    with _checksummer_lock:
        if _checksummer is None:
            _checksummer = ThreadPoolExecutor(CHECKSUM_THREADS, thread_name_prefix="kv-crc")
    step = -(-n // CHECKSUM_THREADS)
    slices = _checksummer.map(lambda first: [block_checksum(r) for r in records[first:first + step]], range(0, n, step))
    return [c for part in slices for c in part]


@dataclass(frozen=True, slots=True)
class BlockRef:
    """Where one stored block is: what a reader needs for a one-sided read, and the checksum to verify."""

    block_hash: bytes
    address: int  # host virtual address in the owner's process (inside its registered buffer)
    nbytes: int
    checksum: bytes


class HostKVStore:
    def __init__(self, fingerprint: bytes, block_bytes: int, capacity_bytes: int,
                 on_evict: Callable[[list[bytes]], None] | None = None):
        """fingerprint: the replica's engine salt (every stored block is under it). capacity_bytes is
        rounded down to whole blocks; the buffer is allocated (anonymous mmap: page-aligned) up front."""
        if block_bytes <= 0 or capacity_bytes < block_bytes:
            raise ValueError(f"a store of {capacity_bytes} B cannot hold one {block_bytes} B block")
        self.fingerprint, self.block_bytes = fingerprint, block_bytes
        self.num_slots = capacity_bytes // block_bytes
        self._mmap = mmap.mmap(-1, self.num_slots * block_bytes)
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8).reshape(self.num_slots, block_bytes)
        self.on_evict = on_evict
        self._slot: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._checksum: dict[bytes, bytes] = {}
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.num_evicted = 0

    @property
    def address(self) -> int:
        """The buffer's host address (page-aligned), for registering it with a transfer agent."""
        return self.buffer.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def num_blocks(self) -> int:
        return len(self._slot)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot

    def put(self, prefix: ExportedPrefix) -> list[bytes]:
        """Stores the prefix's blocks (head first; ones already here are refreshed, not rewritten),
        evicting least recently used blocks of other prefixes as needed. Returns the hashes now held,
        a leading run of prefix.hashes (shorter only when the prefix is larger than the store)."""
        if prefix.fingerprint != self.fingerprint:
            raise ValueError(f"prefix fingerprint {prefix.fingerprint.hex()[:16]} is not this store's")
        if prefix.data.shape[1] != self.block_bytes:
            raise ValueError(f"prefix blocks have {prefix.data.shape[1]} bytes, the store's {self.block_bytes}")
        hashes = prefix.hashes[:self.num_slots]
        keep = set(hashes)
        missing = [i for i, h in enumerate(hashes) if h not in self._slot]
        victims: list[bytes] = []
        short = len(missing) - len(self._free)
        for h in self._slot if short > 0 else ():  # least recently used first
            if h not in keep:
                victims.append(h)
                if len(victims) == short:
                    break
        self._evict(victims)
        slots = [self._free.pop() for _ in missing]
        if missing:
            self.buffer[slots] = prefix.data[missing]
            for i, slot, checksum in zip(missing, slots, block_checksums(self.buffer[slots])):
                self._checksum[hashes[i]] = checksum
                self._slot[hashes[i]] = slot
        for h in reversed(hashes):  # the head most recently used: the tail is evicted first
            self._slot.move_to_end(h)
        return list(hashes)

    def longest_prefix(self, hashes: list[bytes]) -> int:
        """How many leading hashes are stored here."""
        n = 0
        while n < len(hashes) and hashes[n] in self._slot:
            n += 1
        return n

    def get_descriptors(self, hashes: list[bytes]) -> list[BlockRef]:
        """BlockRefs of the longest stored leading run of hashes (refreshing their recency)."""
        refs = []
        for h in hashes[:self.longest_prefix(hashes)]:
            slot = self._slot[h]
            refs.append(BlockRef(h, self.address + slot * self.block_bytes, self.block_bytes, self._checksum[h]))
        for ref in reversed(refs):
            self._slot.move_to_end(ref.block_hash)
        return refs

    def read(self, hashes: list[bytes]) -> ExportedPrefix:
        """A copy of the longest stored leading run of hashes (same-process use and tests)."""
        n = self.longest_prefix(hashes)
        data = self.buffer[[self._slot[h] for h in hashes[:n]]] if n else np.empty((0, self.block_bytes), np.uint8)
        return ExportedPrefix(self.fingerprint, list(hashes[:n]), data)

    def drop(self, hashes: list[bytes]) -> list[bytes]:
        """Evicts these hashes now (those held), telling on_evict first; returns the ones dropped."""
        victims = [h for h in hashes if h in self._slot]
        self._evict(victims)
        return victims

    def held_hashes(self) -> list[bytes]:
        """Every stored hash, least recently used first (e.g. to withdraw them all at shutdown)."""
        return list(self._slot)

    def check_integrity(self, verify_checksums: bool = False) -> None:
        slots = sorted(self._free + list(self._slot.values()))
        assert slots == list(range(self.num_slots)), f"slots free + held != 0..{self.num_slots - 1}"
        assert self._checksum.keys() == self._slot.keys(), "checksums and slots name different hashes"
        if verify_checksums:
            for h, slot in self._slot.items():
                assert block_checksum(self.buffer[slot]) == self._checksum[h], f"block {h.hex()[:16]} corrupted"

    def _evict(self, victims: list[bytes]) -> None:
        if not victims:
            return
        if self.on_evict is not None:
            self.on_evict(victims)  # before the slots can be overwritten
        for h in victims:
            self._free.append(self._slot.pop(h))
            del self._checksum[h]
        self.num_evicted += len(victims)
