import copy
import random

import pytest

from engine.core.block_pool import BlockPool, PoolExhausted


def h(k: int) -> bytes:
    return bytes([k]) * 32


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable through the public API, including the order allocate() would hand out."""
    refs = [pool.ref_count(b) for b in range(pool.num_blocks)]
    hashes = [pool.hash_of(b) for b in range(pool.num_blocks)]
    probe = copy.deepcopy(pool)
    return refs, hashes, pool.num_free, pool.num_cached, pool.num_in_use, probe.allocate(probe.num_free)


def cached_pool(num_blocks: int, release_order: list[int]) -> BlockPool:
    """All blocks allocated, block b registered as h(b), then released one at a time in release_order."""
    pool = BlockPool(num_blocks)
    for b in pool.allocate(num_blocks):
        assert pool.register(b, h(b))
    for b in release_order:
        pool.release([b])
    return pool


def test_fresh_pool_hands_out_ascending_ids():
    pool = BlockPool(8)
    assert (pool.num_blocks, pool.num_free, pool.num_cached, pool.num_in_use) == (8, 8, 0, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (3, 0, 5)
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    pool.check_integrity()


def test_released_blocks_are_reused_in_fifo_order_after_the_untouched_ones():
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.release([2, 0])
    pool.release([3])
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (5, 0, 1)
    assert pool.allocate(5) == [4, 5, 2, 0, 3]
    pool.release([4, 1])
    assert pool.allocate(2) == [4, 1]
    pool.check_integrity()


def test_cached_blocks_are_evicted_least_recently_released_first():
    pool = cached_pool(5, release_order=[3, 1, 4, 0, 2])
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (5, 5, 0)
    assert [pool.lookup(h(b)) for b in range(5)] == [0, 1, 2, 3, 4]

    assert pool.allocate(1) == [3]
    assert pool.lookup(h(3)) is None
    assert pool.hash_of(3) is None
    assert pool.allocate(2) == [1, 4]
    assert [pool.lookup(h(b)) for b in range(5)] == [0, None, 2, None, None]
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (2, 2, 3)
    assert pool.allocate(2) == [0, 2]
    assert pool.num_cached == 0
    pool.check_integrity()


def test_plain_free_blocks_go_before_any_cached_block():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.register(0, h(0)) and pool.register(2, h(2))
    pool.release([0, 1, 2, 3])  # 0 and 2 cached, 1 and 3 free
    assert (pool.num_free, pool.num_cached) == (4, 2)
    assert pool.allocate(3) == [1, 3, 0]
    assert pool.lookup(h(0)) is None
    assert pool.lookup(h(2)) == 2
    pool.check_integrity()


def test_tail_first_release_keeps_the_chain_head_longest():
    pool = BlockPool(3)
    table = pool.allocate(3)
    for i, b in enumerate(table):
        pool.register(b, h(10 + i))
    pool.release(list(reversed(table)))
    assert pool.allocate(1) == [table[2]]
    assert pool.allocate(1) == [table[1]]
    assert pool.lookup(h(10)) == table[0]


def test_acquire_takes_a_cached_block_out_of_the_evictable_set():
    pool = cached_pool(4, release_order=[0, 1, 2, 3])
    pool.acquire([pool.lookup(h(0))])
    assert pool.ref_count(0) == 1
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (3, 3, 1)
    assert pool.allocate(3) == [1, 2, 3]
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.lookup(h(0)) == 0 and pool.hash_of(0) == h(0)
    # Releasing it again makes it the most recently released cached block.
    pool.release([0])
    assert (pool.num_cached, pool.num_in_use) == (1, 3)
    pool.check_integrity()


def test_acquire_of_an_in_use_block_shares_it():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    assert pool.register(b, h(1))
    pool.acquire([pool.lookup(h(1))])
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert (pool.ref_count(b), pool.num_in_use, pool.num_cached) == (1, 1, 0)
    pool.release([b])
    assert (pool.ref_count(b), pool.num_in_use, pool.num_cached) == (0, 0, 1)
    pool.check_integrity()


def test_acquire_of_a_free_block_asserts_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(AssertionError, match="acquire of free block 1"):
        pool.acquire([0, 1])
    assert snapshot(pool) == before


def test_pool_exhausted_changes_nothing():
    pool = cached_pool(6, release_order=[4, 2])
    pool.release([5])  # three evictable: 4, 2, 5
    pool.acquire([4])
    pool.release([4])
    before = snapshot(pool)
    assert before[2:5] == (3, 3, 3)
    with pytest.raises(PoolExhausted, match="asked for 4 blocks, 3 free"):
        pool.allocate(4)
    assert snapshot(pool) == before
    assert pool.allocate(3) == [2, 5, 4]
    pool.check_integrity()


def test_double_free_asserts_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.release([1])
    with pytest.raises(AssertionError, match="double free: block 1"):
        pool.release([1])
    before = snapshot(pool)
    with pytest.raises(AssertionError, match="double free: block 0 released 2x with ref count 1"):
        pool.release([0, 0])
    assert snapshot(pool) == before
    with pytest.raises(AssertionError, match="double free: block 3"):
        pool.release([0, 3])
    assert snapshot(pool) == before
    with pytest.raises(AssertionError, match="out of range"):
        pool.release([-1])
    pool.check_integrity()


def test_register_a_duplicate_hash_returns_false():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, h(7)) is True
    assert pool.register(b, h(7)) is False
    assert pool.hash_of(b) is None
    assert pool.lookup(h(7)) == a
    assert pool.register(a, h(7)) is True  # idempotent
    with pytest.raises(AssertionError, match="already registered"):
        pool.register(a, h(8))
    pool.release([b, a])  # the duplicate is not cached: it goes to the free FIFO
    assert (pool.num_cached, pool.num_free) == (1, 3)
    assert pool.allocate(3) == [2, b, a]
    pool.check_integrity()


def test_register_needs_an_in_use_block():
    pool = BlockPool(2)
    with pytest.raises(AssertionError, match="not in use"):
        pool.register(0, h(1))


def test_caching_disabled_never_caches():
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.allocate(3)
    assert [pool.register(b, h(b)) for b in blocks] == [False, False, False]
    assert [pool.hash_of(b) for b in blocks] == [None, None, None]
    pool.release(list(reversed(blocks)))
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (3, 0, 0)
    assert pool.lookup(h(0)) is None
    assert pool.allocate(3) == [2, 1, 0]
    pool.check_integrity()


class ModelPool:
    """An independent, deliberately naive model of the pool: plain lists, O(n) everything."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.free = list(range(num_blocks))
        self.cached: list[int] = []  # least recently released first

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free) + len(self.cached):
            return None
        out = []
        while len(out) < n and self.free:
            out.append(self.free.pop(0))
        while len(out) < n:
            b = self.cached.pop(0)
            self.hash[b] = None
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (self.cached if self.hash[b] is not None else self.free).append(b)

    def lookup(self, block_hash: bytes) -> int | None:
        owners = [b for b, x in enumerate(self.hash) if x == block_hash]
        return owners[0] if owners else None

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.cached.remove(b)
            self.ref[b] += 1

    def register(self, b: int, block_hash: bytes) -> bool:
        if not self.enable_caching or (self.hash[b] is None and self.lookup(block_hash) is not None):
            return False
        self.hash[b] = block_hash
        return True


