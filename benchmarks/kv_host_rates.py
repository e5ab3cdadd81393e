"""The rates that bound a same-node KV pull (issue 27), on this machine: host copies by thread count (what
serve_app/kv_local.copy_blocks does), block checksums on the host (zlib CRC-32, which pulls used to check, and the
64-bit word sum of engine/core/block_checksum.py) and on the device, and host-to-device copies from pinned,
registered-shared (a memfd mapping, cudaHostRegister'ed) and pageable memory.

    python benchmarks/kv_host_rates.py [--blocks 2048] [--block-bytes 34176]

2048 blocks of 34,176 B (70 MB) is a 128K-token pull of eight real-width layers. Prints GB/s, the best of 5.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.block_checksum import block_checksums, host_block_checksums  # noqa: E402


def best_of(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--block-bytes", type=int, default=34176)
    args = p.parse_args()
    n, nbytes = args.blocks, args.block_bytes
    src = np.frombuffer(mmap.mmap(-1, n * nbytes), dtype=np.uint8).reshape(n, nbytes)
    src[:] = np.random.default_rng(0).integers(0, 256, src.shape, dtype=np.uint8)
    dst = np.frombuffer(mmap.mmap(-1, n * nbytes), dtype=np.uint8).reshape(n, nbytes)
    gb = src.nbytes / 1e9
    print(f"{os.cpu_count()} CPUs, {n} blocks of {nbytes:,} B = {gb * 1e3:.0f} MB, zlib {zlib.ZLIB_RUNTIME_VERSION}")
    print("| threads | copy GB/s | CRC-32 GB/s | 64-bit word sum GB/s |")
    print("|---|---|---|---|")
    for threads in (1, 2, 4, 8, 12):
        step = -(-n // threads)
        with ThreadPoolExecutor(threads) as pool:
            def on_threads(fn):
                list(pool.map(fn, range(0, n, step)))

            def copy(f):
                dst[f:f + step] = src[f:f + step]

            def crc(f):
                for row in src[f:f + step]:
                    zlib.crc32(row)

            def word_sum(f):
                host_block_checksums(src[f:f + step])

            rates = [gb / best_of(lambda fn=fn: on_threads(fn)) for fn in (copy, crc, word_sum)]
        print(f"| {threads} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} |", flush=True)
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda")
    g = torch.empty(src.shape, dtype=torch.uint8, device=dev)

    def h2d(host: torch.Tensor, chunk: int) -> None:
        for f in range(0, n, chunk):
            g[f:f + chunk].copy_(host[f:f + chunk], non_blocking=True)
        torch.cuda.synchronize()

    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    pinned.numpy()[:] = src
    fd = os.memfd_create("kv-host-rates")
    os.ftruncate(fd, src.nbytes)
    shared = np.frombuffer(mmap.mmap(fd, src.nbytes), dtype=np.uint8).reshape(n, nbytes)
    shared[:] = src
    t0 = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(shared.ctypes.data, shared.nbytes, 0)
    register_ms = (time.perf_counter() - t0) * 1e3
    print(f"\n{torch.cuda.get_device_name()}: cudaHostRegister of the memfd mapping: {rc}, {register_ms:.1f} ms")
    print("| host memory | chunk blocks | host-to-device GB/s |")
    print("|---|---|---|")
    for name, host in (("pinned", pinned), ("registered memfd", torch.from_numpy(shared)),
                       ("pageable", torch.from_numpy(dst))):
        for chunk in (64, 512):
            print(f"| {name} | {chunk} | {gb / best_of(lambda: h2d(host, chunk)):.1f} |", flush=True)
    on_device = best_of(lambda: (block_checksums(g), torch.cuda.synchronize()))
    assert np.array_equal(block_checksums(g).cpu().numpy(), host_block_checksums(src)), "device and host sums differ"
    print(f"device checksums of {gb * 1e3:.0f} MB: {on_device * 1e3:.2f} ms ({gb / on_device:.0f} GB/s), equal to the host's")


if __name__ == "__main__":
    main()
