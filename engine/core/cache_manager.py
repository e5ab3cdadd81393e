"""Which cache blocks each request owns (plain data, no torch): global blocks with a prefix cache,
window (SWA) blocks, compressor pending slots, and snapshots of finished requests.

- Global block: `global_block_size` consecutive positions' global KV (main KV + index keys of every KV
  source). A full block whose global KV is written is registered under the chain hash of the tokens up
  to its end (salted with the replica fingerprint) and is shared read-only by every later hit.
- SWA block: `swa_block_size` positions' window KV for every layer (and, with speculative decoding, the DSpark
  stages' context KV). A request holds only the blocks a present or future query can see: positions
  >= max(swa_floor, num_computed - window + 1 - swa_lookback).
- Pending slot: the compressor's incomplete ratio-r group (one per running request or snapshot).
- Snapshot: a finished request's whole state at its end (global blocks incl. the partial tail, its
  window KV, its pending group). The next turn of that conversation resumes from it exactly; a block
  hit without it rebuilds window KV by encoder bounded replay of the last `window` cached tokens (or,
  with exact_hits, by recomputing every cached position's window KV while reusing its global KV).
  One request adopts a snapshot (it then writes into the tail blocks); snapshots are dropped oldest
  first when full or when a pool runs short.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool
from engine.core.prefix_hash import block_hashes
from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class CacheLayout:
    global_block_size: int
    swa_block_size: int
    window_size: int
    num_global_blocks: int
    num_swa_blocks: int
    num_pending_slots: int
    max_snapshots: int
    num_dspark_layers: int = 0  # DSpark stages whose context KV the SWA blocks also hold (speculative decoding)
    # positions below the window a request keeps: 1 with DSpark, whose drafts after position P read context
    # P - window + 1 .. P while the target's next query (P + 1) reads P - window + 2 .. P + 1
    swa_lookback: int = 0

    def first_live(self, swa_floor: int, num_computed: int) -> int:
        """The first position whose window KV a request at num_computed may still read."""
        return max(swa_floor, num_computed - self.window_size + 1 - self.swa_lookback, 0)

    def swa_blocks_for(self, first: int, end: int) -> range:
        """SWA block indices covering positions first .. end-1."""
        return range(first // self.swa_block_size, -(-end // self.swa_block_size)) if end > first else range(0)


@dataclass(slots=True)
class Snapshot:
    token_ids: list[int]  # positions 0..L-1, all computed (prefix-cache ids: image spans as their key)
    global_blocks: list[int]
    swa_blocks: dict[int, int]
    pending_slot: int
    block_hashes: list[bytes]
    num_registered_blocks: int


@dataclass(slots=True)
class PrefixHit:
    num_tokens: int = 0  # global KV exists for positions below
    blocks: list[int] = field(default_factory=list)
    snapshot_id: int | None = None


@dataclass(eq=False, slots=True)
class PendingImport:
    """A pull in flight (KVCacheManager.begin_import .. end_import): the leading run of hashes it covers and per
    hash the block it holds (None: another pull in flight brings that one); `fresh` indexes the blocks it holds
    unpublished, for the pull to write. Compared by identity."""

    hashes: list[bytes] = field(default_factory=list)
    blocks: list[int | None] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)  # indices into hashes / blocks

    @property
    def fresh_blocks(self) -> list[int]:
        return [self.blocks[i] for i in self.fresh]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy one block's contents to another in a device pool (a fork for n > 1)."""

    pool: str  # "global" | "swa" | "pending"
    src: int
    dst: int


