"""Who holds which global KV blocks in its host store, in Redis (the only module that imports redis).

Keys (namespace `ns`, default "dsv41:kv"):
- `{ns}:blk:{chain hash hex}`: a hash of replica id -> JSON {n, addr, len, sum, fp, exp}: that replica's
  host store holds the block that ends the n-block prefix named by the chain hash, at host address
  `addr` (len bytes, CRC-32 `sum`), under engine fingerprint `fp`, until `exp` (unix time).
- `{ns}:peer:{replica id}`: JSON {agent, md, region, fp, exp}: where to read from: the replica's NIXL
  agent name and metadata (md, base64: what kv_transfer.TransferAgent.connect takes).
- `{ns}:owned:{replica id}`: the set of chain hashes the replica published (to withdraw them all).

Every key carries a Redis TTL of `lease_s`, refreshed by publish / renew, so a replica that dies
without withdrawing its records is forgotten within one lease; readers also skip records whose `exp`
passed. A replica withdraws a block before its store overwrites the slot, and everything at shutdown.
Any Redis failure is an OwnershipUnavailable: the caller recomputes instead of pulling.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from serve_app.kv_store import BlockRef

DEFAULT_NAMESPACE = "dsv41:kv"


class OwnershipUnavailable(RuntimeError):
    """Redis could not be reached or failed the command; no ownership is known (recompute)."""


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """One replica's transfer endpoint."""

    replica_id: str
    agent_name: str
    agent_metadata: bytes  # NIXL agent metadata (kv_transfer.TransferAgent.metadata)
    region: str
    fingerprint: bytes
    expires_at: float  # unix time


@dataclass(frozen=True, slots=True)
class OwnedBlock:
    block_hash: bytes
    num_blocks: int  # the block ends the prefix of this many blocks
    address: int  # in the owner's registered host buffer
    nbytes: int
    checksum: bytes
    expires_at: float

    def ref(self) -> BlockRef:
        return BlockRef(self.block_hash, self.address, self.nbytes, self.checksum)


class OwnedPrefix(NamedTuple):
    """The longest leading run of a prompt's blocks that one live peer holds (0, None, [] if none)."""

    num_blocks: int
    owner: PeerRecord | None
    blocks: list[OwnedBlock]


