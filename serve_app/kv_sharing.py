"""The replica's side of cross-replica KV sharing: publish a finished request's blocks; before admitting a
prompt, pull the blocks another replica owns.

- Owner side (`publish_soon`, after a request ends): the request's full global blocks that the host store
  lacks are read from the engine (between steps), stored in the HostKVStore and published in the
  ownership index (Redis), so peers can read them with one-sided NIXL reads.
- Receiver side (`prefetch`, before the engine sees the prompt), given the router's KVHint: first the
  prompt's blocks this replica's own host store still holds (its device cache may have dropped blocks it
  exported), then, if the hint says pull, the owner's: looked up in Redis, then imported under the owner's
  fingerprint (AsyncEngine.import_blocks): the engine holds target blocks between two steps, unpublished; the
  executor reads the blocks (from the owner's shared memory on the same node, else over NIXL) into the staging
  buffer of whoever owns the pools (the shard actor: the bytes never pass through Ray), chunk by chunk, each
  chunk's read overlapped with the previous one's import (engine/core/kv_import.py), every block's checksum
  verified on the device, while the engine keeps stepping the other requests; then
  the engine publishes the blocks between two steps and admits the prompt as after a local prefix hit (block hit +
  encoder replay of the last window).
- Any failure is a fallback to recomputation: the response is the same, only slower;
  `dsv41_kv_pull_fallbacks_total{reason}` counts it and the request_end line names it. `prefetch` never
  raises for a sharing failure.

Threads: engine calls run on the AsyncEngine's worker thread (between steps); Redis, the host store and
this agent's set-up and shutdown (none of them thread-safe as used here) on this module's single I/O thread;
a pull's reads on the importer's reader thread, in the shard actor (its own agent) or, with the engine in
this process, with this agent, beside the steps; the event loop awaits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from engine.core.async_engine import AsyncEngine, EngineShutdownError
from engine.core.kv_blocks import ExportedPrefix, PrefixImportError, block_bytes
from engine.core.kv_import import ArrayReader, BlockChecksumMismatch
from engine.core.prefix_hash import block_hashes
from serve_app.kv_metrics import KVMetrics
from serve_app.kv_store import HostKVStore
from serve_app.kv_transfer import PeerBlockReader, TransferAgent, TransferFailed
from serve_app.ownership import OwnershipIndex, OwnershipUnavailable
from serve_app.records import KVHint

T = TypeVar("T")
logger = logging.getLogger("dsv41.kv")

FallbackReason = Literal[
    "fingerprint",  # the decision or the owner's blocks are under another engine salt (model, weights, format)
    "redis_unavailable",  # the ownership index could not be read
    "record_expired",  # the owner's records expired or were withdrawn after the router looked
    "owner_unreachable",  # NIXL could not read from the owner (gone, bad address, connection refused)
    "timeout",  # the read did not finish within pull_timeout_s
    "checksum",  # a block arrived with another checksum than its record (slot reused, torn, corrupted)
]
DEFAULT_PULL_TIMEOUT_S = 5.0
DEFAULT_LEASE_S = 60.0


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """What prefetch did for one prompt."""

    num_local_tokens: int = 0  # leading prompt tokens held here before any pull (device cache or own store)
    num_pulled_tokens: int = 0  # further tokens imported from another replica
    num_bytes: int = 0
    seconds: float = 0.0  # lookup + read + checksums + import (or until the fallback)
    lookup_seconds: float = 0.0  # of which the ownership lookup (Redis)
    import_seconds: float = 0.0  # and the engine's import: blocks held, read, copied, checked, published
    owner: str | None = None
    fallback: FallbackReason | None = None

    def log_fields(self) -> dict[str, object]:
        """The request_end line's `kv` object."""
        return {"local_tokens": self.num_local_tokens, "pulled_tokens": self.num_pulled_tokens,
                "pull_bytes": self.num_bytes, "pull_ms": round(self.seconds * 1000, 3),
                "lookup_ms": round(self.lookup_seconds * 1000, 3), "import_ms": round(self.import_seconds * 1000, 3),
                "owner": self.owner,
                "fallback": self.fallback}


