"""Faults under load (issue 20): what breaks, how each request ends, and how fast the server recovers by itself.

The process faults run on the live Serve app (the tiny checkpoint on the CPU, one replica, health checked every
second): a ShardWorker killed, then the EngineReplica actor killed, each while 8 greedy streams run. Every
stream must end with OpenAI's error event and [DONE] on a clean connection; every request sent while the
server recovers gets 200 or 503 with Retry-After (never a 500 or a hang); a fresh replica then serves again.
The time from the kill to the first request served again is printed.

The KV-sharing faults run on in-process replicas against a real Redis and NIXL over loopback (tests/kv's
fixtures): four conversations' second turns at once on a replica that did not serve their first, while Redis is
stopped and restarted (empty), while NIXL transfers fail or time out, and while one conversation's block is
corrupted in the owner's store. Each turn either pulls (and equals a replica that resumes from the blocks) or
falls back to recomputing (and equals a cold replica), with the reason counted; after Redis returns, the owner's
lease renewal re-publishes and pulls resume (the time to that is printed).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from serve_app.router import KVRouter
from serve_app.settings import ServeSettings
from tests.core.conftest import random_prompt, tiny_model  # noqa: F401  (the fixture)
from tests.kv.sharing_fixtures import (LocalReplica, identity, loop, redis, reference_turns,  # noqa: F401 (fixtures)
                                       wait_for)
from tests.reliability.live_faults import (API_KEY, NUM_STREAMS, Live, assert_ended_with_error_events, ready_again,
                                           recover, start_live, streams_then_fault, summary)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


# ---- process faults on the live app ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(serve_session, tiny_checkpoint) -> Iterator[Live]:
    from ray import serve

    settings = ServeSettings(checkpoint=str(tiny_checkpoint), device="cpu", api_key=API_KEY, replica_num_cpus=0.5,
                             health_check_period_s=1, graceful_shutdown_timeout_s=1)
    yield start_live(settings, "faults", serve_session, 60)
    serve.delete("faults")


def test_a_shard_worker_killed_mid_stream(live):
    [shard] = live.engine.shard_info.remote().result()
    ends, struck = asyncio.run(streams_then_fault(live.base_url, lambda: os.kill(shard["pid"], signal.SIGKILL)))
    assert_ended_with_error_events(ends)
    assert any("ActorDied" in e.error["message"] or "actor" in e.error["message"].lower() for e in ends), ends[0]
    with pytest.raises(Exception, match="cannot serve"):  # the replica fails its health check: Serve replaces it
        live.engine.check_health.remote().result()
    served_s, statuses = recover(live.base_url, struck)
    ready_s = ready_again(live.base_url, struck)
    [new_shard] = live.engine.shard_info.remote().result()
    print(f"\nshard killed under {NUM_STREAMS} streams: all ended with an error event; served again {served_s:.1f} s "
          f"after the kill (statuses meanwhile {summary(statuses)}), /readyz 200 after {ready_s:.1f} s")
    assert new_shard["pid"] != shard["pid"]
    live.engine.check_integrity.remote().result()


def test_the_engine_replica_killed_mid_stream(live):
    import ray

    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::faults#EngineReplica#")]
    actor = ray.get_actor(name, namespace="serve")
    ends, struck = asyncio.run(streams_then_fault(live.base_url, lambda: ray.kill(actor, no_restart=True)))
    assert_ended_with_error_events(ends)
    assert all("retried" in e.error["message"] for e in ends), ends[0]  # the failure's type, not Ray's text
    served_s, statuses = recover(live.base_url, struck)
    ready_s = ready_again(live.base_url, struck)
    print(f"\nengine replica killed under {NUM_STREAMS} streams: all ended with an error event; served again "
          f"{served_s:.1f} s after the kill (statuses meanwhile {summary(statuses)}), /readyz 200 after {ready_s:.1f} s")
    live.engine.check_integrity.remote().result()


# ---- KV-sharing faults on in-process replicas -------------------------------------------------------------
K = 4  # conversations whose second turns run at once
LEASE_S = 3.0  # the owner renews every lease_s / 3


@dataclass(frozen=True)
class Conversation:
    turn2: list[int]
    resumed: list[int]  # turn 2's tokens on a replica resuming from turn 1's blocks (what a pull gives)
    cold: list[int]  # ... on a replica that never saw turn 1 (what a fallback gives)




@pytest.fixture(scope="module")
def conversations(tiny_model, identity) -> list[tuple[list[int], Conversation]]:  # noqa: F811
    out = []
    for k in range(K):
        turn1 = random_prompt(150, seed=600 + k)
        out1, = reference_turns(tiny_model.model, identity, [turn1])
        turn2 = turn1 + out1 + random_prompt(20, seed=700 + k)
        _, resumed = reference_turns(tiny_model.model, identity, [turn1, turn2])
        cold, = reference_turns(tiny_model.model, identity, [turn2])
        out.append((turn1, Conversation(turn2, resumed, cold)))
    assert any(c.resumed != c.cold for _, c in out), "resumed and cold agree everywhere: a fallback would not show"
    return out


@pytest.fixture(scope="module")
def owner(loop, tiny_model, redis, identity, conversations) -> Iterator[LocalReplica]:  # noqa: F811
    """Replica "a": served every first turn and published their blocks; renews its leases by itself."""
    a = LocalReplica("a", tiny_model.model, redis.url, identity, lease_s=LEASE_S)

    async def serve_first_turns() -> None:
        a.kv.start_renewal()
        for k, (turn1, _) in enumerate(conversations):
            await a.turn(f"t1-{k}", turn1)

    loop.run(serve_first_turns())
    assert a.kv.store.num_blocks == 2 * K
    yield a
    loop.run(a.close())


@pytest.fixture(scope="module")
def router(tiny_checkpoint, redis) -> KVRouter:
    return KVRouter(ServeSettings(checkpoint=str(tiny_checkpoint), kv_sharing=True, redis_url=redis.url))


@pytest.fixture
def receiver(loop, tiny_model, redis, identity):  # noqa: F811
    made = []

    def make(name: str) -> LocalReplica:
        made.append(LocalReplica(name, tiny_model.model, redis.url, identity))
        return made[-1]

    yield make
    for r in made:
        loop.run(r.close())


def hints(loop, router, conversations) -> list:
    return [loop.run(router.route(f"h{k}", c.turn2)) for k, (_, c) in enumerate(conversations)]


def second_turns(loop, replica: LocalReplica, conversations, hint_list) -> list:
    """All K second turns on `replica` at once."""
    async def run():
        return await asyncio.gather(*(replica.turn(f"t2-{k}", c.turn2, h)
                                      for k, ((_, c), h) in enumerate(zip(conversations, hint_list))))
    return loop.run(run(), timeout_s=300)


def check_turns(turns, conversations, reasons: list[str | None]) -> None:
    """Each turn pulled (None: its tokens are the resumed ones, 128 tokens pulled) or fell back for the reason
    given (its tokens are the cold ones, nothing pulled or cached); `reasons` per conversation."""
    for k, (turn, (_, c), reason) in enumerate(zip(turns, conversations, reasons)):
        assert turn.outcome.fallback == reason, (k, turn.outcome)
        if reason is None:
            assert turn.token_ids == c.resumed and turn.outcome.num_pulled_tokens == 128, (k, turn.outcome)
        else:
            assert turn.token_ids == c.cold and turn.outcome.num_pulled_tokens == 0, (k, turn.outcome)
            assert turn.stats.num_cached_tokens == 0, k


def test_kv_pulls_under_load(owner, router, receiver, conversations, loop):
    hint_list = hints(loop, router, conversations)
    assert all(h is not None and h.pull_from == "a" and h.num_blocks == 2 for h in hint_list), hint_list
    b = receiver("b")
    check_turns(second_turns(loop, b, conversations, hint_list), conversations, [None] * K)
    assert b.fallbacks() == {}


def test_redis_down_and_back_under_load(owner, router, receiver, conversations, redis, loop):
    hint_list = hints(loop, router, conversations)  # decided while Redis was up
    redis.stop()
    try:
        assert hints(loop, router, conversations) == [None] * K  # the router routes by load only meanwhile
        c = receiver("c")
        check_turns(second_turns(loop, c, conversations, hint_list), conversations, ["redis_unavailable"] * K)
        assert c.fallbacks() == {"reason=redis_unavailable": K}
    finally:
        redis.start()  # empty: nothing persisted
    back = time.monotonic()
    wait_for(lambda: all(h is not None and h.pull_from == "a" for h in hints(loop, router, conversations)),
             10 * LEASE_S, "the owner's renewal re-published its blocks")
    republished_s = time.monotonic() - back
    d = receiver("d")
    check_turns(second_turns(loop, d, conversations, hints(loop, router, conversations)), conversations, [None] * K)
    print(f"\nRedis down: {K} turns at once all recomputed, correct; Redis back empty: pulls again after "
          f"{republished_s:.1f} s (the owner renews every {LEASE_S / 3:.1f} s here, every 20 s by default)")


def test_nixl_transfers_failing_and_timing_out_under_load(owner, router, receiver, conversations, loop, monkeypatch):
    """Of the K pulls (one at a time on the receiver's I/O thread), the first transfer fails outright (a dead
    peer's NIXL error), the second never finishes (timeout), the others are real."""
    e = receiver("e")
    e.kv.pull_timeout_s = 0.3
    e.kv.same_node_reads = False  # the owner is on this node: without this, it reads shared memory, not NIXL
    nixl = e.kv.agent._agent
    real_transfer, real_check = nixl.transfer, nixl.check_xfer_state
    calls, stuck = itertools.count(), set()

    def transfer(handle):
        k = next(calls)
        if k == 0:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT (injected)")
        state = real_transfer(handle)
        if k == 1:
            stuck.add(handle)
            return "PROC"
        return state

    monkeypatch.setattr(nixl, "transfer", transfer)
    monkeypatch.setattr(nixl, "check_xfer_state", lambda handle: "PROC" if handle in stuck else real_check(handle))
    t0 = time.monotonic()
    turns = second_turns(loop, e, conversations, hints(loop, router, conversations))
    seconds = time.monotonic() - t0
    reasons = [t.outcome.fallback for t in turns]
    assert sorted(reasons, key=str) == sorted([None] * (K - 2) + ["owner_unreachable", "timeout"], key=str), reasons
    check_turns(turns, conversations, reasons)
    assert e.fallbacks() == {"reason=owner_unreachable": 1, "reason=timeout": 1}
    print(f"\nNIXL: {K} turns at once, one transfer failed, one timed out ({e.kv.pull_timeout_s} s): both recomputed, "
          f"the rest pulled; {seconds:.1f} s for all")


def test_a_corrupted_block_under_load(owner, router, receiver, conversations, loop):
    from engine.core.prefix_hash import block_hashes

    bad = 1  # the conversation whose second block is corrupted in the owner's store
    [ref] = owner.kv.store.get_descriptors(block_hashes(conversations[bad][1].turn2, 64, owner.kv.salt)[:2])[1:]
    row = (ref.address - owner.kv.store.address) // ref.nbytes
    owner.kv.store.buffer[row, 123] ^= 0x10
    try:
        g = receiver("g")
        turns = second_turns(loop, g, conversations, hints(loop, router, conversations))
        check_turns(turns, conversations, ["checksum" if k == bad else None for k in range(K)])
        assert g.fallbacks() == {"reason=checksum": 1}
    finally:
        owner.kv.store.buffer[row, 123] ^= 0x10
    owner.kv.store.check_integrity(verify_checksums=True)