class OwnershipIndex:
    def __init__(self, client: redis.Redis | str, *, replica_id: str, region: str, fingerprint: bytes,
                 lease_s: float = 60.0, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 0.5):
        """client: a redis.Redis or a redis:// URL (then commands time out after timeout_s, one retry).
        fingerprint: this replica's engine salt: only records under it are read back."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if isinstance(client, str):
            client = redis.Redis.from_url(client, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 1))
        self.redis, self.replica_id, self.region = client, replica_id, region
        self.fingerprint, self.lease_s, self.ns = fingerprint, lease_s, namespace
        self._published: dict[bytes, tuple[int, BlockRef]] = {}  # what renew() refreshes
        self._peer: dict[str, str] | None = None

    # ---- the owner's side ---------------------------------------------------------------------------
    def announce(self, agent_name: str, agent_metadata: bytes) -> None:
        """Publishes (or refreshes) this replica's peer record."""
        self._peer = {"agent": agent_name, "md": base64.b64encode(agent_metadata).decode(), "region": self.region,
                      "fp": self.fingerprint.hex()}
        with self._redis():
            self._set_peer(self.redis)

    def publish(self, refs: list[BlockRef], first_block: int = 0) -> None:
        """Records that this replica's store holds refs, the blocks first_block, first_block + 1, ...
        of one chain (so refs[i] ends the prefix of first_block + i + 1 blocks)."""
        for i, ref in enumerate(refs):
            self._published[ref.block_hash] = (first_block + i + 1, ref)
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            self._write_blocks(pipe, [(ref.block_hash, first_block + i + 1, ref) for i, ref in enumerate(refs)])
            pipe.execute()

    def withdraw(self, hashes: list[bytes]) -> None:
        """Removes this replica's records of these blocks (before its store reuses their slots)."""
        for h in hashes:
            self._published.pop(h, None)
        if not hashes:
            return
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            for h in hashes:
                pipe.hdel(self._blk(h), self.replica_id)
            pipe.srem(self._owned(), *[h.hex() for h in hashes])
            pipe.execute()

    def withdraw_all(self) -> None:
        """Shutdown: every record this replica published (as Redis knows them) and its peer record."""
        self._published.clear()
        with self._redis():
            owned = self.redis.smembers(self._owned())
            pipe = self.redis.pipeline(transaction=False)
            for h in owned:
                pipe.hdel(f"{self.ns}:blk:{h.decode()}", self.replica_id)
            pipe.delete(self._owned(), self._peer_key(self.replica_id))
            pipe.execute()

    def renew(self) -> None:
        """Extends the lease of the peer record and of every block still published (call every
        lease_s / 3 or so; costs one pipelined write per block)."""
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            if self._peer is not None:
                self._set_peer(pipe)
            self._write_blocks(pipe, [(h, n, ref) for h, (n, ref) in self._published.items()])
            pipe.execute()

    # ---- the reader's side --------------------------------------------------------------------------
    def longest_owned_prefix(self, hashes: list[bytes], include_self: bool = False) -> OwnedPrefix:
        """The live peer (not this replica unless include_self) holding the most leading blocks of
        hashes under this fingerprint; ties go to a peer in this region, then by replica id."""
        if not hashes:
            return OwnedPrefix(0, None, [])
        now = time.time()
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            for h in hashes:
                pipe.hgetall(self._blk(h))
            fields = pipe.execute()
        runs: dict[str, list[OwnedBlock]] = {}  # replica -> its leading run so far
        alive: set[str] | None = None
        stale: list[tuple[str, bytes]] = []  # expired fields in keys that another owner keeps alive
        for i, (h, owners) in enumerate(zip(hashes, fields)):
            here = set()
            for rid_raw, raw in owners.items():
                rid = rid_raw.decode()
                rec = json.loads(raw)
                if rec["exp"] <= now:
                    stale.append((self._blk(h), rid_raw))
                    continue
                if (rid == self.replica_id and not include_self) or (alive is not None and rid not in alive):
                    continue
                if rec["fp"] != self.fingerprint.hex() or rec["n"] != i + 1:
                    continue
                runs.setdefault(rid, []).append(OwnedBlock(h, rec["n"], rec["addr"], rec["len"],
                                                           bytes.fromhex(rec["sum"]), rec["exp"]))
                here.add(rid)
            alive = here
            if not alive:
                break
        with self._redis():
            if stale:
                pipe = self.redis.pipeline(transaction=False)
                for key, rid_raw in stale:
                    pipe.hdel(key, rid_raw)
                pipe.execute()
            if not runs:
                return OwnedPrefix(0, None, [])
            peers = self.redis.mget([self._peer_key(rid) for rid in runs])
        candidates = []
        for (rid, run), raw in zip(runs.items(), peers):
            peer = _peer_record(rid, raw) if raw else None
            if peer is not None and peer.expires_at > now and peer.fingerprint == self.fingerprint:
                candidates.append((-len(run), peer.region != self.region, rid, peer, run))
        if not candidates:
            return OwnedPrefix(0, None, [])
        _, _, _, peer, run = min(candidates, key=lambda c: c[:3])
        return OwnedPrefix(len(run), peer, run)

    def peer(self, replica_id: str) -> PeerRecord | None:
        with self._redis():
            raw = self.redis.get(self._peer_key(replica_id))
        return _peer_record(replica_id, raw) if raw else None

    # ---- internals ----------------------------------------------------------------------------------
    @contextmanager
    def _redis(self) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.RedisError as e:
            raise OwnershipUnavailable(f"ownership index (Redis) unavailable: {e}") from e

    def _blk(self, block_hash: bytes) -> str:
        return f"{self.ns}:blk:{block_hash.hex()}"

    def _owned(self) -> str:
        return f"{self.ns}:owned:{self.replica_id}"

    def _peer_key(self, replica_id: str) -> str:
        return f"{self.ns}:peer:{replica_id}"

    def _ttl_ms(self) -> int:
        return max(1, int(self.lease_s * 1000))

    def _set_peer(self, pipe) -> None:
        doc = dict(self._peer, exp=time.time() + self.lease_s)
        pipe.set(self._peer_key(self.replica_id), json.dumps(doc), px=self._ttl_ms())

    def _write_blocks(self, pipe, blocks: list[tuple[bytes, int, BlockRef]]) -> None:
        if not blocks:
            return
        exp = time.time() + self.lease_s
        for h, n, ref in blocks:
            doc = {"n": n, "addr": ref.address, "len": ref.nbytes, "sum": ref.checksum.hex(),
                   "fp": self.fingerprint.hex(), "exp": exp}
            pipe.hset(self._blk(h), self.replica_id, json.dumps(doc))
            pipe.pexpire(self._blk(h), self._ttl_ms())
        pipe.sadd(self._owned(), *[h.hex() for h, _, _ in blocks])
        pipe.pexpire(self._owned(), self._ttl_ms())


def _peer_record(replica_id: str, raw: bytes) -> PeerRecord:
    doc = json.loads(raw)
    return PeerRecord(replica_id, doc["agent"], base64.b64decode(doc["md"]), doc["region"], bytes.fromhex(doc["fp"]),
                      doc["exp"])
