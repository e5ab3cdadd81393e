"""Ref-counted pool of KV-cache block ids with a prefix cache of released, still-valid blocks (no torch)."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence


class PoolExhausted(RuntimeError):
    """allocate() asked for more blocks than are free or evictable; the pool is unchanged."""


# Invariant (checked by check_integrity):
#   every block id 0..num_blocks-1 is in exactly one state
#     free    ref 0, no hash          in _free   (FIFO: release order, initially ascending ids)
#     cached  ref 0, registered hash  in _cached (LRU: least recently released first)
#     in use  ref > 0, hash or not    in neither
#   so len(_free) + len(_cached) + #in use == num_blocks,
#   and _hash_to_block / _block_hash are inverse maps over the cached and in-use blocks that hold a hash.
class BlockPool:
    """A fixed set of block ids 0..num_blocks-1. Each block is in exactly one state:
    free (no data worth keeping), cached (ref count 0 but holds a registered hash: reusable by a prefix
    hit, evictable in LRU order), or in use (ref count > 0).

    Eviction order is release order, so callers release a request's blocks tail first
    (`release(reversed(block_table))`): the tail of a hash chain is then evicted before its head, and a
    surviving head is still a usable prefix.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert isinstance(num_blocks, int) and num_blocks >= 0, f"num_blocks must be an int >= 0, got {num_blocks!r}"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref: list[int] = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out now: free + cached."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref count 1: plain free blocks first (FIFO), then cached blocks evicted LRU first,
        their hash dropped. Raises PoolExhausted, changing nothing, when n > num_free."""
        assert n >= 0, f"allocate({n})"
        if n > self.num_free:
            raise PoolExhausted(f"asked for {n} blocks, {self.num_free} free ({self.num_cached} of them cached) "
                                f"of {self.num_blocks}")
        block_ids = []
        for _ in range(min(n, len(self._free))):
            block_ids.append(self._free.popleft())
        for _ in range(n - len(block_ids)):
            block_id, _ = self._cached.popitem(last=False)
            del self._hash_to_block[self._block_hash[block_id]]
            self._block_hash[block_id] = None
            block_ids.append(block_id)
        for block_id in block_ids:
            self._ref[block_id] = 1
        return block_ids

    def release(self, block_ids: Sequence[int]) -> None:
        """ref -= 1 for each, in the order given. A block reaching 0 becomes cached (most recently released)
        if it has a hash, else free (back of the free FIFO). Release tail first (see the class docstring).
        A release below ref 0 (double free) is an AssertionError, checked before anything changes."""
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            assert self._ref[block_id] >= times, (
                f"double free: block {block_id} released {times}x with ref count {self._ref[block_id]}")
        for block_id in block_ids:
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                if self._block_hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached or in-use block holding the content chain-hashed to block_hash, if any."""
        return self._hash_to_block.get(block_hash)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """ref += 1 for each (a prefix hit taking cached or in-use blocks); a cached block leaves the LRU.
        Acquiring a free block is an AssertionError (it holds nothing to share), checked before anything changes."""
        for block_id in block_ids:
            self._check_id(block_id)
            assert self._ref[block_id] > 0 or block_id in self._cached, f"acquire of free block {block_id}"
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._cached[block_id]
            self._ref[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Records that in-use block_id now holds the full content whose chain hash is block_hash.
        False (nothing recorded) when caching is off or another block already holds that hash: the
        duplicate simply is not cached. A block's hash never changes once set."""
        self._check_id(block_id)
        assert self._ref[block_id] > 0, f"register of block {block_id} which is not in use"
        if not self.enable_caching:
            return False
        current = self._block_hash[block_id]
        if current is not None:
            assert current == block_hash, (
                f"block {block_id} already registered as {current.hex()}, now {block_hash.hex()}")
            return True
        if block_hash in self._hash_to_block:
            return False
        self._block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def hash_of(self, block_id: int) -> bytes | None:
        self._check_id(block_id)
        return self._block_hash[block_id]

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def check_integrity(self) -> None:
        """Asserts the invariant written above the class; O(num_blocks), for tests and debug builds."""
        n = self.num_blocks
        assert len(self._ref) == n and len(self._block_hash) == n, (
            f"per-block arrays have {len(self._ref)} refs / {len(self._block_hash)} hashes for {n} blocks")
        state: list[str | None] = [None] * n
        for name, ids in (("free", self._free), ("cached", self._cached)):
            for block_id in ids:
                assert 0 <= block_id < n, f"{name} list holds out-of-range block {block_id}"
                assert state[block_id] is None, f"block {block_id} is both {state[block_id]} and {name}"
                state[block_id] = name
        for block_id in range(n):
            ref, block_hash = self._ref[block_id], self._block_hash[block_id]
            assert ref >= 0, f"block {block_id} has ref count {ref}"
            if state[block_id] is None:
                assert ref > 0, f"block {block_id} has ref count 0 but is neither free nor cached"
                state[block_id] = "in use"
            else:
                assert ref == 0, f"{state[block_id]} block {block_id} has ref count {ref}"
            if state[block_id] == "free":
                assert block_hash is None, f"free block {block_id} holds hash {block_hash.hex()}"
            if state[block_id] == "cached":
                assert block_hash is not None, f"cached block {block_id} holds no hash"
            if block_hash is not None:
                assert self.enable_caching, f"block {block_id} holds a hash with caching disabled"
                owner = self._hash_to_block.get(block_hash)
                assert owner == block_id, f"block {block_id} holds hash {block_hash.hex()} mapped to block {owner}"
        num_hashed = n - self._block_hash.count(None)
        assert len(self._hash_to_block) == num_hashed, (
            f"hash map has {len(self._hash_to_block)} entries for {num_hashed} hashed blocks")
        num_in_use = state.count("in use")
        assert len(self._free) + len(self._cached) + num_in_use == n, (
            f"free {len(self._free)} + cached {len(self._cached)} + in use {num_in_use} != {n}")

    def _check_id(self, block_id: int) -> None:
        assert 0 <= block_id < self.num_blocks, f"block id {block_id} out of range [0, {self.num_blocks})"
