"""Turn 2 of a conversation on another replica: time to first token with a KV pull against a cold re-prefill, by
history length (issue 27), through two replicas in one process on one device.

    python benchmarks/kv_turn2.py [--model real-width|tiny] [--layers 8] [--lengths 1K,8K,32K,128K]
        [--new-tokens 64] [--chunk 8192] [--runs 2] [--cache-mib 1024] [--decodes 16]

Replicas A (owner), B and C (receivers) are what EngineReplica composes around its engine: LLMEngine + AsyncEngine +
KVSharing (a host store in shared memory registered with a NIXL agent, ownership records in a throwaway
redis-server). B reads a same-node owner's shared memory (the default), C always reads over NIXL. They share one
random model's weights (real_width_config(--layers) built on the GPU, or the tiny config on the CPU) and so one engine
salt. Per history length L and run, with fresh random token ids:
  1. A serves turn 1 (L tokens, one output token); its blocks are published (A's pools -> its host store -> Redis).
  2. cold: B serves a turn-2 prompt nobody holds (L + 1 + --new-tokens tokens), without a hint; TTFT from the call.
  3. pull: B, then C, serves the conversation's turn 2 with the router's hint (pull from A): KVSharing.prefetch (the
     ownership lookup, the read into the receiver's pinned staging buffer, the copy into its pools with every block's
     checksum checked on the device, chunks overlapped, beside its steps), then the prefill of what is left (the
     replayed window and the new tokens); TTFT from prefetch's start.
  4. check: the first tokens equal A's own turn 2 (A resumes from its blocks; no snapshots, so by replay as B).
Then, per length, the pull's parts timed alone on the same blocks (best of 5): lookup (one script call), read (a
copy out of A's mapped store, or one NIXL READ, into pinned memory), host to pools (one copy and scatter), the device
checks, the pipeline a pull runs per path (engine/core/kv_import.py: chunked reads overlapped with the copies and
checks; at the default chunk and at OTHER_CHUNK_BLOCKS), and the owner's export (A's pools -> host with the
blocks' checksums, what a publish reads); each publish's own parts are logged as it ends. Prints markdown tables: the fastest run per length. With --decodes N, last: N requests decode on B while it
pulls a fresh conversation of the longest length, and their inter-token gaps before and during the pull are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_pull import parse_tokens, start_redis  # noqa: E402
from benchmarks.random_model import bench_model  # noqa: E402
from engine.core.async_engine import AsyncEngine  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.kv_blocks import block_bytes, write_rows  # noqa: E402
from engine.core.kv_import import DEFAULT_CHUNK_BLOCKS, BlockImporter  # noqa: E402
from engine.core.prefix_hash import block_hashes  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from serve_app.kv_metrics import KVMetrics  # noqa: E402
from serve_app.kv_sharing import KVSharing, PullOutcome  # noqa: E402
from engine.core.block_checksum import block_checksums  # noqa: E402
from serve_app.kv_local import copy_blocks, peer_stores  # noqa: E402
from serve_app.kv_transfer import PeerBlockReader  # noqa: E402
from serve_app.records import KVHint  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)  # greedy
WEIGHTS = "kv-turn2-benchmark"  # one weights identity: A's and B's salts match
VOCAB_DRAWN = 120_000
OTHER_CHUNK_BLOCKS = 256  # the import pipeline also timed at this chunk size (the default until 2026-12-07)


class Replica:
    def __init__(self, name: str, model, config: EngineConfig, redis_url: str, host_kv_bytes: int,
                 same_node_reads: bool = True):
        self.name = name
        self.engine = LLMEngine.local(model, config, eos_token_id=-1, weights_identity=WEIGHTS)
        self.aengine = AsyncEngine(self.engine)
        self.kv = KVSharing.create(self.aengine, name, redis_url, region="local", host_kv_bytes=host_kv_bytes,
                                   metrics=KVMetrics("bench"), pull_timeout_s=60.0, same_node_reads=same_node_reads)
        self.kv.start_renewal()  # as EngineReplica does: the peer record outlives its first lease

    async def first_token(self, rid: str, prompt: list[int], hint: KVHint | None = None
                          ) -> tuple[float, int, PullOutcome | None, int]:
        """(seconds to the first token from the call, that token, the pull's outcome, tokens hit in the cache)."""
        t0 = time.perf_counter()
        outcome = await self.kv.prefetch(prompt, hint)
        seconds, token, stats = None, None, None
        async for out in self.aengine.generate(rid, prompt, ONE_TOKEN):
            if out.new_token_ids and seconds is None:
                seconds, token = time.perf_counter() - t0, out.new_token_ids[0]
            stats = out.stats
        return seconds, token, outcome, stats.num_cached_tokens

    async def publish(self, token_ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.kv.publish_soon(token_ids)
        await self.kv.flush()
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self.kv.close()
        await self.aengine.shutdown()


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


async def parts(a: Replica, b: Replica, prompt: list[int], num_blocks: int) -> dict[str, float]:
    """The pull's pieces alone, on blocks A published and B holds (engines idle), for both read paths."""
    B = a.engine.cache.layout.global_block_size
    hashes = block_hashes(prompt, B, a.engine.cache.salt)[:num_blocks]
    _, ids_a, _ = await a.aengine.call(a.engine.cache.cached_prefix, prompt)
    _, ids_b, _ = await b.aengine.call(b.engine.cache.cached_prefix, prompt)
    assert len(ids_a) >= num_blocks and len(ids_b) >= num_blocks, (len(ids_a), len(ids_b), num_blocks)
    ids_a, ids_b = ids_a[:num_blocks], ids_b[:num_blocks]
    n_owned, owner, blocks = b.kv.index.longest_owned_prefix(hashes)
    assert n_owned == num_blocks and owner.replica_id == a.name, (n_owned, owner)
    assert owner.shared_store is not None, "A's store is not shared memory"
    refs = [blk.ref() for blk in blocks]
    kv = b.engine.executor.kv
    device = next(iter(kv.main_kv.values())).device
    host = torch.empty((num_blocks, refs[0].nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = host.numpy()
    b.kv.agent.register(dst)
    b.kv.agent.pull(owner.agent_metadata, refs, dst)  # connected and warm
    mapped = peer_stores.map(owner.shared_store)
    assert mapped is not None, "A's store cannot be mapped from B's process"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    landed = host.to(device)

    def import_once() -> None:  # what BlockImporter does with a chunk's rows, all blocks in one copy
        write_rows(kv, ids_b, host.to(device, non_blocking=True))
        sync()

    def check_once() -> None:  # the importer's checks of what landed
        block_checksums(landed).cpu()

    readers = {"shm": PeerBlockReader(owner.agent_metadata, refs, 60.0, owner.shared_store, agent=b.kv.agent),
               "nixl": PeerBlockReader(owner.agent_metadata, refs, 60.0, None, agent=b.kv.agent)}
    importers = {c: BlockImporter(kv, c) for c in (DEFAULT_CHUNK_BLOCKS, OTHER_CHUNK_BLOCKS)}
    result = {  # (the pipelines rewrite B's blocks with the bytes they hold)
        "lookup": best_of(5, lambda: b.kv.index.longest_owned_prefix(hashes)),
        "read_shm": best_of(5, lambda: copy_blocks(mapped.array, owner.shared_store.base, [r.address for r in refs], dst)),
        "read_nixl": best_of(5, lambda: b.kv.agent.pull(owner.agent_metadata, refs, dst, verify=False)),
        "import": best_of(5, import_once),
        "check": best_of(5, check_once),
        "export": best_of(5, lambda: a.engine.executor.read_blocks_checked(ids_a)),
        "bytes": float(dst.nbytes),
    }
    for path, reader in readers.items():
        for c, imp in importers.items():
            result[f"pipeline_{path}{c}"] = best_of(5, lambda: imp.import_blocks(ids_b, reader))
            result[f"direct_{path}{c}"] = f"{imp.last_direct_chunks} / {imp.last_staged_chunks}"
        assert np.array_equal(a.engine.executor.read_blocks(ids_a), b.engine.executor.read_blocks(ids_b)), \
            f"B's blocks pulled by {path} differ from A's"
    return result


async def run(args, model, device: str) -> None:
    lengths = [parse_tokens(t) for t in args.lengths.split(",")]
    max_len = max(lengths) + args.new_tokens + 256
    # no snapshots: A's own turn 2 then resumes from its blocks + encoder replay of the window, as B does after a pull
    config = EngineConfig(max_num_seqs=2 + args.decodes, max_num_batched_tokens=args.chunk, cache_memory_bytes=args.cache_mib << 20,
                          max_model_len=max_len, max_snapshots=0)
    workdir = tempfile.mkdtemp(prefix="kv-turn2-")
    redis_proc, redis_url = start_redis(workdir)
    B = config.global_block_size
    store_bytes = 2 * (max_len // B + 1) * block_bytes(model.cfg, B)
    a = Replica("A", model, config, redis_url, store_bytes)
    b = Replica("B", model, config, redis_url, store_bytes)
    c = Replica("C", model, config, redis_url, store_bytes, same_node_reads=False)
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, min(VOCAB_DRAWN, model.cfg.vocab_size), (n,), generator=g).tolist()

    rows = []
    try:
        warm = tokens(min(args.chunk, max(lengths)))  # compiles the kernels on both engines
        await a.first_token("warm-a", warm)
        await b.first_token("warm-b", tokens(len(warm)))
        await c.first_token("warm-c", tokens(len(warm)))
        # a first pull from A, as a running server has long made: B maps A's store and registers it with CUDA (in the
        # background, waited for here), C connects to A over NIXL
        warm1 = tokens(4 * B)
        _, warm_tok, _, _ = await a.first_token("warm-t1", warm1)
        await a.publish(warm1 + [warm_tok])
        warm_hint = KVHint(a.engine.cache.salt, target=a.name, pull_from=a.name, num_blocks=len(warm1) // B)
        for r in (b, c):
            await r.first_token(f"warm-pull-{r.name}", warm1 + [warm_tok] + tokens(8), warm_hint)
        mapped = peer_stores.map(a.kv.store.shared_handle(), page_locked=device == "cuda")
        assert mapped is not None and (mapped.wait_locked(120.0) or device != "cuda"), "A's store is not page-locked"
        for L in lengths:
            best: dict[str, float] = {}
            for r in range(args.runs):
                turn1 = tokens(L)
                t1, tok1, _, _ = await a.first_token(f"t1-{L}-{r}", turn1)
                publish_s = await a.publish(turn1 + [tok1])
                turn2 = turn1 + [tok1] + tokens(args.new_tokens)
                cold_s, _, _, cold_hit = await b.first_token(f"cold-{L}-{r}", tokens(len(turn2)))
                owned = (L + 1) // B
                hint = KVHint(a.engine.cache.salt, target=a.name, pull_from=a.name, num_blocks=owned)
                pull_s, tok_b, outcome, hit = await b.first_token(f"pull-{L}-{r}", turn2, hint)
                nixl_s, tok_c, outcome_c, hit_c = await c.first_token(f"nixl-{L}-{r}", turn2, hint)
                _, tok_a, _, _ = await a.first_token(f"own-{L}-{r}", turn2)
                for o, h in ((outcome, hit), (outcome_c, hit_c)):
                    assert o.fallback is None and o.num_pulled_tokens == owned * B and h == owned * B, (o, h)
                assert cold_hit == 0, cold_hit
                run_row = {"turn1": t1, "publish": publish_s, "cold": cold_s, "pull_ttft": pull_s,
                           "pull": outcome.seconds, "nixl_ttft": nixl_s, "nixl_pull": outcome_c.seconds,
                           "same": float(tok_a == tok_b == tok_c)}  # same: every run's
                print(f"L={L} run {r}: turn 1 {t1 * 1e3:.1f} ms, publish {publish_s * 1e3:.1f} ms, "
                      f"cold turn 2 {cold_s * 1e3:.1f} ms, pulled turn 2 {pull_s * 1e3:.1f} ms "
                      f"(pull {outcome.seconds * 1e3:.1f} ms: lookup {outcome.lookup_seconds * 1e3:.1f}, import "
                      f"{outcome.import_seconds * 1e3:.1f}; {outcome.num_bytes / 1e6:.1f} MB), over NIXL "
                      f"{nixl_s * 1e3:.1f} ms (pull {outcome_c.seconds * 1e3:.1f} ms), "
                      f"first tokens {'=' if tok_a == tok_b == tok_c else '!='} A's", flush=True)
                if not best or run_row["pull_ttft"] < best["pull_ttft"]:
                    best = {**run_row, "cold": min(cold_s, best.get("cold", cold_s)),
                            "same": min(run_row["same"], best.get("same", 1.0))}
                else:
                    best["cold"], best["same"] = min(best["cold"], cold_s), min(best["same"], run_row["same"])
                last_turn2 = turn2
            best.update(await parts(a, b, last_turn2, (L + 1) // B))
            rows.append((L, best))
        if args.decodes:
            itl = await decode_during_pull(a, b, tokens, max(lengths), args.decodes)
    finally:
        await c.close()
        await b.close()
        await a.close()
        redis_proc.terminate()
    report(args, rows, device)
    if args.decodes:
        alone, during, pull_s = itl
        print(f"\n{args.decodes} requests decoding on B while it pulls {max(lengths):,} tokens of history "
              f"({pull_s * 1e3:.1f} ms): ITL decode alone p50 {np.percentile(alone, 50):.2f} / p99 "
              f"{np.percentile(alone, 99):.2f} ms; during the pull p50 {np.percentile(during, 50):.2f} / p99 "
              f"{np.percentile(during, 99):.2f} / max {during.max():.2f} ms ({len(during)} gaps)")


async def decode_during_pull(a: Replica, b: Replica, tokens, L: int, n: int) -> tuple[np.ndarray, np.ndarray, float]:
    """n requests decode on B; A serves and publishes a fresh L-token turn 1; B pulls it (prefetch alone, as a turn 2
    on B starts). Returns the decoding requests' inter-token gaps (ms) before the pull and those ending during it,
    and the pull's seconds."""
    B = a.engine.cache.layout.global_block_size
    stamps: list[list[float]] = [[] for _ in range(n)]
    stop = asyncio.Event()

    async def decode(i: int) -> None:
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        async for out in b.aengine.generate(f"decode-{i}", tokens(128), params):
            stamps[i].extend([time.perf_counter()] * len(out.new_token_ids))
            if stop.is_set():
                break

    turn1 = tokens(L)
    _, tok1, _, _ = await a.first_token("itl-t1", turn1)
    await a.publish(turn1 + [tok1])
    tasks = [asyncio.create_task(decode(i)) for i in range(n)]
    while min(len(s) for s in stamps) < 40:  # steady decode, past the decodes' own prefills
        await asyncio.sleep(0.01)
    start = time.perf_counter()
    hint = KVHint(a.engine.cache.salt, target=a.name, pull_from=a.name, num_blocks=(L + 1) // B)
    outcome = await b.kv.prefetch(turn1 + [tok1] + tokens(64), hint)
    end = time.perf_counter()
    assert outcome.fallback is None and outcome.num_pulled_tokens > 0, outcome
    marks = [len(s) for s in stamps]
    while min(len(s) - m for s, m in zip(stamps, marks)) < 10:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.gather(*tasks)
    alone, during = [], []
    for s in stamps:
        for t0, t1 in zip(s[20:], s[21:]):  # identical stamps (tokens of one output) are not gaps
            if t1 == t0:
                continue
            if t1 < start:
                alone.append((t1 - t0) * 1e3)
            elif t1 <= end or t0 < end:
                during.append((t1 - t0) * 1e3)
    return np.array(alone), np.array(during), end - start


def report(args, rows, device: str) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    what = f"{args.layers} real-width layers" if args.model == "real-width" else "tiny model"
    D, G = DEFAULT_CHUNK_BLOCKS, OTHER_CHUNK_BLOCKS
    print(f"\n{name}, {what}, chunk {args.chunk}, {args.new_tokens} new tokens in turn 2, fastest of {args.runs}; "
          "B pulls from A's shared memory, C over NIXL")
    print("| history tokens | MB pulled | cold turn 2 TTFT ms | pulled turn 2 TTFT ms (shm / NIXL) | pull ms (shm / NIXL) "
          "| pull / cold re-prefill (shm) | same token |")
    print("|---|---|---|---|---|---|---|")
    for L, r in rows:
        print(f"| {L:,} | {r['bytes'] / 1e6:.1f} | {r['cold'] * 1e3:.1f} | {r['pull_ttft'] * 1e3:.1f} / "
              f"{r['nixl_ttft'] * 1e3:.1f} | {r['pull'] * 1e3:.1f} / {r['nixl_pull'] * 1e3:.1f} | "
              f"{r['pull'] / r['cold']:.1%} | {'yes' if r['same'] else 'NO'} |")
    print(f"\nThe pull's parts alone (best of 5), ms and GB/s; pipeline = read + host-to-device copy + scatter + checks, "
          f"chunked and overlapped, at chunk {D} / {G} blocks")
    print("| history tokens | lookup ms | read ms (shm / NIXL) | host-to-pools ms | device checks ms "
          "| pipeline ms shm | pipeline ms NIXL | export ms | read GB/s (shm / NIXL) | pipeline GB/s (shm / NIXL, best) "
          "| export GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for L, r in rows:
        gb = r["bytes"] / 1e9
        shm, nixl = min(r[f"pipeline_shm{D}"], r[f"pipeline_shm{G}"]), min(r[f"pipeline_nixl{D}"], r[f"pipeline_nixl{G}"])
        print(f"| {L:,} | {r['lookup'] * 1e3:.2f} | {r['read_shm'] * 1e3:.2f} / {r['read_nixl'] * 1e3:.2f} | "
              f"{r['import'] * 1e3:.2f} | {r['check'] * 1e3:.2f} | {r[f'pipeline_shm{D}'] * 1e3:.2f} / "
              f"{r[f'pipeline_shm{G}'] * 1e3:.2f} | {r[f'pipeline_nixl{D}'] * 1e3:.2f} / {r[f'pipeline_nixl{G}'] * 1e3:.2f} "
              f"| {r['export'] * 1e3:.2f} | {gb / r['read_shm']:.1f} / {gb / r['read_nixl']:.1f} | "
              f"{gb / shm:.1f} / {gb / nixl:.1f} | {gb / r['export']:.1f} |")
    print("shared-memory pipeline chunks from the owner's page-locked rows directly / through the staging buffer: "
          + "; ".join(f"{L:,}: {r[f'direct_shm{D}']} (chunk {D}), {r[f'direct_shm{G}']} (chunk {G})" for L, r in rows))
    wins = [L for L, r in rows if r["pull_ttft"] < r["cold"]]
    print(f"pulled turn 2 faster than cold at: {', '.join(f'{L:,}' for L in wins) or 'no length measured'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["real-width", "tiny"], default="real-width",
                   help="real-width: real_width_config(--layers) on the GPU; tiny: the tiny config (CPU works)")
    p.add_argument("--layers", type=int, default=8, help="real_width_config's role order (6, 8 or 10 layers)")
    p.add_argument("--lengths", default="1K,8K,32K,128K", help="turn 1's tokens (the history turn 2 carries)")
    p.add_argument("--new-tokens", type=int, default=64, help="turn 2's new tokens after the history")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens: prefill chunk size")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--cache-mib", type=int, default=1024, help="each engine's KV cache")
    p.add_argument("--decodes", type=int, default=0,
                   help="then: this many requests decode on B while it pulls the longest length (their ITL)")
    args = p.parse_args()
    publish_log = logging.getLogger("dsv41.kv")  # serve_app.kv_sharing: each publish's parts (export, store, records)
    publish_log.setLevel(logging.DEBUG)
    publish_log.addHandler(logging.StreamHandler(sys.stdout))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [parse_tokens(t) for t in args.lengths.split(",")]
    t0 = time.perf_counter()
    model = bench_model(args.model, args.layers, max(lengths) + args.new_tokens + 256)
    print(f"random {args.model} model built in {time.perf_counter() - t0:.0f} s"
          + (f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB" if device == "cuda" else ""), flush=True)
    print(f"UCX_TLS={os.environ.get('UCX_TLS', 'unset')}", flush=True)
    asyncio.run(run(args, model, device))


if __name__ == "__main__":
    main()
