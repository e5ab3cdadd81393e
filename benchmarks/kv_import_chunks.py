"""A pull's import pipeline (engine/core/kv_import.py) by read path and chunk size: real-width global blocks read from
a host store in this process, copied out of its shared memory (the same-node path, serve_app/kv_local.py) or over NIXL
(UCX loopback), into a PagedKVCache's pools with every block's checksum checked where it landed, chunk i + 1's read
overlapping chunk i's copy (issue 27).

    python benchmarks/kv_import_chunks.py [--blocks 1024] [--layers 8] [--chunks 16,64,256,1024] [--paths shm,nixl]
        [--device cpu]

Prints, per path and chunk size (the default DEFAULT_CHUNK_BLOCKS first), the fastest of 5 imports and its GB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.random_model import real_width_config  # noqa: E402
from engine.core.engine import EngineConfig, cache_layout  # noqa: E402
from engine.core.block_checksum import block_checksums  # noqa: E402
from engine.core.kv_blocks import ExportedPrefix, block_bytes, write_rows  # noqa: E402
from engine.core.kv_cache import PagedKVCache  # noqa: E402
from engine.core.kv_import import DEFAULT_CHUNK_BLOCKS, BlockImporter  # noqa: E402
from serve_app.kv_store import HostKVStore  # noqa: E402
from serve_app.kv_transfer import PeerBlockReader, TransferAgent  # noqa: E402

SALT = b"kv-import-chunks".ljust(32, b"\0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1024, help="64-token blocks pulled (1024: 64K tokens)")
    p.add_argument("--layers", type=int, default=8, help="real_width_config's layers (its KV sources set the block)")
    p.add_argument("--chunks", default="16,64,256,1024", help="chunk sizes in blocks, besides the default")
    p.add_argument("--paths", default="shm,nixl", help="read paths: shm (same node), nixl")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    cfg = real_width_config(args.layers, 4096)
    nbytes = block_bytes(cfg, 64)
    layout = cache_layout(cfg, EngineConfig(max_num_seqs=1, max_num_batched_tokens=256, max_model_len=4096,
                                            cache_memory_bytes=(args.blocks * nbytes * 2) + (64 << 20)))
    assert layout.num_global_blocks >= args.blocks, layout
    kv = PagedKVCache(cfg, layout, args.device)
    store = HostKVStore(SALT, nbytes, args.blocks * nbytes)
    hashes = [i.to_bytes(32, "big") for i in range(args.blocks)]
    records = np.random.default_rng(0).integers(0, 256, (args.blocks, nbytes), dtype=np.uint8)
    store.put(ExportedPrefix(SALT, hashes, records))
    owner, reader_agent = TransferAgent(f"owner-{os.getpid()}", store), TransferAgent(f"reader-{os.getpid()}", None, 0)
    refs = store.get_descriptors(hashes)
    readers = {"shm": PeerBlockReader(owner.metadata, refs, 30.0, store.shared_handle(), agent=reader_agent),
               "nixl": PeerBlockReader(owner.metadata, refs, 30.0, None, agent=reader_agent)}
    targets = list(range(args.blocks))
    print(f"{args.blocks} blocks of {nbytes:,} B = {args.blocks * nbytes / 1e6:.1f} MB into {args.device} pools "
          f"(UCX_TLS={os.environ.get('UCX_TLS', 'unset')}), every block's checksum checked on the {args.device}")
    print("| path | chunk blocks | chunk MiB | import ms | GB/s | chunks direct / staged |")
    print("|---|---|---|---|---|---|")
    for path in args.paths.split(","):
        reader = readers[path]
        for chunk in [DEFAULT_CHUNK_BLOCKS] + [int(c) for c in args.chunks.split(",") if int(c) != DEFAULT_CHUNK_BLOCKS]:
            importer = BlockImporter(kv, chunk)
            importer.import_blocks(targets, reader)  # registers the staging buffer, warms the connection
            if reader.mapped is not None:
                reader.mapped.wait_locked(60.0)  # the owner's store registered with CUDA (in the background)
            assert reader.path.startswith({"shm": "shared memory", "nixl": "NIXL"}[path]), reader.path
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                importer.import_blocks(targets, reader)
                times.append(time.perf_counter() - t0)
            best = min(times)
            label = f"{chunk} (default)" if chunk == DEFAULT_CHUNK_BLOCKS else str(chunk)
            print(f"| {reader.path} | {label} | {importer.chunk_blocks * nbytes / 2**20:.1f} | {best * 1e3:.1f} | "
                  f"{args.blocks * nbytes / best / 1e9:.2f} | {importer.last_direct_chunks} / "
                  f"{importer.last_staged_chunks} |", flush=True)
            importer.close()
    shm = readers["shm"]
    if args.device == "cuda" and "shm" in args.paths and shm.mapped is not None and shm.mapped.page_locked is not None:
        print_parts(kv, targets, shm.pinned_rows(0, args.blocks))
    os._exit(0)  # NIXL's agents hold UCX threads that can stall interpreter shutdown


def print_parts(kv: PagedKVCache, targets: list[int], rows: torch.Tensor | None) -> None:
    """The direct path's parts, each alone over all blocks at once (best of 5): the owner's registered rows to the
    device in one copy, the scatter into the pools, the checksums."""
    if rows is None:
        print("the owner's blocks are not one adjacent run: no direct-path parts")
        return
    landed = rows.to("cuda")

    def best(fn) -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    parts = {"registered rows -> device": best(lambda: rows.to("cuda", non_blocking=True)),
             "scatter into the pools": best(lambda: write_rows(kv, targets, landed)),
             "checksums": best(lambda: block_checksums(landed))}
    for name, s in parts.items():
        print(f"{name}: {s * 1e3:.2f} ms ({rows.numel() / s / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