@pytest.mark.parametrize("enable_caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_a_naive_model(seed, enable_caching):
    rng = random.Random(seed)
    num_blocks = 24
    pool, model = BlockPool(num_blocks, enable_caching), ModelPool(num_blocks, enable_caching)
    requests: list[list[int]] = []  # each a block table holding one reference per entry
    counts = {"allocate": 0, "exhausted": 0, "release": 0, "register": 0, "hit": 0, "share": 0}

    for _ in range(600):
        op = rng.choice(["allocate", "allocate", "release", "register", "register", "hit", "share"])
        if op == "allocate":
            n = rng.randint(0, 10)
            expected = model.allocate(n)
            if expected is None:
                counts["exhausted"] += 1
                with pytest.raises(PoolExhausted):
                    pool.allocate(n)
            else:
                assert pool.allocate(n) == expected
                requests.append(expected)
        elif op == "release" and requests:
            table = requests.pop(rng.randrange(len(requests)))
            model.release(list(reversed(table)))
            pool.release(list(reversed(table)))
        elif op == "register" and any(requests):
            b = rng.choice(rng.choice([t for t in requests if t]))
            # Re-registering keeps the block's own hash; fresh registrations draw from a small alphabet
            # so that duplicates (False) happen often.
            block_hash = model.hash[b] or h(rng.randrange(12))
            assert pool.register(b, block_hash) == model.register(b, block_hash)
        elif op == "hit":
            block_hash = h(rng.randrange(12))
            b = model.lookup(block_hash)
            assert pool.lookup(block_hash) == b
            if b is not None:
                model.acquire([b])
                pool.acquire([b])
                requests.append([b])
        elif op == "share" and any(requests):
            table = rng.choice([t for t in requests if t])
            model.acquire(table)
            pool.acquire(table)
            requests.append(list(table))
        else:
            continue
        counts[op] += 1

        pool.check_integrity()
        assert [pool.ref_count(b) for b in range(num_blocks)] == model.ref
        assert [pool.hash_of(b) for b in range(num_blocks)] == model.hash
        in_use = sum(r > 0 for r in model.ref)
        assert (pool.num_free, pool.num_cached, pool.num_in_use) == (
            len(model.free) + len(model.cached), len(model.cached), in_use)

    # The walk exercised every path, not just the easy ones.
    assert min(counts.values()) > 5, counts
    if enable_caching:
        assert any(x is not None for x in model.hash)
    while requests:
        pool.release(list(reversed(requests.pop())))
    pool.check_integrity()
    assert pool.num_in_use == 0


def test_large_pool_integrity():
    pool = BlockPool(100_000)
    blocks = pool.allocate(100_000)
    for b in blocks[::2]:
        pool.register(b, b.to_bytes(32, "little"))
    pool.release(list(reversed(blocks)))
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (100_000, 50_000, 0)
    assert pool.allocate(50_001)[-2:] == [1, 99_998]
    pool.check_integrity()


def corrupt_cases():
    def ref_on_free(p):
        p._ref[5] = 1

    def negative_ref(p):
        p._ref[1] = -1

    def lost_block(p):
        p._free.remove(5)

    def both_free_and_cached(p):
        p._cached[5] = None

    def cached_without_hash(p):
        del p._hash_to_block[p._block_hash[2]]
        p._block_hash[2] = None

    def free_with_hash(p):
        p._block_hash[5] = h(99)
        p._hash_to_block[h(99)] = 5

    def maps_not_inverse(p):
        p._hash_to_block[h(2)] = 3

    def stale_hash_entry(p):
        p._hash_to_block[h(99)] = 0

    return [
        (ref_on_free, "free block 5 has ref count 1"),
        (negative_ref, "block 1 has ref count -1"),
        (lost_block, "block 5 has ref count 0 but is neither free nor cached"),
        (both_free_and_cached, "block 5 is both free and cached"),
        (cached_without_hash, "cached block 2 holds no hash"),
        (free_with_hash, "free block 5 holds hash"),
        (maps_not_inverse, "block 2 holds hash .* mapped to block 3"),
        (stale_hash_entry, "hash map has 3 entries for 2 hashed blocks"),
    ]


@pytest.mark.parametrize("corrupt,message", corrupt_cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_check_integrity_detects_corruption(corrupt, message):
    # Ends with blocks 0 (hashed) and 1 in use, 2 cached, 3..7 free (3 lost its hash to eviction).
    pool = BlockPool(8)
    pool.allocate(4)
    for b in (0, 2, 3):
        pool.register(b, h(b))
    pool.release([3, 2])
    assert pool.allocate(5) == [4, 5, 6, 7, 3]
    pool.release([3, 7, 6, 5, 4])
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (6, 1, 2)
    assert [pool.hash_of(b) for b in range(4)] == [h(0), None, h(2), None]
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
