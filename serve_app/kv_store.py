"""The replica's host KV store: exported global blocks in one fixed, page-aligned host buffer, keyed by
chain hash, that other replicas read with one-sided transfers (serve_app/kv_transfer.py) or, on the same node,
map and copy from (serve_app/kv_local.py: the buffer is shared memory).

A slot holds one block's flat record (engine/core/kv_blocks.py) and its checksum. Slots are evicted least
recently used first, a chain's tail before its head (as the engine's BlockPool does), and `on_evict`
hears of every evicted hash *before* its slot is overwritten, so the replica withdraws its ownership
records first (if it raises, nothing is evicted and the call raises). A reader that raced an eviction
anyway, or read a stale record, gets a checksum mismatch, never wrong KV.

Invariant (check_integrity): every slot is either free or holds exactly one hash;
len(free) + len(hash -> slot) == num_slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.core.block_checksum import checksum_bytes, host_block_checksums
from engine.core.kv_blocks import ExportedPrefix
from serve_app.kv_local import SharedBuffer, SharedStoreHandle


def block_checksums(records: np.ndarray) -> list[bytes]:
    """Every row's checksum (engine/core/block_checksum.py: the one the importer verifies on the device), 8 bytes
    each, in row order. records: uint8 [n, block_bytes]."""
    return [checksum_bytes(v) for v in host_block_checksums(np.ascontiguousarray(records)).tolist()]


def block_checksum(record: np.ndarray) -> bytes:
    return block_checksums(record.reshape(1, -1))[0]


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
        rounded down to whole blocks; the buffer is allocated (shared memory, page-aligned) up front."""
        if block_bytes <= 0 or capacity_bytes < block_bytes:
            raise ValueError(f"a store of {capacity_bytes} B cannot hold one {block_bytes} B block")
        if block_bytes % 4:
            raise ValueError(f"blocks of {block_bytes} B: a block's checksum sums 4-byte words")
        self.fingerprint, self.block_bytes = fingerprint, block_bytes
        self.num_slots = capacity_bytes // block_bytes
        self._shared = SharedBuffer(self.num_slots * block_bytes)
        self.buffer = self._shared.array.reshape(self.num_slots, block_bytes)
        self.on_evict = on_evict
        self._slot: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._checksum: dict[bytes, bytes] = {}
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.num_evicted = 0

    @property
    def address(self) -> int:
        """The buffer's host address (page-aligned), for registering it with a transfer agent."""
        return self.buffer.ctypes.data

    def shared_handle(self) -> SharedStoreHandle | None:
        """What a peer on this node needs to map the buffer (None where it is not shared memory)."""
        return self._shared.handle()

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
            # every block new (an export of the blocks past those stored): the rows as they are, no gathered copy;
            # the checksums are of these bytes, the ones the slots now hold: the exporter's (summed on its device)
            # where it sent them, else summed here
            every = len(missing) == prefix.data.shape[0]
            rows = prefix.data if every else prefix.data[missing]
            self.buffer[slots] = rows
            if prefix.checksums is None:
                checksums = block_checksums(rows)
            else:
                sums = prefix.checksums if every else prefix.checksums[missing]
                checksums = [checksum_bytes(v) for v in sums.tolist()]
            for i, slot, checksum in zip(missing, slots, checksums):
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
