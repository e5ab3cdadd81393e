"""Who holds which global KV blocks in its host store, in Redis (the only module that imports redis).

One record per published *run* of blocks (the blocks one publish() stored, consecutive in one chain) instead of
one per block, so that a lookup parses a handful of records, read in one server-side script, however long the
prompt (issue 27).

Keys (namespace `ns`, default "dsv41:kv"):
- `{ns}:run:{chain hash hex}`: a hash of replica id -> JSON {n, first, addrs, lens, sums, fp, exp}: that
  replica's host store holds blocks first .. n-1 of the chain whose n-block prefix the chain hash names (the
  key is the run's last block), block first + i at host address addrs[i] (lens[i] bytes, checksum sums[i]),
  under engine fingerprint `fp`, until `exp` (unix time).
- `{ns}:blk:{chain hash hex}:{j}`: the set of run keys (their chain hashes, hex) whose runs were published
  holding that block as block j of their chain. A chain hash names its whole prefix, so a run holding block j of
  a prompt's chain holds the prompt's blocks first .. j too: a prompt that shares only the head of a run still
  finds it.
- `{ns}:peer:{replica id}`: JSON {agent, md, region, fp, exp, local}: where to read from: the replica's NIXL
  agent name and metadata (md, base64: what kv_transfer.TransferAgent.connect takes) and, where its store is
  shared memory, the handle a reader on its node maps it by (local: kv_local.SharedStoreHandle's fields, or null).
- `{ns}:owned:{replica id}`: the set of run keys the replica published (to withdraw them all).

A reader sends its prompt's block keys to one script (LOOKUP), which returns each run that can hold the prompt's
blocks from block 0 on, once, with the last prompt block it holds (O(runs) set reads, not one per block); the reader
then chains each replica's runs from block 0. Invariant the owner keeps: each
of its run records names blocks its store holds; withdrawing a block cuts every run holding it to the blocks
before it (a new, shorter run record; the blocks after it can no longer extend a prefix from block 0 through this
replica). Set members left pointing at a record that no longer covers a block are harmless: the record's n or
its missing field says so. Every key carries a Redis TTL of `lease_s`, refreshed by publish / renew, so a replica
that dies without withdrawing its records is forgotten within one lease; readers also skip records whose `exp`
passed. A replica withdraws a block before its store overwrites the slot, and everything at shutdown. The script
reads keys it derives (the block and run keys): one Redis server, not a cluster. Any Redis failure is an
OwnershipUnavailable: the caller recomputes.
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

from serve_app.kv_local import SharedStoreHandle
from serve_app.kv_store import BlockRef

DEFAULT_NAMESPACE = "dsv41:kv"
# ARGV: the run keys' prefix, the block keys' prefix, the prompt's block hashes (hex, concatenated, `width` digits
# each), width -> [run hash, i, HGETALL of its key, ...] for the runs that hold the prompt's blocks from block 0 on,
# each once, with i the 1-based index of the last prompt block it holds (block i's key: blk(i); the script builds
# the keys, so the call carries one string, not a key per block). A run holds a contiguous stretch of the prompt's
# blocks (chain hashes: once the prompt leaves the run's chain it never meets it again), ending at the run's own
# last block (the run key, block n) or where the prompt diverges: found with SISMEMBER, by bisection. So the script
# does not read every block's set: from block i it reads that block's set, then jumps past the end of the shortest
# run holding block i (every run that starts later, and could extend some replica's prefix from block 0, starts
# right after a run found here ends), and stops at the first block no record holds (no prefix from block 0 passes
# it): O(runs x log(blocks)) calls.
LOOKUP = """
local width = tonumber(ARGV[4])
local num_blocks = #ARGV[3] / width
local function blk(i)
  return ARGV[2] .. string.sub(ARGV[3], (i - 1) * width + 1, i * width) .. ':' .. (i - 1)
end
local function last_held(run, i, n)
  local hi = math.min(n, num_blocks)
  if redis.call('SISMEMBER', blk(hi), run) == 1 then return hi end
  local lo = i
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if redis.call('SISMEMBER', blk(mid), run) == 1 then lo = mid else hi = mid end
  end
  return lo