class KVCacheManager:
    def __init__(self, layout: CacheLayout, salt: bytes, enable_prefix_caching: bool = True,
                 exact_hits: bool = False):
        """exact_hits: a block hit rebuilds window KV from position 0 (bit-exact, as a cold run; the
        global KV is still reused) instead of by encoder bounded replay of the last window."""
        self.layout, self.salt, self.enable_prefix_caching = layout, salt, enable_prefix_caching
        self.exact_hits = exact_hits
        self.global_pool = BlockPool(layout.num_global_blocks, enable_caching=enable_prefix_caching)
        self.swa_pool = BlockPool(layout.num_swa_blocks, enable_caching=False)
        self.free_pending = list(range(layout.num_pending_slots - 1, -1, -1))  # pop() hands out 0 first
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self._next_snapshot = 0
        self.imports: list[PendingImport] = []  # pulls in flight, each holding its blocks
        self._importing: dict[bytes, int] = {}  # their fresh blocks' hashes (unpublished) -> block
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    # ---- prefix lookup and admission ------------------------------------------------------------
    def find_prefix(self, req: Request) -> PrefixHit:
        """Longest reusable prefix, leaving at least one position to compute (its logits are needed). Image spans
        are matched by their image's content (`Request.cache_ids_between`), never by their token ids."""
        ids = req.all_cache_ids
        if not self.enable_prefix_caching:
            return PrefixHit()
        req.block_hashes = block_hashes(ids, self.layout.global_block_size, self.salt)
        max_blocks = (len(ids) - 1) // self.layout.global_block_size
        hit = PrefixHit()
        for h in req.block_hashes[:max_blocks]:
            block = self.global_pool.lookup(h)
            if block is None:
                break
            hit.blocks.append(block)
        hit.num_tokens = len(hit.blocks) * self.layout.global_block_size
        for sid, snap in reversed(self.snapshots.items()):
            L = len(snap.token_ids)
            if hit.num_tokens <= L < len(ids) and ids[:L] == snap.token_ids:
                return PrefixHit(L, [], sid)
        return hit

    def admit(self, req: Request, hit: PrefixHit) -> bool:
        """Take the hit's blocks and a pending slot; set where computation starts. False (nothing
        changed) when no pending slot is free."""
        if hit.snapshot_id is None and not self.free_pending and not self._drop_oldest_snapshot():
            return False
        self.num_lookup_tokens += req.num_tokens
        self.num_hit_tokens += hit.num_tokens
        W = self.layout.window_size
        if hit.snapshot_id is not None:
            snap = self.snapshots.pop(hit.snapshot_id)
            req.global_blocks, req.swa_blocks, req.pending_slot = snap.global_blocks, snap.swa_blocks, snap.pending_slot
            req.block_hashes = snap.block_hashes + req.block_hashes[len(snap.block_hashes):]
            req.num_registered_blocks = snap.num_registered_blocks
            req.num_computed = req.global_from = hit.num_tokens
            req.swa_floor = 0  # the kept window reaches back a whole window: no floor needed
        else:
            self.global_pool.acquire(hit.blocks)
            req.global_blocks = list(hit.blocks)
            req.num_registered_blocks = len(hit.blocks)
            req.pending_slot = self.free_pending.pop()
            req.global_from = hit.num_tokens
            rebuild = hit.num_tokens if self.exact_hits else W  # positions recomputed for their window KV
            req.num_computed = req.swa_floor = max(0, hit.num_tokens - rebuild)
            req.stats.num_replayed_tokens = hit.num_tokens - req.num_computed
        req.stats.num_cached_tokens = hit.num_tokens
        return True

    # ---- cross-replica sharing (engine/core/kv_blocks.py moves the bytes) ---------------------------
    def cached_prefix(self, token_ids: list[int]) -> tuple[int, list[int], list[bytes]]:
        """(num_tokens, block_ids, hashes): the longest run of token_ids' full blocks held here
        (cached or in use), from block 0. Changes nothing; read the blocks before the next step."""
        if not self.enable_prefix_caching:
            return 0, [], []
        hashes = block_hashes(token_ids, self.layout.global_block_size, self.salt)
        blocks = []
        for h in hashes:
            block = self.global_pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return len(blocks) * self.layout.global_block_size, blocks, hashes[:len(blocks)]

    def begin_import(self, hashes: list[bytes]) -> PendingImport:
        """Hold blocks for a pull of hashes (a leading run of a prompt's chain): per hash the block here that
        holds it, or nothing when another pull in flight brings it (skipped: this pull neither reads nor waits
        for it), or a fresh block (held, unpublished) for the caller to write. Stops at the first hash that no
        free block is left for. Every block stays in use until end_import, so no step evicts, reuses or hits
        one meanwhile; a fresh block is no prefix hit before end_import publishes it."""
        pending = PendingImport()
        self.imports.append(pending)
        if not self.enable_prefix_caching:
            return pending
        held = [self.global_pool.lookup(h) for h in hashes]
        self.global_pool.acquire([b for b in held if b is not None])  # allocating the others cannot evict them
        num_fresh = sum(b is None and h not in self._importing for h, b in zip(hashes, held))
        fresh = iter(self.global_pool.allocate(min(num_fresh, self.global_pool.num_free)))
        for h, b in zip(hashes, held):
            if b is None and h not in self._importing:
                b = next(fresh, None)
                if b is None:
                    break
                pending.fresh.append(len(pending.hashes))
                self._importing[h] = b
            pending.hashes.append(h)
            pending.blocks.append(b)
        stop = len(pending.hashes)
        self.global_pool.release(list(reversed([b for b in held[stop:] if b is not None])))  # held past the stop
        return pending

    def end_import(self, pending: PendingImport, is_written: bool) -> int:
        """A pull ended: when is_written (every fresh block holds its hash's content, and the device has it), the
        fresh blocks are published (prefix hits from now on); else they are freed, holding no hash. Then every
        block is released, tail first like a request's (the chain's head outlives it). Returns the blocks
        published: a fresh block whose hash a step registered meanwhile (a request that computed the same prefix)
        is freed instead."""
        self.imports.remove(pending)
        num_published = 0
        for i in pending.fresh:
            del self._importing[pending.hashes[i]]
            if is_written:
                num_published += self.global_pool.register(pending.blocks[i], pending.hashes[i])
        self.global_pool.release([b for b in reversed(pending.blocks) if b is not None])
        return num_published

    def num_leading_held(self, hashes: list[bytes]) -> int:
        """How many of hashes, from the first, a block here holds (published)."""
        n = 0
        while n < len(hashes) and self.global_pool.lookup(hashes[n]) is not None:
            n += 1
        return n

    # ---- per-step allocation ----------------------------------------------------------------------
    def allocate(self, req: Request, end: int) -> bool:
        """Own the blocks positions num_computed .. end-1 need (and drop window blocks no query can see
        any more). False, allocating nothing, when a pool is short even after dropping snapshots."""
        L = self.layout
        self._release_dead_swa(req)
        new_global = -(-end // L.global_block_size) - len(req.global_blocks)
        first_live = L.first_live(req.swa_floor, req.num_computed)
        new_swa = [i for i in L.swa_blocks_for(first_live, end) if i not in req.swa_blocks]
        if new_global <= 0 and not new_swa:  # most decode steps: nothing to allocate
            return True
        while new_global > self.global_pool.num_free or len(new_swa) > self.swa_pool.num_free:
            if not self._drop_oldest_snapshot():
                return False
        if new_global > 0:
            req.global_blocks += self.global_pool.allocate(new_global)
        for i, b in zip(new_swa, self.swa_pool.allocate(len(new_swa))):
            req.swa_blocks[i] = b
        return True

    def trim(self, req: Request) -> None:
        """Give back the blocks that hold only positions >= num_computed (a verify step's rejected drafts; never
        registered, as registration covers full blocks below num_computed). Invariant the speculative engine keeps:
        a request owns global blocks 0 .. ceil(num_computed / G) - 1 and window blocks below num_computed between
        steps, as without speculation."""
        L = self.layout
        keep = -(-req.num_computed // L.global_block_size)
        if len(req.global_blocks) > keep:
            assert req.num_registered_blocks <= keep, f"{req.request_id}: trimming a registered block"
            self.global_pool.release(list(reversed(req.global_blocks[keep:])))
            del req.global_blocks[keep:]
        past = [i for i in req.swa_blocks if i * L.swa_block_size >= req.num_computed]
        if past:
            self.swa_pool.release([req.swa_blocks.pop(i) for i in past])

    def register_full_blocks(self, req: Request) -> None:
        """Publish the global blocks whose positions are all computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        B = self.layout.global_block_size
        num_full = req.num_computed // B
        if num_full <= req.num_registered_blocks:
            return
        if len(req.block_hashes) < num_full:
            known = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes += block_hashes(req.cache_ids_between(len(req.block_hashes) * B, num_full * B), B, self.salt,
                                             known)
        for i in range(req.num_registered_blocks, num_full):
            self.global_pool.register(req.global_blocks[i], req.block_hashes[i])
        req.num_registered_blocks = num_full

    # ---- end of a request -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """Give back everything (abort, preemption): full registered blocks stay cached for later hits."""
        self.global_pool.release(list(reversed(req.global_blocks)))
        self.swa_pool.release(list(req.swa_blocks.values()))
        if req.pending_slot is not None:
            self.free_pending.append(req.pending_slot)
        self._clear(req)

    def retain(self, req: Request) -> None:
        """A finished request: keep its whole state as a snapshot for the conversation's next turn."""
        L = self.layout
        if not self.enable_prefix_caching or L.max_snapshots == 0 or req.num_computed == 0:
            self.release(req)
            return
        self._release_dead_swa(req)
        self.register_full_blocks(req)
        snap = Snapshot(req.cache_ids_between(0, req.num_computed), req.global_blocks, req.swa_blocks, req.pending_slot,
                        req.block_hashes[:req.num_computed // L.global_block_size], req.num_registered_blocks)
        self.snapshots[self._next_snapshot] = snap
        self._next_snapshot += 1
        self._clear(req)
        while len(self.snapshots) > L.max_snapshots:
            self._drop_oldest_snapshot()

    def fork(self, parent: Request, child: Request) -> list[CopyOp] | None:
        """child gets parent's state at parent.num_computed: full global blocks shared, the partial
        tail block, live window blocks and the pending group copied. None (nothing changed) if short."""
        L = self.layout
        full = parent.num_computed // L.global_block_size
        tail = parent.global_blocks[full:]
        live = sorted(parent.swa_blocks.items())
        if (len(tail) > self.global_pool.num_free or len(live) > self.swa_pool.num_free or not self.free_pending):
            return None
        self.global_pool.acquire(parent.global_blocks[:full])
        new_tail = self.global_pool.allocate(len(tail))
        new_swa = self.swa_pool.allocate(len(live))
        child.global_blocks = parent.global_blocks[:full] + new_tail
        child.swa_blocks = {i: b for (i, _), b in zip(live, new_swa)}
        child.pending_slot = self.free_pending.pop()
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        for name in ("num_computed", "global_from", "swa_floor", "decoder_from", "decoder_floor", "num_prompt_at_admission"):
            setattr(child, name, getattr(parent, name))
        return ([CopyOp("global", s, d) for s, d in zip(tail, new_tail)]
                + [CopyOp("swa", s, d) for (_, s), d in zip(live, new_swa)]
                + [CopyOp("pending", parent.pending_slot, child.pending_slot)])

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of global blocks in use (cached blocks count as free)."""
        return self.global_pool.num_in_use / max(1, self.global_pool.num_blocks)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0

    def check_integrity(self, running: list[Request]) -> None:
        """Pools self-consistent, and their in-use counts equal what requests, snapshots and pulls in flight hold;
        a pull's fresh blocks hold no hash until it ends."""
        self.global_pool.check_integrity()
        self.swa_pool.check_integrity()
        owners = [(r.global_blocks, r.swa_blocks, r.pending_slot) for r in running]
        owners += [(s.global_blocks, s.swa_blocks, s.pending_slot) for s in self.snapshots.values()]
        owners += [([b for b in p.blocks if b is not None], {}, None) for p in self.imports]
        fresh = {p.hashes[i]: p.blocks[i] for p in self.imports for i in p.fresh}
        assert fresh == self._importing, f"pulls in flight hold {fresh}, the import map says {self._importing}"
        for h, b in fresh.items():
            assert self.global_pool.hash_of(b) is None, f"block {b} of a pull in flight is published"
        global_refs: dict[int, int] = {}
        for blocks, _, _ in owners:
            for b in blocks:
                global_refs[b] = global_refs.get(b, 0) + 1
        for b in range(self.global_pool.num_blocks):
            assert self.global_pool.ref_count(b) == global_refs.get(b, 0), \
                f"global block {b}: ref {self.global_pool.ref_count(b)}, owners hold {global_refs.get(b, 0)}"
        swa_owned = [b for _, swa, _ in owners for b in swa.values()]
        assert len(swa_owned) == len(set(swa_owned)) == self.swa_pool.num_in_use, \
            f"SWA blocks: {len(swa_owned)} owned ({len(set(swa_owned))} distinct), {self.swa_pool.num_in_use} in use"
        slots = [p for _, _, p in owners if p is not None] + self.free_pending
        assert sorted(slots) == list(range(self.layout.num_pending_slots)), f"pending slots: {sorted(slots)}"

    # ---- internals --------------------------------------------------------------------------------
    def _release_dead_swa(self, req: Request) -> None:
        first_live = self.layout.first_live(req.swa_floor, req.num_computed)
        dead = [i for i in req.swa_blocks if (i + 1) * self.layout.swa_block_size <= first_live]
        if dead:
            self.swa_pool.release([req.swa_blocks.pop(i) for i in dead])

    def _drop_oldest_snapshot(self) -> bool:
        if not self.snapshots:
            return False
        _, snap = self.snapshots.popitem(last=False)
        self.global_pool.release(list(reversed(snap.global_blocks)))
        self.swa_pool.release(list(snap.swa_blocks.values()))
        self.free_pending.append(snap.pending_slot)
        return True

    @staticmethod
    def _clear(req: Request) -> None:
        req.global_blocks, req.swa_blocks, req.pending_slot = [], {}, None
        req.num_registered_blocks = 0