class KVSharing:
    NO_PULL = PullOutcome()  # the outcome of a request without a hint

    def __init__(self, aengine: AsyncEngine, replica_id: str, index: OwnershipIndex, store: HostKVStore,
                 agent: TransferAgent, metrics: KVMetrics, *, pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
                 same_node_reads: bool = True, on_pull: Callable[[int, float], None] | None = None):
        """on_pull(num_bytes, seconds) hears of every successful pull (the router's bandwidth estimate).
        same_node_reads: pull from an owner on this node through its shared memory (else always NIXL)."""
        self.aengine, self.engine = aengine, aengine.engine
        self.replica_id, self.index, self.store, self.agent, self.metrics = replica_id, index, store, agent, metrics
        self.salt = self.engine.cache.salt
        self.block_size = self.engine.cache.layout.global_block_size
        self.pull_timeout_s, self.same_node_reads, self.on_pull = pull_timeout_s, same_node_reads, on_pull
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-io")
        self._tasks: set[asyncio.Task] = set()
        self._renewal: asyncio.Task | None = None

    @classmethod
    def create(cls, aengine: AsyncEngine, replica_id: str, redis_url: str, *, region: str, host_kv_bytes: int,
               metrics: KVMetrics, lease_s: float = DEFAULT_LEASE_S, **kw) -> "KVSharing":
        """A host store of host_kv_bytes registered with a new NIXL agent, an ownership index on redis_url,
        this replica's peer record announced (a Redis failure here is counted; renewal retries), and the staging
        buffer (a shard actor: and its NIXL agent) that pulls land in made ahead of the first pull."""
        engine = aengine.engine
        salt, B = engine.cache.salt, engine.cache.layout.global_block_size
        index = OwnershipIndex(redis_url, replica_id=replica_id, region=region, fingerprint=salt, lease_s=lease_s)
        store = HostKVStore(salt, block_bytes(engine.cfg, B), host_kv_bytes, on_evict=index.withdraw)
        agent = TransferAgent(f"{replica_id}-{os.getpid()}", store)
        engine.executor.prepare_pulls()  # the pools' owner's staging buffer (and agent), before the first pull
        sharing = cls(aengine, replica_id, index, store, agent, metrics, **kw)
        try:
            index.announce(agent.name, agent.metadata, store.shared_handle())
        except OwnershipUnavailable as e:
            metrics.observe_publish_failure("redis_unavailable")
            logger.warning("KV sharing: cannot announce replica %s yet: %s", replica_id, e)
        return sharing

    # ---- receiver side ------------------------------------------------------------------------------
    async def prefetch(self, prompt_ids: list[int], hint: KVHint | None) -> PullOutcome | None:
        """Before the prompt is added: make the leading blocks the hint names local. None without a hint."""
        if hint is None or hint.num_blocks == 0:
            return None
        t0 = time.perf_counter()
        if hint.fingerprint != self.salt:
            return self._fallback("fingerprint", PullOutcome(), t0, f"the router decided under engine salt "
                                  f"{hint.fingerprint.hex()[:16]}, this replica's is {self.salt.hex()[:16]}")
        B = self.block_size
        usable = min(hint.num_blocks, (len(prompt_ids) - 1) // B)  # a hit leaves one position to compute
        head = list(prompt_ids[:usable * B])
        hashes = block_hashes(head, B, self.salt)
        num_local = (await self.aengine.call(self.engine.cache.cached_prefix, head))[0] // B
        num_local = await self._restore_from_store(hashes, num_local)
        outcome = PullOutcome(num_local_tokens=num_local * B)
        if num_local >= usable or hint.pull_from is None or hint.pull_from == self.replica_id:
            return outcome
        t_lookup = time.perf_counter()
        try:
            num_owned, owner, blocks = await self._run(self.index.longest_owned_prefix, hashes)
        except OwnershipUnavailable as e:
            return self._fallback("redis_unavailable", outcome, t0, e)
        outcome = replace(outcome, lookup_seconds=time.perf_counter() - t_lookup)
        num_owned = min(num_owned, usable)
        if num_owned <= num_local:
            return self._fallback("record_expired", outcome, t0, f"no live record of blocks {num_local}..{usable - 1} "
                                  f"(the router saw {hint.num_blocks} at {hint.pull_from})")
        outcome = replace(outcome, owner=owner.replica_id)
        refs = [b.ref() for b in blocks[num_local:num_owned]]
        reader = PeerBlockReader(owner.agent_metadata, refs, self.pull_timeout_s,
                                 owner.shared_store if self.same_node_reads else None, self.agent)
        t_import = time.perf_counter()
        try:
            num_pulled = await self.aengine.import_blocks(owner.fingerprint, hashes[num_local:num_owned], reader)
        except TransferFailed as e:
            return self._fallback(_transfer_reason(e), outcome, t0, e)
        except BlockChecksumMismatch as e:
            return self._fallback("checksum", outcome, t0, e)
        except PrefixImportError as e:
            return self._fallback("fingerprint", outcome, t0, e)
        t_done = time.perf_counter()
        seconds = t_done - t0
        nbytes = sum(r.nbytes for r in refs)  # asked for (the engine skips any it holds; num_local counted those)
        self.metrics.observe_pull(nbytes, seconds)
        if self.on_pull is not None:
            self.on_pull(nbytes, seconds)
        return replace(outcome, num_pulled_tokens=num_pulled, num_bytes=nbytes, seconds=seconds,
                       import_seconds=t_done - t_import)

    def observe_hits(self, outcome: PullOutcome | None, num_cached_tokens: int) -> int:
        """Splits a request's prefix-hit tokens into local and remote (pulled) for the metrics; returns
        the remote ones. Pulled blocks count as remote only as far as the engine's hit reached them."""
        remote = 0
        if outcome is not None:
            remote = max(0, min(outcome.num_pulled_tokens, num_cached_tokens - outcome.num_local_tokens))
        self.metrics.observe_hits(num_cached_tokens - remote, remote)
        return remote

    # ---- owner side ---------------------------------------------------------------------------------
    def publish_soon(self, token_ids: list[int]) -> None:
        """After a request ended: store and publish its full blocks in the background (`flush` waits).
        A failure is counted and logged, never raised into the request."""
        task = asyncio.get_running_loop().create_task(self._publish(list(token_ids)), name="kv-publish")
        self._tasks.add(task)
        task.add_done_callback(self._publish_done)

    async def flush(self) -> None:
        """Waits until every publish started so far has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def start_renewal(self) -> None:
        """Renews this replica's leases every lease_s / 3 from now on (idempotent; call on the serving loop)."""
        if self._renewal is None:
            self._renewal = asyncio.get_running_loop().create_task(self._renew_forever(), name="kv-renew")

    async def renew(self) -> None:
        """Re-announces the peer record and refreshes every published block (e.g. after Redis restarted
        empty). Raises OwnershipUnavailable."""
        await self._run(self.index.renew)

    async def close(self) -> None:
        """Shutdown: stop renewing, withdraw every record, deregister the buffers (best effort)."""
        if self._renewal is not None:
            self._renewal.cancel()
        try:
            await self._run(self.index.withdraw_all)
        except OwnershipUnavailable as e:
            logger.warning("KV sharing: could not withdraw replica %s's records (they expire): %s", self.replica_id, e)
        await self._run(self.agent.close)
        self._io.shutdown(wait=True)

    # ---- internals ----------------------------------------------------------------------------------
    def _run(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _restore_from_store(self, hashes: list[bytes], num_local: int) -> int:
        stored = await self._run(self.store.read, hashes[num_local:])
        if stored.num_blocks == 0:
            return num_local
        # as a pull, beside the steps (to a shard actor the records travel as a Ray argument: host memory here)
        held = await self.aengine.import_blocks(self.salt, stored.hashes, ArrayReader(stored.data))
        return num_local + held // self.block_size

    def _fallback(self, reason: FallbackReason, outcome: PullOutcome, t0: float, why: object) -> PullOutcome:
        self.metrics.observe_fallback(reason)
        logger.warning("KV pull fell back to recomputation (%s): %s", reason, why)
        return replace(outcome, fallback=reason, seconds=time.perf_counter() - t0)

    async def _publish(self, token_ids: list[int]) -> None:
        try:
            t0 = time.perf_counter()
            hashes = block_hashes(token_ids, self.block_size, self.salt)
            num_stored = await self._run(self.store.longest_prefix, hashes)
            t1 = time.perf_counter()
            held, exported = await self.aengine.call(self._read_new_blocks, token_ids, num_stored)
            t2 = time.perf_counter()
            num_new = await self._run(self._store_and_publish, hashes, held, num_stored, exported)
            logger.debug("KV publish of %d blocks (%d new): hashes + store lookup %.1f ms, export %.1f ms, "
                         "store + ownership records %.1f ms", len(hashes), num_new, (t1 - t0) * 1e3,
                         (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3)
        except OwnershipUnavailable as e:
            self.metrics.observe_publish_failure("redis_unavailable")
            logger.warning("KV sharing: publish failed (peers will recompute this prefix): %s", e)
            return
        except EngineShutdownError:
            return
        self.metrics.observe_published(num_new)

    def _read_new_blocks(self, token_ids: list[int], num_stored: int
                         ) -> tuple[list[bytes], tuple[np.ndarray, np.ndarray] | None]:
        """On the engine's worker: the hashes of token_ids' blocks the engine holds, and the flat records
        of those past the first num_stored (the store has those already) with their checksums."""
        _, block_ids, held = self.engine.cache.cached_prefix(token_ids)
        new = block_ids[num_stored:]
        return held, self.engine.executor.read_blocks_checked(new) if new else None

    def _store_and_publish(self, hashes: list[bytes], held: list[bytes], num_stored: int,
                           exported: tuple[np.ndarray, np.ndarray] | None) -> int:
        self.store.get_descriptors(hashes[:num_stored])  # the head most recent: this put evicts other chains first
        if exported is not None:
            self.store.put(ExportedPrefix(self.salt, held[num_stored:], *exported))
        refs = self.store.get_descriptors(hashes)  # the leading run from block 0 now stored
        new = refs[num_stored:]
        if new:
            self.index.publish(new, first_block=num_stored)
        return len(new)

    def _publish_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("KV sharing: publish task failed", exc_info=task.exception())

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.index.lease_s / 3)
            try:
                await self.renew()
            except OwnershipUnavailable as e:
                self.metrics.observe_publish_failure("redis_unavailable")
                logger.warning("KV sharing: lease renewal failed: %s", e)


def _transfer_reason(e: TransferFailed) -> FallbackReason:
    message = str(e)  # (a pull's reads are unverified: its checksums fail as BlockChecksumMismatch)
    if "timed out" in message:
        return "timeout"
    return "owner_unreachable"