end
local info, order, i = {}, {}, 1
while i <= num_blocks do
  local next_i = nil
  for _, run in ipairs(redis.call('SMEMBERS', blk(i))) do
    if info[run] == nil then
      local fields = redis.call('HGETALL', ARGV[1] .. run)
      info[run] = false
      if #fields > 0 then
        info[run] = {fields, last_held(run, i, cjson.decode(fields[2]).n)}
        order[#order + 1] = run
      end
    end
    if info[run] and (next_i == nil or info[run][2] + 1 < next_i) then next_i = info[run][2] + 1 end
  end
  if next_i == nil then break end
  i = math.max(next_i, i + 1)
end
local out = {}
for _, run in ipairs(order) do
  out[#out + 1] = run
  out[#out + 1] = info[run][2]
  out[#out + 1] = info[run][1]
end
return out
"""


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
    shared_store: SharedStoreHandle | None = None  # its host store, for a reader on its node


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


@dataclass(slots=True)
class PublishedRun:
    """The owner's copy of one run record: blocks first .. first + len(refs) - 1 of a chain."""

    first: int
    refs: list[BlockRef]

    @property
    def end_hash(self) -> bytes:
        return self.refs[-1].block_hash

    def doc(self, fingerprint: bytes, expires_at: float) -> str:
        return json.dumps({"n": self.first + len(self.refs), "first": self.first,
                           "addrs": [r.address for r in self.refs], "lens": [r.nbytes for r in self.refs],
                           "sums": [r.checksum.hex() for r in self.refs], "fp": fingerprint.hex(), "exp": expires_at})


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
        self._runs: dict[bytes, PublishedRun] = {}  # run key's chain hash -> the run (what renew() refreshes)
        self._peer: dict[str, str] | None = None
        self._lookup = self.redis.register_script(LOOKUP)

    # ---- the owner's side ---------------------------------------------------------------------------
    def announce(self, agent_name: str, agent_metadata: bytes, shared_store: SharedStoreHandle | None = None) -> None:
        """Publishes (or refreshes) this replica's peer record."""
        self._peer = {"agent": agent_name, "md": base64.b64encode(agent_metadata).decode(), "region": self.region,
                      "fp": self.fingerprint.hex(), "local": shared_store.doc() if shared_store is not None else None}
        with self._redis():
            self._set_peer(self.redis)

    def publish(self, refs: list[BlockRef], first_block: int = 0) -> None:
        """Records that this replica's store holds refs, the blocks first_block, first_block + 1, ...
        of one chain (so refs[i] ends the prefix of first_block + i + 1 blocks): one run record."""
        if not refs:
            return
        run = PublishedRun(first_block, list(refs))
        self._runs[run.end_hash] = run
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            self._write_runs(pipe, [run])
            pipe.execute()

    def withdraw(self, hashes: list[bytes]) -> None:
        """This replica's store drops these blocks (before it overwrites their slots): every run holding one
        is cut to the blocks before the first dropped (or removed, if that is its first)."""
        dropped = set(hashes)
        cut = {key: run for key, run in self._runs.items() if any(r.block_hash in dropped for r in run.refs)}
        if not cut:
            return
        kept = []
        for key, run in cut.items():
            del self._runs[key]
            keep = next(i for i, r in enumerate(run.refs) if r.block_hash in dropped)
            if keep:
                kept.append(PublishedRun(run.first, run.refs[:keep]))
        for run in kept:
            self._runs[run.end_hash] = run
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            for key in cut:
                pipe.hdel(self._run_key(key), self.replica_id)
            pipe.srem(self._owned(), *[key.hex() for key in cut])
            self._write_runs(pipe, kept)
            pipe.execute()

    def withdraw_all(self) -> None:
        """Shutdown: every record this replica published (as Redis knows them) and its peer record."""
        self._runs.clear()
        with self._redis():
            owned = self.redis.smembers(self._owned())
            pipe = self.redis.pipeline(transaction=False)
            for h in owned:
                pipe.hdel(f"{self.ns}:run:{h.decode()}", self.replica_id)
            pipe.delete(self._owned(), self._peer_key(self.replica_id))
            pipe.execute()

    def renew(self) -> None:
        """Extends the lease of the peer record and of every run still published (call every lease_s / 3 or
        so; one pipeline: a record per run and a set entry per block)."""
        with self._redis():
            pipe = self.redis.pipeline(transaction=False)
            if self._peer is not None:
                self._set_peer(pipe)
            self._write_runs(pipe, list(self._runs.values()))
            pipe.execute()

    # ---- the reader's side --------------------------------------------------------------------------
    def longest_owned_prefix(self, hashes: list[bytes], include_self: bool = False) -> OwnedPrefix:
        """The live peer (not this replica unless include_self) holding the most leading blocks of
        hashes under this fingerprint; ties go to a peer in this region, then by replica id. Two round trips
        (the lookup script, the peers' records), three when it clears expired fields."""
        if not hashes:
            return OwnedPrefix(0, None, [])
        now = time.time()
        with self._redis():
            found = self._lookup(keys=[], args=[f"{self.ns}:run:", f"{self.ns}:blk:", b"".join(hashes).hex(),
                                                2 * len(hashes[0])])
        spans: dict[str, list[tuple[int, int, dict]]] = {}  # replica -> (first, end, record): prompt blocks held
        stale: list[tuple[str, bytes]] = []  # expired fields in keys that another owner keeps alive
        for run, last, fields in zip(found[0::3], found[1::3], found[2::3]):
            for rid_raw, raw in zip(fields[0::2], fields[1::2]):
                rid, rec = rid_raw.decode(), json.loads(raw)
                if rec["exp"] <= now:
                    stale.append((f"{self.ns}:run:{run.decode()}", rid_raw))
                    continue
                if (rid == self.replica_id and not include_self) or rec["fp"] != self.fingerprint.hex():
                    continue
                end = min(rec["n"], last)  # this record holds prompt blocks first .. end - 1
                if rec["first"] < end:
                    spans.setdefault(rid, []).append((rec["first"], end, rec))
        runs: dict[str, list[OwnedBlock]] = {}  # replica -> the blocks it holds from block 0, in order
        for rid, held_spans in spans.items():
            held = runs[rid] = []
            for first, end, rec in sorted(held_spans, key=lambda span: span[0]):
                if first > len(held):
                    break  # a gap: nothing later starts at block 0 through this replica
                for j in range(len(held), end):
                    k = j - first
                    held.append(OwnedBlock(hashes[j], j + 1, rec["addrs"][k], rec["lens"][k],
                                           bytes.fromhex(rec["sums"][k]), rec["exp"]))
        runs = {rid: held for rid, held in runs.items() if held}
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

    def _run_key(self, block_hash: bytes) -> str:
        return f"{self.ns}:run:{block_hash.hex()}"

    def _blk_key(self, block_hash: bytes, position: int) -> str:
        return f"{self.ns}:blk:{block_hash.hex()}:{position}"

    def _owned(self) -> str:
        return f"{self.ns}:owned:{self.replica_id}"

    def _peer_key(self, replica_id: str) -> str:
        return f"{self.ns}:peer:{replica_id}"

    def _ttl_ms(self) -> int:
        return max(1, int(self.lease_s * 1000))

    def _set_peer(self, pipe) -> None:
        doc = dict(self._peer, exp=time.time() + self.lease_s)
        pipe.set(self._peer_key(self.replica_id), json.dumps(doc), px=self._ttl_ms())

    def _write_runs(self, pipe, runs: list[PublishedRun]) -> None:
        """Each run's record and its blocks' set entries (all with a fresh lease)."""
        if not runs:
            return
        exp, ttl = time.time() + self.lease_s, self._ttl_ms()
        for run in runs:
            key = run.end_hash.hex()
            pipe.hset(self._run_key(run.end_hash), self.replica_id, run.doc(self.fingerprint, exp))
            pipe.pexpire(self._run_key(run.end_hash), ttl)
            for j, ref in enumerate(run.refs, start=run.first):
                pipe.sadd(self._blk_key(ref.block_hash, j), key)
                pipe.pexpire(self._blk_key(ref.block_hash, j), ttl)
        pipe.sadd(self._owned(), *[run.end_hash.hex() for run in runs])
        pipe.pexpire(self._owned(), ttl)


def _peer_record(replica_id: str, raw: bytes) -> PeerRecord:
    doc = json.loads(raw)
    local = doc.get("local")
    return PeerRecord(replica_id, doc["agent"], base64.b64decode(doc["md"]), doc["region"], bytes.fromhex(doc["fp"]),
                      doc["exp"], SharedStoreHandle.from_doc(local) if local else None)
